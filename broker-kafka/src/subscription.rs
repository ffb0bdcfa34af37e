//! One consumer-group member per subscription, committing offsets only past acknowledged work.
//!
//! Kafka acknowledges by committing one offset per partition: "everything before this is done".
//! Acknowledgements arrive in any order, so each partition keeps the offsets handed out and not
//! yet acknowledged; an ack commits the lowest offset still outstanding (or the one after the
//! newest delivered, when nothing is). An out-of-order ack therefore never commits past an
//! unprocessed message: after a crash the group re-reads from that message on, and the inbox
//! absorbs the repeats.
//!
//! A rebalance that takes a partition away bumps its epoch: acknowledgements of deliveries from
//! the old assignment are refused (the new owner re-reads them from the committed offset), and
//! local redeliveries of that partition are dropped for the same reason.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    Acknowledge, ConsumerGroup, Delivery, Destination, Error, ErrorKind, Event, EventId, ForeignDelivery, Headers,
    Malformed, RawMessage, Received, Result, Subscription,
};
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers as _, Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::config::KafkaConfig;
use crate::{BACKEND, EVENT_ID_HEADER, blocking, error};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Offsets of one partition as seen by this member.
#[derive(Debug, Default)]
struct PartitionState {
    assigned: bool,
    /// Bumped on every assignment change; deliveries carry the epoch they were made in.
    epoch: u64,
    /// Offsets delivered in this epoch and not yet released from the front: `true` = acked.
    pending: BTreeMap<i64, bool>,
    /// Offset after the newest delivered in this epoch (`None` before the first delivery).
    next: Option<i64>,
    /// Last offset this member committed in this epoch; starts at the first offset fetched
    /// in the epoch (where the group's committed position was).
    committed: Option<i64>,
    /// Highest offset ever delivered by this subscription, across epochs: a fetch at or below
    /// it is a redelivery.
    seen_max: Option<i64>,
    /// A fetch of this partition was dropped since the last assignment change (it was not
    /// assigned to this member): warned about once, then counted quietly.
    dropped: bool,
}

impl PartitionState {
    fn reset(&mut self, assigned: bool) {
        self.assigned = assigned;
        self.epoch += 1;
        self.pending.clear();
        self.next = None;
        self.committed = None;
        self.dropped = false;
    }

    fn live(&self, epoch: u64) -> bool {
        self.assigned && self.epoch == epoch
    }
}

struct Redelivery {
    partition: i32,
    epoch: u64,
    offset: i64,
    item: Item,
}

/// What a record turned out to be; kept by an acknowledger for a local redelivery after `nack`.
#[derive(Clone)]
enum Item {
    Event(Event),
    Foreign(RawMessage, Malformed, String),
}

#[derive(Default)]
struct Tracker {
    partitions: HashMap<i32, PartitionState>,
    /// Nacked deliveries, handed out again by this member before anything new.
    redeliver: VecDeque<Redelivery>,
}

/// Why an acknowledgement could not be applied.
enum Stale {
    /// The partition was taken away (or the subscription closed) since the delivery.
    Revoked,
}

impl Tracker {
    fn rebalance(&mut self, partition: i32, assigned: bool) {
        self.partitions.entry(partition).or_default().reset(assigned);
        self.redeliver.retain(|r| r.partition != partition);
    }

    /// Record a fetched message; `Err(first)` when its partition is not assigned to this member,
    /// `first` for the first such fetch since the partition's last assignment change.
    fn register(&mut self, partition: i32, offset: i64) -> std::result::Result<(u64, bool), bool> {
        let p = self.partitions.entry(partition).or_default();
        if !p.assigned {
            return Err(!std::mem::replace(&mut p.dropped, true));
        }
        let redelivered = p.seen_max.is_some_and(|max| offset <= max);
        p.seen_max = Some(p.seen_max.map_or(offset, |m| m.max(offset)));
        p.pending.insert(offset, false);
        p.committed.get_or_insert(offset);
        p.next = Some(p.next.map_or(offset + 1, |n| n.max(offset + 1)));
        Ok((p.epoch, redelivered))
    }

    /// Mark `offset` done; the offset to commit if the contiguous done prefix moved past what
    /// this member committed.
    fn ack(&mut self, partition: i32, epoch: u64, offset: i64) -> std::result::Result<Option<i64>, Stale> {
        let p = self.partitions.get_mut(&partition).filter(|p| p.live(epoch)).ok_or(Stale::Revoked)?;
        if let Some(done) = p.pending.get_mut(&offset) {
            *done = true;
        }
        while let Some(entry) = p.pending.first_entry() {
            if !*entry.get() {
                break;
            }
            entry.remove();
        }
        let target = p.pending.keys().next().copied().or(p.next);
        Ok(target.filter(|t| p.committed.is_none_or(|c| *t > c)))
    }

    fn committed(&mut self, partition: i32, epoch: u64, offset: i64) {
        if let Some(p) = self.partitions.get_mut(&partition).filter(|p| p.live(epoch))
            && p.committed.is_none_or(|c| offset > c)
        {
            p.committed = Some(offset);
        }
    }

    fn nack(&mut self, partition: i32, epoch: u64, offset: i64, item: Item) -> std::result::Result<(), Stale> {
        self.partitions.get(&partition).filter(|p| p.live(epoch)).ok_or(Stale::Revoked)?;
        self.redeliver.push_back(Redelivery { partition, epoch, offset, item });
        Ok(())
    }

    fn take_redelivery(&mut self) -> Option<Redelivery> {
        while let Some(r) = self.redeliver.pop_front() {
            if self.partitions.get(&r.partition).is_some_and(|p| p.live(r.epoch)) {
                return Some(r);
            }
        }
        None
    }
}

/// Learns about assignment changes; librdkafka calls it from inside `recv`.
pub(crate) struct TrackingContext {
    topic: String,
    tracker: Arc<Mutex<Tracker>>,
}

impl ClientContext for TrackingContext {}

impl ConsumerContext for TrackingContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let (list, assigned) = match rebalance {
            Rebalance::Assign(list) => (list, true),
            Rebalance::Revoke(list) => (list, false),
            Rebalance::Error(e) => {
                warn!(target: "outbox.kafka", topic = %self.topic, error = %e, "rebalance error");
                return;
            }
        };
        let mut tracker = lock(&self.tracker);
        for elem in list.elements() {
            if elem.topic() == self.topic {
                tracker.rebalance(elem.partition(), assigned);
            }
        }
        // Rare and the first thing to read when a group stops consuming: info, not debug.
        // `lost`: taken away by a session timeout or a fenced member, not handed over.
        info!(target: "outbox.kafka", topic = %self.topic, assigned, lost = !assigned && consumer.assignment_lost(),
            partitions = ?list.elements().iter().map(|e| e.partition()).collect::<Vec<_>>(), "rebalance");
    }
}

struct Inner {
    consumer: StreamConsumer<TrackingContext>,
    tracker: Arc<Mutex<Tracker>>,
    /// Serializes commits so that a slow commit of a lower offset never lands after a higher one.
    commit_lock: Mutex<()>,
    /// Wakes a waiting `next` when a delivery is nacked.
    wake: Notify,
    destination: Destination,
}

impl Inner {
    /// Apply an ack and commit what it released. Blocking (a synchronous commit).
    fn ack_blocking(&self, partition: i32, epoch: u64, offset: i64) -> Result<()> {
        let _serial = lock(&self.commit_lock);
        let target = lock(&self.tracker)
            .ack(partition, epoch, offset)
            .map_err(|Stale::Revoked| revoked(&self.destination, partition, offset))?;
        let Some(target) = target else { return Ok(()) };
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(self.destination.as_str(), partition, Offset::Offset(target))
            .map_err(|e| error::convert("building the commit", e))?;
        self.consumer.commit(&list, CommitMode::Sync).map_err(|e| {
            error::convert(&format!("committing offset {target} of {}[{partition}]", self.destination), e)
        })?;
        lock(&self.tracker).committed(partition, epoch, target);
        debug!(target: "outbox.kafka", topic = %self.destination, partition, offset = target, "committed");
        Ok(())
    }
}

fn revoked(destination: &Destination, partition: i32, offset: i64) -> Error {
    Error::transient(
        ErrorKind::Closed,
        BACKEND,
        format!(
            "{destination}[{partition}]@{offset}: the partition left this subscription (rebalance or close) \
             before the acknowledgement; the group redelivers it from the last committed offset"
        ),
    )
}

/// A member of a Kafka consumer group (one librdkafka consumer).
///
/// - Offsets are committed only by acknowledgements, never automatically, and never past a
///   delivery of the same partition that is not acknowledged yet.
/// - `nack` puts the delivery in a local queue: this member hands it out again before anything
///   new, and its offset stays uncommitted until it is acknowledged. If the partition moves to
///   another member first, the local copy is dropped and the new owner re-reads it.
/// - Dropping the subscription closes the consumer (leaving the group, in the background);
///   the group's other members then re-read every unacknowledged message from the last
///   committed offset.
/// - `redelivered` is `true` for a local redelivery and for a fetch at or below an offset this
///   subscription delivered before; Kafka keeps no delivery count, so `attempt` is `None`.
/// - A record that is not a readable event (no or a bad [`EVENT_ID_HEADER`], the id header or
///   another header twice, a bad header name, headers over the limit, a key that is not UTF-8)
///   is handed out as [`Received::Foreign`] with its raw key, headers and payload and the
///   position `<topic>[<partition>]@<offset>`; its offset is committed like an event's, once it
///   is acknowledged.
pub struct KafkaSubscription {
    inner: Option<Arc<Inner>>,
}

impl std::fmt::Debug for KafkaSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSubscription")
            .field("destination", &self.inner.as_ref().map(|i| &i.destination))
            .finish_non_exhaustive()
    }
}

impl KafkaSubscription {
    pub(crate) fn new(config: &KafkaConfig, destination: &Destination, group: &ConsumerGroup) -> Result<Self> {
        let tracker = Arc::new(Mutex::new(Tracker::default()));
        let context = TrackingContext { topic: destination.as_str().to_string(), tracker: Arc::clone(&tracker) };
        let consumer: StreamConsumer<TrackingContext> = config
            .client_config(
                &[
                    ("session.timeout.ms", config.session_timeout_ms()),
                    ("heartbeat.interval.ms", config.heartbeat_interval_ms()),
                    ("enable.partition.eof", "false".to_string()),
                    ("partition.assignment.strategy", "cooperative-sticky".to_string()),
                ],
                &[
                    ("group.id", group.as_str()),
                    ("enable.auto.commit", "false"),
                    ("enable.auto.offset.store", "false"),
                    ("auto.offset.reset", "earliest"),
                ],
            )
            .create_with_context(context)
            .map_err(|e| error::convert("creating the consumer", e))?;
        consumer
            .subscribe(&[destination.as_str()])
            .map_err(|e| error::convert(&format!("subscribing to {destination}"), e))?;
        Ok(Self {
            inner: Some(Arc::new(Inner {
                consumer,
                tracker,
                commit_lock: Mutex::new(()),
                wake: Notify::new(),
                destination: destination.clone(),
            })),
        })
    }

    fn inner(&self) -> Result<&Arc<Inner>> {
        self.inner.as_ref().ok_or_else(|| Error::transient(ErrorKind::Closed, BACKEND, "subscription closed"))
    }

    fn delivery(
        inner: &Arc<Inner>,
        partition: i32,
        epoch: u64,
        offset: i64,
        item: Item,
        redelivered: bool,
    ) -> Received {
        let acker = Box::new(KafkaAck {
            inner: Arc::downgrade(inner),
            destination: inner.destination.clone(),
            partition,
            epoch,
            offset,
            item: item.clone(),
        });
        match item {
            Item::Event(event) => Received::Event(Delivery::new(event, redelivered, None, acker)),
            Item::Foreign(raw, problem, detail) => {
                Received::Foreign(ForeignDelivery::new(raw, problem, detail, redelivered, acker))
            }
        }
    }

    fn take_redelivery(inner: &Arc<Inner>) -> Option<Received> {
        let r = lock(&inner.tracker).take_redelivery()?;
        Some(Self::delivery(inner, r.partition, r.epoch, r.offset, r.item, true))
    }

    /// Turn a fetched message into a delivery; `None` for a message of a partition this member
    /// no longer owns.
    fn accept(inner: &Arc<Inner>, message: &OwnedMessage) -> Option<Received> {
        let (partition, offset) = (message.partition(), message.offset());
        let (epoch, redelivered) = match lock(&inner.tracker).register(partition, offset) {
            Ok(registered) => registered,
            // librdkafka stops fetching a partition when it is revoked, so this is rare; a stream
            // of them would mean the member fetches what it does not own (and skips it), which
            // is worth one line at warn.
            Err(true) => {
                warn!(target: "outbox.kafka", topic = %inner.destination, partition, offset,
                    "dropped a fetch of a partition not assigned to this member (further ones at debug)");
                return None;
            }
            Err(false) => {
                debug!(target: "outbox.kafka", topic = %inner.destination, partition, offset, "dropped fetch of a revoked partition");
                return None;
            }
        };
        let item = match decode_checked(&inner.destination, message) {
            Ok(event) => Item::Event(event),
            Err((problem, detail)) => {
                debug!(target: "outbox.kafka", topic = %inner.destination, partition, offset, %problem, %detail, "record is not an outbox event");
                Item::Foreign(raw(&inner.destination, message), problem, detail)
            }
        };
        Some(Self::delivery(inner, partition, epoch, offset, item, redelivered))
    }
}

/// What woke `next`.
enum Step {
    Message(OwnedMessage),
    Failed(KafkaError),
    Nacked,
    TimedOut,
}

#[async_trait]
impl Subscription for KafkaSubscription {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        let inner = Arc::clone(self.inner()?);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let nacked = inner.wake.notified();
            if let Some(d) = Self::take_redelivery(&inner) {
                return Ok(Some(d));
            }
            let step = tokio::select! {
                biased;
                received = inner.consumer.recv() => match received {
                    Ok(m) => Step::Message(m.detach()),
                    Err(e) => Step::Failed(e),
                },
                () = nacked => Step::Nacked,
                () = tokio::time::sleep_until(deadline) => Step::TimedOut,
            };
            match step {
                Step::Message(m) => {
                    if let Some(d) = Self::accept(&inner, &m) {
                        return Ok(Some(d));
                    }
                }
                Step::Failed(e) => return Err(error::convert(&format!("receiving from {}", inner.destination), e)),
                Step::Nacked => {}
                Step::TimedOut => return Ok(Self::take_redelivery(&inner)),
            }
        }
    }
}

impl Drop for KafkaSubscription {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else { return };
        // Closing the consumer leaves the group and waits for the coordinator's answer. Doing it
        // here, not in the background, means that once `drop` returns the group is already
        // rebalancing, and nothing of this member fetches any more (tansu answers a fetch of a
        // topic deleted meanwhile in a way that crashes librdkafka; see the crate docs).
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(move || close_bounded(inner));
            }
            _ => close_bounded(inner),
        }
    }
}

/// How long [`close_bounded`] waits for the consumer to leave its group.
const CLOSE_LIMIT: Duration = Duration::from_secs(30);

/// Drop the consumer (leave the group) on a thread of its own and wait for it at most
/// [`CLOSE_LIMIT`]. librdkafka 2.12 can block forever in a close: rust-rdkafka's `drop` serves
/// the last rebalance, whose `incremental_unassign` waits without a timeout for the main thread
/// (seen once in CI against tansu, in `postgres+kafka::f2_stale_completion_rejected`). Past the
/// limit the close is left running on its thread, with a warning, and the caller goes on.
fn close_bounded(inner: Arc<Inner>) {
    let (done, closed) = std::sync::mpsc::channel::<()>();
    let spawned = std::thread::Builder::new().name("kafka-close".into()).spawn(move || {
        drop(inner);
        let _ = done.send(());
    });
    match spawned {
        Ok(_) => {
            if closed.recv_timeout(CLOSE_LIMIT).is_err() {
                warn!(
                    backend = BACKEND,
                    "the Kafka consumer did not leave its group within {CLOSE_LIMIT:?}; its close goes on in the background"
                );
            }
        }
        // No thread to spare: `spawn` dropped the closure, so the consumer was closed here,
        // unbounded, as before.
        Err(e) => warn!(backend = BACKEND, "no thread for the Kafka consumer's close ({e}); it was closed inline"),
    }
}

struct KafkaAck {
    inner: Weak<Inner>,
    destination: Destination,
    partition: i32,
    epoch: u64,
    offset: i64,
    /// Kept for a local redelivery after `nack`.
    item: Item,
}

impl KafkaAck {
    fn inner(&self) -> Result<Arc<Inner>> {
        self.inner.upgrade().ok_or_else(|| revoked(&self.destination, self.partition, self.offset))
    }
}

#[async_trait]
impl Acknowledge for KafkaAck {
    async fn ack(self: Box<Self>) -> Result<()> {
        let inner = self.inner()?;
        let (partition, epoch, offset) = (self.partition, self.epoch, self.offset);
        blocking(move || inner.ack_blocking(partition, epoch, offset)).await?
    }

    async fn nack(self: Box<Self>) -> Result<()> {
        let inner = self.inner()?;
        let KafkaAck { partition, epoch, offset, item, .. } = *self;
        lock(&inner.tracker)
            .nack(partition, epoch, offset, item)
            .map_err(|Stale::Revoked| revoked(&inner.destination, partition, offset))?;
        inner.wake.notify_waiters();
        Ok(())
    }
}

/// Rebuild the event from a Kafka record; the reason when it was not written by this adapter.
#[cfg(feature = "testkit")]
pub(crate) fn decode(message: &impl Message) -> std::result::Result<Event, String> {
    let destination = Destination::new(message.topic()).map_err(|e| e.message().to_string())?;
    decode_checked(&destination, message).map_err(|(problem, detail)| format!("{problem}: {detail}"))
}

/// Rebuild the event from a Kafka record, or say why it is not one: exactly one
/// [`EVENT_ID_HEADER`] with a valid id, no header twice, a UTF-8 key, and the rules of
/// [`Event::validate`] ([`Malformed::of_event`]).
fn decode_checked(
    destination: &Destination,
    message: &impl Message,
) -> std::result::Result<Event, (Malformed, String)> {
    let mut ids = Vec::new();
    let mut headers = Headers::new();
    if let Some(hs) = message.headers() {
        for h in hs.iter() {
            let value = h.value.unwrap_or_default().to_vec();
            if h.key == EVENT_ID_HEADER {
                ids.push(value);
            } else if headers.insert(h.key.to_string(), value).is_some() {
                return Err((Malformed::DuplicateHeader, format!("header {:?} appears more than once", h.key)));
            }
        }
    }
    let id = match ids.as_slice() {
        [] => return Err((Malformed::NoEventId, format!("no {EVENT_ID_HEADER} header"))),
        [id] => id,
        many => {
            return Err((
                Malformed::DuplicateHeader,
                format!("the {EVENT_ID_HEADER} header appears {} times", many.len()),
            ));
        }
    };
    let id = std::str::from_utf8(id).ok().and_then(|t| EventId::new(t).ok()).ok_or_else(|| {
        (Malformed::BadEventId, format!("{EVENT_ID_HEADER} {:?} is not a valid event id", String::from_utf8_lossy(id)))
    })?;
    let key = match message.key() {
        None => None,
        Some(k) => {
            Some(String::from_utf8(k.to_vec()).map_err(|_| (Malformed::BadKey, "the key is not UTF-8".to_string()))?)
        }
    };
    let event = Event {
        id,
        destination: destination.clone(),
        key,
        headers,
        payload: message.payload().unwrap_or_default().to_vec(),
    };
    match Malformed::of_event(&event) {
        None => Ok(event),
        Some(problem) => Err(problem),
    }
}

/// The record as Kafka holds it: its key, every header in order (a null value as empty), the
/// payload.
fn raw(destination: &Destination, message: &impl Message) -> RawMessage {
    let mut headers = Vec::new();
    if let Some(hs) = message.headers() {
        for h in hs.iter() {
            headers.push((h.key.as_bytes().to_vec(), h.value.unwrap_or_default().to_vec()));
        }
    }
    let ids: Vec<&Vec<u8>> =
        headers.iter().filter(|(k, _)| k.as_slice() == EVENT_ID_HEADER.as_bytes()).map(|(_, v)| v).collect();
    let event_id = match ids.as_slice() {
        [id] => std::str::from_utf8(id).ok().and_then(|t| EventId::new(t).ok()),
        _ => None,
    };
    RawMessage {
        backend: BACKEND,
        destination: destination.clone(),
        position: format!("{destination}[{}]@{}", message.partition(), message.offset()),
        event_id,
        key: message.key().map(<[u8]>::to_vec),
        headers,
        payload: message.payload().unwrap_or_default().to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assigned(partition: i32) -> Tracker {
        let mut t = Tracker::default();
        t.rebalance(partition, true);
        t
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
    fn a_record_in_the_readme_wire_format_is_the_event() {
        use rdkafka::Timestamp;
        use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
        let table = wire_format();
        assert_eq!(row(&table, "event id").2, EVENT_ID_HEADER);
        assert_eq!(row(&table, "key").1, "record key");
        assert_eq!(row(&table, "payload").1, "record value");
        let headers = OwnedHeaders::new()
            .insert(Header { key: &row(&table, "event id").2, value: Some(b"e-9") })
            .insert(Header { key: &row(&table, "header").2.replace("<name>", "trace"), value: Some(&[0u8, 0xff]) })
            .insert(Header { key: &row(&table, "content type").2, value: Some(b"application/json") });
        let m = OwnedMessage::new(
            Some(b"body".to_vec()),
            Some(b"k-1".to_vec()),
            "orders".into(),
            Timestamp::NotAvailable,
            0,
            7,
            Some(headers),
        );
        let d = Destination::new("orders").unwrap();
        let want = Event::new(EventId::new("e-9").unwrap(), d.clone(), b"body".to_vec())
            .with_key("k-1")
            .with_header("trace", vec![0u8, 0xff])
            .with_content_type("application/json");
        assert_eq!(decode_checked(&d, &m).unwrap(), want);
        assert_eq!(raw(&d, &m).position, "orders[0]@7");
    }

    #[test]
    fn commits_only_the_contiguous_acked_prefix() {
        let mut t = assigned(0);
        let (e, _) = t.register(0, 10).unwrap();
        t.register(0, 11).unwrap();
        t.register(0, 13).unwrap(); // 12 was a gap (control record, compaction)
        assert!(matches!(t.ack(0, e, 13), Ok(None)));
        assert!(matches!(t.ack(0, e, 11), Ok(None)));
        assert!(matches!(t.ack(0, e, 10), Ok(Some(14))));
        t.committed(0, e, 14);
        t.register(0, 14).unwrap();
        t.register(0, 15).unwrap();
        assert!(matches!(t.ack(0, e, 15), Ok(None)));
        assert!(matches!(t.ack(0, e, 14), Ok(Some(16))));
    }

    #[test]
    fn commit_stops_at_an_unacked_offset() {
        let mut t = assigned(0);
        let (e, _) = t.register(0, 0).unwrap();
        t.register(0, 1).unwrap();
        t.register(0, 2).unwrap();
        assert!(matches!(t.ack(0, e, 1), Ok(None)));
        assert!(matches!(t.ack(0, e, 2), Ok(None)));
        assert_eq!(t.partitions[&0].pending.keys().next(), Some(&0));
    }

    #[test]
    fn revocation_refuses_old_acks_and_drops_local_redeliveries() {
        let mut t = assigned(3);
        let (e, redelivered) = t.register(3, 5).unwrap();
        assert!(!redelivered);
        let ev = Event::new(EventId::new("x").unwrap(), Destination::new("d").unwrap(), b"p".to_vec());
        assert!(t.nack(3, e, 5, Item::Event(ev)).is_ok());
        t.rebalance(3, false);
        assert!(t.take_redelivery().is_none());
        assert!(t.ack(3, e, 5).is_err());
        assert_eq!(t.register(3, 6), Err(true), "the first fetch dropped since the revocation is reported");
        assert_eq!(t.register(3, 7), Err(false), "later ones are not");
        assert_eq!(t.register(4, 0), Err(true), "a partition never assigned: dropped and reported");
        t.rebalance(3, true);
        let (_, redelivered) = t.register(3, 5).unwrap();
        assert!(redelivered, "offset 5 was delivered before by this subscription");
        t.rebalance(3, false);
        assert_eq!(t.register(3, 8), Err(true), "reported again after the next assignment change");
    }
}
