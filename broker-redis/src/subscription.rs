//! One member of a consumer group, and the acknowledgement of its deliveries.
//!
//! Redis keeps every entry delivered to a consumer in the group's pending list until it is
//! acknowledged, but it never gives it back by itself. So the subscription does the redelivery:
//!
//! 1. it first re-reads the entries still pending for its own consumer name (`XREADGROUP … 0`):
//!    a consumer restarted under the same name gets back what it held;
//! 2. it periodically takes over entries of other consumers (gone or stuck) that have been idle
//!    longer than the claim idle time (`XAUTOCLAIM`);
//! 3. otherwise it reads new entries (`XREADGROUP … >`), blocking on a connection of its own.
//!
//! A nack puts the entry back for immediate reclaim (its idle time is set to the claim idle time)
//! instead of keeping it in this process, so it survives this subscription going away, and any
//! member may take it.
//!
//! Entries handed out and not yet settled are remembered, so that re-reading after a connection
//! error or reclaiming its own idle entries never hands the same entry to this subscription twice.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    Acknowledge, ConsumerGroup, Delivery, Destination, ErrorKind, Event, ForeignDelivery, Malformed, RawMessage,
    Received, Result, Subscription,
};
use redis::Value;
use redis::aio::ConnectionManager;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::BACKEND;
use crate::broker::RedisBroker;
use crate::codec::{self, RawEntry};
use crate::error::{Op, map};

/// State shared by a subscription and the acknowledgers of its deliveries.
#[derive(Debug, Default)]
struct Shared {
    /// Entry ids handed out and not yet acked or nacked.
    in_flight: Mutex<HashSet<String>>,
    /// A nack happened: reclaim from the start of the pending list at the next opportunity.
    claim_now: AtomicBool,
}

impl Shared {
    fn in_flight(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.in_flight.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Where an entry came from; decides its `redelivered` flag and how its attempt is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// `XREADGROUP … >`: first delivery to the group.
    New,
    /// Own pending entries or reclaimed ones: delivered before; the count is in `XPENDING`.
    Again,
}

struct Ready {
    entry_id: String,
    item: Item,
    attempt: u32,
}

/// What an entry turned out to be.
enum Item {
    Event(Event),
    Foreign(RawMessage, Malformed, String),
}

/// A member of a consumer group on a [`RedisBroker`].
///
/// Dropping it leaves its unacknowledged entries pending under its consumer name; another member
/// reclaims them once they have been idle for the claim idle time, or a subscription created
/// later with the same consumer name ([`RedisBroker::subscribe_as`]) reads them first.
pub struct RedisSubscription {
    broker: RedisBroker,
    /// Dedicated connection for blocking reads.
    conn: ConnectionManager,
    destination: Destination,
    group: ConsumerGroup,
    stream: String,
    consumer: String,
    /// `Some(cursor)` while re-reading our own pending entries.
    history: Option<String>,
    claim_cursor: String,
    next_claim: Instant,
    claim_interval: Duration,
    buffer: VecDeque<Ready>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RedisSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSubscription")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

impl RedisSubscription {
    pub(crate) fn new(
        broker: RedisBroker,
        conn: ConnectionManager,
        destination: Destination,
        group: ConsumerGroup,
        stream: String,
        consumer: String,
    ) -> Self {
        let claim_interval =
            (broker.inner.config.claim_idle / 2).clamp(Duration::from_millis(10), Duration::from_secs(5));
        Self {
            broker,
            conn,
            destination,
            group,
            stream,
            consumer,
            history: Some("0".into()),
            claim_cursor: "0-0".into(),
            next_claim: Instant::now(),
            claim_interval,
            buffer: VecDeque::new(),
            shared: Arc::default(),
        }
    }

    /// The consumer name this subscription reads as.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The stream key it reads.
    pub fn stream_key(&self) -> &str {
        &self.stream
    }

    /// The group it belongs to.
    pub fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    async fn next_inner(&mut self, deadline: Instant) -> Result<Option<Received>> {
        loop {
            if let Some(ready) = self.buffer.pop_front() {
                return Ok(Some(self.hand_out(ready)));
            }
            if let Some(cursor) = self.history.clone() {
                let entries = self.read(&cursor, None).await?;
                self.history = entries.last().map(|e| e.id.clone());
                if self.history.is_none() {
                    debug!(backend = BACKEND, stream = %self.stream, consumer = %self.consumer, "own pending entries re-read");
                }
                self.accept(entries, Source::Again).await?;
                continue;
            }
            let now = Instant::now();
            if self.shared.claim_now.load(Ordering::Acquire) || now >= self.next_claim {
                self.claim().await?;
                if !self.buffer.is_empty() {
                    continue;
                }
            }
            let now = Instant::now();
            let block = deadline
                .saturating_duration_since(now)
                .min(self.broker.inner.config.block)
                .min(self.next_claim.saturating_duration_since(now));
            let entries = self.read(">", Some(block)).await?;
            let got = !entries.is_empty();
            self.accept(entries, Source::New).await?;
            if !got && Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    /// `XREADGROUP` from `id` (`>` for new entries, an id for our own pending ones), blocking up
    /// to `block` when given and non-zero.
    async fn read(&mut self, id: &str, block: Option<Duration>) -> Result<Vec<RawEntry>> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg(self.group.as_str()).arg(&self.consumer);
        cmd.arg("COUNT").arg(self.broker.inner.config.read_count);
        if let Some(block) = block {
            // Round up: BLOCK 0 would mean "forever".
            let ms = block.as_micros().div_ceil(1000);
            if ms > 0 {
                cmd.arg("BLOCK").arg(u64::try_from(ms).unwrap_or(u64::MAX));
            }
        }
        cmd.arg("STREAMS").arg(&self.stream).arg(id);
        let v: Value = cmd.query_async(&mut self.conn).await.map_err(|e| {
            map(e, Op::Read, &format!("XREADGROUP {} {} on {}", self.group, self.consumer, self.stream))
        })?;
        codec::read_reply(v)
    }

    /// Take over entries idle longer than the claim idle time (from any consumer, ourselves
    /// included: a nacked entry comes back this way).
    async fn claim(&mut self) -> Result<()> {
        if self.shared.claim_now.swap(false, Ordering::AcqRel) {
            self.claim_cursor = "0-0".into();
        }
        let c = &self.broker.inner.config;
        let idle_ms = u64::try_from(c.claim_idle.as_millis()).unwrap_or(u64::MAX);
        let mut conn = self.broker.inner.conn.clone();
        let v: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.stream)
            .arg(self.group.as_str())
            .arg(&self.consumer)
            .arg(idle_ms)
            .arg(&self.claim_cursor)
            .arg("COUNT")
            .arg(c.read_count)
            .query_async(&mut conn)
            .await
            .map_err(|e| map(e, Op::Read, &format!("XAUTOCLAIM {} on {}", self.group, self.stream)))?;
        let (cursor, claimed, deleted) = codec::autoclaim_reply(v)?;
        if !deleted.is_empty() {
            warn!(
                backend = BACKEND,
                stream = %self.stream,
                group = %self.group,
                ids = ?deleted,
                "pending entries no longer exist in the stream (deleted or trimmed by someone else); Redis dropped them"
            );
        }
        if cursor == "0-0" {
            // A full pass over the pending list: wait for the next round.
            self.claim_cursor = cursor;
            self.next_claim = Instant::now() + self.claim_interval;
        } else {
            // More of the pending list to scan: continue at the next call.
            self.claim_cursor = cursor;
            self.next_claim = Instant::now();
        }
        if !claimed.is_empty() {
            debug!(backend = BACKEND, stream = %self.stream, consumer = %self.consumer, n = claimed.len(), "reclaimed idle entries");
        }
        self.accept(claimed, Source::Again).await
    }

    /// Turn raw entries into ready deliveries in the buffer.
    async fn accept(&mut self, entries: Vec<RawEntry>, source: Source) -> Result<()> {
        let mut live = Vec::with_capacity(entries.len());
        for e in entries {
            match e.fields {
                Some(fields) => live.push((e.id, fields)),
                None => {
                    // Deleted from the stream while pending: there is nothing to deliver.
                    warn!(backend = BACKEND, stream = %self.stream, entry = %e.id, "pending entry was deleted from the stream; acknowledging it");
                    self.xack(&e.id).await?;
                }
            }
        }
        if source == Source::Again {
            let in_flight = self.shared.in_flight();
            live.retain(|(id, _)| !in_flight.contains(id));
        }
        if live.is_empty() {
            return Ok(());
        }
        let counts = match source {
            Source::New => vec![Some(1); live.len()],
            Source::Again => self.delivery_counts(live.iter().map(|(id, _)| id.as_str())).await?,
        };
        for ((entry_id, fields), count) in live.into_iter().zip(counts) {
            // No longer pending for us: acknowledged (or taken over) in the meantime.
            let Some(attempt) = count else { continue };
            let item = match codec::decode(&self.destination, &fields) {
                Ok(event) => Item::Event(event),
                Err((problem, detail)) => {
                    // Not an event: handed out with its acknowledger like one, so the consumer
                    // records it before it is acknowledged (it stays in the stream either way).
                    debug!(backend = BACKEND, stream = %self.stream, entry = %entry_id, %problem, %detail, "entry is not an outbox event");
                    let position = format!("{}/{entry_id}", self.stream);
                    Item::Foreign(codec::raw(&self.destination, position, &fields), problem, detail)
                }
            };
            self.buffer.push_back(Ready { entry_id, item, attempt });
        }
        Ok(())
    }

    /// Delivery count of each entry if it is pending for this consumer, else `None`.
    async fn delivery_counts<'a>(&self, ids: impl Iterator<Item = &'a str>) -> Result<Vec<Option<u32>>> {
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.cmd("XPENDING").arg(&self.stream).arg(self.group.as_str()).arg(id).arg(id).arg(1);
        }
        let mut conn = self.broker.inner.conn.clone();
        let replies: Vec<Value> = pipe
            .query_async(&mut conn)
            .await
            .map_err(|e| map(e, Op::Read, &format!("XPENDING {} on {}", self.group, self.stream)))?;
        replies
            .into_iter()
            .map(|r| {
                let rows = codec::pending_reply(r)?;
                Ok(rows.into_iter().find(|(_, owner, _)| *owner == self.consumer).map(|(_, _, n)| n.max(1)))
            })
            .collect()
    }

    async fn xack(&self, entry_id: &str) -> Result<()> {
        xack(&self.broker, &self.stream, &self.group, entry_id).await
    }

    fn hand_out(&mut self, r: Ready) -> Received {
        self.shared.in_flight().insert(r.entry_id.clone());
        let ack = RedisAck {
            broker: self.broker.clone(),
            stream: self.stream.clone(),
            group: self.group.clone(),
            consumer: self.consumer.clone(),
            entry_id: r.entry_id,
            shared: Arc::clone(&self.shared),
        };
        match r.item {
            Item::Event(event) => Received::Event(Delivery::new(event, r.attempt > 1, Some(r.attempt), Box::new(ack))),
            Item::Foreign(raw, problem, detail) => {
                Received::Foreign(ForeignDelivery::new(raw, problem, detail, r.attempt > 1, Box::new(ack)))
            }
        }
    }
}

#[async_trait]
impl Subscription for RedisSubscription {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        let deadline = Instant::now() + wait;
        match self.next_inner(deadline).await {
            Ok(d) => Ok(d),
            Err(e) => {
                if e.kind() != ErrorKind::Corrupt {
                    // A reply may have been lost after Redis recorded the delivery: re-read our
                    // pending entries before anything new (what is in flight is skipped).
                    self.buffer.clear();
                    self.history = Some("0".into());
                }
                Err(e)
            }
        }
    }
}

async fn xack(broker: &RedisBroker, stream: &str, group: &ConsumerGroup, entry_id: &str) -> Result<()> {
    let mut conn = broker.inner.conn.clone();
    let _: i64 = redis::cmd("XACK")
        .arg(stream)
        .arg(group.as_str())
        .arg(entry_id)
        .query_async(&mut conn)
        .await
        .map_err(|e| map(e, Op::Read, &format!("XACK {entry_id} in {group} on {stream}")))?;
    Ok(())
}

struct RedisAck {
    broker: RedisBroker,
    stream: String,
    group: ConsumerGroup,
    consumer: String,
    entry_id: String,
    shared: Arc<Shared>,
}

#[async_trait]
impl Acknowledge for RedisAck {
    /// `XACK`. Accepted even when the entry was reclaimed by another consumer meanwhile: the
    /// effect committed, so the group is done with it either way.
    async fn ack(self: Box<Self>) -> Result<()> {
        self.shared.in_flight().remove(&self.entry_id);
        xack(&self.broker, &self.stream, &self.group, &self.entry_id).await
    }

    /// Make the entry reclaimable at once, if this consumer still holds it.
    async fn nack(self: Box<Self>) -> Result<()> {
        self.shared.in_flight().remove(&self.entry_id);
        let idle_ms = u64::try_from(self.broker.inner.config.claim_idle.as_millis()).unwrap_or(u64::MAX);
        let mut conn = self.broker.inner.conn.clone();
        let mut inv = self.broker.inner.nack.prepare_invoke();
        inv.key(&self.stream).arg(self.group.as_str()).arg(&self.consumer).arg(&self.entry_id).arg(idle_ms);
        let released: i64 = inv
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map(e, Op::Read, &format!("nack {} in {} on {}", self.entry_id, self.group, self.stream)))?;
        if released == 0 {
            debug!(backend = BACKEND, entry = %self.entry_id, "nack: entry no longer held by this consumer");
        }
        self.shared.claim_now.store(true, Ordering::Release);
        Ok(())
    }
}

impl std::fmt::Debug for RedisAck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisAck").field("stream", &self.stream).field("entry_id", &self.entry_id).finish()
    }
}
