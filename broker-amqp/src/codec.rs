//! An event as AMQP message properties and body, and back, byte-for-byte.
//!
//! Application headers go at the top level of the AMQP header table as `longstr` values (which
//! are byte strings on the wire, so NUL and non-UTF-8 survive), where any AMQP client and a
//! headers exchange can see them. RabbitMQ adds headers of its own on the way (a quorum queue's
//! `x-delivery-count`, `x-death` after dead-lettering), so decoding must not take "every
//! header": the publisher lists the application header names in `x-outbox-headers`, and only
//! those are read back. The event key travels in `x-outbox-key`, the event id as `message_id`.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use outbox_core::{Destination, Error, ErrorKind, Event, EventId, Headers, Result, Retry};

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
    for (name, value) in &event.headers {
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
    Ok(BasicProperties::default()
        .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
        .with_message_id(event.id.as_str().into())
        .with_headers(table))
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
    for (name, value) in &event.headers {
        table += entry(name.len(), long_string(value.len()));
        names += 1 + long_string(name.len());
    }
    table += entry(HEADER_NAMES_HEADER.len(), names);
    if let Some(key) = &event.key {
        table += entry(KEY_HEADER.len(), long_string(key.len()));
    }
    let properties = 1 + (1 + event.id.as_str().len()) + table;
    8 + 14 + properties
}

fn corrupt(message: String) -> Error {
    Error::new(ErrorKind::Corrupt, Retry::Permanent, BACKEND, message)
}

fn bytes(value: &AMQPValue) -> Option<&[u8]> {
    match value {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        AMQPValue::ByteArray(b) => Some(b.as_slice()),
        _ => None,
    }
}

/// Rebuild the event of a delivery from `destination` (the subscription's).
///
/// A message without a `message_id` that is a valid event id, or with a malformed outbox header,
/// was not published by this crate: [`ErrorKind::Corrupt`].
pub(crate) fn decode(destination: &Destination, properties: &BasicProperties, payload: Vec<u8>) -> Result<Event> {
    let id = properties
        .message_id()
        .as_ref()
        .ok_or_else(|| corrupt(format!("a message on {destination} has no message_id, so it has no event id")))?;
    let id = EventId::new(id.as_str())
        .map_err(|e| corrupt(format!("a message on {destination} has an invalid event id: {}", e.message())))?;
    let empty = FieldTable::default();
    let table = properties.headers().as_ref().unwrap_or(&empty).inner();

    let key = match table.get(KEY_HEADER) {
        None => None,
        Some(v) => {
            let raw = bytes(v).ok_or_else(|| corrupt(format!("event {id}: header {KEY_HEADER} is not a string")))?;
            Some(
                String::from_utf8(raw.to_vec())
                    .map_err(|_| corrupt(format!("event {id}: header {KEY_HEADER} is not UTF-8")))?,
            )
        }
    };

    let mut headers = Headers::new();
    match table.get(HEADER_NAMES_HEADER) {
        Some(AMQPValue::FieldArray(names)) => {
            for name in names.as_slice() {
                let name = bytes(name)
                    .and_then(|n| std::str::from_utf8(n).ok())
                    .ok_or_else(|| corrupt(format!("event {id}: {HEADER_NAMES_HEADER} holds a non-text name")))?;
                let value = table
                    .get(name)
                    .and_then(bytes)
                    .ok_or_else(|| corrupt(format!("event {id}: header {name:?} is missing or not a byte string")))?;
                headers.insert(name.to_string(), value.to_vec());
            }
        }
        Some(_) => return Err(corrupt(format!("event {id}: header {HEADER_NAMES_HEADER} is not an array"))),
        // Published by another client: its byte-string headers, minus the broker's own.
        None => {
            for (name, value) in table {
                if let Some(value) = bytes(value).filter(|_| !is_reserved_header(name.as_str())) {
                    headers.insert(name.to_string(), value.to_vec());
                }
            }
        }
    }
    Ok(Event { id, destination: destination.clone(), key, headers, payload })
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
    use super::*;

    fn event() -> Event {
        Event::new(EventId::new("evt-1").unwrap(), Destination::new("orders").unwrap(), vec![0, 159, 146, 150, 0, 255])
            .with_key("customer-7")
            .with_header("bin", vec![0u8, 0xff, 0xfe, 0])
            .with_header("empty", Vec::new())
            .with_header("text", b"hello".to_vec())
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
    fn foreign_messages() {
        let d = Destination::new("orders").unwrap();
        let err = decode(&d, &BasicProperties::default(), b"x".to_vec()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        let mut table = FieldTable::default();
        table.insert("trace".into(), AMQPValue::LongString("t-1".into()));
        table.insert("n".into(), AMQPValue::LongInt(4));
        let props = BasicProperties::default().with_message_id("m-1".into()).with_headers(table);
        let e = decode(&d, &props, b"x".to_vec()).unwrap();
        assert_eq!(e.key, None);
        assert_eq!(e.headers, Headers::from([("trace".to_string(), b"t-1".to_vec())]));
    }
}
