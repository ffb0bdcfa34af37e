use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;

use super::{BACKEND, lock};
use crate::broker::{Acknowledge, Broker, Delivery, ForeignDelivery, Malformed, RawMessage, Received, Subscription};
use crate::error::{Error, ErrorKind, Result};
use crate::event::{ConsumerGroup, DEFAULT_MAX_PAYLOAD, Destination, Event, EventId, Headers};

#[derive(Debug, Default)]
struct Group {
    /// Next offset never delivered to this group.
    cursor: usize,
    /// Offsets delivered before and handed back (nack, or their subscriber went away).
    returned: VecDeque<usize>,
    /// Offset → subscription holding it unacknowledged.
    in_flight: HashMap<usize, u64>,
    /// Offset → deliveries so far.
    deliveries: HashMap<usize, u32>,
}

/// One message of a destination's log.
#[derive(Debug, Clone)]
enum Entry {
    /// Published through [`Broker::publish`].
    Event(Event),
    /// Written by [`MemoryBroker::publish_raw`]: fields, as a Redis stream entry has them.
    Raw(Vec<(Vec<u8>, Vec<u8>)>),
}

#[derive(Debug, Default)]
struct Topic {
    log: Vec<Entry>,
    groups: BTreeMap<ConsumerGroup, Group>,
}

#[derive(Debug, Default)]
struct State {
    topics: BTreeMap<Destination, Topic>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    notify: Notify,
    next_sub: AtomicU64,
}

/// The reference [`Broker`]: an append-only log per destination, consumer groups with
/// per-group cursors, explicit acknowledgement, and redelivery of whatever a dropped
/// subscription left unacknowledged.
///
/// Publishing to a destination that was never declared (nor subscribed to) fails with
/// [`ErrorKind::Unroutable`]: like a broker without auto-created topics, it can tell. A
/// destination declared without groups is a log, as a Kafka topic or a Redis stream is: what is
/// published there is kept, and a group that joins later starts at the beginning. It never
/// accepts a message and drops it (what a RabbitMQ publish without `mandatory` does when no
/// queue is bound).
#[derive(Debug, Clone)]
pub struct MemoryBroker {
    shared: Arc<Shared>,
    max_payload: usize,
}

impl Default for MemoryBroker {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBroker {
    /// An empty broker.
    pub fn new() -> Self {
        Self { shared: Arc::default(), max_payload: DEFAULT_MAX_PAYLOAD }
    }

    /// Set the largest accepted payload ([`ErrorKind::TooLarge`], permanent, beyond it).
    #[must_use]
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// Every event ever published to `destination`, in order (the broker's durable contents;
    /// messages written by [`publish_raw`](Self::publish_raw) that are not readable events are
    /// left out).
    pub fn log(&self, destination: &Destination) -> Vec<Event> {
        lock(&self.shared.state)
            .topics
            .get(destination)
            .map(|t| t.log.iter().enumerate().filter_map(|(offset, e)| decode(destination, offset, e).ok()).collect())
            .unwrap_or_default()
    }

    /// Append a message given as raw fields, bypassing [`Broker::publish`]: what another program
    /// writing to the same destination would do. The memory broker's wire format is the one of
    /// the Redis adapter: `v` = `1`, `id` = event id, `k` = key (optional), `h:<name>` = a
    /// header, `p` = payload; fields may repeat. A message that does not follow it is received
    /// as [`Received::Foreign`].
    ///
    /// # Errors
    /// [`ErrorKind::Unroutable`] when `destination` was never declared.
    pub fn publish_raw(&self, destination: &Destination, fields: Vec<(Vec<u8>, Vec<u8>)>) -> Result<()> {
        let mut st = lock(&self.shared.state);
        let Some(t) = st.topics.get_mut(destination) else {
            return Err(Error::transient(
                ErrorKind::Unroutable,
                BACKEND,
                format!("destination {destination} does not exist (declare it first)"),
            ));
        };
        t.log.push(Entry::Raw(fields));
        drop(st);
        self.shared.notify.notify_waiters();
        Ok(())
    }

    /// Messages of `destination` that `group` has not acknowledged yet (never delivered, returned,
    /// or in flight).
    pub fn unacknowledged(&self, destination: &Destination, group: &ConsumerGroup) -> usize {
        let st = lock(&self.shared.state);
        let Some(t) = st.topics.get(destination) else { return 0 };
        t.groups.get(group).map_or(t.log.len(), |g| t.log.len() - g.cursor + g.returned.len() + g.in_flight.len())
    }

    fn settle(&self, destination: &Destination, group: &ConsumerGroup, offset: usize, sub: u64, requeue: bool) {
        let mut st = lock(&self.shared.state);
        let Some(g) = st.topics.get_mut(destination).and_then(|t| t.groups.get_mut(group)) else { return };
        // Only the holder may settle; a late ack after the delivery was handed back is a no-op.
        if g.in_flight.get(&offset) == Some(&sub) {
            g.in_flight.remove(&offset);
            if requeue {
                g.returned.push_back(offset);
            }
        }
        drop(st);
        if requeue {
            self.shared.notify.notify_waiters();
        }
    }
}

#[async_trait]
impl Broker for MemoryBroker {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> crate::Capabilities {
        // Unroutable when no group is declared; a per-group delivery count; nack requeues.
        crate::Capabilities::none()
            .with_detects_unroutable(true)
            .with_delivery_count(true)
            .with_redelivery_flag(true)
            .with_nack_redelivers(true)
            .with_max_payload(Some(self.max_payload))
    }

    async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        let mut st = lock(&self.shared.state);
        let t = st.topics.entry(destination.clone()).or_default();
        for g in groups {
            t.groups.entry(g.clone()).or_default();
        }
        Ok(())
    }

    async fn publish(&self, event: &Event) -> Result<()> {
        event.validate(self.max_payload)?;
        let mut st = lock(&self.shared.state);
        let Some(t) = st.topics.get_mut(&event.destination) else {
            return Err(Error::transient(
                ErrorKind::Unroutable,
                BACKEND,
                format!("destination {} does not exist (declare it first)", event.destination),
            ));
        };
        t.log.push(Entry::Event(event.clone()));
        drop(st);
        self.shared.notify.notify_waiters();
        Ok(())
    }

    /// Native batching: one lock for the whole batch, appended in slice order, one wake-up of
    /// the subscribers; after a failure the later events of its key are
    /// [`Skipped`](ErrorKind::Skipped).
    async fn publish_batch(&self, events: &[Event]) -> Vec<Result<()>> {
        let mut out = Vec::with_capacity(events.len());
        let mut failed: HashMap<&str, &EventId> = HashMap::new();
        let mut appended = false;
        let mut st = lock(&self.shared.state);
        for event in events {
            if let Some(first) = event.key.as_deref().and_then(|k| failed.get(k)) {
                out.push(Err(crate::broker::skipped(BACKEND, first.as_str())));
                continue;
            }
            let result = event.validate(self.max_payload).and_then(|()| match st.topics.get_mut(&event.destination) {
                Some(t) => {
                    t.log.push(Entry::Event(event.clone()));
                    appended = true;
                    Ok(())
                }
                None => Err(Error::transient(
                    ErrorKind::Unroutable,
                    BACKEND,
                    format!("destination {} does not exist (declare it first)", event.destination),
                )),
            });
            if let (Err(_), Some(k)) = (&result, event.key.as_deref()) {
                failed.insert(k, &event.id);
            }
            out.push(result);
        }
        drop(st);
        if appended {
            self.shared.notify.notify_waiters();
        }
        out
    }

    async fn subscribe(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        self.declare(destination, std::slice::from_ref(group)).await?;
        let id = self.shared.next_sub.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(MemorySubscription {
            broker: self.clone(),
            destination: destination.clone(),
            group: group.clone(),
            id,
        }))
    }
}

/// A member of a consumer group on a [`MemoryBroker`]. Dropping it returns its unacknowledged
/// deliveries to the group at once.
#[derive(Debug)]
pub struct MemorySubscription {
    broker: MemoryBroker,
    destination: Destination,
    group: ConsumerGroup,
    id: u64,
}

impl MemorySubscription {
    fn try_next(&self) -> Option<Received> {
        let mut st = lock(&self.broker.shared.state);
        let t = st.topics.get_mut(&self.destination)?;
        let g = t.groups.get_mut(&self.group)?;
        let offset = match g.returned.pop_front() {
            Some(o) => o,
            None if g.cursor < t.log.len() => {
                g.cursor += 1;
                g.cursor - 1
            }
            None => return None,
        };
        g.in_flight.insert(offset, self.id);
        let count = g.deliveries.entry(offset).or_insert(0);
        *count += 1;
        let attempt = *count;
        let entry = t.log[offset].clone();
        drop(st);
        let ack = Box::new(MemoryAck {
            broker: self.broker.clone(),
            destination: self.destination.clone(),
            group: self.group.clone(),
            offset,
            sub: self.id,
        });
        Some(match decode(&self.destination, offset, &entry) {
            Ok(event) => Received::Event(Delivery::new(event, attempt > 1, Some(attempt), ack)),
            Err(foreign) => {
                let (message, problem, detail) = *foreign;
                Received::Foreign(ForeignDelivery::new(message, problem, detail, attempt > 1, ack))
            }
        })
    }
}

/// The event of a log entry, or the raw message and what is wrong with it.
fn decode(
    destination: &Destination,
    offset: usize,
    entry: &Entry,
) -> std::result::Result<Event, Box<(RawMessage, Malformed, String)>> {
    let fields = match entry {
        Entry::Event(e) => return Ok(e.clone()),
        Entry::Raw(fields) => fields,
    };
    let mut raw = RawMessage {
        backend: BACKEND,
        destination: destination.clone(),
        position: format!("{destination}@{offset}"),
        event_id: None,
        key: None,
        headers: fields.iter().filter(|(f, _)| f != b"p").cloned().collect(),
        payload: fields.iter().find(|(f, _)| f == b"p").map(|(_, v)| v.clone()).unwrap_or_default(),
    };
    let all = |name: &[u8]| fields.iter().filter(move |(f, _)| f == name).map(|(_, v)| v).collect::<Vec<_>>();
    let ids = all(b"id");
    let id = match ids.as_slice() {
        [id] => std::str::from_utf8(id).ok().and_then(|t| EventId::new(t).ok()),
        _ => None,
    };
    raw.event_id = id.clone();
    let fail = |raw: RawMessage, p: Malformed, d: String| Err(Box::new((raw, p, d)));
    if all(b"v") != [b"1"] {
        return fail(raw, Malformed::UnknownFormat, "format field v is not exactly one \"1\"".into());
    }
    match ids.len() {
        0 => return fail(raw, Malformed::NoEventId, "no id field".into()),
        1 => {}
        n => return fail(raw, Malformed::DuplicateHeader, format!("the id field appears {n} times")),
    }
    let Some(id) = id else {
        return fail(
            raw,
            Malformed::BadEventId,
            format!("id {:?} is not a valid event id", String::from_utf8_lossy(ids[0])),
        );
    };
    let mut headers = Headers::new();
    let mut key = None;
    for (field, value) in fields {
        if field == b"k" {
            match String::from_utf8(value.clone()) {
                Ok(k) => key = Some(k),
                Err(_) => return fail(raw, Malformed::BadKey, "key is not UTF-8".into()),
            }
        } else if let Some(name) = field.strip_prefix(b"h:") {
            let Ok(name) = String::from_utf8(name.to_vec()) else {
                return fail(raw, Malformed::BadHeaderName, "a header name is not UTF-8".into());
            };
            if headers.insert(name.clone(), value.clone()).is_some() {
                return fail(raw, Malformed::DuplicateHeader, format!("header {name:?} appears more than once"));
            }
        }
    }
    let event = Event { id, destination: destination.clone(), key, headers, payload: raw.payload.clone() };
    match Malformed::of_event(&event) {
        None => Ok(event),
        Some((p, d)) => fail(raw, p, d),
    }
}

#[async_trait]
impl Subscription for MemorySubscription {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        if wait.is_zero() {
            return Ok(self.try_next());
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.broker.shared.notify.notified();
            if let Some(d) = self.try_next() {
                return Ok(Some(d));
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Ok(self.try_next());
            }
        }
    }
}

impl Drop for MemorySubscription {
    fn drop(&mut self) {
        let mut st = lock(&self.broker.shared.state);
        if let Some(g) = st.topics.get_mut(&self.destination).and_then(|t| t.groups.get_mut(&self.group)) {
            let mut mine: Vec<usize> = g.in_flight.iter().filter(|(_, s)| **s == self.id).map(|(o, _)| *o).collect();
            mine.sort_unstable();
            for o in mine {
                g.in_flight.remove(&o);
                g.returned.push_back(o);
            }
        }
        drop(st);
        self.broker.shared.notify.notify_waiters();
    }
}

struct MemoryAck {
    broker: MemoryBroker,
    destination: Destination,
    group: ConsumerGroup,
    offset: usize,
    sub: u64,
}

#[async_trait]
impl Acknowledge for MemoryAck {
    async fn ack(self: Box<Self>) -> Result<()> {
        self.broker.settle(&self.destination, &self.group, self.offset, self.sub, false);
        Ok(())
    }

    async fn nack(self: Box<Self>) -> Result<()> {
        self.broker.settle(&self.destination, &self.group, self.offset, self.sub, true);
        Ok(())
    }
}
