//! The broker handle: one multiplexed, self-reconnecting connection shared by publishes,
//! acknowledgements and the non-blocking commands of every subscription.
//!
//! Blocking reads (`XREADGROUP … BLOCK`) would stall every other command on a shared connection,
//! so each subscription opens a connection of its own for them (see `subscription.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::broker::skipped;
use outbox_core::{Broker, ConsumerGroup, Destination, Error, Event, Result, Subscription};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};
use tracing::{debug, info, warn};

use crate::codec::{self, string};
use crate::config::RedisConfig;
use crate::error::{Op, map};
use crate::subscription::RedisSubscription;
use crate::{BACKEND, scripts};

/// Entries the publish script examines for trimming per publish: trimming catches up over several
/// publishes instead of stalling the server on one.
const TRIM_BATCH: u64 = 1000;

/// Oldest server with everything used here (`XAUTOCLAIM`, exclusive ranges).
const MIN_VERSION: (u32, u32) = (6, 2);

static NEXT_SUBSCRIPTION: AtomicU64 = AtomicU64::new(1);

/// A [`Broker`] on Redis Streams: one stream per destination (`prefix + destination`), one
/// consumer group per [`ConsumerGroup`].
///
/// Cheap to clone: clones share the connection.
#[derive(Clone)]
pub struct RedisBroker {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) config: RedisConfig,
    client: redis::Client,
    pub(crate) conn: ConnectionManager,
    publish: Script,
    publish_batch: Script,
    pub(crate) nack: Script,
    aof: Mutex<Option<bool>>,
}

impl std::fmt::Debug for RedisBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBroker")
            .field("config", &self.inner.config)
            .field("aof_enabled", &self.aof_enabled())
            .finish_non_exhaustive()
    }
}

/// Connect with our timeouts and a short reconnect schedule: callers (the relay, the consumer
/// runtime) have their own backoff, so a dead server should surface as an error quickly.
pub(crate) async fn manager(
    client: &redis::Client,
    config: &RedisConfig,
    response_timeout: Duration,
) -> Result<ConnectionManager> {
    let cm = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(2)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(1));
    ConnectionManager::new_with_config(client.clone(), cm)
        .await
        .map_err(|e| map(e, Op::Read, &format!("connect to {}", config.redacted_url())))
}

impl RedisBroker {
    /// Validate `config`, connect, check the server version, check that the user may run what
    /// trimming / the dedupe window need, and read the server's durability setting (logged at
    /// warn when AOF is off; see [`aof_enabled`](Self::aof_enabled)).
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) for a bad setting, a server older
    /// than 6.2 or missing permissions;
    /// [`ErrorKind::Connection`](outbox_core::ErrorKind::Connection) (transient) when the server
    /// cannot be reached.
    pub async fn connect(config: RedisConfig) -> Result<Self> {
        config.validate()?;
        let client = redis::Client::open(config.url.as_str()).map_err(|e| {
            Error::config(BACKEND, format!("Redis URL {} is not accepted: {}", config.redacted_url(), e.category()))
        })?;
        let conn = manager(&client, &config, config.response_timeout).await?;
        let broker = Self {
            inner: Arc::new(Inner {
                config,
                client,
                conn,
                publish: Script::new(scripts::PUBLISH),
                publish_batch: Script::new(scripts::PUBLISH_BATCH),
                nack: Script::new(scripts::NACK),
                aof: Mutex::new(None),
            }),
        };
        broker.check_version().await?;
        if broker.inner.config.max_len.is_some() || broker.inner.config.dedupe_window.is_some() {
            broker.check_publish_permissions().await?;
        }
        broker.check_durability().await?;
        Ok(broker)
    }

    /// The settings this broker was built with.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// Whether the server had append-only persistence on when last checked: `Some(false)` means
    /// a Redis crash can lose entries that were already acknowledged to the publisher; `None`
    /// means the server would not say (`CONFIG` disabled or not permitted).
    pub fn aof_enabled(&self) -> Option<bool> {
        *self.inner.aof.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Read `CONFIG GET appendonly` (and `appendfsync`) again, log the result (warn when AOF is
    /// off or unknown) and remember it for [`aof_enabled`](Self::aof_enabled).
    ///
    /// # Errors
    /// Only connection failures; a refused `CONFIG` is tolerated and yields `None`.
    pub async fn check_durability(&self) -> Result<Option<bool>> {
        let url = self.inner.config.redacted_url();
        let aof = match self.config_get("appendonly").await? {
            Some(v) if v.eq_ignore_ascii_case("yes") => {
                let fsync = self.config_get("appendfsync").await?.unwrap_or_else(|| "unknown".into());
                info!(backend = BACKEND, %url, appendfsync = %fsync, "Redis has AOF on");
                Some(true)
            }
            Some(_) => {
                warn!(
                    backend = BACKEND,
                    %url,
                    "Redis has AOF off (appendonly no): a Redis crash loses stream entries that were already \
                     published, however the publisher was answered; enable appendonly for the outbox contract"
                );
                Some(false)
            }
            None => {
                warn!(
                    backend = BACKEND,
                    %url,
                    "cannot read Redis persistence settings (CONFIG GET refused or disabled); without AOF a \
                     Redis crash loses published entries"
                );
                None
            }
        };
        *self.inner.aof.lock().unwrap_or_else(PoisonError::into_inner) = aof;
        Ok(aof)
    }

    /// `Ok(None)` when the server refuses `CONFIG` (renamed, disabled, not permitted).
    async fn config_get(&self, name: &str) -> Result<Option<String>> {
        let mut conn = self.inner.conn.clone();
        let reply: redis::RedisResult<Value> = redis::cmd("CONFIG").arg("GET").arg(name).query_async(&mut conn).await;
        match reply {
            Ok(v) => {
                for (k, v) in codec::pairs(v, "CONFIG GET reply")? {
                    if string(k, "config name")?.eq_ignore_ascii_case(name) {
                        return Ok(Some(string(v, "config value")?));
                    }
                }
                Ok(None)
            }
            Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
                Err(map(e, Op::Read, &format!("CONFIG GET {name}")))
            }
            Err(e) => {
                debug!(backend = BACKEND, error = %e, "CONFIG GET {name} refused");
                Ok(None)
            }
        }
    }

    async fn check_version(&self) -> Result<()> {
        let mut conn = self.inner.conn.clone();
        let reply: redis::RedisResult<String> = redis::cmd("INFO").arg("server").query_async(&mut conn).await;
        let text = match reply {
            Ok(t) => t,
            Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
                return Err(map(e, Op::Read, "INFO server"));
            }
            Err(e) => {
                warn!(backend = BACKEND, error = %e, "cannot read the Redis version (INFO refused); Redis 6.2 or newer is required");
                return Ok(());
            }
        };
        let version = text.lines().find_map(|l| l.trim().strip_prefix("redis_version:")).map(str::to_string);
        let Some(version) = version else { return Ok(()) };
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        if found < MIN_VERSION {
            return Err(Error::config(
                BACKEND,
                format!(
                    "Redis {version} is too old: the adapter needs {}.{} or newer (XAUTOCLAIM)",
                    MIN_VERSION.0, MIN_VERSION.1
                ),
            ));
        }
        debug!(backend = BACKEND, %version, "Redis version");
        Ok(())
    }

    /// Run the publish script's permission checks (and nothing else) on a key under the prefix.
    async fn check_publish_permissions(&self) -> Result<()> {
        let probe = format!("{}acl-probe", self.inner.config.prefix);
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.publish.prepare_invoke();
        inv.key(&probe).key(format!("{probe}:dedupe")).arg("check");
        self.publish_args(&mut inv);
        let _: Value = inv
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map(e, Op::Read, "check the permissions the configured trimming / dedupe window need"))?;
        Ok(())
    }

    fn publish_args(&self, inv: &mut redis::ScriptInvocation<'_>) {
        let c = &self.inner.config;
        let window_ms = c.dedupe_window.map_or(0, |w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX).max(1));
        inv.arg(window_ms).arg(c.max_len.unwrap_or(0)).arg(TRIM_BATCH);
    }

    /// The stream key of `destination`: the configured prefix followed by its name.
    pub fn stream_key(&self, destination: &Destination) -> String {
        format!("{}{}", self.inner.config.prefix, destination.as_str())
    }

    /// The dedupe key of `event` on `stream` (its destination's [`stream_key`](Self::stream_key)).
    fn dedupe_key(stream: &str, event: &Event) -> String {
        format!("{stream}:dedupe:{}", event.id.as_str())
    }

    /// Join `group` on `destination` under a consumer name of its own: the configured
    /// [`consumer_name`](RedisConfig::consumer_name) and a suffix unique in this process. What it
    /// leaves unacknowledged is reclaimed by the other members after the claim idle time.
    ///
    /// # Errors
    /// As for [`subscribe_as`](Self::subscribe_as).
    pub async fn subscription(&self, destination: &Destination, group: &ConsumerGroup) -> Result<RedisSubscription> {
        let n = NEXT_SUBSCRIPTION.fetch_add(1, Ordering::Relaxed);
        let consumer = format!("{}-{n}", self.inner.config.consumer_name);
        self.subscribe_as(destination, group, &consumer).await
    }

    /// Join `group` on `destination` as exactly `consumer`. The subscription first re-reads the
    /// entries still pending for that consumer (a restarted consumer gets back what it held),
    /// then new entries. Two live subscriptions must not share a consumer name.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](outbox_core::ErrorKind::InvalidInput) for an empty consumer
    /// name; connection and server errors otherwise.
    pub async fn subscribe_as(
        &self,
        destination: &Destination,
        group: &ConsumerGroup,
        consumer: &str,
    ) -> Result<RedisSubscription> {
        if consumer.is_empty() {
            return Err(Error::invalid_input(BACKEND, "consumer name is empty"));
        }
        let stream = self.stream_key(destination);
        self.create_group(&stream, group).await?;
        let c = &self.inner.config;
        let conn = manager(&self.inner.client, c, c.block + c.response_timeout).await?;
        debug!(backend = BACKEND, %stream, group = %group, consumer, "subscribed");
        Ok(RedisSubscription::new(self.clone(), conn, destination.clone(), group.clone(), stream, consumer.to_string()))
    }

    async fn create_group(&self, stream: &str, group: &ConsumerGroup) -> Result<()> {
        let mut conn = self.inner.conn.clone();
        let reply: redis::RedisResult<Value> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg(group.as_str())
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match reply {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(map(e, Op::Read, &format!("create group {group} on {stream}"))),
        }
    }

    /// Number of entries in the stream of `destination` (`XLEN`; 0 when it does not exist).
    ///
    /// # Errors
    /// Connection and server errors.
    pub async fn stream_len(&self, destination: &Destination) -> Result<u64> {
        let stream = self.stream_key(destination);
        let mut conn = self.inner.conn.clone();
        redis::cmd("XLEN")
            .arg(&stream)
            .query_async(&mut conn)
            .await
            .map_err(|e| map(e, Op::Read, &format!("XLEN {stream}")))
    }

    /// Every event the stream of `destination` holds, oldest first (the broker's durable
    /// contents; reads the whole stream). Only with the `testkit` feature: a test inspector,
    /// not part of the stable API.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`](outbox_core::ErrorKind::Corrupt) when an entry is not an outbox
    /// event; connection and server errors.
    #[cfg(feature = "testkit")]
    pub async fn events(&self, destination: &Destination) -> Result<Vec<Event>> {
        let stream = self.stream_key(destination);
        let mut conn = self.inner.conn.clone();
        let v: Value = redis::cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .map_err(|e| map(e, Op::Read, &format!("XRANGE {stream}")))?;
        Ok(codec::range_reply(destination, v)?.into_iter().map(|(_, e)| e).collect())
    }

    /// Entries of `destination` delivered to `group` and not acknowledged yet (its pending list).
    /// 0 when the stream or the group does not exist.
    ///
    /// # Errors
    /// Connection and server errors.
    pub async fn pending(&self, destination: &Destination, group: &ConsumerGroup) -> Result<u64> {
        Ok(self.group_state(destination, group).await?.map_or(0, |(pending, _)| pending))
    }

    /// Entries of `destination` that `group` has not acknowledged: pending ones plus those never
    /// delivered to it. A group that does not exist yet would receive the whole stream.
    ///
    /// # Errors
    /// Connection and server errors.
    pub async fn unacknowledged(&self, destination: &Destination, group: &ConsumerGroup) -> Result<u64> {
        match self.group_state(destination, group).await? {
            Some((pending, undelivered)) => Ok(pending + undelivered),
            None => self.stream_len(destination).await,
        }
    }

    /// `(pending, never delivered)` of the group, `None` when it (or the stream) does not exist.
    async fn group_state(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Option<(u64, u64)>> {
        let stream = self.stream_key(destination);
        let mut conn = self.inner.conn.clone();
        let exists: i64 = redis::cmd("EXISTS")
            .arg(&stream)
            .query_async(&mut conn)
            .await
            .map_err(|e| map(e, Op::Read, &format!("EXISTS {stream}")))?;
        if exists == 0 {
            return Ok(None);
        }
        let groups: Value = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&stream)
            .query_async(&mut conn)
            .await
            .map_err(|e| map(e, Op::Read, &format!("XINFO GROUPS {stream}")))?;
        let Value::Array(groups) = groups else { return Err(crate::error::corrupt("XINFO GROUPS: not an array")) };
        for g in groups {
            let mut name = None;
            let mut pending = 0;
            let mut last = None;
            for (k, v) in codec::pairs(g, "XINFO GROUPS entry")? {
                match string(k, "XINFO field")?.as_str() {
                    "name" => name = Some(string(v, "group name")?),
                    "pending" => pending = codec::int(v, "pending")?,
                    "last-delivered-id" => last = Some(string(v, "last-delivered-id")?),
                    _ => {}
                }
            }
            if name.as_deref() != Some(group.as_str()) {
                continue;
            }
            let last = last.unwrap_or_else(|| "0-0".into());
            let after: Value = redis::cmd("XRANGE")
                .arg(&stream)
                .arg(format!("({last}"))
                .arg("+")
                .query_async(&mut conn)
                .await
                .map_err(|e| map(e, Op::Read, &format!("XRANGE {stream}")))?;
            let undelivered = match after {
                Value::Array(a) => a.len() as u64,
                _ => 0,
            };
            return Ok(Some((u64::try_from(pending).unwrap_or(0), undelivered)));
        }
        Ok(None)
    }

    /// Delete the stream of `destination` with its groups and its dedupe keys (cleanup for tests
    /// and decommissioning; everything in it is lost).
    ///
    /// # Errors
    /// Connection and server errors.
    pub async fn delete_destination(&self, destination: &Destination) -> Result<()> {
        let stream = self.stream_key(destination);
        let mut conn = self.inner.conn.clone();
        let mut keys = vec![stream.clone()];
        let pattern = format!("{}:dedupe:*", glob_escape(&stream));
        let mut cursor: u64 = 0;
        loop {
            let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(|e| map(e, Op::Read, &format!("SCAN {pattern}")))?;
            keys.extend(found);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        for chunk in keys.chunks(500) {
            let _: i64 = redis::cmd("DEL")
                .arg(chunk)
                .query_async(&mut conn)
                .await
                .map_err(|e| map(e, Op::Read, &format!("DEL {stream}")))?;
        }
        Ok(())
    }
}

fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Most events in one batch script.
const BATCH_EVENTS: usize = 512;
/// Field bytes above which a batch script is closed and the next one started.
const BATCH_BYTES: usize = 4 << 20;

/// What one event of a batch script reported.
enum Outcome {
    /// `{1, id, trimmed, over}` or `{0, id}`: the publish script's reply.
    Replied(Vec<Value>),
    /// `{-1, error text}`: this event failed; nothing was appended for it.
    Failed(String),
    /// `{-2}`: not attempted, an earlier event of its key failed in the script.
    NotAttempted,
}

impl RedisBroker {
    async fn publish_events(&self, events: &[Event]) -> Vec<Result<()>> {
        let c = &self.inner.config;
        let mut out: Vec<Option<Result<()>>> = (0..events.len()).map(|_| None).collect();
        // Lane of each key (1-based; 0 = an event without a key, independent of all others),
        // and the id of the event that failed first in each failed lane.
        let mut lanes: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        let mut failed: std::collections::HashMap<usize, String> = std::collections::HashMap::new();
        let lane_of_events: Vec<usize> = events
            .iter()
            .map(|e| match e.key.as_deref() {
                None => 0,
                Some(k) => {
                    let next = lanes.len() + 1;
                    *lanes.entry(k).or_insert(next)
                }
            })
            .collect();
        let mut start = 0;
        while start < events.len() {
            // Build one chunk: validated events, in slice order.
            let mut inv = self.inner.publish_batch.prepare_invoke();
            self.publish_args(&mut inv);
            // Each event sent, with its stream key (for the reply's messages).
            let mut sent: Vec<(usize, String)> = Vec::new();
            let mut bytes = 0;
            let mut i = start;
            while i < events.len() && sent.len() < BATCH_EVENTS && (sent.is_empty() || bytes < BATCH_BYTES) {
                let event = &events[i];
                let lane = lane_of_events[i];
                i += 1;
                if let Some(first) = failed.get(&lane) {
                    out[i - 1] = Some(Err(skipped(BACKEND, first)));
                    continue;
                }
                if let Err(e) = event.validate(c.max_payload) {
                    out[i - 1] = Some(Err(e));
                    if lane != 0 {
                        failed.insert(lane, event.id.to_string());
                    }
                    continue;
                }
                let fields = codec::encode(event);
                let stream = self.stream_key(&event.destination);
                inv.key(&stream).key(Self::dedupe_key(&stream, event));
                inv.arg(lane).arg(fields.len() * 2);
                for (f, v) in &fields {
                    bytes += f.len() + v.len();
                    inv.arg(f.as_slice()).arg(*v);
                }
                sent.push((i - 1, stream));
            }
            start = i;
            if sent.is_empty() {
                continue;
            }
            let mut conn = self.inner.conn.clone();
            let reply: redis::RedisResult<Value> = inv.invoke_async(&mut conn).await;
            let outcomes =
                reply.map_err(|e| map(e, Op::Write, "publish a batch")).and_then(|v| batch_reply(v, sent.len()));
            match outcomes {
                Err(err) => {
                    // The script may or may not have run: every event of it gets the error.
                    for (k, stream) in sent {
                        let event = &events[k];
                        out[k] = Some(Err(err.clone().with_operation(format!("publish {} to {stream}", event.id))));
                        if lane_of_events[k] != 0 {
                            failed.entry(lane_of_events[k]).or_insert_with(|| event.id.to_string());
                        }
                    }
                }
                Ok(outcomes) => {
                    for ((k, stream), outcome) in sent.into_iter().zip(outcomes) {
                        let event = &events[k];
                        let lane = lane_of_events[k];
                        let doing = || format!("publish {} to {stream}", event.id);
                        let r = match outcome {
                            Outcome::Replied(parts) => published(&stream, event, parts, &doing),
                            Outcome::Failed(text) => Err(map(script_error(&text), Op::Write, &doing())),
                            Outcome::NotAttempted => {
                                Err(skipped(BACKEND, failed.get(&lane).map_or("?", String::as_str)))
                            }
                        };
                        if r.is_err() && lane != 0 {
                            failed.entry(lane).or_insert_with(|| event.id.to_string());
                        }
                        out[k] = Some(r);
                    }
                }
            }
        }
        out.into_iter().map(|r| r.unwrap_or_else(|| Err(skipped(BACKEND, "?")))).collect()
    }
}

/// Split a batch script's reply into one outcome per event.
fn batch_reply(reply: Value, expected: usize) -> Result<Vec<Outcome>> {
    let Value::Array(items) = reply else {
        return Err(crate::error::corrupt("publish batch: the script's reply is not an array"));
    };
    if items.len() != expected {
        return Err(crate::error::corrupt(format!(
            "publish batch: the script replied for {} events, {expected} were sent",
            items.len()
        )));
    }
    items
        .into_iter()
        .map(|item| {
            let Value::Array(parts) = item else {
                return Err(crate::error::corrupt("publish batch: an event's reply is not an array"));
            };
            match parts.first() {
                Some(Value::Int(-1)) => Ok(Outcome::Failed(
                    parts.into_iter().nth(1).map(|v| string(v, "error text")).transpose()?.unwrap_or_default(),
                )),
                Some(Value::Int(-2)) => Ok(Outcome::NotAttempted),
                _ => Ok(Outcome::Replied(parts)),
            }
        })
        .collect()
}

/// A server error caught inside a script (`CODE detail`), as the error the command would have
/// returned on its own.
fn script_error(text: &str) -> redis::RedisError {
    let text = text.trim();
    let (code, detail) = text.split_once(' ').unwrap_or((text, ""));
    if !code.is_empty() && code.bytes().all(|b| b.is_ascii_uppercase()) {
        redis::make_extension_error(code.to_string(), Some(detail.to_string()))
    } else {
        redis::make_extension_error("ERR".to_string(), Some(text.to_string()))
    }
}

/// Interpret the publish script's reply for `event`.
fn published(stream: &str, event: &Event, parts: Vec<Value>, doing: &dyn Fn() -> String) -> Result<()> {
    let mut parts = parts.into_iter();
    let status = codec::int(parts.next().unwrap_or(Value::Nil), "publish status")?;
    let id = parts.next().map(|v| string(v, "entry id")).transpose()?.unwrap_or_default();
    if status == 0 {
        debug!(backend = BACKEND, %stream, event_id = %event.id, entry = %id, "duplicate within the dedupe window; not appended");
        return Ok(());
    }
    if status != 1 {
        return Err(crate::error::corrupt(format!("{}: unexpected publish status {status}", doing())));
    }
    let mut count = |what| match parts.next() {
        None | Some(Value::Nil) => Ok(0),
        Some(v) => codec::int(v, what),
    };
    let trimmed = count("trimmed")?;
    let over = count("over")?;
    debug!(backend = BACKEND, %stream, event_id = %event.id, entry = %id, trimmed, "published");
    if over > 0 {
        debug!(
            backend = BACKEND,
            %stream,
            over,
            "stream is over max_len: the oldest entries are not acknowledged by every group yet"
        );
    }
    Ok(())
}

#[async_trait]
impl Broker for RedisBroker {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// [`RedisConfig::capabilities`]: no unroutable detection, a delivery count.
    fn capabilities(&self) -> outbox_core::Capabilities {
        self.inner.config.capabilities()
    }

    /// `XGROUP CREATE <stream> <group> 0 MKSTREAM` per group (an existing group is left as it
    /// is). Without groups there is nothing to create: Redis keeps no empty stream without a
    /// group, and a publish creates the stream anyway.
    async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        let stream = self.stream_key(destination);
        for g in groups {
            self.create_group(&stream, g).await?;
        }
        Ok(())
    }

    /// `XADD`, or the publish script when a dedupe window or trimming is configured. Redis cannot
    /// tell that nobody reads a stream, so this never returns `Unroutable`.
    async fn publish(&self, event: &Event) -> Result<()> {
        let c = &self.inner.config;
        event.validate(c.max_payload)?;
        let stream = self.stream_key(&event.destination);
        let fields = codec::encode(event);
        let mut conn = self.inner.conn.clone();
        let doing = || format!("publish {} to {stream}", event.id);
        if c.max_len.is_none() && c.dedupe_window.is_none() {
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&stream).arg("*");
            for (f, v) in &fields {
                cmd.arg(f.as_slice()).arg(*v);
            }
            let id: String = cmd.query_async(&mut conn).await.map_err(|e| map(e, Op::Write, &doing()))?;
            debug!(backend = BACKEND, %stream, event_id = %event.id, entry = %id, "published");
            return Ok(());
        }
        let mut inv = self.inner.publish.prepare_invoke();
        inv.key(&stream).key(Self::dedupe_key(&stream, event)).arg("publish");
        self.publish_args(&mut inv);
        for (f, v) in &fields {
            inv.arg(f.as_slice()).arg(*v);
        }
        let reply: Value = inv.invoke_async(&mut conn).await.map_err(|e| map(e, Op::Write, &doing()))?;
        let Value::Array(parts) = reply else {
            return Err(crate::error::corrupt(format!("{}: unexpected publish script reply", doing())));
        };
        published(&stream, event, parts, &doing)
    }

    /// One Lua script per chunk of the batch (up to 512 events or about 4 MiB of fields): a
    /// single round trip, the events appended in slice order, and a key stopped at its first
    /// failure inside the script (see the crate documentation, "Batching").
    async fn publish_batch(&self, events: &[Event]) -> Vec<Result<()>> {
        self.publish_events(events).await
    }

    async fn subscribe(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        Ok(Box::new(self.subscription(destination, group).await?))
    }
}
