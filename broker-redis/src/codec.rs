//! The stream entry format and the parsing of stream replies.
//!
//! An entry is a flat list of binary-safe field/value pairs, so an event maps onto it without any
//! escaping: one field per part, one field per header (`h:<name>`, header names are visible ASCII
//! so the prefix cannot be confused), and the key only when there is one, which keeps "no key"
//! and "empty key" apart. A version field lets a future format coexist with this one, and makes a
//! foreign entry (written by something else to the same stream) recognisable.
//!
//! Replies are parsed from `redis::Value` by hand rather than with the crate's typed stream
//! replies, which key fields by `String` and drop entries deleted from the stream; we need the
//! raw bytes and must see the deleted ones to acknowledge them.

use outbox_core::{Destination, Event, EventId, Headers, Result};
use redis::Value;

use crate::error::corrupt;

pub(crate) const F_VERSION: &[u8] = b"v";
pub(crate) const VERSION: &[u8] = b"1";
pub(crate) const F_ID: &[u8] = b"id";
pub(crate) const F_KEY: &[u8] = b"k";
pub(crate) const F_PAYLOAD: &[u8] = b"p";
pub(crate) const HEADER_PREFIX: &[u8] = b"h:";

/// Field/value pairs of an event, in the order they are written.
pub(crate) fn encode(event: &Event) -> Vec<(Vec<u8>, &[u8])> {
    let mut fields: Vec<(Vec<u8>, &[u8])> = Vec::with_capacity(4 + event.headers.len());
    fields.push((F_VERSION.to_vec(), VERSION));
    fields.push((F_ID.to_vec(), event.id.as_str().as_bytes()));
    if let Some(key) = &event.key {
        fields.push((F_KEY.to_vec(), key.as_bytes()));
    }
    for (name, value) in &event.headers {
        let mut field = HEADER_PREFIX.to_vec();
        field.extend_from_slice(name.as_bytes());
        fields.push((field, value.as_slice()));
    }
    fields.push((F_PAYLOAD.to_vec(), event.payload.as_slice()));
    fields
}

/// One stream entry as read: its id and its fields, `None` when the entry was deleted from the
/// stream while still pending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawEntry {
    pub(crate) id: String,
    pub(crate) fields: Option<Vec<(Vec<u8>, Vec<u8>)>>,
}

/// Rebuild the event of `entry`, published to `destination`.
pub(crate) fn decode(destination: &Destination, entry_id: &str, fields: &[(Vec<u8>, Vec<u8>)]) -> Result<Event> {
    let bad = |what: &str| corrupt(format!("stream entry {entry_id} of {destination} is not an outbox event: {what}"));
    let mut version = None;
    let mut id = None;
    let mut key = None;
    let mut payload = None;
    let mut headers = Headers::new();
    for (field, value) in fields {
        match field.as_slice() {
            F_VERSION => version = Some(value.as_slice()),
            F_ID => id = Some(value.as_slice()),
            F_KEY => key = Some(value.as_slice()),
            F_PAYLOAD => payload = Some(value.clone()),
            f if f.starts_with(HEADER_PREFIX) => {
                let name = std::str::from_utf8(&f[HEADER_PREFIX.len()..]).map_err(|_| bad("header name"))?;
                headers.insert(name.to_string(), value.clone());
            }
            // Unknown fields of the same version are tolerated (added by a newer writer).
            _ => {}
        }
    }
    match version {
        Some(VERSION) => {}
        Some(v) => return Err(bad(&format!("format version {:?} is not supported", String::from_utf8_lossy(v)))),
        None => return Err(bad("no format version field")),
    }
    let id = id.ok_or_else(|| bad("no event id"))?;
    let id = std::str::from_utf8(id).map_err(|_| bad("event id is not UTF-8"))?;
    let id = EventId::new(id).map_err(|e| bad(e.message()))?;
    let key =
        key.map(|k| std::str::from_utf8(k).map(str::to_string).map_err(|_| bad("key is not UTF-8"))).transpose()?;
    let payload = payload.ok_or_else(|| bad("no payload"))?;
    Ok(Event { id, destination: destination.clone(), key, headers, payload })
}

fn bytes(v: Value, what: &str) -> Result<Vec<u8>> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        Value::VerbatimString { text, .. } => Ok(text.into_bytes()),
        Value::Int(i) => Ok(i.to_string().into_bytes()),
        other => Err(corrupt(format!("{what}: expected a string, got {other:?}"))),
    }
}

pub(crate) fn string(v: Value, what: &str) -> Result<String> {
    String::from_utf8(bytes(v, what)?).map_err(|_| corrupt(format!("{what}: not UTF-8")))
}

pub(crate) fn int(v: Value, what: &str) -> Result<i64> {
    match v {
        Value::Int(i) => Ok(i),
        other => string(other, what)?.parse().map_err(|_| corrupt(format!("{what}: not an integer"))),
    }
}

fn array(v: Value, what: &str) -> Result<Vec<Value>> {
    match v {
        Value::Array(a) | Value::Set(a) => Ok(a),
        Value::Nil => Ok(Vec::new()),
        other => Err(corrupt(format!("{what}: expected an array, got {other:?}"))),
    }
}

/// Pairs of a RESP3 map or of a flat RESP2 array.
pub(crate) fn pairs(v: Value, what: &str) -> Result<Vec<(Value, Value)>> {
    match v {
        Value::Map(m) => Ok(m),
        Value::Attribute { data, .. } => pairs(*data, what),
        other => {
            let flat = array(other, what)?;
            if flat.len() % 2 != 0 {
                return Err(corrupt(format!("{what}: odd number of elements")));
            }
            let mut out = Vec::with_capacity(flat.len() / 2);
            let mut it = flat.into_iter();
            while let (Some(a), Some(b)) = (it.next(), it.next()) {
                out.push((a, b));
            }
            Ok(out)
        }
    }
}

/// `[id, [field, value, …] | nil]` entries.
fn entries(v: Value) -> Result<Vec<RawEntry>> {
    let mut out = Vec::new();
    for entry in array(v, "stream entries")? {
        // Redis 6 XAUTOCLAIM reports deleted entries as nil; they carry no id, so skip them.
        if entry == Value::Nil {
            continue;
        }
        let mut parts = array(entry, "stream entry")?.into_iter();
        let id = string(parts.next().ok_or_else(|| corrupt("stream entry without id"))?, "entry id")?;
        let fields = match parts.next() {
            None | Some(Value::Nil) => None,
            Some(f) => Some(
                pairs(f, "entry fields")?
                    .into_iter()
                    .map(|(k, v)| Ok((bytes(k, "field name")?, bytes(v, "field value")?)))
                    .collect::<Result<Vec<_>>>()?,
            ),
        };
        out.push(RawEntry { id, fields });
    }
    Ok(out)
}

/// Reply of `XREADGROUP … STREAMS <one key> <id>`: nil on timeout, else the entries of the key.
pub(crate) fn read_reply(v: Value) -> Result<Vec<RawEntry>> {
    let streams: Vec<(Value, Value)> = match v {
        Value::Nil => return Ok(Vec::new()),
        Value::Map(m) => m,
        other => array(other, "XREADGROUP reply")?
            .into_iter()
            .map(|s| {
                let mut kv = array(s, "XREADGROUP stream")?.into_iter();
                match (kv.next(), kv.next()) {
                    (Some(k), Some(e)) => Ok((k, e)),
                    _ => Err(corrupt("XREADGROUP stream without entries")),
                }
            })
            .collect::<Result<_>>()?,
    };
    let mut out = Vec::new();
    for (_, e) in streams {
        out.extend(entries(e)?);
    }
    Ok(out)
}

/// Reply of `XAUTOCLAIM`: the next cursor, the claimed entries and the ids that no longer exist.
pub(crate) fn autoclaim_reply(v: Value) -> Result<(String, Vec<RawEntry>, Vec<String>)> {
    let mut parts = array(v, "XAUTOCLAIM reply")?.into_iter();
    let cursor = string(parts.next().ok_or_else(|| corrupt("XAUTOCLAIM reply without cursor"))?, "cursor")?;
    let claimed = entries(parts.next().unwrap_or(Value::Nil))?;
    let deleted = match parts.next() {
        Some(d) => array(d, "XAUTOCLAIM deleted ids")?
            .into_iter()
            .map(|id| string(id, "deleted id"))
            .collect::<Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    Ok((cursor, claimed, deleted))
}

/// Reply of the extended `XPENDING key group start end count [consumer]`:
/// `(entry id, owner, delivery count)` per pending entry.
pub(crate) fn pending_reply(v: Value) -> Result<Vec<(String, String, u32)>> {
    array(v, "XPENDING reply")?
        .into_iter()
        .map(|row| {
            let mut f = array(row, "XPENDING row")?.into_iter();
            let (Some(id), Some(owner), Some(_idle), Some(count)) = (f.next(), f.next(), f.next(), f.next()) else {
                return Err(corrupt("XPENDING row with fewer than 4 fields"));
            };
            let count = int(count, "delivery count")?;
            Ok((
                string(id, "pending id")?,
                string(owner, "pending owner")?,
                u32::try_from(count.max(0)).unwrap_or(u32::MAX),
            ))
        })
        .collect()
}

/// The events of an `XRANGE` reply (entries that are not outbox events are an error).
pub(crate) fn range_reply(destination: &Destination, v: Value) -> Result<Vec<(String, Event)>> {
    entries(v)?
        .into_iter()
        .map(|e| {
            let fields = e.fields.ok_or_else(|| corrupt(format!("XRANGE returned entry {} without fields", e.id)))?;
            Ok((e.id.clone(), decode(destination, &e.id, &fields)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev() -> Event {
        Event::new(EventId::new("e-1").unwrap(), Destination::new("d").unwrap(), b"\0\xff\xfe payload".to_vec())
            .with_key("")
            .with_header("bin", vec![0u8, 0xff, b'\n', 0x80])
            .with_header("empty", Vec::new())
    }

    fn owned(fields: Vec<(Vec<u8>, &[u8])>) -> Vec<(Vec<u8>, Vec<u8>)> {
        fields.into_iter().map(|(f, v)| (f, v.to_vec())).collect()
    }

    #[test]
    fn encode_decode_round_trip() {
        let e = ev();
        let back = decode(&e.destination, "1-0", &owned(encode(&e))).unwrap();
        assert_eq!(back, e);
        let mut no_key = e.clone();
        no_key.key = None;
        let fields = owned(encode(&no_key));
        assert!(!fields.iter().any(|(f, _)| f == F_KEY));
        assert_eq!(decode(&e.destination, "1-0", &fields).unwrap(), no_key);
    }

    #[test]
    fn foreign_entries_are_corrupt() {
        let d = Destination::new("d").unwrap();
        let no_version = vec![(b"id".to_vec(), b"x".to_vec()), (b"p".to_vec(), Vec::new())];
        let other_version = vec![(b"v".to_vec(), b"9".to_vec()), (b"id".to_vec(), b"x".to_vec())];
        let bad_id = vec![(b"v".to_vec(), b"1".to_vec()), (b"id".to_vec(), b"a b".to_vec()), (b"p".to_vec(), vec![])];
        for f in [no_version, other_version, bad_id] {
            assert_eq!(decode(&d, "1-0", &f).unwrap_err().kind(), outbox_core::ErrorKind::Corrupt);
        }
    }

    #[test]
    fn parses_resp2_and_resp3_read_replies() {
        let entry = Value::Array(vec![
            Value::BulkString(b"1-1".to_vec()),
            Value::Array(vec![Value::BulkString(b"v".to_vec()), Value::BulkString(b"1".to_vec())]),
        ]);
        let deleted = Value::Array(vec![Value::BulkString(b"1-2".to_vec()), Value::Nil]);
        let entries_v = Value::Array(vec![entry, deleted]);
        let resp2 = Value::Array(vec![Value::Array(vec![Value::BulkString(b"k".to_vec()), entries_v.clone()])]);
        let resp3 = Value::Map(vec![(Value::BulkString(b"k".to_vec()), entries_v)]);
        for v in [resp2, resp3] {
            let got = read_reply(v).unwrap();
            assert_eq!(got.len(), 2);
            assert_eq!(got[0].id, "1-1");
            assert_eq!(got[0].fields.as_deref(), Some(&[(b"v".to_vec(), b"1".to_vec())][..]));
            assert_eq!(got[1], RawEntry { id: "1-2".into(), fields: None });
        }
        assert!(read_reply(Value::Nil).unwrap().is_empty());
    }
}
