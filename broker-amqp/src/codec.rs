//! An event as AMQP message properties and body, and back, byte-for-byte.
//!
//! Application headers go at the top level of the AMQP header table as `longstr` values (which
//! are byte strings on the wire, so NUL and non-UTF-8 survive), where any AMQP client and a
//! headers exchange can see them. RabbitMQ adds headers of its own on the way (a quorum queue's
//! `x-delivery-count`, `x-death` after dead-lettering), so decoding must not take "every
//! header": the publisher lists the application header names in `x-outbox-headers`, and only
//! those are read back. The event key travels in `x-outbox-key`, the event id as `message_id`,
//! and the reserved `content-type` header as the `content_type` property (where AMQP clients
//! look for it). The crate README's wire-format table is the specification; a test reads it.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use outbox_core::event::CONTENT_TYPE_HEADER;
use outbox_core::{Destination, Error, Event, EventId, Headers, Malformed, RawMessage, Result};

use crate::config::QueueType;
use crate::error::BACKEND;

/// Header carrying the event key.
pub const KEY_HEADER: &str = "x-outbox-key";
/// Header listing the application header names, in order.
pub const HEADER_NAMES_HEADER: &str = "x-outbox-headers";
/// Header a quorum queue sets to the number of earlier deliveries.
pub const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// Header names an event may not use: this crate's own, and those RabbitMQ writes into a
/// message on its way (they would be overwritten).
const RESERVED_PREFIXES: [&str; 3] = ["x-outbox-", "x-first-death-", "x-last-death-"];
const RESERVED_NAMES: [&str; 3] = [DELIVERY_COUNT_HEADER, "x-death", "x-received-from"];

/// Persistent: written to disk by durable queues.
const DELIVERY_MODE_PERSISTENT: u8 = 2;

/// Whether `name` is reserved (see the crate documentation).
pub fn is_reserved_header(name: &str) -> bool {
    RESERVED_NAMES.contains(&name) || RESERVED_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The properties `event` is published with.
pub(crate) fn encode(event: &Event) -> Result<BasicProperties> {
    let mut table = FieldTable::default();
    let mut names = FieldArray::default();
    let mut content_type = None;
    for (name, value) in &event.headers {
        if name == CONTENT_TYPE_HEADER {
            let text = std::str::from_utf8(value).map_err(|_| {
                Error::invalid_input(BACKEND, format!("event {}: the content type is not text", event.id))
            })?;
            content_type = Some(ShortString::from(text));
            continue;
        }
        if is_reserved_header(name) {
            return Err(Error::invalid_input(
                BACKEND,
                format!("event {}: header name {name:?} is reserved for the broker or this adapter", event.id),
            ));
        }
        table.insert(ShortString::from(name.as_str()), AMQPValue::LongString(LongString::from(value.clone())));
        names.push(AMQPValue::LongString(LongString::from(name.as_bytes())));
    }
    table.insert(HEADER_NAMES_HEADER.into(), AMQPValue::FieldArray(names));
    if let Some(key) = &event.key {
        table.insert(KEY_HEADER.into(), AMQPValue::LongString(LongString::from(key.as_bytes())));
    }
    let properties = BasicProperties::default()
        .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
        .with_message_id(event.id.as_str().into())
        .with_headers(table);
    Ok(match content_type {
        Some(ct) => properties.with_content_type(ct),
        None => properties,
    })
}

/// Bytes of the content-header frame that carries `event`'s properties, as [`encode`] builds
/// them: frame envelope (8), class, weight, body size and property flags (14), delivery mode,
/// `message_id` and the header table (AMQP 0-9-1 field-table encoding).
///
/// The whole frame must fit the connection's negotiated `frame_max`: RabbitMQ answers a larger
/// one with `FRAME_ERROR` and closes the connection, with every channel on it. So the broker
/// checks this before sending, and refuses the one message instead.
pub(crate) fn content_header_frame_bytes(event: &Event) -> usize {
    // A table entry: short-string name, a type byte, then the value.
    let entry = |name: usize, value: usize| 1 + name + 1 + value;
    let long_string = |len: usize| 4 + len;
    let mut table = 4;
    let mut names = 4;
    let mut content_type = 0;
    for (name, value) in &event.headers {
        if name == CONTENT_TYPE_HEADER {
            content_type = 1 + value.len();
            continue;
        }
        table += entry(name.len(), long_string(value.len()));
        names += 1 + long_string(name.len());
    }
    table += entry(HEADER_NAMES_HEADER.len(), names);
    if let Some(key) = &event.key {
        table += entry(KEY_HEADER.len(), long_string(key.len()));
    }
    let properties = 1 + (1 + event.id.as_str().len()) + table + content_type;
    8 + 14 + properties
}

fn bytes(value: &AMQPValue) -> Option<&[u8]> {
    match value {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        AMQPValue::ByteArray(b) => Some(b.as_slice()),
        _ => None,
    }
}

/// Rebuild the event of a delivery from `destination` (the subscription's), or say why it is not
/// one.
///
/// A message without a `message_id` that is a valid event id, or with a malformed outbox header,
/// was not published by this crate; an event that breaks the rules of
/// [`Event::validate`](outbox_core::Event::validate) on receive is not accepted either
/// ([`Malformed::of_event`]).
///
/// On failure the payload is handed back with the problem, for the raw message.
pub(crate) fn decode(
    destination: &Destination,
    properties: &BasicProperties,
    payload: Vec<u8>,
) -> std::result::Result<Event, (Malformed, String, Vec<u8>)> {
    let (id, key, headers) = match parts(properties) {
        Ok(parts) => parts,
        Err((problem, detail)) => return Err((problem, detail, payload)),
    };
    let event = Event { id, destination: destination.clone(), key, headers, payload };
    match Malformed::of_event(&event) {
        None => Ok(event),
        Some((problem, detail)) => Err((problem, detail, event.payload)),
    }
}

type Parts = (EventId, Option<String>, Headers);

fn parts(properties: &BasicProperties) -> std::result::Result<Parts, (Malformed, String)> {
    let id = properties.message_id().as_ref().ok_or((Malformed::NoEventId, "no message_id property".to_string()))?;
    let id = EventId::new(id.as_str())
        .map_err(|e| (Malformed::BadEventId, format!("message_id {:?}: {}", id.as_str(), e.message())))?;
    let empty = FieldTable::default();
    let table = properties.headers().as_ref().unwrap_or(&empty).inner();

    let key = match table.get(KEY_HEADER) {
        None => None,
        Some(v) => {
            let raw = bytes(v).ok_or((Malformed::UnknownFormat, format!("header {KEY_HEADER} is not a string")))?;
            Some(
                String::from_utf8(raw.to_vec())
                    .map_err(|_| (Malformed::BadKey, format!("header {KEY_HEADER} is not UTF-8")))?,
            )
        }
    };

    let mut headers = Headers::new();
    match table.get(HEADER_NAMES_HEADER) {
        Some(AMQPValue::FieldArray(names)) => {
            for name in names.as_slice() {
                let name = bytes(name).and_then(|n| std::str::from_utf8(n).ok()).ok_or((
                    Malformed::BadHeaderName,
                    format!("{HEADER_NAMES_HEADER} holds a name that is not text"),
                ))?;
                let value = table.get(name).and_then(bytes).ok_or((
                    Malformed::UnknownFormat,
                    format!("header {name:?} is listed in {HEADER_NAMES_HEADER} but missing or not a byte string"),
                ))?;
                if headers.insert(name.to_string(), value.to_vec()).is_some() {
                    return Err((Malformed::DuplicateHeader, format!("{HEADER_NAMES_HEADER} lists {name:?} twice")));
                }
            }
        }
        Some(_) => {
            return Err((Malformed::UnknownFormat, format!("header {HEADER_NAMES_HEADER} is not an array")));
        }
        // Published by another client: its byte-string headers, minus the broker's own.
        None => {
            for (name, value) in table {
                if let Some(value) = bytes(value).filter(|_| !is_reserved_header(name.as_str())) {
                    headers.insert(name.to_string(), value.to_vec());
                }
            }
        }
    }
    if let Some(ct) = properties.content_type()
        && headers.insert(CONTENT_TYPE_HEADER.to_string(), ct.as_str().as_bytes().to_vec()).is_some()
    {
        return Err((
            Malformed::DuplicateHeader,
            format!("a {CONTENT_TYPE_HEADER} header and the content_type property are both set"),
        ));
    }
    Ok((id, key, headers))
}

/// The message as RabbitMQ delivered it: the `message_id`, `content_type` and `type` properties
/// (named `amqp.message_id`, ...), then every entry of the header table in its order, byte
/// strings raw and other AMQP values in their debug form.
pub(crate) fn raw(
    destination: &Destination,
    position: String,
    properties: &BasicProperties,
    payload: Vec<u8>,
) -> RawMessage {
    let mut headers = Vec::new();
    let props = [
        ("amqp.message_id", properties.message_id()),
        ("amqp.content_type", properties.content_type()),
        ("amqp.type", properties.kind()),
    ];
    for (name, value) in props {
        if let Some(v) = value {
            headers.push((name.as_bytes().to_vec(), v.as_str().as_bytes().to_vec()));
        }
    }
    if let Some(table) = properties.headers() {
        for (name, value) in table.inner() {
            let value = bytes(value).map_or_else(|| format!("{value:?}").into_bytes(), <[u8]>::to_vec);
            headers.push((name.as_str().as_bytes().to_vec(), value));
        }
    }
    RawMessage {
        backend: BACKEND,
        destination: destination.clone(),
        position,
        event_id: properties.message_id().as_ref().and_then(|id| EventId::new(id.as_str()).ok()),
        key: None,
        headers,
        payload,
    }
}

/// The 1-based delivery attempt: counted by quorum queues only.
///
/// A quorum queue sets `x-delivery-count` to the number of earlier (failed) deliveries, so the
/// attempt is that plus one, and at least 2 when the `redelivered` flag is set. Classic queues
/// keep no count: `None`.
pub(crate) fn attempt(queue_type: QueueType, properties: &BasicProperties, redelivered: bool) -> Option<u32> {
    if queue_type == QueueType::Classic {
        return None;
    }
    let count = properties.headers().as_ref().and_then(|t| t.inner().get(DELIVERY_COUNT_HEADER)).and_then(|v| {
        let n: i128 = match v {
            AMQPValue::ShortShortInt(n) => (*n).into(),
            AMQPValue::ShortShortUInt(n) => (*n).into(),
            AMQPValue::ShortInt(n) => (*n).into(),
            AMQPValue::ShortUInt(n) => (*n).into(),
            AMQPValue::LongInt(n) => (*n).into(),
            AMQPValue::LongUInt(n) => (*n).into(),
            AMQPValue::LongLongInt(n) => (*n).into(),
            AMQPValue::Timestamp(n) => (*n).into(),
            _ => return None,
        };
        u32::try_from(n.max(0)).ok()
    });
    let attempt = count.unwrap_or(0).saturating_add(1);
    Some(if redelivered { attempt.max(2) } else { attempt })
}

#[cfg(test)]
mod tests {
    use outbox_core::ErrorKind;

    use super::*;

    fn event() -> Event {
        Event::new(EventId::new("evt-1").unwrap(), Destination::new("orders").unwrap(), vec![0, 159, 146, 150, 0, 255])
            .with_key("customer-7")
            .with_header("bin", vec![0u8, 0xff, 0xfe, 0])
            .with_header("empty", Vec::new())
            .with_header("text", b"hello".to_vec())
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
        let e = Event::new(EventId::new("e-9").unwrap(), Destination::new("d").unwrap(), b"body".to_vec())
            .with_key("k-1")
            .with_header("trace", vec![0u8, 0xff])
            .with_content_type("application/json");
        let props = encode(&e).unwrap();
        assert_eq!(row(&table, "event id").2, "message_id");
        assert_eq!(props.message_id().as_ref().map(ShortString::as_str), Some("e-9"));
        assert_eq!(row(&table, "content type").2, "content_type");
        assert_eq!(props.content_type().as_ref().map(ShortString::as_str), Some("application/json"));
        let headers = props.headers().clone().unwrap();
        let t = headers.inner();
        let key = row(&table, "key").2.as_str();
        assert_eq!(t.get(key).and_then(bytes), Some(&b"k-1"[..]));
        let header = row(&table, "header").2.replace("<name>", "trace");
        assert_eq!(t.get(header.as_str()).and_then(bytes), Some(&[0u8, 0xff][..]));
        let names = row(&table, "header names").2.as_str();
        assert_eq!(t.get(names), Some(&AMQPValue::FieldArray(vec![AMQPValue::LongString("trace".into())].into())));
        let mut keys: Vec<&str> = t.keys().map(ShortString::as_str).collect();
        keys.sort_unstable();
        let mut want = vec![key, header.as_str(), names];
        want.sort_unstable();
        assert_eq!(keys, want, "nothing else in the header table");
        assert_eq!(row(&table, "payload").1, "body");
    }

    #[test]
    fn round_trips_through_properties() {
        let e = event();
        let props = encode(&e).unwrap();
        assert_eq!(props.delivery_mode(), &Some(2));
        assert_eq!(props.message_id().as_ref().map(ShortString::as_str), Some("evt-1"));
        let back = decode(&e.destination, &props, e.payload.clone()).unwrap();
        assert_eq!(back, e);
        assert_eq!(back.fingerprint(), e.fingerprint());
    }

    #[test]
    fn broker_headers_are_not_application_headers() {
        let e = event();
        let mut props = encode(&e).unwrap();
        let mut table = props.headers().clone().unwrap();
        table.insert(DELIVERY_COUNT_HEADER.into(), AMQPValue::LongLongInt(3));
        table.insert("x-first-death-queue".into(), AMQPValue::LongString("q".into()));
        props = props.with_headers(table);
        assert_eq!(decode(&e.destination, &props, e.payload.clone()).unwrap(), e);
        assert_eq!(attempt(QueueType::Quorum, &props, true), Some(4));
        assert_eq!(attempt(QueueType::Classic, &props, true), None);
    }

    #[test]
    fn attempt_without_count() {
        let props = encode(&event()).unwrap();
        assert_eq!(attempt(QueueType::Quorum, &props, false), Some(1));
        assert_eq!(attempt(QueueType::Quorum, &props, true), Some(2));
    }

    #[test]
    fn reserved_header_names_are_rejected() {
        for name in ["x-outbox-key", "x-delivery-count", "x-death", "x-first-death-reason"] {
            let e = event().with_header(name, b"v".to_vec());
            let err = encode(&e).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{name}");
            assert!(err.is_permanent());
        }
        assert!(!is_reserved_header("x-request-id"));
    }

    #[test]
    fn content_type_travels_as_the_property() {
        let e = event().with_content_type("application/json");
        let props = encode(&e).unwrap();
        assert_eq!(props.content_type().as_ref().map(ShortString::as_str), Some("application/json"));
        let table = props.headers().clone().unwrap();
        assert!(!table.inner().contains_key(CONTENT_TYPE_HEADER), "not a table header");
        assert_eq!(decode(&e.destination, &props, e.payload.clone()).unwrap(), e);
        assert_eq!(content_header_frame_bytes(&e), content_header_frame_bytes(&event()) + 1 + "application/json".len());
    }

    #[test]
    fn foreign_messages() {
        let d = Destination::new("orders").unwrap();
        let problem = decode(&d, &BasicProperties::default(), b"x".to_vec()).map(|_| ()).unwrap_err().0;
        assert_eq!(problem, Malformed::NoEventId);
        let bad_id = BasicProperties::default().with_message_id("a b".into());
        assert_eq!(decode(&d, &bad_id, vec![]).map(|_| ()).unwrap_err().0, Malformed::BadEventId);
        let mut table = FieldTable::default();
        table.insert("bad name".into(), AMQPValue::LongString("v".into()));
        let bad_name = BasicProperties::default().with_message_id("m-2".into()).with_headers(table);
        assert_eq!(decode(&d, &bad_name, vec![]).map(|_| ()).unwrap_err().0, Malformed::BadHeaderName);
        let mut table = FieldTable::default();
        table.insert(HEADER_NAMES_HEADER.into(), AMQPValue::LongString("x".into()));
        let unknown = BasicProperties::default().with_message_id("m-3".into()).with_headers(table);
        assert_eq!(decode(&d, &unknown, vec![]).map(|_| ()).unwrap_err().0, Malformed::UnknownFormat);
        let raw = raw(&d, "q#1".into(), &unknown, b"body".to_vec());
        assert_eq!(raw.headers[0], (b"amqp.message_id".to_vec(), b"m-3".to_vec()));
        assert_eq!(raw.payload, b"body");

        let mut table = FieldTable::default();
        table.insert("trace".into(), AMQPValue::LongString("t-1".into()));
        table.insert("n".into(), AMQPValue::LongInt(4));
        let props = BasicProperties::default().with_message_id("m-1".into()).with_headers(table);
        let e = decode(&d, &props, b"x".to_vec()).unwrap();
        assert_eq!(e.key, None);
        assert_eq!(e.headers, Headers::from([("trace".to_string(), b"t-1".to_vec())]));
    }
}
