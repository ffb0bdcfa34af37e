//! Server-side scripts: the steps that must not interleave with other clients.
//!
//! * Publish with a dedupe window or trimming: the dedupe check, the append and the dedupe mark
//!   happen in one script, so two concurrent publishes of one id cannot both append; and the
//!   trim decision reads the groups' progress and trims in the same atomic step, so no group can
//!   be created or read past between the decision and the `XTRIM`.
//! * Publish a batch: the events of a batch are appended in slice order by one script, so the
//!   whole batch costs one round trip, and the script can stop a key at its first failure (a
//!   pipeline of `XADD`s cannot: Redis runs every command of a pipeline whatever happened to the
//!   ones before).
//! * Nack: "give the entry back only if I still own it" is a read and a write on the pending
//!   list that another consumer's `XAUTOCLAIM` must not split.
//!
//! Scripts are not transactions: a command that fails halfway leaves the earlier writes. So the
//! publish script checks every permission first (`redis.acl_check_cmd`, Redis 7+), trims before
//! it appends, and appends before it writes the dedupe mark: whatever fails, nothing is appended
//! that the caller is told failed, and no mark exists for an entry that was not appended.

/// The body shared by [`PUBLISH`] and [`PUBLISH_BATCH`]: one event's permission checks, dedupe
/// check, trimming, append and dedupe mark.
macro_rules! publish_one {
    () => {
        r#"
local function publish_one(stream, dkey, mode, window, maxlen, batch, fields)
local checks = {}
if window > 0 then
  table.insert(checks, {'GET', dkey})
  table.insert(checks, {'SET', dkey, '0-0', 'PX', '1'})
end
if maxlen > 0 then
  table.insert(checks, {'XLEN', stream})
  table.insert(checks, {'XINFO', 'GROUPS', stream})
  table.insert(checks, {'XPENDING', stream, 'group'})
  table.insert(checks, {'XRANGE', stream, '-', '+', 'COUNT', '1'})
  table.insert(checks, {'XTRIM', stream, 'MAXLEN', '=', '1'})
end
table.insert(checks, {'XADD', stream, '*', 'v', '1'})
if redis.acl_check_cmd then
  for _, c in ipairs(checks) do
    if not redis.acl_check_cmd(unpack(c)) then
      local what = c[1]
      if c[1] == 'XINFO' then what = 'XINFO GROUPS' end
      return redis.error_reply('OUTBOXACL the Redis user may not run ' .. what .. ' on ' .. c[2] ..
        ', which the configured publish needs (trimming reads every group\'s progress before it trims; ' ..
        'the dedupe window keeps a key per event id); nothing was written')
    end
  end
end
if mode == 'check' then return {2} end

if window > 0 then
  local seen = redis.call('GET', dkey)
  if seen then return {0, seen} end
end

-- Exact decimal comparison of two stream ids "ms-seq" (no floating point).
local function numless(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function idless(x, y)
  local xm, xs = string.match(x, '^(%d+)-(%d+)$')
  local ym, ys = string.match(y, '^(%d+)-(%d+)$')
  if xm ~= ym then return numless(xm, ym) end
  return numless(xs, ys)
end

local trimmed, over = 0, 0
if maxlen > 0 then
  local len = redis.call('XLEN', stream)
  local excess = len + 1 - maxlen
  if excess > 0 then
    local groups = redis.call('XINFO', 'GROUPS', stream)
    -- A stream nobody has joined is never trimmed: nothing was acknowledged.
    if #groups > 0 then
      local floors = {}
      for _, g in ipairs(groups) do
        local info = {}
        for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
        if tonumber(info['pending']) > 0 then
          local summary = redis.call('XPENDING', stream, info['name'])
          table.insert(floors, {pending = summary[2]})
        else
          table.insert(floors, {last = info['last-delivered-id']})
        end
      end
      -- An entry may go only if every group acknowledged it: it is older than the group's oldest
      -- pending entry, or (no pending entry) not newer than what the group was last given.
      local function acknowledged(id)
        for _, f in ipairs(floors) do
          if f.pending then
            if not idless(id, f.pending) then return false end
          elseif idless(f.last, id) then
            return false
          end
        end
        return true
      end
      local n = excess
      if n > batch then n = batch end
      local oldest = redis.call('XRANGE', stream, '-', '+', 'COUNT', n)
      for _, e in ipairs(oldest) do
        if acknowledged(e[1]) then trimmed = trimmed + 1 else break end
      end
      if trimmed > 0 then
        redis.call('XTRIM', stream, 'MAXLEN', '=', len - trimmed)
      end
    end
    over = excess - trimmed
  end
end

local id = redis.call('XADD', stream, '*', unpack(fields))
if window > 0 then
  redis.call('SET', dkey, id, 'PX', window)
end
return {1, id, trimmed, over}
end
"#
    };
}

/// `KEYS[1]` stream, `KEYS[2]` dedupe key.
/// `ARGV[1]` mode (`publish` or `check`: only the permission checks), `ARGV[2]` dedupe window in
/// ms (`0` = off), `ARGV[3]` max length (`0` = no trimming), `ARGV[4]` most entries trimmed per
/// call, `ARGV[5..]` the entry's field/value pairs.
///
/// Returns `{1, new entry id, trimmed, still over max_len}` or `{0, id stored by the earlier
/// publish}` for a duplicate within the window. Raises `OUTBOXACL …` before writing anything
/// when the user may not run a command the configuration needs.
pub(crate) const PUBLISH: &str = concat!(
    publish_one!(),
    r#"
return publish_one(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), {unpack(ARGV, 5)})
"#
);

/// `KEYS[2i-1]` stream and `KEYS[2i]` dedupe key of the `i`-th event.
/// `ARGV[1]` dedupe window in ms, `ARGV[2]` max length, `ARGV[3]` most entries trimmed per event,
/// then per event: its lane (`0` = independent, else events of one key share a lane), the number
/// `n` of field/value items, and the `n` items.
///
/// Publishes the events in order with [`PUBLISH`]'s logic, each under `pcall`. Once an event of
/// a lane fails, the later events of that lane are not attempted. Returns one reply per event:
/// `{1, id, trimmed, over}` appended, `{0, id}` duplicate within the window, `{-1, error text}`
/// failed (nothing appended for it), `{-2}` not attempted.
pub(crate) const PUBLISH_BATCH: &str = concat!(
    publish_one!(),
    r#"
local window, maxlen, batch = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local failed, out = {}, {}
local a, i = 4, 1
while a <= #ARGV do
  local lane, n = ARGV[a], tonumber(ARGV[a + 1])
  local fields = {}
  for j = 1, n do fields[j] = ARGV[a + 1 + j] end
  a = a + 2 + n
  if lane ~= '0' and failed[lane] then
    out[i] = {-2}
  else
    local ok, r = pcall(publish_one, KEYS[2 * i - 1], KEYS[2 * i], 'publish', window, maxlen, batch, fields)
    if ok and type(r) == 'table' and r.err == nil then
      out[i] = r
    else
      local text
      if type(r) == 'table' and r.err then text = r.err else text = tostring(r) end
      out[i] = {-1, text}
      if lane ~= '0' then failed[lane] = true end
    end
  end
  i = i + 1
end
return out
"#
);

/// `KEYS[1]` stream; `ARGV[1]` group, `ARGV[2]` consumer, `ARGV[3]` entry id, `ARGV[4]` idle ms.
///
/// If the entry is still pending for this consumer, set its idle time to the claim idle time so
/// that the next `XAUTOCLAIM` of any member takes it, without counting a delivery (`JUSTID`).
/// Returns 1, or 0 when the entry was acknowledged or claimed by another consumer meanwhile.
pub(crate) const NACK: &str = r#"
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 1 and p[1][2] == ARGV[2] then
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4], 'JUSTID')
  return 1
end
return 0
"#;
