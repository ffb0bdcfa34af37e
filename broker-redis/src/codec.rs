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

use outbox_core::{Destination, Event, EventId, Headers, Malformed, RawMessage, Result};
use redis::Value;

use crate::BACKEND;
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

/// Rebuild the event of `entry`, published to `destination`, or say why it is not one.
///
/// Strict about everything a reader could otherwise silently guess at: exactly one `v` (= `1`),
/// one `id`, at most one `k` and `p`, no header twice, and the rules of
/// [`Event::validate`](outbox_core::Event::validate) for names, sizes and the content type
/// ([`Malformed::of_event`]). Unknown fields of the same version are tolerated (added by a newer
/// writer).
pub(crate) fn decode(
    destination: &Destination,
    fields: &[(Vec<u8>, Vec<u8>)],
) -> std::result::Result<Event, (Malformed, String)> {
    let all = |name: &[u8]| fields.iter().filter(|(f, _)| f == name).map(|(_, v)| v.as_slice()).collect::<Vec<_>>();
    let once = |name: &[u8], what: &str| -> std::result::Result<Option<&[u8]>, (Malformed, String)> {
        match all(name).as_slice() {
            [] => Ok(None),
            [one] => Ok(Some(one)),
            many => Err((Malformed::DuplicateHeader, format!("the {what} field appears {} times", many.len()))),
        }
    };
    match all(F_VERSION).as_slice() {
        [VERSION] => {}
        [] => return Err((Malformed::UnknownFormat, "no format version field v".into())),
        [v] => {
            return Err((
                Malformed::UnknownFormat,
                format!("format version {:?} is not supported", String::from_utf8_lossy(v)),
            ));
        }
        many => return Err((Malformed::UnknownFormat, format!("the version field v appears {} times", many.len()))),
    }
    let id = once(F_ID, "event id (id)")?.ok_or((Malformed::NoEventId, "no id field".to_string()))?;
    let id = std::str::from_utf8(id).ok().and_then(|t| EventId::new(t).ok()).ok_or_else(|| {
        (Malformed::BadEventId, format!("id {:?} is not a valid event id", String::from_utf8_lossy(id)))
    })?;
    let key = once(F_KEY, "key (k)")?
        .map(|k| String::from_utf8(k.to_vec()).map_err(|_| (Malformed::BadKey, "the key is not UTF-8".to_string())))
        .transpose()?;
    let payload =
        once(F_PAYLOAD, "payload (p)")?.ok_or((Malformed::UnknownFormat, "no payload field p".to_string()))?.to_vec();
    let mut headers = Headers::new();
    for (field, value) in fields {
        if let Some(name) = field.strip_prefix(HEADER_PREFIX) {
            let name = String::from_utf8(name.to_vec()).map_err(|_| {
                (Malformed::BadHeaderName, format!("header name {:?} is not UTF-8", String::from_utf8_lossy(name)))
            })?;
            if headers.insert(name.clone(), value.clone()).is_some() {
                return Err((Malformed::DuplicateHeader, format!("header {name:?} appears more than once")));
            }
        }
    }
    let event = Event { id, destination: destination.clone(), key, headers, payload };
    match Malformed::of_event(&event) {
        None => Ok(event),
        Some(problem) => Err(problem),
    }
}

/// The entry as the stream holds it: the payload field `p` (the first, if several) as payload,
/// every other field as a raw header, in stream order.
pub(crate) fn raw(destination: &Destination, position: String, fields: &[(Vec<u8>, Vec<u8>)]) -> RawMessage {
    let payload_at = fields.iter().position(|(f, _)| f == F_PAYLOAD);
    let event_id = match fields.iter().filter(|(f, _)| f == F_ID).collect::<Vec<_>>().as_slice() {
        [(_, id)] => std::str::from_utf8(id).ok().and_then(|t| EventId::new(t).ok()),
        _ => None,
    };
    RawMessage {
        backend: BACKEND,
        destination: destination.clone(),
        position,
        event_id,
        key: None,
        headers: fields.iter().enumerate().filter(|(i, _)| Some(*i) != payload_at).map(|(_, f)| f.clone()).collect(),
        payload: payload_at.map(|i| fields[i].1.clone()).unwrap_or_default(),
    }
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
#[cfg_attr(not(feature = "testkit"), allow(dead_code))]
pub(crate) fn range_reply(destination: &Destination, v: Value) -> Result<Vec<(String, Event)>> {
    entries(v)?
        .into_iter()
        .map(|e| {
            let fields = e.fields.ok_or_else(|| corrupt(format!("XRANGE returned entry {} without fields", e.id)))?;
            let event = decode(destination, &fields).map_err(|(problem, detail)| {
                corrupt(format!("stream entry {} of {destination} is not an outbox event: {problem}: {detail}", e.id))
            })?;
            Ok((e.id.clone(), event))
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

    /// The rows of the README's wire-format table: `(event part, slot, name or value)`, with
    /// backticks removed.
    fn wire_format() -> Vec<(String, String, String)> {
        let rows = outbox_conformance_tests::docs::markdown_table(include_str!("../README.md"), "## Wire format");
        let plain = |c: &String| c.replace('`', "");
        rows[1..].iter().map(|r| (plain(&r[0]), plain(&r[1]), plain(&r[2]))).collect()
    }

    fn row<'a>(table: &'a [(String, String, String)], part: &str) -> &'a (String, String, String) {
        table.iter().find(|r| r.0 == part).unwrap_or_else(|| panic!("README wire format has no {part:?} row"))
    }

    #[test]
    fn what_the_adapter_writes_is_the_readme_wire_format() {
        let table = wire_format();
        let e = Event::new(EventId::new("e-9").unwrap(), Destination::new("d").unwrap(), b"\0body\xff".to_vec())
            .with_key("k-1")
            .with_header("trace", b"t\0".to_vec())
            .with_content_type("application/json");
        let field = |part: &str| row(&table, part).1.replace("<name>", "trace").into_bytes();
        let want: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (field("format version"), row(&table, "format version").2.clone().into_bytes()),
            (field("event id"), b"e-9".to_vec()),
            (field("key"), b"k-1".to_vec()),
            (field("header"), b"t\0".to_vec()),
            (field("content type"), b"application/json".to_vec()),
            (field("payload"), b"\0body\xff".to_vec()),
        ];
        let mut got = owned(encode(&e));
        assert_eq!(got.first().map(|f| f.0.clone()), Some(field("format version")), "the version comes first");
        assert_eq!(got.last().map(|f| f.0.clone()), Some(field("payload")), "the payload comes last");
        got.sort();
        let mut want = want;
        want.sort();
        assert_eq!(got, want);
        assert_eq!(decode(&e.destination, &owned(encode(&e))).unwrap().content_type(), Some("application/json"));
    }

    #[test]
    fn encode_decode_round_trip() {
        let e = ev();
        let back = decode(&e.destination, &owned(encode(&e))).unwrap();
        assert_eq!(back, e);
        let mut no_key = e.clone();
        no_key.key = None;
        let fields = owned(encode(&no_key));
        assert!(!fields.iter().any(|(f, _)| f == F_KEY));
        assert_eq!(decode(&e.destination, &fields).unwrap(), no_key);
    }

    #[test]
    fn foreign_entries_name_their_problem() {
        let d = Destination::new("d").unwrap();
        let f = |pairs: &[(&str, &[u8])]| {
            pairs.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.to_vec())).collect::<Vec<_>>()
        };
        type Fields = Vec<(Vec<u8>, Vec<u8>)>;
        let cases: Vec<(Fields, Malformed)> = vec![
            (f(&[("id", b"x"), ("p", b"")]), Malformed::UnknownFormat),
            (f(&[("v", b"9"), ("id", b"x"), ("p", b"")]), Malformed::UnknownFormat),
            (f(&[("v", b"1"), ("p", b"")]), Malformed::NoEventId),
            (f(&[("v", b"1"), ("id", b"a b"), ("p", b"")]), Malformed::BadEventId),
            (f(&[("v", b"1"), ("id", b"x"), ("id", b"y"), ("p", b"")]), Malformed::DuplicateHeader),
            (f(&[("v", b"1"), ("id", b"x"), ("h:bad name", b"1"), ("p", b"")]), Malformed::BadHeaderName),
            (f(&[("v", b"1"), ("id", b"x"), ("h:a", b"1"), ("h:a", b"2"), ("p", b"")]), Malformed::DuplicateHeader),
            (f(&[("v", b"1"), ("id", b"x"), ("k", b"\xff"), ("p", b"")]), Malformed::BadKey),
            (f(&[("v", b"1"), ("id", b"x"), ("h:big", &vec![b'x'; 70_000]), ("p", b"")]), Malformed::OversizedHeaders),
        ];
        for (fields, want) in cases {
            let (got, detail) = decode(&d, &fields).unwrap_err();
            assert_eq!(got, want, "{detail}");
            let raw = raw(&d, "s/1-0".into(), &fields);
            assert_eq!(raw.headers.len() + 1, fields.len(), "every field but p is a raw header");
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
