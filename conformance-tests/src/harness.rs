//! What a backend provides to be judged: fresh, isolated components for one case, a place to
//! write and read back the business effect, and the capabilities it has.
//!
//! The suite never asks a backend "did it work?". It runs actions against the components and
//! then reads durable state back — outbox rows, broker contents, inbox markers, effect rows —
//! and judges that.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{Broker, Destination, EventId, Inbox, ManualClock, OutboxStore, Result};

/// One row of the business effect table: what a consumer durably did for one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectRow {
    /// Consumer that applied it.
    pub consumer: String,
    /// Event it came from.
    pub event_id: EventId,
    /// Account (credits) or projection subject.
    pub subject: String,
    /// Amount (credits) or version (projections).
    pub value: i64,
}

/// The business effect's table, in the consumer's store. `insert` runs inside the inbox
/// transaction, so effect and marker commit together.
#[async_trait]
pub trait EffectTable<I: Inbox>: Send + Sync {
    /// Write one effect row in `tx`.
    async fn insert(&self, tx: &mut I::Tx, row: &EffectRow) -> Result<()>;
    /// Every committed effect row, in commit order.
    async fn rows(&self) -> Result<Vec<EffectRow>>;
}

/// Something a backend may or may not be able to do. A case that needs a missing capability is
/// reported as skipped (naming it), never as passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Capability {
    /// The broker can tell that a destination cannot route a message (RabbitMQ `mandatory`,
    /// Kafka unknown topic, the memory broker).
    DetectsUnroutable,
    /// The broker reports a delivery count or redelivered flag.
    RedeliveryInfo,
    /// A negative acknowledgement makes the message come back.
    Nack,
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::DetectsUnroutable => "detects-unroutable",
            Self::RedeliveryInfo => "redelivery-info",
            Self::Nack => "nack",
        })
    }
}

/// What a backend declares about itself.
#[derive(Debug, Clone)]
pub struct Capabilities {
    /// Capabilities present.
    pub present: Vec<Capability>,
    /// How long to wait for a delivery before deciding there is none. On in-process brokers
    /// zero; on real ones long enough for a redelivery after a consumer went away (idle /
    /// session timeouts).
    pub delivery_wait: Duration,
    /// Iterations of seeded random permutations per run (`OUTBOX_TEST_ITERATIONS` overrides).
    pub sampled_iterations: u32,
    /// Run the bounded exhaustive exploration (cheap fixtures only).
    pub exhaustive: bool,
}

impl Capabilities {
    /// Whether `c` is present.
    pub fn has(&self, c: Capability) -> bool {
        self.present.contains(&c)
    }
}

/// Fresh components for one case (or one path of an exploration).
pub struct Fixture<I: Inbox> {
    /// The producer's outbox (built on the case's [`ManualClock`]).
    pub store: Arc<dyn OutboxStore>,
    /// The broker.
    pub broker: Arc<dyn Broker>,
    /// The consumer's inbox (shared durable state).
    pub inbox: I,
    /// The consumer's effect table.
    pub effects: Arc<dyn EffectTable<I>>,
    /// A destination unique to this fixture.
    pub destination: Destination,
    /// Builds the inbox handle of a restarted consumer process. The default clones `inbox`;
    /// backends whose handles keep process state return a fresh one.
    pub restart_inbox: Arc<dyn Fn() -> I + Send + Sync>,
    /// Builds the broker handle of a restarted process (default: the same broker).
    pub restart_broker: Arc<dyn Fn() -> Arc<dyn Broker> + Send + Sync>,
}

impl<I: Inbox + Clone> Fixture<I> {
    /// A fixture whose restarted processes share `inbox` and `broker`.
    pub fn new(
        store: Arc<dyn OutboxStore>,
        broker: Arc<dyn Broker>,
        inbox: I,
        effects: Arc<dyn EffectTable<I>>,
        destination: Destination,
    ) -> Self {
        let i = inbox.clone();
        let b = broker.clone();
        Self {
            store,
            broker,
            inbox,
            effects,
            destination,
            restart_inbox: Arc::new(move || i.clone()),
            restart_broker: Arc::new(move || b.clone()),
        }
    }
}

/// A backend under test.
///
/// `fixture` must return components isolated from every other fixture (fresh tables, schema,
/// topic, stream or queue names) so cases run in parallel and re-run on a dirty server. The
/// outbox store must take its time from `clock`.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The consumer-side store.
    type Inbox: Inbox;

    /// Name shown in reports (`"sqlite + memory broker"`).
    fn name(&self) -> String;

    /// What the backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Fresh, isolated components for the case `case`.
    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<Fixture<Self::Inbox>>;
}
