//! The broker side of the contract: publish with the strongest acknowledgement the broker
//! offers, and subscribe with explicit acknowledgement.
//!
//! Acknowledgement is explicit and happens only after the consumer's effect committed; a
//! delivery that is never acknowledged comes back once its subscription goes away. That is what
//! turns a consumer crash into a redelivery instead of a lost effect.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

use sha2::{Digest, Sha256};

use crate::error::Result;
use crate::event::{ConsumerGroup, Destination, Event, EventId};

/// Acknowledges or rejects one delivery. Implemented by each broker adapter.
#[async_trait]
pub trait Acknowledge: Send {
    /// The consumer is done with the message: never deliver it to this group again.
    async fn ack(self: Box<Self>) -> Result<()>;
    /// The consumer could not process the message: deliver it again (to any member of the group).
    async fn nack(self: Box<Self>) -> Result<()>;
    /// Give up on the message without processing it and without a record of the consumer's:
    /// never deliver it to this group again. The default acknowledges; a broker with a
    /// dead-letter route of its own (RabbitMQ's dead-letter exchange) sends it there.
    async fn reject(self: Box<Self>) -> Result<()> {
        self.ack().await
    }
}

/// A message as delivered to a consumer group member.
pub struct Delivery {
    /// The event, byte-for-byte as published.
    pub event: Event,
    /// The broker says this message was delivered before (to this group).
    pub redelivered: bool,
    /// 1-based delivery count, where the broker tracks one.
    pub attempt: Option<u32>,
    acker: Box<dyn Acknowledge>,
}

impl Delivery {
    /// Assemble a delivery (for adapters).
    pub fn new(event: Event, redelivered: bool, attempt: Option<u32>, acker: Box<dyn Acknowledge>) -> Self {
        Self { event, redelivered, attempt, acker }
    }

    /// Acknowledge: only after the effect committed.
    ///
    /// # Errors
    /// The adapter's error; an ack that fails leaves the message to be redelivered. An ack of a
    /// delivery the broker already handed to another member (idle timeout, rebalance) may fail
    /// with a transient [`Closed`](crate::ErrorKind::Closed) error; the effect's marker makes
    /// that redelivery harmless.
    pub async fn ack(self) -> Result<()> {
        self.acker.ack().await
    }

    /// Negative acknowledgement: redeliver.
    ///
    /// # Errors
    /// The adapter's error; the message is redelivered when the subscription ends in any case.
    pub async fn nack(self) -> Result<()> {
        self.acker.nack().await
    }

    /// Split into the event and its acknowledger.
    pub fn into_parts(self) -> (Event, Box<dyn Acknowledge>) {
        (self.event, self.acker)
    }
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("event", &self.event)
            .field("redelivered", &self.redelivered)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

/// Why a received message is not an outbox event a consumer can read.
///
/// A subscription hands such a message out as [`Received::Foreign`] instead of failing, so the
/// consumer runtime can record it durably ([`DeadLetterReason::Malformed`]) and acknowledge it,
/// and the stream goes on.
///
/// [`DeadLetterReason::Malformed`]: crate::DeadLetterReason::Malformed
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Malformed {
    /// No event id where the broker's format puts it.
    NoEventId,
    /// An event id that is not 1 to 128 bytes of visible ASCII.
    BadEventId,
    /// Not this library's format (a format version it does not know, or none at all).
    UnknownFormat,
    /// A header name that is empty, longer than 128 bytes or not visible ASCII.
    BadHeaderName,
    /// A header (the event id header included) that appears more than once.
    DuplicateHeader,
    /// Headers whose names and values together exceed
    /// [`DEFAULT_MAX_HEADER_BYTES`](crate::event::DEFAULT_MAX_HEADER_BYTES).
    OversizedHeaders,
    /// A key that is not UTF-8, longer than 512 bytes or has a control character.
    BadKey,
    /// A [`content-type`](crate::event::CONTENT_TYPE_HEADER) that is not 1 to 255 bytes of
    /// printable ASCII.
    BadContentType,
}

impl Malformed {
    /// Stable text form, used in dead-letter error texts (`no-event-id`, `bad-event-id`,
    /// `unknown-format`, `bad-header-name`, `duplicate-header`, `oversized-headers`, `bad-key`,
    /// `bad-content-type`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoEventId => "no-event-id",
            Self::BadEventId => "bad-event-id",
            Self::UnknownFormat => "unknown-format",
            Self::BadHeaderName => "bad-header-name",
            Self::DuplicateHeader => "duplicate-header",
            Self::OversizedHeaders => "oversized-headers",
            Self::BadKey => "bad-key",
            Self::BadContentType => "bad-content-type",
        }
    }

    /// The problem of an event a broker decoded, if any: the checks of [`Event::validate`] that a
    /// message written by something else can fail (key, header names, total header size, content
    /// type), so that every broker applies the same rules on receive as on publish.
    pub fn of_event(event: &Event) -> Option<(Self, String)> {
        use crate::event::{DEFAULT_MAX_HEADER_BYTES, MAX_HEADER_NAME_LEN, MAX_KEY_LEN};
        if let Some(key) = &event.key
            && (key.len() > MAX_KEY_LEN || key.chars().any(char::is_control))
        {
            return Some((
                Self::BadKey,
                format!("key of {} bytes is longer than {MAX_KEY_LEN} or has a control character", key.len()),
            ));
        }
        for name in event.headers.keys() {
            if name.is_empty() || name.len() > MAX_HEADER_NAME_LEN || !name.chars().all(|c| c.is_ascii_graphic()) {
                return Some((
                    Self::BadHeaderName,
                    format!("header name {name:?} is not 1 to {MAX_HEADER_NAME_LEN} bytes of visible ASCII"),
                ));
            }
        }
        let bytes = event.header_bytes();
        if bytes > DEFAULT_MAX_HEADER_BYTES {
            return Some((
                Self::OversizedHeaders,
                format!(
                    "headers are {bytes} bytes (names and values), more than the limit of {DEFAULT_MAX_HEADER_BYTES}"
                ),
            ));
        }
        if let Some(problem) =
            event.headers.get(crate::event::CONTENT_TYPE_HEADER).and_then(|v| crate::event::content_type_problem(v))
        {
            return Some((Self::BadContentType, problem));
        }
        None
    }
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A message exactly as the broker held it, for one that is not a readable outbox event.
#[derive(Clone, PartialEq, Eq)]
pub struct RawMessage {
    /// The adapter that received it (`"kafka"`, `"amqp"`, `"redis"`, `"memory"`).
    pub backend: &'static str,
    /// The destination the subscription reads (where the message was found).
    pub destination: Destination,
    /// Where the broker keeps it, in the adapter's notation: `<stream>/<entry id>` (Redis),
    /// `<topic>[<partition>]@<offset>` (Kafka), `<queue>#<delivery tag>` (RabbitMQ; the tag is
    /// per channel), `<destination>@<offset>` (memory). Visible ASCII.
    pub position: String,
    /// The message's event id, when it had a valid one (the message is foreign for another
    /// reason).
    pub event_id: Option<EventId>,
    /// The broker's own message key, raw (Kafka's record key). `None` where the broker has no key
    /// of its own (the adapter's key field or header is then among `headers`).
    pub key: Option<Vec<u8>>,
    /// Everything else the broker carried beside the payload, in the broker's order, duplicates
    /// kept, names and values raw: Kafka's headers, the fields of a Redis stream entry other than
    /// the payload field, RabbitMQ's header table and its `message_id` / `content_type` / `type`
    /// properties (named `amqp.message_id`, ...). The crate READMEs say which.
    pub headers: Vec<(Vec<u8>, Vec<u8>)>,
    /// The payload, byte-for-byte (Redis: the payload field, empty when there is none).
    pub payload: Vec<u8>,
}

impl fmt::Debug for RawMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawMessage")
            .field("backend", &self.backend)
            .field("destination", &self.destination)
            .field("position", &self.position)
            .field("event_id", &self.event_id)
            .field("headers", &self.headers.iter().map(|(n, _)| String::from_utf8_lossy(n)).collect::<Vec<_>>())
            .field("payload_len", &self.payload.len())
            .finish_non_exhaustive()
    }
}

/// Prefix of the event id of a dead letter made from a message without a valid id of its own.
pub const MALFORMED_ID_PREFIX: &str = "malformed:";

impl RawMessage {
    /// The event id a record of this message is filed under: the message's own when valid, else
    /// `malformed:<position>` (or `malformed:sha256-<32 hex digits of the position>` when that
    /// is not a valid id, e.g. longer than 128 bytes).
    pub fn record_id(&self) -> EventId {
        if let Some(id) = &self.event_id {
            return id.clone();
        }
        EventId::new(format!("{MALFORMED_ID_PREFIX}{}", self.position)).unwrap_or_else(|_| {
            let digest = Sha256::digest(self.position.as_bytes());
            let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
            EventId::trusted(format!("{MALFORMED_ID_PREFIX}sha256-{hex}"))
        })
    }

    /// The message as an [`Event`] to keep in a dead letter: [`record_id`](Self::record_id), the
    /// subscribed destination, the payload byte-for-byte, the key when it is valid text, and the
    /// headers as far as an event can hold them (names made text lossily; a name seen before
    /// gets `#2`, `#3`, ... appended). Returns what could not be kept as it was, for the record's
    /// error text.
    pub fn to_event(&self) -> (Event, Vec<String>) {
        let mut lost = Vec::new();
        let key = self.key.as_ref().and_then(|k| match std::str::from_utf8(k) {
            Ok(text) if text.len() <= crate::event::MAX_KEY_LEN && !text.chars().any(char::is_control) => {
                Some(text.to_string())
            }
            _ => {
                lost.push(format!("key (raw bytes, hex) {}", hex(k)));
                None
            }
        });
        let mut headers = crate::event::Headers::new();
        for (name, value) in &self.headers {
            let text = String::from_utf8_lossy(name).into_owned();
            if std::str::from_utf8(name).is_err() {
                lost.push(format!("header name (raw bytes, hex) {} kept as {text:?}", hex(name)));
            }
            let mut unique = text.clone();
            let mut n = 1;
            while headers.contains_key(&unique) {
                n += 1;
                unique = format!("{text}#{n}");
            }
            headers.insert(unique, value.clone());
        }
        let event = Event {
            id: self.record_id(),
            destination: self.destination.clone(),
            key,
            headers,
            payload: self.payload.clone(),
        };
        (event, lost)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A message that is not a readable outbox event, with its acknowledger: the consumer records it
/// and then acknowledges it.
pub struct ForeignDelivery {
    /// The message as the broker held it.
    pub message: RawMessage,
    /// What is wrong with it.
    pub problem: Malformed,
    /// The problem in words (names the header, the id, the sizes).
    pub detail: String,
    /// The broker says this message was delivered before (to this group).
    pub redelivered: bool,
    acker: Box<dyn Acknowledge>,
}

impl ForeignDelivery {
    /// Assemble a foreign delivery (for adapters).
    pub fn new(
        message: RawMessage,
        problem: Malformed,
        detail: impl Into<String>,
        redelivered: bool,
        acker: Box<dyn Acknowledge>,
    ) -> Self {
        Self { message, problem, detail: detail.into(), redelivered, acker }
    }

    /// `<problem>: <detail> (<backend> <position>)`: the record's error text and the log line.
    pub fn describe(&self) -> String {
        format!("{}: {} ({} {})", self.problem, self.detail, self.message.backend, self.message.position)
    }

    /// The error [`Subscription::next`] reports for it: [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt),
    /// permanent, naming the problem and the position.
    pub fn error(&self) -> crate::Error {
        crate::Error::permanent(
            crate::ErrorKind::Corrupt,
            self.message.backend,
            format!(
                "{} on {} is not an outbox event: {}: {}",
                self.message.position, self.message.destination, self.problem, self.detail
            ),
        )
    }

    /// Acknowledge: only after its record committed.
    ///
    /// # Errors
    /// As [`Delivery::ack`].
    pub async fn ack(self) -> Result<()> {
        self.acker.ack().await
    }

    /// Negative acknowledgement: deliver it again (its record did not commit).
    ///
    /// # Errors
    /// As [`Delivery::nack`].
    pub async fn nack(self) -> Result<()> {
        self.acker.nack().await
    }

    /// Give up on it without a record: [`Acknowledge::reject`].
    ///
    /// # Errors
    /// The adapter's error.
    pub async fn reject(self) -> Result<()> {
        self.acker.reject().await
    }

    /// Split into the message and its acknowledger.
    pub fn into_parts(self) -> (RawMessage, Box<dyn Acknowledge>) {
        (self.message, self.acker)
    }
}

impl fmt::Debug for ForeignDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForeignDelivery")
            .field("message", &self.message)
            .field("problem", &self.problem)
            .field("detail", &self.detail)
            .field("redelivered", &self.redelivered)
            .finish_non_exhaustive()
    }
}

/// What a subscription received: an outbox event, or a message that is not one.
#[derive(Debug)]
pub enum Received {
    /// An outbox event.
    Event(Delivery),
    /// A message that is not a readable outbox event (written by something else, damaged, or
    /// breaking the limits events keep).
    Foreign(ForeignDelivery),
}

/// One member of a consumer group, receiving deliveries.
///
/// Dropping it without acknowledging is the model of a consumer that went away: every delivery
/// it holds unacknowledged returns to the group (at once, or after the broker's own timeout).
#[async_trait]
pub trait Subscription: Send {
    /// Wait up to `wait` for the next message: an event, or a message that is not one.
    ///
    /// # Behavior
    /// - returns `Ok(None)` when nothing arrived within `wait`;
    /// - a delivery not yet acknowledged is not handed to another member of the group while
    ///   this subscription lives, unless the broker's own idle / session timeout passes or the
    ///   group rebalances (then acknowledging the old delivery may fail with a transient
    ///   [`Closed`](crate::ErrorKind::Closed) error, and the new holder gets it);
    /// - foreign_message_is_handed_out_not_an_error: a message that is not a readable outbox event
    ///   (no or a bad event id, unknown format, bad header names, duplicate headers, headers over
    ///   the limit, a bad key or content type) is returned as [`Received::Foreign`] with its raw
    ///   payload, raw headers, broker position and the [`Malformed`] problem, never as an error,
    ///   and the messages after it are received as usual;
    /// - foreign_message_is_unacknowledged_until_settled: a foreign message is acknowledged like
    ///   an event: only by [`ForeignDelivery::ack`] (or `reject`); until then it is held (and comes
    ///   back after the subscription is dropped, or on `nack`);
    /// - header names are checked on receive with the rules of [`Event::validate`]: an event the
    ///   adapter could decode that breaks them is foreign ([`Malformed::of_event`]).
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>>;

    /// Wait up to `wait` for the next event, for callers that only want events.
    ///
    /// # Behavior
    /// - as [`receive`](Subscription::receive) for events;
    /// - a foreign message is rejected ([`ForeignDelivery::reject`]: acknowledged, or sent to the
    ///   broker's own dead-letter route) without any record, and reported as a permanent
    ///   [`Corrupt`](crate::ErrorKind::Corrupt) error naming its position and problem; the next
    ///   call goes on after it. The consumer runtime uses `receive` and records it instead.
    async fn next(&mut self, wait: Duration) -> Result<Option<Delivery>> {
        match self.receive(wait).await? {
            None => Ok(None),
            Some(Received::Event(d)) => Ok(Some(d)),
            Some(Received::Foreign(f)) => {
                let err = f.error();
                f.reject().await?;
                Err(err)
            }
        }
    }
}

/// A message broker.
#[async_trait]
pub trait Broker: Send + Sync {
    /// Short backend name for logs and errors (`"kafka"`, `"amqp"`, `"redis"`, `"memory"`).
    fn backend(&self) -> &'static str;

    /// What this broker can tell and guarantee (unroutable detection, delivery count, ...).
    ///
    /// # Behavior
    /// - cheap and without I/O: decided by the adapter and its configuration;
    /// - the default promises nothing ([`Capabilities::none`](crate::Capabilities::none));
    ///   adapters override it with what they actually provide;
    /// - a capability reported here is one the conformance suite checks for this broker.
    fn capabilities(&self) -> crate::capabilities::Capabilities {
        crate::capabilities::Capabilities::none()
    }

    /// Batches a [`Relay`](crate::Relay) should keep at this broker at once when its
    /// [`RelayConfig::pipeline_depth`](crate::RelayConfig::pipeline_depth) is not set.
    ///
    /// # Behavior
    /// - cheap and without I/O: decided by the adapter and its configuration;
    /// - `None` (the default): no preference, the relay uses
    ///   [`DEFAULT_PIPELINE_DEPTH`](crate::DEFAULT_PIPELINE_DEPTH);
    /// - a broker whose acknowledgements come late and in groups (RabbitMQ's publisher confirms
    ///   after a disk sync) names the depth at which one relay keeps it busy; a depth set in the
    ///   relay's config wins;
    /// - decorators return their inner broker's preference.
    fn preferred_pipeline_depth(&self) -> Option<usize> {
        None
    }

    /// Make sure `destination` exists and each group in `groups` will receive everything
    /// published to it from now on.
    ///
    /// # Behavior
    /// - idempotent: declaring twice is not an error and loses nothing;
    /// - a group declared here, or created by [`subscribe`](Broker::subscribe), starts at the
    ///   beginning of what the broker retains for the destination.
    async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()>;

    /// Publish one event.
    ///
    /// # Behavior
    /// - returns `Ok` only once the broker accepted the message with its strongest
    ///   acknowledgement (replication / confirm / reply);
    /// - the event id, key, headers and payload arrive byte-for-byte;
    /// - a destination that cannot route is an error of kind
    ///   [`Unroutable`](crate::ErrorKind::Unroutable) where the broker can tell;
    /// - a timeout after sending is [`Retry::OutcomeUnknown`](crate::Retry::OutcomeUnknown);
    /// - safe to call concurrently.
    async fn publish(&self, event: &Event) -> Result<()>;

    /// Publish several events at once, with the broker's own batching (a pipeline, a window of
    /// confirms, many deliveries in flight); one result per event, in slice order.
    ///
    /// # Behavior
    /// - each `Ok` means the same as an `Ok` from [`publish`](Broker::publish) for that event;
    /// - events with the same key and destination reach the broker in slice order (the first
    ///   offer of each); events of one key to different destinations may reach them in any order;
    /// - once an event fails, no later event of the same key is reported `Ok`: each is an error
    ///   of kind [`Skipped`](crate::ErrorKind::Skipped) (transient), so the caller can retry the
    ///   key from the failed event on and keep its order. Where the broker learns of the failure
    ///   only after later events were sent (a confirm window, deliveries in flight), those may
    ///   have reached the broker too (a duplicate on retry, never a gap); each adapter documents
    ///   where later events are truly not sent;
    /// - events of different keys, and events without a key, are independent: one failing
    ///   changes nothing for the others;
    /// - an empty slice returns an empty vector without I/O;
    /// - the default publishes one key after another per lane, lanes concurrently (up to 16),
    ///   with [`publish`](Broker::publish); adapters override it with native batching;
    /// - the default starts no further publish once the [`Relay`](crate::Relay) that called it
    ///   is shutting down: those events are [`Skipped`](crate::ErrorKind::Skipped), and the relay
    ///   releases them (publishes already started finish).
    async fn publish_batch(&self, events: &[Event]) -> Vec<Result<()>> {
        crate::broker::publish_batch_by_lanes(self, events, 16).await
    }

    /// Join `group` on `destination`.
    ///
    /// # Behavior
    /// - creates the group if absent (starting at the beginning);
    /// - deliveries must be acknowledged explicitly; unacknowledged ones come back after the
    ///   subscription is dropped.
    async fn subscribe(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Box<dyn Subscription>>;
}

/// The default [`Broker::publish_batch`]: events grouped into lanes by key (each keyless event
/// is a lane of its own), one event after another within a lane, up to `concurrency` lanes at
/// once; after a failure the rest of its lane is [`Skipped`](crate::ErrorKind::Skipped).
///
/// For adapters whose native batching covers only part of a batch, and for decorators.
pub async fn publish_batch_by_lanes<B: Broker + ?Sized>(
    broker: &B,
    events: &[Event],
    concurrency: usize,
) -> Vec<Result<()>> {
    use futures::StreamExt;
    use std::collections::HashMap;
    // Lanes in the order of their first event, so the oldest rows start first.
    let mut lanes: Vec<Vec<usize>> = Vec::new();
    let mut lane_of_key: HashMap<&str, usize> = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        match e.key.as_deref() {
            Some(k) => {
                let lane = *lane_of_key.entry(k).or_insert_with(|| {
                    lanes.push(Vec::new());
                    lanes.len() - 1
                });
                lanes[lane].push(i);
            }
            None => lanes.push(vec![i]),
        }
    }
    let mut out: Vec<Option<Result<()>>> = (0..events.len()).map(|_| None).collect();
    let done: Vec<Vec<(usize, Result<()>)>> = futures::stream::iter(lanes.into_iter().map(|lane| async move {
        let mut results = Vec::with_capacity(lane.len());
        let mut failed: Option<String> = None;
        for i in lane {
            if let Some(id) = &failed {
                results.push((i, Err(skipped(broker.backend(), id))));
                continue;
            }
            if crate::relay::stopping() {
                use crate::error::{Error, ErrorKind};
                let why = "not sent: the relay is shutting down";
                results.push((i, Err(Error::transient(ErrorKind::Skipped, broker.backend(), why))));
                continue;
            }
            let r = broker.publish(&events[i]).await;
            if r.is_err() {
                failed = Some(events[i].id.to_string());
            }
            results.push((i, r));
        }
        results
    }))
    .buffer_unordered(concurrency.max(1))
    .collect()
    .await;
    for (i, r) in done.into_iter().flatten() {
        out[i] = Some(r);
    }
    out.into_iter().map(|r| r.unwrap_or_else(|| Err(skipped("relay", "?")))).collect()
}

/// The error of an event not sent because an earlier event of its key failed in the same batch.
pub fn skipped(backend: &'static str, failed_event: &str) -> crate::error::Error {
    crate::error::Error::transient(
        crate::error::ErrorKind::Skipped,
        backend,
        format!("not sent: event {failed_event} of the same key failed earlier in this batch"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Unsettled;

    #[async_trait]
    impl Acknowledge for Unsettled {
        async fn ack(self: Box<Self>) -> Result<()> {
            Ok(())
        }
        async fn nack(self: Box<Self>) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_foreign_message_is_reported_by_its_position_once_with_its_problem() {
        let message = RawMessage {
            backend: "redis",
            destination: Destination::new("orders").unwrap(),
            position: "outbox:orders/17-0".into(),
            event_id: None,
            key: None,
            headers: Vec::new(),
            payload: b"{}".to_vec(),
        };
        let f = ForeignDelivery::new(message, Malformed::NoEventId, "no id field", false, Box::new(Unsettled));
        let err = f.error();
        assert_eq!(err.kind(), crate::ErrorKind::Corrupt);
        assert!(err.is_permanent());
        assert_eq!(
            err.to_string(),
            "redis: outbox:orders/17-0 on orders is not an outbox event: no-event-id: no id field"
        );
    }
}
