//! What a backend provides to be judged: fresh, isolated components for one case, a place to
//! write and read back the business effect, and the capabilities it has.
//!
//! The suite never asks a backend "did it work?". It runs actions against the components and
//! then reads durable state back — outbox rows, broker contents, inbox markers, effect rows —
//! and judges that.
//!
//! A backend is half of a deployment: a store is used with any broker and a broker with any
//! store. So each adapter ships one half ([`StoreHarness`] or [`BrokerHarness`]) and
//! [`Combined`] pairs any two into the [`Harness`] the suite runs — the in-memory halves for an
//! adapter's own run, two real ones for the store × broker matrix.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::memory::{MemoryBroker, MemoryInbox, MemoryOutbox};
use outbox_core::{
    Broker, Destination, Error, ErrorKind, EventId, Inbox, Malformed, ManualClock, OutboxAdmin, ParkedHead, Result,
};

use crate::reference::{MemoryEffects, memory_capabilities};

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
    /// The harness can write messages that are not readable outbox events
    /// ([`ForeignWriter`]), bypassing the adapter's encoding.
    ForeignMessages,
    /// The harness can build a fixture whose store passes over parked rows
    /// ([`ParkedHead::Skip`], through [`Harness::fixture_with_parked_head`]).
    ParkedHeadSkip,
    /// The store implements retention ([`OutboxAdmin::purge_published`]).
    /// Found out by the case itself, not declared: the trait's default, a permanent
    /// [`Rejected`](outbox_core::ErrorKind::Rejected) error, means the store has none.
    Retention,
    /// The store has a wake-up signal ([`OutboxStore::wakeup`](outbox_core::OutboxStore::wakeup)
    /// returns `Some`). Found out by the case itself, like [`Retention`](Self::Retention): the
    /// trait's default, `None`, means relays find new rows by polling.
    Wakeup,
    /// A delivery a live member holds unacknowledged stays with it while another member joins
    /// and reads for a few delivery waits: no rebalance moves it and no idle timeout that short
    /// hands it over ([`Subscription::receive`](outbox_core::Subscription::receive) allows both:
    /// a Kafka group rebalances when a member joins, and only a sticky assignment keeps a
    /// partition with its live owner). The case takes its fixture from
    /// [`Harness::fixture_holding`], so a harness whose fixtures hand deliveries over after a
    /// short idle time (the suite's Redis harness: 200 ms) declares it by giving that case a
    /// longer one.
    HeldWhileLive,
}

impl Capability {
    /// The suite's capabilities that a broker's run-time
    /// [`Capabilities`](outbox_core::Capabilities) promise, so a harness declares what its
    /// broker reports instead of a second, hand-written list.
    pub fn present_in(caps: &outbox_core::Capabilities) -> Vec<Capability> {
        let mut present = Vec::new();
        if caps.detects_unroutable {
            present.push(Self::DetectsUnroutable);
        }
        if caps.reports_redelivery() {
            present.push(Self::RedeliveryInfo);
        }
        if caps.nack_redelivers {
            present.push(Self::Nack);
        }
        present
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::DetectsUnroutable => "detects-unroutable",
            Self::RedeliveryInfo => "redelivery-info",
            Self::Nack => "nack",
            Self::ForeignMessages => "foreign-messages",
            Self::ParkedHeadSkip => "parked-head-skip",
            Self::Retention => "retention",
            Self::Wakeup => "wakeup",
            Self::HeldWhileLive => "held-while-live",
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
    pub store: Arc<dyn OutboxAdmin>,
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
    /// Writes messages that are not readable events to this fixture's broker (`None`: the
    /// harness cannot; declare [`Capability::ForeignMessages`] only with one).
    pub foreign: Option<Arc<dyn ForeignWriter>>,
}

impl<I: Inbox + Clone> Fixture<I> {
    /// A fixture whose restarted processes share `inbox` and `broker`.
    pub fn new(
        store: Arc<dyn OutboxAdmin>,
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
            foreign: None,
        }
    }
}

/// A kind of message that is not a readable outbox event, as the suite asks a harness to write
/// one (with the broker's driver, not the adapter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ForeignKind {
    /// Everything of an event but its id.
    NoEventId,
    /// An event id with spaces in it.
    BadEventId,
    /// Not the adapter's format (another format version), where the broker's format has one.
    UnknownFormat,
    /// A header named `bad name` (a space).
    BadHeaderName,
    /// The event id twice, with different values.
    DuplicateIdHeader,
    /// One header of [`OVERSIZED_HEADER_BYTES`](ForeignKind::OVERSIZED_HEADER_BYTES) (over the
    /// 64 KiB limit of all headers).
    OversizedHeaders,
    /// A key that is not UTF-8.
    BadKey,
}

impl ForeignKind {
    /// Every kind, in the order the suite writes them.
    pub const ALL: [ForeignKind; 7] = [
        Self::NoEventId,
        Self::BadEventId,
        Self::UnknownFormat,
        Self::BadHeaderName,
        Self::DuplicateIdHeader,
        Self::OversizedHeaders,
        Self::BadKey,
    ];

    /// Size of the header [`OversizedHeaders`](Self::OversizedHeaders) writes.
    pub const OVERSIZED_HEADER_BYTES: usize = 70_000;

    /// The problem a subscription must report for it.
    pub fn expected(self) -> Malformed {
        match self {
            Self::NoEventId => Malformed::NoEventId,
            Self::BadEventId => Malformed::BadEventId,
            Self::UnknownFormat => Malformed::UnknownFormat,
            Self::BadHeaderName => Malformed::BadHeaderName,
            Self::DuplicateIdHeader => Malformed::DuplicateHeader,
            Self::OversizedHeaders => Malformed::OversizedHeaders,
            Self::BadKey => Malformed::BadKey,
        }
    }
}

impl fmt::Display for ForeignKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expected().as_str())
    }
}

/// Whether a [`ForeignWriter`] wrote the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Foreign {
    /// Written to the destination.
    Written,
    /// The broker cannot carry this kind (e.g. a header twice in an AMQP header table); why.
    Unsupported(String),
}

/// Writes raw messages to a fixture's broker with its driver, the way another program sharing
/// the destination would.
#[async_trait]
pub trait ForeignWriter: Send + Sync {
    /// Write one message of `kind` to `destination` (declared before), with `payload` as its
    /// payload byte-for-byte and `id` as its event id where the kind has a valid one.
    ///
    /// # Behavior
    /// - `Ok(Foreign::Written)` once the broker accepted it; `Ok(Foreign::Unsupported(why))`,
    ///   writing nothing, for a kind the broker's format cannot express;
    /// - the message is received by the suite's group like an event published after the calls
    ///   before it.
    async fn write(&self, destination: &Destination, kind: ForeignKind, id: &str, payload: &[u8]) -> Result<Foreign>;
}

/// The fields of a stream entry of `kind` in the Redis adapter's (and the memory broker's)
/// format: `v`, `id`, `k`, `h:<name>`, `p`.
pub fn stream_fields(kind: ForeignKind, id: &str, payload: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let f = |k: &str, v: &[u8]| (k.as_bytes().to_vec(), v.to_vec());
    let mut fields = vec![f("v", if kind == ForeignKind::UnknownFormat { b"9" } else { b"1" })];
    match kind {
        ForeignKind::NoEventId => {}
        ForeignKind::BadEventId => fields.push(f("id", format!("{id} has spaces").as_bytes())),
        ForeignKind::DuplicateIdHeader => {
            fields.push(f("id", id.as_bytes()));
            fields.push(f("id", format!("{id}-other").as_bytes()));
        }
        _ => fields.push(f("id", id.as_bytes())),
    }
    match kind {
        ForeignKind::BadHeaderName => fields.push(f("h:bad name", b"v")),
        ForeignKind::OversizedHeaders => fields.push(f("h:big", &vec![b'x'; ForeignKind::OVERSIZED_HEADER_BYTES])),
        ForeignKind::BadKey => fields.push(f("k", &[0xff, 0xfe, b'k'])),
        _ => {}
    }
    fields.push(f("p", payload));
    fields
}

/// [`ForeignWriter`] of a [`MemoryBroker`]: [`stream_fields`] through
/// [`MemoryBroker::publish_raw`]. Every kind is supported.
#[derive(Debug, Clone)]
pub struct MemoryForeign(pub MemoryBroker);

#[async_trait]
impl ForeignWriter for MemoryForeign {
    async fn write(&self, destination: &Destination, kind: ForeignKind, id: &str, payload: &[u8]) -> Result<Foreign> {
        self.0.publish_raw(destination, stream_fields(kind, id, payload))?;
        Ok(Foreign::Written)
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

    /// [`fixture`](Harness::fixture) with the store configured to treat a parked head row as
    /// `parked_head` (see [`OutboxStore::claim`](outbox_core::OutboxStore::claim)).
    ///
    /// The default serves [`ParkedHead::Block`] (every store's default) with `fixture` and
    /// refuses `Skip`; a harness that can configure it overrides this and declares
    /// [`Capability::ParkedHeadSkip`].
    async fn fixture_with_parked_head(
        &self,
        case: &str,
        clock: ManualClock,
        parked_head: ParkedHead,
    ) -> Result<Fixture<Self::Inbox>> {
        match parked_head {
            ParkedHead::Block => self.fixture(case, clock).await,
            ParkedHead::Skip => Err(cannot_skip(&self.name())),
        }
    }

    /// [`fixture`](Harness::fixture) for a case that needs [`Capability::HeldWhileLive`]: its
    /// subscriptions keep a delivery they hold unacknowledged while they live.
    ///
    /// The default is `fixture`, for a harness whose fixtures hold anyway; one whose fixtures
    /// hand deliveries over after a short idle time (so that its redelivery cases are quick)
    /// overrides this with a longer one.
    async fn fixture_holding(&self, case: &str, clock: ManualClock) -> Result<Fixture<Self::Inbox>> {
        self.fixture(case, clock).await
    }
}

fn cannot_skip(name: &str) -> Error {
    Error::permanent(
        ErrorKind::Rejected,
        "suite",
        format!("{name} cannot configure ParkedHead::Skip (it does not declare the parked-head-skip capability)"),
    )
}

/// The store half of a fixture: the producer's outbox and the consumer's inbox with its effect
/// table, all on the case's [`ManualClock`].
pub struct StoreFixture<I: Inbox> {
    /// The producer's outbox (built on the case's [`ManualClock`]).
    pub store: Arc<dyn OutboxAdmin>,
    /// The consumer's inbox (shared durable state).
    pub inbox: I,
    /// The consumer's effect table, in the inbox's store.
    pub effects: Arc<dyn EffectTable<I>>,
    /// Builds the inbox handle of a restarted consumer process (default: a clone of `inbox`).
    pub restart_inbox: Arc<dyn Fn() -> I + Send + Sync>,
}

impl<I: Inbox + Clone> StoreFixture<I> {
    /// A store fixture whose restarted consumers share `inbox`.
    pub fn new(store: Arc<dyn OutboxAdmin>, inbox: I, effects: Arc<dyn EffectTable<I>>) -> Self {
        let i = inbox.clone();
        Self { store, inbox, effects, restart_inbox: Arc::new(move || i.clone()) }
    }
}

/// The broker half of a fixture: a broker and a destination no other fixture uses.
pub struct BrokerFixture {
    /// The broker.
    pub broker: Arc<dyn Broker>,
    /// A destination unique to this fixture.
    pub destination: Destination,
    /// Builds the broker handle of a restarted process (default: the same broker).
    pub restart_broker: Arc<dyn Fn() -> Arc<dyn Broker> + Send + Sync>,
    /// Writes messages that are not readable events (`None` by default).
    pub foreign: Option<Arc<dyn ForeignWriter>>,
}

impl BrokerFixture {
    /// A broker fixture whose restarted processes share `broker`.
    pub fn new(broker: Arc<dyn Broker>, destination: Destination) -> Self {
        let b = broker.clone();
        Self { broker, destination, restart_broker: Arc::new(move || b.clone()), foreign: None }
    }
}

/// The store side of a backend under test: an outbox store, an inbox and an effect table.
///
/// Combined with any [`BrokerHarness`] by [`Combined`], so a store is judged with every broker
/// (and a broker with every store) without either knowing the other.
#[async_trait]
pub trait StoreHarness: Send + Sync + 'static {
    /// The consumer-side store.
    type Inbox: Inbox;

    /// Name shown in reports (`"sqlite store + sqlite inbox"`).
    fn name(&self) -> String;

    /// Whether fixtures are cheap enough for the bounded exhaustive exploration (thousands of
    /// fixtures per run).
    fn exhaustive(&self) -> bool;

    /// The most sampled permutation paths per run this store affords (the combination takes the
    /// smaller of the store's and the broker's).
    fn sampled_iterations(&self) -> u32 {
        200
    }

    /// Fresh, isolated store components for the case `case`, taking time from `clock`.
    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<StoreFixture<Self::Inbox>>;

    /// Whether [`fixture_with_parked_head`](StoreHarness::fixture_with_parked_head) can build a
    /// store that passes over parked rows ([`ParkedHead::Skip`]); [`Combined`] then declares
    /// [`Capability::ParkedHeadSkip`]. `false` by default.
    fn configures_parked_head(&self) -> bool {
        false
    }

    /// [`fixture`](StoreHarness::fixture) with the outbox treating a parked head row as
    /// `parked_head`. The default serves `Block` with `fixture` and refuses `Skip`.
    async fn fixture_with_parked_head(
        &self,
        case: &str,
        clock: ManualClock,
        parked_head: ParkedHead,
    ) -> Result<StoreFixture<Self::Inbox>> {
        match parked_head {
            ParkedHead::Block => self.fixture(case, clock).await,
            ParkedHead::Skip => Err(cannot_skip(&self.name())),
        }
    }
}

/// The broker side of a backend under test.
#[async_trait]
pub trait BrokerHarness: Send + Sync + 'static {
    /// Name shown in reports (`"redis streams broker"`).
    fn name(&self) -> String;

    /// What the broker can do, how long to wait for a delivery, and how much exploration it
    /// affords (`exhaustive` only when fixtures are in-process).
    fn capabilities(&self) -> Capabilities;

    /// A fresh broker fixture for the case `case`: its destination (and consumer groups, where
    /// the broker keeps them per name) is used by no other fixture.
    async fn fixture(&self, case: &str) -> Result<BrokerFixture>;

    /// [`fixture`](BrokerHarness::fixture) for a case that needs [`Capability::HeldWhileLive`]
    /// (see [`Harness::fixture_holding`]). The default is `fixture`.
    async fn fixture_holding(&self, case: &str) -> Result<BrokerFixture> {
        self.fixture(case).await
    }
}

/// A broker half chosen at run time (a URL's scheme, say): a [`Combined`] over it compiles the
/// suite once per store type instead of once per store × broker pair.
#[async_trait]
impl BrokerHarness for Box<dyn BrokerHarness> {
    fn name(&self) -> String {
        (**self).name()
    }

    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }

    async fn fixture(&self, case: &str) -> Result<BrokerFixture> {
        (**self).fixture(case).await
    }

    async fn fixture_holding(&self, case: &str) -> Result<BrokerFixture> {
        (**self).fixture_holding(case).await
    }
}

/// A store half and a broker half judged together: the [`Harness`] the suite runs.
///
/// Capabilities and the delivery wait are the broker's; the exhaustive exploration runs only
/// when both halves are cheap; sampled permutations take the smaller budget of the two (or the
/// one given by [`Combined::with_sampled_iterations`]).
pub struct Combined<S, B> {
    store: S,
    broker: B,
    sampled_iterations: Option<u32>,
}

impl<S: StoreHarness, B: BrokerHarness> Combined<S, B> {
    /// `store` with `broker`.
    pub fn new(store: S, broker: B) -> Self {
        Self { store, broker, sampled_iterations: None }
    }

    /// Sample `iterations` permutation paths per run instead of the halves' budget
    /// (`OUTBOX_TEST_ITERATIONS` still overrides).
    #[must_use]
    pub fn with_sampled_iterations(mut self, iterations: u32) -> Self {
        self.sampled_iterations = Some(iterations);
        self
    }

    /// The store half.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The broker half.
    pub fn broker(&self) -> &B {
        &self.broker
    }
}

impl<S, B> fmt::Debug for Combined<S, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Combined").field("sampled_iterations", &self.sampled_iterations).finish_non_exhaustive()
    }
}

#[async_trait]
impl<S: StoreHarness, B: BrokerHarness> Harness for Combined<S, B> {
    type Inbox = S::Inbox;

    fn name(&self) -> String {
        format!("{} + {}", self.store.name(), self.broker.name())
    }

    fn capabilities(&self) -> Capabilities {
        let mut broker = self.broker.capabilities();
        if self.store.configures_parked_head() && !broker.has(Capability::ParkedHeadSkip) {
            broker.present.push(Capability::ParkedHeadSkip);
        }
        Capabilities {
            exhaustive: broker.exhaustive && self.store.exhaustive(),
            sampled_iterations: self
                .sampled_iterations
                .unwrap_or_else(|| broker.sampled_iterations.min(self.store.sampled_iterations())),
            ..broker
        }
    }

    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<Fixture<Self::Inbox>> {
        self.fixture_with_parked_head(case, clock, ParkedHead::Block).await
    }

    async fn fixture_with_parked_head(
        &self,
        case: &str,
        clock: ManualClock,
        parked_head: ParkedHead,
    ) -> Result<Fixture<Self::Inbox>> {
        let store = self.store.fixture_with_parked_head(case, clock, parked_head).await?;
        let broker = self.broker.fixture(case).await?;
        Ok(Self::join(store, broker))
    }

    async fn fixture_holding(&self, case: &str, clock: ManualClock) -> Result<Fixture<Self::Inbox>> {
        let store = self.store.fixture(case, clock).await?;
        let broker = self.broker.fixture_holding(case).await?;
        Ok(Self::join(store, broker))
    }
}

impl<S: StoreHarness, B: BrokerHarness> Combined<S, B> {
    /// One fixture of the two halves.
    fn join(store: StoreFixture<S::Inbox>, broker: BrokerFixture) -> Fixture<S::Inbox> {
        Fixture {
            store: store.store,
            broker: broker.broker,
            inbox: store.inbox,
            effects: store.effects,
            destination: broker.destination,
            restart_inbox: store.restart_inbox,
            restart_broker: broker.restart_broker,
            foreign: broker.foreign,
        }
    }
}

/// The in-memory reference outbox and inbox ([`MemoryOutbox`], [`MemoryInbox`]): the store half
/// a broker adapter is judged with.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryStoreHarness;

#[async_trait]
impl StoreHarness for MemoryStoreHarness {
    type Inbox = MemoryInbox;

    fn name(&self) -> String {
        "memory store + memory inbox".into()
    }

    fn exhaustive(&self) -> bool {
        true
    }

    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<StoreFixture<MemoryInbox>> {
        self.fixture_with_parked_head(case, clock, ParkedHead::Block).await
    }

    fn configures_parked_head(&self) -> bool {
        true
    }

    async fn fixture_with_parked_head(
        &self,
        _case: &str,
        clock: ManualClock,
        parked_head: ParkedHead,
    ) -> Result<StoreFixture<MemoryInbox>> {
        let inbox = MemoryInbox::new(Arc::new(clock.clone()));
        Ok(StoreFixture::new(
            Arc::new(MemoryOutbox::new(Arc::new(clock)).with_parked_head(parked_head)),
            inbox.clone(),
            Arc::new(MemoryEffects(inbox)),
        ))
    }
}

/// The in-process reference broker ([`MemoryBroker`]): the broker half a store adapter is
/// judged with. Every fixture has a broker of its own, so one destination name serves all.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryBrokerHarness;

#[async_trait]
impl BrokerHarness for MemoryBrokerHarness {
    fn name(&self) -> String {
        "memory broker".into()
    }

    fn capabilities(&self) -> Capabilities {
        memory_capabilities()
    }

    async fn fixture(&self, _case: &str) -> Result<BrokerFixture> {
        let broker = MemoryBroker::new();
        let mut fx = BrokerFixture::new(Arc::new(broker.clone()), Destination::new("suite")?);
        fx.foreign = Some(Arc::new(MemoryForeign(broker)));
        Ok(fx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_combination_takes_the_broker_capabilities_and_the_smaller_budget() {
        struct Slow;
        #[async_trait]
        impl StoreHarness for Slow {
            type Inbox = MemoryInbox;
            fn name(&self) -> String {
                "slow".into()
            }
            fn exhaustive(&self) -> bool {
                false
            }
            fn sampled_iterations(&self) -> u32 {
                7
            }
            async fn fixture(&self, case: &str, clock: ManualClock) -> Result<StoreFixture<MemoryInbox>> {
                MemoryStoreHarness.fixture(case, clock).await
            }
        }
        let fast = Combined::new(MemoryStoreHarness, MemoryBrokerHarness);
        assert_eq!(fast.name(), "memory store + memory inbox + memory broker");
        let caps = fast.capabilities();
        assert!(caps.exhaustive);
        let mut want = memory_capabilities().present;
        want.push(Capability::ParkedHeadSkip);
        assert_eq!(caps.present, want);
        let slow = Combined::new(Slow, MemoryBrokerHarness);
        assert!(!slow.capabilities().exhaustive);
        assert!(!slow.capabilities().has(Capability::ParkedHeadSkip), "Slow cannot configure the parked head");
        assert_eq!(slow.capabilities().sampled_iterations, 7);
        assert_eq!(slow.with_sampled_iterations(3).capabilities().sampled_iterations, 3);
    }
}
