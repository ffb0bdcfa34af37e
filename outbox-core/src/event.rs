//! The values that travel from an outbox row to a consumer.
//!
//! Validation happens once, when a value is built, so that every store and broker can rely on
//! the same limits and a bad value is rejected before anything is written.

use std::collections::BTreeMap;
use std::fmt;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Longest accepted event id, in bytes.
pub const MAX_EVENT_ID_LEN: usize = 128;
/// Longest accepted destination (and consumer group) name, in bytes.
///
/// Below every supported broker's own limit with room for an adapter's prefix: Kafka topic
/// names end at 249 bytes, and RabbitMQ's exchange names at 255 bytes *including* the adapter's
/// exchange prefix (at most 50 bytes). Redis keys have no practical limit.
pub const MAX_DESTINATION_LEN: usize = 200;

/// The prefix RabbitMQ reserves for its own exchanges and queues; declaring a name that starts
/// with it is refused (`ACCESS_REFUSED`).
pub const RESERVED_AMQP_PREFIX: &str = "amq.";
/// Longest accepted key, in bytes.
pub const MAX_KEY_LEN: usize = 512;
/// Longest accepted header name, in bytes.
pub const MAX_HEADER_NAME_LEN: usize = 128;
/// Default largest payload a store accepts (1 MiB). Stores may be configured otherwise.
pub const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;
/// Largest total size of an event's headers, in bytes: the names plus the values of all of them
/// (64 KiB). [`Event::validate`] refuses more with [`ErrorKind::TooLarge`](crate::ErrorKind::TooLarge).
///
/// Headers travel outside the payload on every broker and some carry them in a size-capped
/// frame: RabbitMQ puts them in one content-header frame that must fit the negotiated
/// `frame_max` (128 KiB by default, and a larger header breaks the whole connection). 64 KiB
/// leaves room for the adapter's own properties within the smallest common frame size.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;

/// The reserved header that carries an event's content type (a MIME type such as
/// `application/json`), set with [`Event::with_content_type`].
///
/// It is an ordinary header in the event, so stores keep it without a column of their own and it
/// takes part in the fingerprint; brokers that have a content-type slot of their own (the AMQP
/// `content_type` property) carry it there and put it back into the headers on receive. Each
/// broker crate's README documents where it goes on the wire.
pub const CONTENT_TYPE_HEADER: &str = "content-type";
/// Longest accepted content type, in bytes (the AMQP `content_type` property is a short string).
pub const MAX_CONTENT_TYPE_LEN: usize = 255;

/// Why `value` is not an acceptable content type (1 to [`MAX_CONTENT_TYPE_LEN`] bytes of printable
/// ASCII, spaces allowed: `text/plain; charset=utf-8`), or `None` when it is.
pub fn content_type_problem(value: &[u8]) -> Option<String> {
    if value.is_empty() || value.len() > MAX_CONTENT_TYPE_LEN {
        return Some(format!("content type is {} bytes; 1 to {MAX_CONTENT_TYPE_LEN} are allowed", value.len()));
    }
    if let Some(at) = value.iter().position(|b| !(0x20..=0x7e).contains(b)) {
        return Some(format!("content type has byte 0x{:02x} at {at}; only printable ASCII is allowed", value[at]));
    }
    None
}

fn invalid(message: String) -> Error {
    Error::invalid_input("outbox", message)
}

/// A stable, validated event identity: 1 to [`MAX_EVENT_ID_LEN`] bytes of visible ASCII
/// (`!` to `~`, no spaces or control characters).
///
/// The id is what deduplication keys on, so it must survive every broker and database unchanged.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId(String);

impl EventId {
    /// Validate and wrap an id.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) when the id is empty, too long
    /// or contains anything but visible ASCII.
    pub fn new(id: impl Into<String>) -> Result<Self> {
        let id = id.into();
        if id.is_empty() {
            return Err(invalid("event id is empty".into()));
        }
        if id.len() > MAX_EVENT_ID_LEN {
            return Err(invalid(format!(
                "event id is {} bytes, longer than the limit of {MAX_EVENT_ID_LEN}",
                id.len()
            )));
        }
        if let Some((at, c)) = id.char_indices().find(|(_, c)| !c.is_ascii_graphic()) {
            return Err(invalid(format!(
                "event id {:?} has a character that is not visible ASCII ({c:?}) at byte {at}",
                id
            )));
        }
        Ok(Self(id))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Wrap text the caller built to be valid (visible ASCII, at most the limit).
    pub(crate) fn trusted(id: String) -> Self {
        debug_assert!(Self::new(id.clone()).is_ok(), "{id:?}");
        Self(id)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EventId({})", self.0)
    }
}

impl TryFrom<&str> for EventId {
    type Error = Error;
    fn try_from(value: &str) -> Result<Self> {
        Self::new(value)
    }
}

/// Where an event is published: a topic, exchange or stream name, depending on the broker.
///
/// 1 to [`MAX_DESTINATION_LEN`] bytes of `[A-Za-z0-9._-]`, not `.` or `..`, not starting with
/// [`RESERVED_AMQP_PREFIX`]: the intersection of what Kafka, RabbitMQ and Redis accept, so
/// swapping brokers never turns a valid name invalid.
///
/// | rule | broker that refuses otherwise |
/// |---|---|
/// | only `[A-Za-z0-9._-]` | Kafka (topic names) |
/// | not `.` or `..` | Kafka (they are path components of its log directories) |
/// | at most 200 bytes | Kafka (249), RabbitMQ (255 with the adapter's prefix of up to 50) |
/// | not starting with `amq.` | RabbitMQ (reserved for the server's own exchanges and queues) |
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Destination(String);

impl Destination {
    /// Validate and wrap a destination name.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput), naming the rule and the
    /// broker that needs it, for an empty or too long name, a character outside
    /// `[A-Za-z0-9._-]`, the names `.` and `..`, or a name starting with `amq.`.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        validate_name("destination", &name, MAX_DESTINATION_LEN)?;
        if name == "." || name == ".." {
            return Err(invalid(format!(
                "destination name {name:?} is not allowed: Kafka refuses the topic names \".\" and \"..\""
            )));
        }
        if name.starts_with(RESERVED_AMQP_PREFIX) {
            return Err(invalid(format!(
                "destination name {name:?} starts with {RESERVED_AMQP_PREFIX:?}, which RabbitMQ reserves for its \
                 own exchanges and queues"
            )));
        }
        Ok(Self(name))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Destination({})", self.0)
    }
}

/// A consumer group (Kafka group, RabbitMQ queue, Redis Streams group): every group receives
/// every message of a destination once; members of one group share the work.
///
/// Same rules as [`Destination`].
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConsumerGroup(String);

impl ConsumerGroup {
    /// Validate and wrap a group name.
    ///
    /// # Errors
    /// As for [`Destination::new`].
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        validate_name("consumer group", &name, MAX_DESTINATION_LEN)?;
        Ok(Self(name))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ConsumerGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ConsumerGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConsumerGroup({})", self.0)
    }
}

fn validate_name(what: &str, name: &str, max: usize) -> Result<()> {
    if name.is_empty() {
        return Err(invalid(format!("{what} name is empty")));
    }
    if name.len() > max {
        return Err(invalid(format!("{what} name is {} bytes, longer than the limit of {max}", name.len())));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(invalid(format!("{what} name {name:?} has {c:?}; only [A-Za-z0-9._-] is allowed")));
    }
    Ok(())
}

/// Event headers: names are visible ASCII, values are arbitrary bytes. Kept sorted by name so
/// that comparisons and fingerprints don't depend on insertion order.
pub type Headers = BTreeMap<String, Vec<u8>>;

/// An event: what a producer enqueues, what a relay publishes and what a consumer receives.
#[derive(Clone, PartialEq, Eq)]
pub struct Event {
    /// Stable identity used for deduplication.
    pub id: EventId,
    /// Topic / exchange / stream.
    pub destination: Destination,
    /// Optional ordering key (aggregate id): events with one key are published in row order.
    pub key: Option<String>,
    /// Application headers, delivered byte-for-byte.
    pub headers: Headers,
    /// Opaque payload, delivered byte-for-byte.
    pub payload: Vec<u8>,
}

impl Event {
    /// An event with no key and no headers.
    pub fn new(id: EventId, destination: Destination, payload: impl Into<Vec<u8>>) -> Self {
        Self { id, destination, key: None, headers: Headers::new(), payload: payload.into() }
    }

    /// Set the ordering key.
    #[must_use]
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Add a header.
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Set the content type (`application/json`, `text/plain; charset=utf-8`): the reserved
    /// [`CONTENT_TYPE_HEADER`]. [`Event::validate`] checks it (1 to [`MAX_CONTENT_TYPE_LEN`]
    /// bytes of printable ASCII).
    #[must_use]
    pub fn with_content_type(self, content_type: impl Into<String>) -> Self {
        self.with_header(CONTENT_TYPE_HEADER, content_type.into().into_bytes())
    }

    /// The content type, if the event has one that is text ([`CONTENT_TYPE_HEADER`]).
    pub fn content_type(&self) -> Option<&str> {
        self.headers.get(CONTENT_TYPE_HEADER).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Check the parts that are not validated by construction (key, headers, payload size).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for a key or header name that
    /// is too long or not printable, a content type ([`CONTENT_TYPE_HEADER`]) that is not 1 to
    /// [`MAX_CONTENT_TYPE_LEN`] bytes of printable ASCII, or
    /// [`ErrorKind::TooLarge`](crate::ErrorKind::TooLarge)
    /// (permanent) for a payload over `max_payload` bytes or headers whose names and values
    /// together exceed [`DEFAULT_MAX_HEADER_BYTES`]. The message names the event id, the size
    /// and the limit.
    pub fn validate(&self, max_payload: usize) -> Result<()> {
        if let Some(key) = &self.key {
            if key.len() > MAX_KEY_LEN {
                return Err(invalid(format!(
                    "event {}: key is {} bytes, longer than the limit of {MAX_KEY_LEN}",
                    self.id,
                    key.len()
                )));
            }
            if key.chars().any(char::is_control) {
                return Err(invalid(format!("event {}: key has a control character", self.id)));
            }
        }
        for name in self.headers.keys() {
            if name.is_empty() || name.len() > MAX_HEADER_NAME_LEN || !name.chars().all(|c| c.is_ascii_graphic()) {
                return Err(invalid(format!(
                    "event {}: header name {name:?} must be 1 to {MAX_HEADER_NAME_LEN} bytes of visible ASCII",
                    self.id
                )));
            }
        }
        if let Some(problem) = self.headers.get(CONTENT_TYPE_HEADER).and_then(|v| content_type_problem(v)) {
            return Err(invalid(format!("event {}: {problem}", self.id)));
        }
        let header_bytes = self.header_bytes();
        if header_bytes > DEFAULT_MAX_HEADER_BYTES {
            return Err(Error::permanent(
                crate::ErrorKind::TooLarge,
                "outbox",
                format!(
                    "event {}: headers are {header_bytes} bytes (names and values), larger than the limit of \
                     {DEFAULT_MAX_HEADER_BYTES}",
                    self.id
                ),
            ));
        }
        if self.payload.len() > max_payload {
            return Err(Error::permanent(
                crate::ErrorKind::TooLarge,
                "outbox",
                format!(
                    "event {}: payload is {} bytes, larger than the limit of {max_payload}",
                    self.id,
                    self.payload.len()
                ),
            ));
        }
        Ok(())
    }

    /// Total size of the headers as [`Event::validate`] counts it: names plus values, in bytes.
    pub fn header_bytes(&self) -> usize {
        self.headers.iter().map(|(name, value)| name.len() + value.len()).sum()
    }

    /// A digest of everything that defines the event's content (destination, key, headers,
    /// payload). Two deliveries with one id and different fingerprints are a conflict.
    ///
    /// The W3C trace-context headers ([`TRACEPARENT_HEADER`](crate::telemetry::TRACEPARENT_HEADER),
    /// [`TRACESTATE_HEADER`](crate::telemetry::TRACESTATE_HEADER)) are left out: they say which
    /// trace carried the event, not what it is, so the same event enqueued again from another
    /// trace (a retried request) is a duplicate, not a conflict.
    pub fn fingerprint(&self) -> Fingerprint {
        let mut h = Sha256::new();
        let mut field = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_be_bytes());
            h.update(bytes);
        };
        field(self.destination.as_str().as_bytes());
        match &self.key {
            Some(k) => field(k.as_bytes()),
            None => field(b"\xff-no-key"),
        }
        for (name, value) in self.headers.iter().filter(|(name, _)| !crate::telemetry::is_trace_header(name)) {
            field(name.as_bytes());
            field(value);
        }
        field(&self.payload);
        Fingerprint(h.finalize().into())
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("id", &self.id)
            .field("destination", &self.destination)
            .field("key", &self.key)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

/// SHA-256 digest of an event's content, stored with inbox markers.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Lower-case hex form, for text columns and messages.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parse the hex form.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt) when the text is not 64 hex digits.
    pub fn from_hex(hex: &str) -> Result<Self> {
        let bad = || Error::permanent(crate::ErrorKind::Corrupt, "outbox", format!("bad fingerprint {hex:?}"));
        if hex.len() != 64 {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(hex.get(i * 2..i * 2 + 2).ok_or_else(bad)?, 16).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({}…)", &self.to_hex()[..12])
    }
}

const HEADERS_FORMAT: u8 = 1;

/// Encode headers for a binary column: a format byte (1), a `u32` count, then per header a
/// `u32` name length, the name, a `u32` value length and the value; integers big-endian. Values
/// are arbitrary bytes, which text formats (`jsonb`, `hstore`) can't hold faithfully; names come
/// in sorted order, so equal headers encode to equal bytes. Stores share this format.
pub fn encode_headers(headers: &Headers) -> Vec<u8> {
    let size = 5 + headers.iter().map(|(k, v)| 8 + k.len() + v.len()).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.push(HEADERS_FORMAT);
    out.extend_from_slice(&len32(headers.len()).to_be_bytes());
    for (name, value) in headers {
        out.extend_from_slice(&len32(name.len()).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&len32(value.len()).to_be_bytes());
        out.extend_from_slice(value);
    }
    out
}

/// Lengths beyond `u32` cannot be stored by any backend (PostgreSQL and SQLite cap values near
/// 1 GB); saturate rather than panic, and decoding reports corruption.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Decode [`encode_headers`]; `backend` names the store in errors.
///
/// # Errors
/// [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt) for truncated, unknown or trailing data.
pub fn decode_headers(bytes: &[u8], backend: &'static str) -> Result<Headers> {
    let corrupt = |what: &str| Error::permanent(crate::ErrorKind::Corrupt, backend, format!("stored headers: {what}"));
    let mut rest = bytes;
    let mut take = |n: usize| -> Result<&[u8]> {
        if rest.len() < n {
            return Err(corrupt("truncated"));
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    let format = take(1)?;
    if format != [HEADERS_FORMAT] {
        return Err(corrupt("unknown format byte"));
    }
    // Big-endian; `take(4)` guarantees four bytes.
    let u32_at = |b: &[u8]| -> usize { b.iter().fold(0usize, |n, &byte| (n << 8) | usize::from(byte)) };
    let count = u32_at(take(4)?);
    let mut headers = Headers::new();
    for _ in 0..count {
        let name_len = u32_at(take(4)?);
        let name = std::str::from_utf8(take(name_len)?).map_err(|_| corrupt("header name is not UTF-8"))?;
        let value_len = u32_at(take(4)?);
        let value = take(value_len)?.to_vec();
        headers.insert(name.to_string(), value);
    }
    if !rest.is_empty() {
        return Err(corrupt("trailing bytes"));
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn event_id_rules() {
        assert!(EventId::new("order-42/credit:7").is_ok());
        for bad in ["", "has space", "tab\t", "é", "nul\0"] {
            let err = EventId::new(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{bad:?}");
        }
        let long = "x".repeat(MAX_EVENT_ID_LEN + 1);
        let err = EventId::new(long).unwrap_err();
        assert!(err.message().contains("longer than the limit of 128"), "{err}");
    }

    #[test]
    fn destination_rules() {
        assert!(Destination::new("orders.v1_a-b").is_ok());
        assert!(Destination::new("orders/v1").is_err());
        assert!(Destination::new("").is_err());
        assert!(ConsumerGroup::new("g 1").is_err());
    }

    #[test]
    fn destination_names_any_supported_broker_refuses_are_refused_naming_the_rule() {
        let refused = |name: &str, rule: &str| {
            let err = Destination::new(name).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{name:?}");
            assert!(err.message().contains(rule), "{name:?}: {err}");
        };
        refused(".", "Kafka refuses the topic names \".\" and \"..\"");
        refused("..", "Kafka refuses");
        refused("amq.orders", "RabbitMQ reserves");
        refused("amq.", "RabbitMQ reserves");
        refused(&"d".repeat(MAX_DESTINATION_LEN + 1), "longer than the limit of 200");
        refused("orders eu", "only [A-Za-z0-9._-] is allowed");
        refused("", "empty");
        // Dots elsewhere, and names that merely contain the reserved words, are fine.
        for ok in ["...", ".orders", "orders.", "a..b", "amq", "amqp.orders", "x.amq.y", "AMQ.orders"] {
            assert!(Destination::new(ok).is_ok(), "{ok:?}");
        }
        assert!(Destination::new("d".repeat(MAX_DESTINATION_LEN)).is_ok());
        // Groups are not topics: Kafka takes any group id.
        assert!(ConsumerGroup::new(".").is_ok());
    }

    #[test]
    fn oversized_payload_is_too_large() {
        let e = Event::new(EventId::new("a").unwrap(), Destination::new("d").unwrap(), vec![0; 11]);
        assert_eq!(e.validate(10).unwrap_err().kind(), ErrorKind::TooLarge);
        assert!(e.validate(11).is_ok());
    }

    #[test]
    fn oversized_headers_are_too_large_and_permanent() {
        let id = EventId::new("ev-big-headers").unwrap();
        let d = Destination::new("d").unwrap();
        // Exactly at the limit: one name of 4 bytes plus a value filling the rest.
        let at_limit = Event::new(id.clone(), d.clone(), b"p".to_vec())
            .with_header("big1", vec![b'x'; DEFAULT_MAX_HEADER_BYTES - 4]);
        assert_eq!(at_limit.header_bytes(), DEFAULT_MAX_HEADER_BYTES);
        assert!(at_limit.validate(DEFAULT_MAX_PAYLOAD).is_ok());
        // One byte more, spread over two headers: the total counts, not each header.
        let over = at_limit.clone().with_header("b", Vec::new());
        assert_eq!(over.header_bytes(), DEFAULT_MAX_HEADER_BYTES + 1);
        let err = over.validate(DEFAULT_MAX_PAYLOAD).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
        assert_eq!(err.retry(), crate::Retry::Permanent, "{err}");
        for part in
            ["ev-big-headers", &(DEFAULT_MAX_HEADER_BYTES + 1).to_string(), &DEFAULT_MAX_HEADER_BYTES.to_string()]
        {
            assert!(err.message().contains(part), "{part:?} missing from {err}");
        }
        // A 10 MB value, the case from the field, is refused even with a huge payload limit.
        let huge = Event::new(id, d, Vec::new()).with_header("trace", vec![0; 10 * 1024 * 1024]);
        assert_eq!(huge.validate(usize::MAX).unwrap_err().kind(), ErrorKind::TooLarge);
    }

    #[test]
    fn content_type_is_a_checked_reserved_header() {
        let e = Event::new(EventId::new("a").unwrap(), Destination::new("d").unwrap(), b"{}".to_vec());
        assert_eq!(e.content_type(), None);
        let json = e.clone().with_content_type("application/json; charset=utf-8");
        assert_eq!(json.content_type(), Some("application/json; charset=utf-8"));
        assert_eq!(json.headers[CONTENT_TYPE_HEADER], b"application/json; charset=utf-8");
        assert!(json.validate(DEFAULT_MAX_PAYLOAD).is_ok());
        assert_ne!(json.fingerprint(), e.fingerprint());
        for bad in ["", "text/\u{7f}", "t\u{e9}xt/plain"] {
            let err = e.clone().with_content_type(bad).validate(DEFAULT_MAX_PAYLOAD).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{bad:?}");
            assert!(err.message().contains("content type"), "{err}");
        }
        let long = e.with_content_type("x".repeat(MAX_CONTENT_TYPE_LEN + 1));
        assert!(long.validate(DEFAULT_MAX_PAYLOAD).is_err());
    }

    #[test]
    fn fingerprint_covers_content() {
        let id = EventId::new("a").unwrap();
        let d = Destination::new("d").unwrap();
        let a = Event::new(id.clone(), d.clone(), b"x".to_vec());
        let b = Event::new(id.clone(), d.clone(), b"y".to_vec());
        let c = a.clone().with_header("h", b"1".to_vec());
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), c.fingerprint());
        assert_eq!(a.fingerprint(), a.clone().fingerprint());
        let hex = a.fingerprint().to_hex();
        assert_eq!(Fingerprint::from_hex(&hex).unwrap(), a.fingerprint());
    }

    #[test]
    fn trace_context_headers_are_valid_and_not_content() {
        use crate::telemetry::{TRACEPARENT_HEADER, TRACESTATE_HEADER};
        let a = Event::new(EventId::new("a").unwrap(), Destination::new("d").unwrap(), b"x".to_vec());
        let from = |trace: &str| {
            a.clone()
                .with_header(TRACEPARENT_HEADER, format!("00-{trace}-b7ad6b7169203331-01"))
                .with_header(TRACESTATE_HEADER, "vendor=1")
        };
        let one = from("0af7651916cd43dd8448eb211c80319c");
        let other = from("4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(one.validate(DEFAULT_MAX_PAYLOAD).is_ok());
        // Another trace, or none, is the same content: a duplicate for an inbox, not a conflict.
        assert_eq!(one.fingerprint(), other.fingerprint());
        assert_eq!(one.fingerprint(), a.fingerprint());
        // Every other header still counts.
        assert_ne!(one.clone().with_header("traceparent-x", "1").fingerprint(), one.fingerprint());
    }

    #[test]
    fn round_trips_arbitrary_bytes() {
        let mut h = Headers::new();
        h.insert("a".into(), vec![]);
        h.insert("bin".into(), vec![0, 255, 0xc3, 0x28, b'\n', 0]);
        h.insert("x-trace".into(), b"abc".to_vec());
        let bytes = encode_headers(&h);
        assert_eq!(decode_headers(&bytes, "test").unwrap(), h);
        assert_eq!(decode_headers(&encode_headers(&Headers::new()), "test").unwrap(), Headers::new());
    }

    #[test]
    fn damage_is_corrupt() {
        let mut h = Headers::new();
        h.insert("k".into(), b"v".to_vec());
        let bytes = encode_headers(&h);
        for bad in [&bytes[..bytes.len() - 1], &[], &[2, 0, 0, 0, 0][..], &[bytes.clone(), vec![0]].concat()[..]] {
            assert_eq!(decode_headers(bad, "test").unwrap_err().kind(), ErrorKind::Corrupt);
        }
    }
}
