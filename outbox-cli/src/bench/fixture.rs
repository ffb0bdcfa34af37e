//! What every subject sets up the same way: the seeded events, a fresh PostgreSQL schema with a
//! backlog, the broker that returns at once, and the acknowledgement counter that tells when a
//! consumer is done.
//!
//! Setup is never timed: a backlog is written, analyzed and only then is the clock started, so
//! a figure is the drain alone.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox::core::rng::SplitMix64;
use outbox::core::{Acknowledge, Delivery, Received, Subscription};
use outbox::postgres::sqlx::{self, AssertSqlSafe, Connection, PgConnection};
use outbox::postgres::{PgConfig, PgStore, map_error};
use outbox::{Broker, ConsumerGroup, Destination, Error, ErrorKind, Event, EventId, OutboxAdmin, OutboxStore, Result};

use super::Settings;

/// The header that carries the amount P6's effect adds.
pub(crate) const AMOUNT_HEADER: &str = "amount";

/// The relays' lease: long enough that nothing expires during a measurement.
pub(crate) const LEASE: Duration = Duration::from_secs(120);

/// The bound on any single drain: a measurement past it is a hang, reported as an error.
pub(crate) const DRAIN_LIMIT: Duration = Duration::from_secs(600);

/// `n` events to `destination`: ids `ev-00000000…`, keys `acct-<k>` spread over `--keys` by the
/// seed, an `amount` header (1 to 1000), `--payload` seeded bytes. The same seed gives the same
/// events.
pub(crate) fn events(settings: &Settings, destination: &Destination, n: usize) -> Vec<Event> {
    let mut rng = SplitMix64::new(settings.seed);
    (0..n)
        .map(|i| {
            let key = rng.below(settings.keys);
            let amount = 1 + rng.below(1000);
            let mut payload = Vec::with_capacity(settings.payload + 8);
            while payload.len() < settings.payload {
                payload.extend_from_slice(&rng.next_u64().to_le_bytes());
            }
            payload.truncate(settings.payload);
            Event::new(EventId::new(format!("ev-{i:08}")).expect("a valid id"), destination.clone(), payload)
                .with_key(format!("acct-{key}"))
                .with_header(AMOUNT_HEADER, amount.to_string().into_bytes())
        })
        .collect()
}

/// The amount of an event made by [`events`].
pub(crate) fn amount(event: &Event) -> Result<i64> {
    event
        .headers
        .get(AMOUNT_HEADER)
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::invalid_input("bench", format!("event {} has no amount header", event.id)))
}

/// A broker that keeps nothing and accepts every batch at once ([`InstantBroker::AT_ONCE`]:
/// what is left is the relay's and the store's cost) or after a set latency, as a real broker's
/// acknowledgement takes (P7 with `--p7-broker-latency`).
pub(crate) struct InstantBroker {
    latency: Duration,
}

impl InstantBroker {
    /// Answers every batch at once.
    pub(crate) const AT_ONCE: InstantBroker = InstantBroker { latency: Duration::ZERO };

    /// Answers each batch (and each single publish) after `latency`.
    pub(crate) fn after(latency: Duration) -> Self {
        InstantBroker { latency }
    }

    async fn wait(&self) {
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
    }
}

#[async_trait]
impl Broker for InstantBroker {
    fn backend(&self) -> &'static str {
        "instant"
    }
    async fn declare(&self, _: &Destination, _: &[ConsumerGroup]) -> Result<()> {
        Ok(())
    }
    async fn publish(&self, _: &Event) -> Result<()> {
        self.wait().await;
        Ok(())
    }
    async fn publish_batch(&self, events: &[Event]) -> Vec<Result<()>> {
        self.wait().await;
        events.iter().map(|_| Ok(())).collect()
    }
    async fn subscribe(&self, _: &Destination, _: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        Err(Error::permanent(ErrorKind::Rejected, "instant", "this broker keeps nothing"))
    }
}

/// How a broker with `latency` answers, for the rows and the header: "that returns at once" or
/// "that answers each batch after 20ms".
pub(crate) fn answers(latency: Duration) -> String {
    if latency.is_zero() { "that returns at once".into() } else { format!("that answers each batch after {latency:?}") }
}

pub(crate) fn fail(what: impl std::fmt::Display) -> Error {
    Error::permanent(ErrorKind::Rejected, "bench", what.to_string())
}

/// A fresh PostgreSQL schema with the outbox tables, dropped by [`PgFixture::drop`].
pub(crate) struct PgFixture {
    pub(crate) store: PgStore,
    pub(crate) config: PgConfig,
    pub(crate) schema: String,
    pub(crate) events_table: String,
}

impl PgFixture {
    /// Schema `bench_<tag>_<run id>`, migrated.
    pub(crate) async fn new(settings: &Settings, tag: &str) -> Result<Self> {
        let schema = format!("bench_{tag}_{}", settings.run_id);
        let config =
            PgConfig::from_url(&settings.pg)?.with_schema(schema.clone()).with_application_name(schema.clone());
        let store = PgStore::connect(config.clone()).await?;
        store.migrate().await?;
        let events_table = store.tables().table("events")?;
        Ok(Self { store, config, schema, events_table })
    }

    /// Another store handle on the same schema with its own pool (a relay process of its own).
    pub(crate) async fn another_store(&self, pool_size: u32) -> Result<PgStore> {
        PgStore::connect(self.config.clone().with_pool_size(pool_size)).await
    }

    /// Empty the outbox and enqueue `events` as the backlog, then `ANALYZE` and [`settle`] (not
    /// timed).
    pub(crate) async fn fill(&self, events: &[Event]) -> Result<()> {
        sqlx::raw_sql(AssertSqlSafe(format!("TRUNCATE {}", self.events_table)))
            .execute(self.store.pool())
            .await
            .map_err(map_error)?;
        for chunk in events.chunks(2000) {
            self.store.enqueue(chunk).await?;
        }
        sqlx::raw_sql(AssertSqlSafe(format!("ANALYZE {}", self.events_table)))
            .execute(self.store.pool())
            .await
            .map_err(map_error)?;
        // Best effort: `CHECKPOINT` needs a superuser or `pg_checkpoint`; without it the
        // measurement just starts wherever the server's own checkpoints are.
        let _ = sqlx::raw_sql("CHECKPOINT").execute(self.store.pool()).await;
        settle().await;
        Ok(())
    }

    /// Durable check after a drain: every one of the `n` rows is published, none pending, leased
    /// or parked.
    pub(crate) async fn check_published(&self, n: usize, what: &str) -> Result<()> {
        let stats = self.store.stats().await?;
        if stats.published != n as u64 || stats.pending != 0 || stats.leased != 0 || stats.parked != 0 {
            return Err(fail(format!(
                "{what}: expected {n} published rows, found published {} pending {} leased {} parked {}",
                stats.published, stats.pending, stats.leased, stats.parked
            )));
        }
        Ok(())
    }

    /// A plain connection to the server (for the raw baselines).
    pub(crate) async fn connection(&self) -> Result<PgConnection> {
        PgConnection::connect_with(&self.config.connect_options()?).await.map_err(map_error)
    }

    /// Close the pool and drop the schema.
    pub(crate) async fn drop(self) -> Result<()> {
        self.store.close().await;
        let mut conn = PgConnection::connect_with(&self.config.connect_options()?).await.map_err(map_error)?;
        sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.schema)))
            .execute(&mut conn)
            .await
            .map_err(map_error)?;
        let _ = conn.close().await;
        Ok(())
    }
}

/// Write every dirty page of the machine to disk (`sync`), so that a measurement does not pay
/// for the writeback of the one before it: PostgreSQL, RabbitMQ and SQLite share one disk here,
/// and a ratio of two runs minutes apart is only fair if both start from the same state.
/// PostgreSQL fixtures also `CHECKPOINT` first. Not timed; a failure to run `sync` is ignored.
pub(crate) async fn settle() {
    let _ = tokio::task::spawn_blocking(|| std::process::Command::new("sync").status()).await;
}

/// Events per second of `n` events in `elapsed`.
pub(crate) fn per_second(n: usize, elapsed: Duration) -> f64 {
    n as f64 / elapsed.as_secs_f64().max(1e-9)
}

/// Counts acknowledgements of one subscription's deliveries and notes when the `target`-th
/// one returned: the moment a consumer is done, without polling tables.
#[derive(Clone)]
pub(crate) struct AckCounter {
    inner: Arc<CounterInner>,
}

struct CounterInner {
    acked: AtomicU64,
    target: u64,
    done: tokio::sync::Notify,
    at: std::sync::OnceLock<Instant>,
}

impl AckCounter {
    pub(crate) fn new(target: u64) -> Self {
        Self {
            inner: Arc::new(CounterInner {
                acked: AtomicU64::new(0),
                target,
                done: tokio::sync::Notify::new(),
                at: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Acknowledgements so far.
    pub(crate) fn acked(&self) -> u64 {
        self.inner.acked.load(Ordering::Relaxed)
    }

    /// Wait until `target` deliveries were acknowledged, up to `limit`; returns the instant the
    /// last one was.
    pub(crate) async fn wait(&self, limit: Duration, what: &str) -> Result<Instant> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.inner.done.notified();
            if let Some(at) = self.inner.at.get() {
                return Ok(*at);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(fail(format!(
                    "{what}: only {} of {} deliveries acknowledged within {limit:?}",
                    self.acked(),
                    self.inner.target
                )));
            }
        }
    }

    /// `subscription` with every delivery's acknowledgement counted.
    pub(crate) fn wrap(&self, subscription: Box<dyn Subscription>) -> Box<dyn Subscription> {
        Box::new(Counted { inner: subscription, counter: self.clone() })
    }
}

struct Counted {
    inner: Box<dyn Subscription>,
    counter: AckCounter,
}

#[async_trait]
impl Subscription for Counted {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        Ok(match self.inner.receive(wait).await? {
            Some(Received::Event(d)) => {
                let (redelivered, attempt) = (d.redelivered, d.attempt);
                let (event, acker) = d.into_parts();
                let acker = Box::new(CountedAck { inner: acker, counter: self.counter.clone() });
                Some(Received::Event(Delivery::new(event, redelivered, attempt, acker)))
            }
            other => other,
        })
    }
}

struct CountedAck {
    inner: Box<dyn Acknowledge>,
    counter: AckCounter,
}

#[async_trait]
impl Acknowledge for CountedAck {
    async fn ack(self: Box<Self>) -> Result<()> {
        self.inner.ack().await?;
        let c = &self.counter.inner;
        if c.acked.fetch_add(1, Ordering::AcqRel) + 1 == c.target {
            let _ = c.at.set(Instant::now());
            c.done.notify_waiters();
        }
        Ok(())
    }
    async fn nack(self: Box<Self>) -> Result<()> {
        self.inner.nack().await
    }
    async fn reject(self: Box<Self>) -> Result<()> {
        self.inner.reject().await
    }
}
