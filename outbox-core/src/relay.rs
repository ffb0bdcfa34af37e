//! The relay: claim a batch of rows, publish it, record the outcomes.
//!
//! The relay knows a store and a broker only through their traits and branches only on
//! [`Retry`]: transient → back off and try again, permanent → park, outcome unknown → treat as
//! not published (it will be offered again; duplicates are the consumer's job). A fenced
//! completion means another relay re-claimed the row after this relay's lease expired; it is
//! counted and logged, never treated as success.
//!
//! # Why a pipeline
//!
//! Claim, publish and complete each wait on a different server. Run one after another, each
//! server idles while the others work (measured: the relay at 0.3 cores, PostgreSQL idle more
//! than half the time). So the three stages run at once, connected by bounded queues: the next
//! batch is claimed while this one publishes, and a batch's outcomes are recorded while the next
//! one publishes. At most [`RelayConfig::pipeline_depth`] batches (`d`) are at the broker at
//! once; depth 1 is the serial relay.
//!
//! # Why the broker's slots hold only publishes
//!
//! A batch takes a slot at the broker only for its publish: it is claimed ahead (at most one
//! batch waits, claimed, for a slot to free) and its outcomes are recorded after it has left the
//! broker. When a slot also covered the claim and the completion, a broker whose publishes take
//! longer than the database's statements saw fewer than `d` batches: with RabbitMQ at depth 2
//! about 7 ms of every 24 ms slot went to PostgreSQL (measured in `outbox bench` P2; Kafka's P3
//! gained a quarter, RabbitMQ's P2 an eighth by the change; Redis's P1 lost about an eighth;
//! docs/bench.md).
//! So a batch holds two permits: one of `d + 1` from before its claim until its publish ends,
//! and one of `2d + 1` from before its claim until its outcomes are recorded, which bounds the
//! leases a relay holds and the completions waiting. A claim that runs further ahead does not
//! help: every leased row makes the next claims walk further (measured on P1, Redis: with `2d`
//! batches claimed ahead, claims took an eighth longer, completions half again as long, and the
//! relay lost a tenth).
//!
//! Nothing about a row changes: every transition after the claim is conditional on the claim's
//! token, whichever stage makes it. Per-key order holds because a store's claim never returns a
//! row whose earlier row of the same key is still leased ([`OutboxStore::claim`]): an overlapped
//! claim cannot take a later row of a key that is still in flight, so the batches in flight
//! never share a key. That is also why their publishes may overlap: a broker whose throughput is
//! bound by confirm latency (RabbitMQ's publisher confirms, Kafka's acks) sees `pipeline_depth`
//! batches in flight instead of one.
//!
//! # Why the broker's call runs on a task of its own
//!
//! The three stages are one task (`tokio::join!`), so while a batch's publish runs code of its
//! own (the adapter encoding a hundred messages, the driver framing them) the claim stage cannot
//! take its claim's answer, nor the completion stage its completion's. Each batch's
//! [`Broker::publish_batch`] therefore runs on a task of its own, which the runtime may put on
//! another thread. Measured with `outbox bench --only P2 --seed 7` (RabbitMQ at depth 8, the
//! claim the limit), a switchable build alternating seven times: relay 8.9k, 9.6k, 9.0k, 9.4k,
//! 9.5k, 9.7k, 9.1k events/s (mean 9.31k; ratios to the same run's raw publish 0.73–0.83, mean
//! 0.79) against 8.5k, 8.7k, 9.1k, 8.8k, 8.7k, 9.1k, 9.0k (mean 8.84k; 0.73–0.81, mean 0.76); the
//! relay from the in-memory store 11.4k–12.4k against 10.9k–11.5k; P4 (the instant broker)
//! unchanged (24.3k, 23.7k, 24.6k against 23.0k, 24.6k, 24.9k).
//!
//! # Why completions are settled together
//!
//! A broker that confirms in groups (RabbitMQ confirms persistent messages after a disk sync)
//! ends several batches' publishes at once, and they queued for the completion stage, one
//! `complete_many` (one statement and commit) each. The completion stage now takes every batch
//! whose publish has ended by the time it is free and completes their accepted rows in one
//! [`OutboxStore::complete_many`] (up to 1,000 rows; a batch with more is completed alone); it
//! never waits for a batch to join. Each row is still
//! completed on its own lease's token, and each batch keeps its own report, failures and
//! releases. Measured with `outbox bench --only P2 --seed 7` (RabbitMQ at depth 8), a switchable
//! build alternating nine times: 221–257 completion calls per 50,000 events against 501–504,
//! relay 9.5k–10.5k events/s (mean 10.03k, ratio to the same run's raw publish mean 0.80)
//! against 9.3k–10.5k (mean 9.88k, 0.77): fewer statements, throughput within the spread. With
//! the instant broker completions almost never queue (P7: at most two fewer completion calls
//! than publishes per drain), so the change does not reach it (docs/bench.md).
//!
//! # After a short claim
//!
//! A claim that returns fewer rows than asked used to mean "the backlog is drained", and the
//! claim stage waited until every batch in flight was settled before it claimed again. Beside
//! other relays most claims come back short while the backlog is full: a claim skips the rows
//! another claim has locked and drops the later rows of their keys (50,000 rows took 502 claims
//! at one relay, about 530 at two, 650–700 at eight). Each short claim emptied the pipeline, so
//! relays that wait on their broker hardly added up. Now a short claim waits for one batch in flight to
//! settle (its keys are free then); only a claim that finds nothing waits for all of them (their
//! released and retried rows may be due at once), and one that finds nothing with nothing in
//! flight ends the run. A drained backlog costs at most one more claim. Measured with `outbox
//! bench --only P7 --seed 7`, the build before alternating with this one (relays' events/s, median
//! of three rounds):
//! - a broker that answers each batch after 20 ms (`--p7-broker-latency 20ms`): two relays
//!   16.2k against 12.5k, four 19.8k against 13.9k, eight 19.5k against 16.9k (one: 9.0k, 8.9k);
//! - after 5 ms: two 22.1k against 19.5k, four 23.2k against 21.7k, eight 21.9k against 22.2k;
//! - the instant broker (the store is the limit), two runs each: two relays 26.2k, 26.7k against
//!   25.9k, 25.8k; four 26.8k, 26.4k against 26.0k, 25.9k; eight 23.0k, 24.0k against 23.8k,
//!   23.8k. Not waiting at all after a short claim did as well at two and four relays behind a
//!   slow broker but cost eight relays on the busy store a quarter (17.0k–19.4k): the wait for
//!   one batch is what keeps a relay from claiming faster than its batches settle.
//!
//! # One writer
//!
//! On a store whose writes run one at a time ([`OutboxStore::one_writer`], SQLite) a batch
//! claimed ahead waits for the writer like everything else, and its leased rows make the next
//! claims walk further; it pays only while the broker is what the relay waits for. So on such a
//! store the claim stage, holding its permits, waits while `d` or more other batches are between
//! claim and outcome unless all `d` places at the broker are publishing: a broker that returns
//! within a claim's time (the instant broker, mostly Redis) gets at most `d` batches between
//! claim and outcome, a slow one (Kafka, RabbitMQ) a batch claimed ahead as on any store.
//! Measured with `outbox bench --only P5 --seed 7` (SQLite) in a throwaway build whose P5 relay
//! could publish to Redis or Kafka, alternating with the rule before (nothing claimed ahead on
//! such a store); events/s with the ratio to the same run's raw rusqlite loop:
//! - Kafka (tansu): 25.6k (0.55), 25.5k (0.55), 26.4k (0.55), 23.9k (0.54), 25.8k (0.60)
//!   against 17.2k (0.37), 17.9k (0.40), 16.6k (0.32), 17.0k (0.38), 18.0k (0.44);
//! - the instant broker: 38.8k (0.87), 38.9k (0.84), 34.0k (0.74), 35.0k (0.75), 28.6k (0.75)
//!   against 36.9k (0.76), 37.7k (0.82), 39.6k (0.82), 38.0k (0.90), 31.4k (0.73);
//! - Redis: within each other's spread (eight runs each: means 33.0k against 33.6k, mean ratios
//!   0.72 against 0.74; runs 29.6k–36.2k against 27.9k–36.8k).
//!
//! Claiming ahead regardless, as on PostgreSQL, gave Kafka as much (29.1k (0.64), 25.1k (0.53))
//! but cost Redis (31.6k (0.65), 29.2k (0.64) against 32.1k (0.67), 35.1k (0.74)); on
//! PostgreSQL this rule cost P2 a twentieth (docs/bench.md), so it is for one writer only.
//!
//! # Lease safety
//!
//! A claimed batch's publish starts as soon as a slot at the broker frees (at most one publish
//! later), and its outcomes are recorded as soon as its publish ends, so its lease must outlast
//! two publishes plus the completion (the completion stage records one batch at a time, so up to
//! `2d` completions may be ahead of it). The publish stage still checks: a batch that waited for
//! half its lease or more before its publish began is released unpublished (counted as
//! released, logged as a warning), never published on a lease that may already be gone. With
//! the defaults (30 s lease, depth 2, batches of 100) that takes a stall of 15 s.
//!
//! # Why a summary, not a line per batch, at `info`
//!
//! A relay that keeps up with a busy service settles a hundred batches a second or more (10,000
//! events/s in batches of 100), and a line per batch at `info` was a hundred lines a second in
//! the operator's log for the relay's routine work. So each batch is logged at `debug` ("batch
//! done"), and at `info` a relay at work writes one line ("relayed": the counts of the batches
//! settled since the line before) at most every [`LOG_SUMMARY_EVERY`], and when its work runs
//! out ([`Relay::run`] going idle or stopping, the end of [`Relay::drain`]), so that a burst
//! shorter than the interval is reported too. Warnings (fenced completions, a shrinking batch,
//! parked rows) stay one line each, when they happen.
//!
//! # Why the batch shrinks
//!
//! A batch whose publish outlasts its lease is re-claimed by another relay before its
//! completions land, and those are fenced. If the next claim asked for as many rows again, the
//! same batch would outlast the next lease too, and the relays would take it from each other
//! forever: every publish a duplicate, nothing ever completed (seen with a 200 ms lease and one
//! key's 41 rows published one after another). So a batch with a fenced transition halves the
//! size of this relay's next claims (down to one row), and each full batch settled within half
//! the lease and without one grows it back by a tenth of [`RelayConfig::batch_size`]. The
//! current size is the gauge `outbox_relay_batch_limit`; a shrink is logged as a warning.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore, SemaphorePermit, mpsc};
use tracing::{Instrument, Span, debug, error, info_span, warn};

use crate::broker::Broker;
use crate::error::{Error, ErrorKind, Result, Retry};
use crate::event::{Event, EventId};
use crate::rng::SplitMix64;
use crate::store::{Claimed, Completion, Lease, OutboxStore, Outcome, RowId};
use crate::wakeup::Wakeup;

/// Exponential backoff with jitter for failed publishes.
///
/// `#[non_exhaustive]`: build it with [`Backoff::default`], [`Backoff::none`] or
/// [`Backoff::new`] and the `with_*` setters, so a new knob is not a breaking change.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Backoff {
    /// Delay after the first failure.
    pub initial: Duration,
    /// Upper bound.
    pub max: Duration,
    /// Growth factor per failed attempt.
    pub multiplier: f64,
    /// Relative jitter in `[0, 1]`: the delay is scaled by a factor in `[1 - jitter, 1 + jitter]`.
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { initial: Duration::from_millis(500), max: Duration::from_secs(300), multiplier: 2.0, jitter: 0.2 }
    }
}

impl Backoff {
    /// No delay at all (tests that drive time by hand).
    pub fn none() -> Self {
        Self { initial: Duration::ZERO, max: Duration::ZERO, multiplier: 1.0, jitter: 0.0 }
    }

    /// Doubling from `initial` up to `max`, with the default jitter.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self { initial, max, ..Self::default() }
    }

    /// Set [`initial`](Self::initial).
    #[must_use]
    pub fn with_initial(mut self, initial: Duration) -> Self {
        self.initial = initial;
        self
    }

    /// Set [`max`](Self::max).
    #[must_use]
    pub fn with_max(mut self, max: Duration) -> Self {
        self.max = max;
        self
    }

    /// Set [`multiplier`](Self::multiplier).
    #[must_use]
    pub fn with_multiplier(mut self, multiplier: f64) -> Self {
        self.multiplier = multiplier;
        self
    }

    /// Set [`jitter`](Self::jitter).
    #[must_use]
    pub fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// Delay before the next try after `attempts` failures so far (0-based), with `unit` in
    /// `[0, 1)` choosing the jitter.
    pub fn delay(&self, attempts: u32, unit: f64) -> Duration {
        let exp = self.multiplier.powi(i32::try_from(attempts).unwrap_or(i32::MAX));
        let base = (self.initial.as_secs_f64() * exp).min(self.max.as_secs_f64());
        let jitter = self.jitter.clamp(0.0, 1.0);
        let factor = 1.0 - jitter + 2.0 * jitter * unit;
        Duration::from_secs_f64((base * factor).clamp(0.0, self.max.as_secs_f64().max(0.0)))
    }
}

/// Batches a relay keeps at the broker at once when neither its [`RelayConfig`] nor its broker
/// ([`Broker::preferred_pipeline_depth`]) says otherwise.
pub const DEFAULT_PIPELINE_DEPTH: usize = 2;

/// At most how often a relay at work logs its summary line at `info` (see the
/// [module docs](self), "Why a summary"); each batch is logged at `debug`.
pub const LOG_SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// How a relay behaves. `Default` gives production values.
///
/// `#[non_exhaustive]`: build it with [`RelayConfig::new`] (or `default`) and the `with_*`
/// setters; the fields stay readable and assignable, so a new setting is not a breaking change.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// Lease owner name; must be unique among live relays.
    pub owner: String,
    /// Rows claimed per batch, at most (0 counts as 1). After a batch whose lease ran out before
    /// its outcomes were recorded the relay claims fewer, until batches fit the lease again
    /// (see the module docs).
    pub batch_size: usize,
    /// Lease length per claim.
    pub lease: Duration,
    /// Kept for compatibility; the relay does not read it. The relay hands each batch to
    /// [`Broker::publish_batch`], and the broker's batching decides how many publishes are in
    /// flight (the default `publish_batch` runs up to 16 keys at once; one key is always
    /// sequential); [`pipeline_depth`](Self::pipeline_depth) sets how many batches are at the
    /// broker at once.
    #[deprecated(
        since = "0.1.0",
        note = "not read by the relay: the broker's `publish_batch` decides how many publishes are in flight; \
                `pipeline_depth` sets the batches at the broker"
    )]
    pub concurrency: usize,
    /// Batches at the broker at once (at least 1); `None` (the default): the broker's
    /// [`preferred_pipeline_depth`](Broker::preferred_pipeline_depth), else
    /// [`DEFAULT_PIPELINE_DEPTH`] (2); [`Relay::pipeline_depth`] tells which. With 2, the next
    /// batch is published while this one's publish is still waiting for the broker's
    /// acknowledgements; one more batch is
    /// claimed ahead to take the next free place, and each batch's outcomes are recorded as its
    /// publish ends, so up to `2 × pipeline_depth + 1` batches are between their claim and their
    /// recorded outcomes (on a store with [one writer](OutboxStore::one_writer) a batch is
    /// claimed ahead only while every place at the broker is publishing, else at most
    /// `pipeline_depth` are). 1 is the serial relay (claim, publish, complete, then the next
    /// claim).
    /// [`Relay::run_once`] is always one batch. Keep one batch's publish time well under
    /// [`lease`](Self::lease): a batch that waited in the pipeline for half its lease is released
    /// unpublished (see the module docs).
    pub pipeline_depth: Option<usize>,
    /// Failed attempts after which a row is parked.
    pub max_attempts: u32,
    /// Retry delays.
    pub backoff: Backoff,
    /// Longest wait between polls when nothing was claimable (the `run` loop only). With
    /// [`wakeup`](RelayConfig::wakeup) it is the safety net; without, it is the latency.
    pub idle_poll: Duration,
    /// Also wake up as soon as the store signals an enqueue ([`OutboxStore::wakeup`]), instead
    /// of only every `idle_poll` (the `run` loop only). On by default; a store without a signal
    /// just polls.
    pub wakeup: bool,
    /// Seed of the jitter generator (`None`: from the system time).
    pub seed: Option<u64>,
}

impl Default for RelayConfig {
    // Sets the deprecated `concurrency` to the value it always had.
    #[allow(deprecated)]
    fn default() -> Self {
        Self {
            owner: format!("relay-{}", std::process::id()),
            batch_size: 100,
            lease: Duration::from_secs(30),
            concurrency: 16,
            pipeline_depth: None,
            max_attempts: 10,
            backoff: Backoff::default(),
            idle_poll: Duration::from_millis(500),
            wakeup: true,
            seed: None,
        }
    }
}

impl RelayConfig {
    /// Defaults with the given owner name.
    pub fn new(owner: impl Into<String>) -> Self {
        Self { owner: owner.into(), ..Self::default() }
    }

    /// Set [`owner`](Self::owner).
    #[must_use]
    pub fn with_owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = owner.into();
        self
    }

    /// Set [`batch_size`](Self::batch_size).
    #[must_use]
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// Set [`lease`](Self::lease).
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Set [`concurrency`](Self::concurrency), which the relay does not read.
    #[deprecated(
        since = "0.1.0",
        note = "not read by the relay: the broker's `publish_batch` decides how many publishes are in flight; \
                use `with_pipeline_depth` for the batches at the broker"
    )]
    #[must_use]
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        #[allow(deprecated)]
        {
            self.concurrency = concurrency;
        }
        self
    }

    /// The batches a relay with this config keeps at `broker` at once:
    /// [`pipeline_depth`](Self::pipeline_depth) where set, else the broker's
    /// [`preferred_pipeline_depth`](Broker::preferred_pipeline_depth), else
    /// [`DEFAULT_PIPELINE_DEPTH`]; at least 1, and at most what the relay's semaphores hold.
    /// [`Relay::pipeline_depth`] is this for the relay's broker.
    pub fn pipeline_depth_for(&self, broker: &dyn Broker) -> usize {
        // 2 × depth + 1 permits must fit a semaphore and `acquire_many`'s u32.
        self.pipeline_depth
            .or_else(|| broker.preferred_pipeline_depth())
            .unwrap_or(DEFAULT_PIPELINE_DEPTH)
            .clamp(1, (Semaphore::MAX_PERMITS.min(u32::MAX as usize) - 1) / 2)
    }

    /// Set [`pipeline_depth`](Self::pipeline_depth) (0 counts as 1), whatever the broker
    /// prefers.
    #[must_use]
    pub fn with_pipeline_depth(mut self, pipeline_depth: usize) -> Self {
        self.pipeline_depth = Some(pipeline_depth);
        self
    }

    /// Set [`max_attempts`](Self::max_attempts).
    #[must_use]
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// Set [`backoff`](Self::backoff).
    #[must_use]
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Set [`idle_poll`](Self::idle_poll).
    #[must_use]
    pub fn with_idle_poll(mut self, idle_poll: Duration) -> Self {
        self.idle_poll = idle_poll;
        self
    }

    /// Set [`wakeup`](Self::wakeup).
    #[must_use]
    pub fn with_wakeup(mut self, wakeup: bool) -> Self {
        self.wakeup = wakeup;
        self
    }

    /// Set [`seed`](Self::seed).
    #[must_use]
    pub fn with_seed(mut self, seed: Option<u64>) -> Self {
        self.seed = seed;
        self
    }
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Rows claimed.
    pub claimed: u64,
    /// Rows published and completed by this relay.
    pub published: u64,
    /// Completions rejected because the lease was stale (the row was re-claimed or done).
    pub fenced: u64,
    /// Rows sent back to pending with a retry time.
    pub retried: u64,
    /// Rows dead-lettered.
    pub parked: u64,
    /// Rows released unpublished (shutdown, or a failure earlier in the same key).
    pub released: u64,
    /// Rows released because the broker refused the relay's credentials
    /// ([`ErrorKind::Auth`]): not the row's fault, so no attempt is
    /// counted and nothing is parked; [`Relay::run`] waits `idle_poll` before claiming again.
    pub refused: u64,
}

impl BatchReport {
    fn add(&mut self, o: &BatchReport) {
        self.claimed += o.claimed;
        self.published += o.published;
        self.fenced += o.fenced;
        self.retried += o.retried;
        self.parked += o.parked;
        self.released += o.released;
        self.refused += o.refused;
    }
}

/// Cumulative counters of a relay.
#[derive(Debug, Default)]
struct Counters {
    claimed: AtomicU64,
    published: AtomicU64,
    fenced: AtomicU64,
    retried: AtomicU64,
    parked: AtomicU64,
    released: AtomicU64,
    refused: AtomicU64,
}

/// The relay's `metrics` handles, registered once with the recorder current when the relay is
/// built (not per batch: a registration looks the key up in the recorder and allocates the
/// owner label).
struct Meters {
    claimed: metrics::Counter,
    published: metrics::Counter,
    fenced: metrics::Counter,
    retried: metrics::Counter,
    parked: metrics::Counter,
    released: metrics::Counter,
    refused: metrics::Counter,
    claim_seconds: metrics::Histogram,
    publish_seconds: metrics::Histogram,
    complete_seconds: metrics::Histogram,
    batch_seconds: metrics::Histogram,
    batch_limit: metrics::Gauge,
}

impl Meters {
    fn new(owner: &str) -> Self {
        let counter = |name: &'static str| metrics::counter!(name, OWNER => owner.to_owned());
        let histogram = |name: &'static str| metrics::histogram!(name, OWNER => owner.to_owned());
        Self {
            claimed: counter(CLAIMED),
            published: counter(PUBLISHED),
            fenced: counter(FENCED),
            retried: counter(RETRIED),
            parked: counter(PARKED),
            released: counter(RELEASED),
            refused: counter(REFUSED),
            claim_seconds: histogram(CLAIM_SECONDS),
            publish_seconds: histogram(PUBLISH_SECONDS),
            complete_seconds: histogram(COMPLETE_SECONDS),
            batch_seconds: histogram(BATCH_SECONDS),
            batch_limit: metrics::gauge!(BATCH_LIMIT, OWNER => owner.to_owned()),
        }
    }
}

/// Stops a relay gracefully: no new claims, publishes already started finish, rows not sent
/// (the rest of a batch under the default [`Broker::publish_batch`], batches claimed but not yet
/// handed to the broker) are released, and every outcome is recorded.
#[derive(Debug, Clone, Default)]
pub struct Shutdown(Arc<(AtomicBool, Notify)>);

impl Shutdown {
    /// Ask the relay to stop.
    pub fn trigger(&self) {
        self.0.0.store(true, Ordering::SeqCst);
        self.0.1.notify_waiters();
    }

    /// Whether stop was asked.
    pub fn is_triggered(&self) -> bool {
        self.0.0.load(Ordering::SeqCst)
    }

    /// Resolves once stop was asked (at once if it already was).
    pub(crate) async fn wait(&self) {
        let notified = self.0.1.notified();
        if self.is_triggered() {
            return;
        }
        notified.await;
    }
}

/// Moves rows from an [`OutboxStore`] to a [`Broker`].
///
/// Claim, publish and complete run as a pipeline of up to [`RelayConfig::pipeline_depth`]
/// batches (see the [module docs](self)). Counts go to [`totals`](Relay::totals) and to the
/// `metrics` facade (`outbox_relay_*`, labelled with the owner; the crate README lists them),
/// through handles registered in [`Relay::new`] with the recorder current then.
pub struct Relay {
    store: Arc<dyn OutboxStore>,
    broker: Arc<dyn Broker>,
    config: RelayConfig,
    counters: Counters,
    meters: Meters,
    /// Batches at the broker at once: [`RelayConfig::pipeline_depth`] or the broker's preference.
    depth: usize,
    /// Rows the next claim asks for: [`RelayConfig::batch_size`] or fewer after a batch
    /// outlasted its lease (see the module docs).
    limit: AtomicUsize,
    rng: Mutex<SplitMix64>,
    shutdown: Shutdown,
    /// Batches settled since the last summary line.
    summary: Mutex<Summary>,
}

/// A spawned task aborted when its handle is dropped unjoined: a relay future dropped mid-publish
/// takes its publish with it, as it did when the broker was called in place.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    async fn join(mut self) -> std::result::Result<T, tokio::task::JoinError> {
        (&mut self.0).await
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The counts of the batches settled since the last summary line, and when that line was.
#[derive(Debug)]
struct Summary {
    since: Instant,
    batches: u64,
    report: BatchReport,
}

impl Summary {
    fn new(now: Instant) -> Self {
        Self { since: now, batches: 0, report: BatchReport::default() }
    }

    /// Count a batch settled at `now`; returns the line's counts (batches, their report, the
    /// time they cover) when `every` has passed since the last line, and starts a new count.
    fn add(&mut self, report: &BatchReport, now: Instant, every: Duration) -> Option<(u64, BatchReport, Duration)> {
        self.batches += 1;
        self.report.add(report);
        if now.saturating_duration_since(self.since) < every {
            return None;
        }
        self.take(now)
    }

    /// The counts so far, if any batch was settled since the last line; starts a new count.
    fn take(&mut self, now: Instant) -> Option<(u64, BatchReport, Duration)> {
        if self.batches == 0 {
            return None;
        }
        let over = now.saturating_duration_since(self.since);
        let out = (self.batches, std::mem::take(&mut self.report), over);
        *self = Self::new(now);
        Some(out)
    }
}

/// What the claim stage waits for before its next claim.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Settle {
    /// Nothing: claim when a slot is free.
    Nothing,
    /// One more batch settled: after a short claim (module docs, "After a short claim").
    One,
    /// Every batch in flight settled: after a claim that found nothing, whose rows the batches
    /// in flight may release or retry.
    All,
}

/// How far one run of the pipeline goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Until {
    /// One claim; its batch's outcomes recorded ([`Relay::run_once`]).
    OneBatch,
    /// Until a claim made with nothing in flight finds nothing.
    Idle,
}

/// Why a run of the pipeline stopped. Every batch it claimed is settled by then.
enum Stop {
    /// Nothing claimable (or the one batch of [`Until::OneBatch`] is done).
    Idle,
    /// The broker refused the relay's credentials.
    Refused,
    /// [`Shutdown::trigger`].
    Shutdown,
    /// A claim failed.
    Failed(Error),
}

/// A claimed batch on its way to the publish stage.
struct Batch {
    rows: Vec<Claimed>,
    span: Span,
    /// Taken right before the claim was sent: the lease is at least this old.
    started: Instant,
}

/// The most accepted rows the completion stage completes in one call when it settles several
/// batches together (module docs, "Why completions are settled together"); a batch with more
/// is completed alone.
const ROWS_COMPLETED_TOGETHER: usize = 1_000;

/// A row whose publish failed, for [`Relay::on_failure`].
struct FailedRow {
    row: RowId,
    lease: Lease,
    attempts: u32,
    event_id: EventId,
    error: Error,
}

/// What the publish stage decided for each row of a batch; the completion stage records it.
struct Decided {
    span: Span,
    started: Instant,
    claimed: u64,
    /// Accepted by the broker: complete.
    sent: Vec<(RowId, Lease)>,
    /// The first failure of its key (or a keyless failure): fail or park.
    failed: Vec<FailedRow>,
    /// Refused credentials: release, count as refused.
    refused: Vec<(RowId, Lease)>,
    /// Not published (skipped, held behind an earlier failure of its key, shutdown): release.
    released: Vec<(RowId, Lease)>,
}

impl Decided {
    fn new(span: Span, started: Instant, claimed: usize) -> Self {
        Self {
            span,
            started,
            claimed: claimed as u64,
            sent: Vec::with_capacity(claimed),
            failed: Vec::new(),
            refused: Vec::new(),
            released: Vec::new(),
        }
    }
}

impl Relay {
    /// A relay over `store` and `broker`.
    pub fn new(store: Arc<dyn OutboxStore>, broker: Arc<dyn Broker>, config: RelayConfig) -> Self {
        let seed = config.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0x5eed)
        });
        let meters = Meters::new(&config.owner);
        let limit = config.batch_size.max(1);
        meters.batch_limit.set(limit as f64);
        let depth = config.pipeline_depth_for(broker.as_ref());
        Self {
            store,
            broker,
            config,
            depth,
            counters: Counters::default(),
            meters,
            limit: AtomicUsize::new(limit),
            rng: Mutex::new(SplitMix64::new(seed)),
            shutdown: Shutdown::default(),
            summary: Mutex::new(Summary::new(Instant::now())),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// Batches this relay keeps at the broker at once: [`RelayConfig::pipeline_depth_for`] its
    /// broker, resolved once in [`Relay::new`].
    pub fn pipeline_depth(&self) -> usize {
        self.depth
    }

    /// A handle that stops [`run`](Relay::run) gracefully.
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shutdown.clone()
    }

    /// Rows the next claim asks for: [`RelayConfig::batch_size`], or fewer while batches have
    /// been outlasting their lease (see the [module docs](self)).
    pub fn batch_limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Totals since the relay was built. `claimed` counts when a claim returns; the other counts
    /// when a batch's outcomes are recorded.
    pub fn totals(&self) -> BatchReport {
        let c = &self.counters;
        BatchReport {
            claimed: c.claimed.load(Ordering::Relaxed),
            published: c.published.load(Ordering::Relaxed),
            fenced: c.fenced.load(Ordering::Relaxed),
            retried: c.retried.load(Ordering::Relaxed),
            parked: c.parked.load(Ordering::Relaxed),
            released: c.released.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
        }
    }

    /// Claim one batch, publish it, record the outcomes; returns once they are recorded.
    ///
    /// Returns an empty report when nothing was claimable or shutdown was triggered. Always
    /// serial, whatever [`RelayConfig::pipeline_depth`] says.
    ///
    /// # Errors
    /// Store errors while claiming. Errors after the claim are handled per row (retry, park,
    /// or leave the lease to expire) and show in the report and the logs.
    pub async fn run_once(&self) -> Result<BatchReport> {
        if self.shutdown.is_triggered() {
            return Ok(BatchReport::default());
        }
        match self.pipeline(Until::OneBatch, None).await {
            (_, Stop::Failed(e)) => Err(e),
            (report, _) => Ok(report),
        }
    }

    /// Run batches, pipelined, until nothing is claimable; returns the summed report. For tests
    /// and tools.
    ///
    /// Returns only when a claim made after every earlier batch's outcomes were recorded found
    /// nothing (so rows released or retried without backoff by its own batches are published
    /// too), or earlier on shutdown or when the broker refused the relay's credentials. Every
    /// batch it claimed has its outcomes recorded by then.
    ///
    /// # Errors
    /// A claim's store error, after the batches in flight are settled.
    pub async fn drain(&self) -> Result<BatchReport> {
        let (report, stop) = self.pipeline(Until::Idle, None).await;
        self.log_summary();
        match stop {
            Stop::Failed(e) => Err(e),
            _ => Ok(report),
        }
    }

    /// Run until [`Shutdown::trigger`]: batches pipelined back to back while there is work; when
    /// there is none, wait for the first of the store's wake-up signal ([`OutboxStore::wakeup`],
    /// if [`RelayConfig::wakeup`] is on and the store has one), `idle_poll` and shutdown. Claim
    /// errors are logged and retried after `idle_poll` (a signal does not cut that wait short,
    /// so a failing store is not hammered at the enqueue rate); so is a refusal of the relay's
    /// credentials by the broker.
    ///
    /// Never spins: every wait ends on a timer, on shutdown, or on a signal sent after the last
    /// claim started. On shutdown no new batch is claimed, publishes already started finish
    /// (the default [`Broker::publish_batch`] starts no further one; its unsent events are
    /// released), batches claimed but not yet handed to the broker are released, and every
    /// outcome is recorded before `run` returns.
    ///
    /// # Errors
    /// None today; the signature leaves room for fatal errors.
    pub async fn run(&self) -> Result<BatchReport> {
        // Subscribe before the first claim, so nothing enqueued after it goes unnoticed.
        let mut wakeup = if self.config.wakeup { self.store.wakeup() } else { None };
        while !self.shutdown.is_triggered() {
            let stop = self.pipeline(Until::Idle, wakeup.as_mut()).await.1;
            // The work ran out (or stops): the batches since the last summary line are reported
            // now, not with the next burst, however long the relay idles until then.
            self.log_summary();
            let idle = match stop {
                Stop::Shutdown => break,
                Stop::Idle => true,
                // Refused credentials: claiming again at once would hammer the broker (and may
                // lock the account); wait `idle_poll`, not cut short by a wake-up signal.
                Stop::Refused => false,
                Stop::Failed(e) => {
                    warn!(target: "outbox.relay", owner = %self.config.owner, error = %e, "claim failed");
                    false
                }
            };
            let signal = async {
                match wakeup.as_mut() {
                    Some(w) if idle => w.wait().await,
                    _ => std::future::pending().await,
                }
            };
            tokio::select! {
                () = tokio::time::sleep(self.config.idle_poll) => {}
                () = self.shutdown.wait() => {}
                () = signal => debug!(target: "outbox.relay", owner = %self.config.owner, "woken by the store"),
            }
        }
        Ok(self.totals())
    }

    /// The three stages, run at once in this task and connected by bounded queues. Two
    /// semaphores bound the batches (module docs, "Why the broker's slots hold only publishes"):
    /// `unpublished` from before the claim until the publish ends, `slots` from before the claim until
    /// the outcomes are recorded; the publish stage runs at most `pipeline_depth` publishes.
    ///
    /// Returns once every claimed batch is settled: the claim stage stops (idle, shutdown,
    /// refusal, error, or its one batch), the queues drain, the stages end in order.
    async fn pipeline(&self, until: Until, wakeup: Option<&mut Wakeup>) -> (BatchReport, Stop) {
        let depth = self.depth;
        let (unpublished, in_flight) = Self::bounds(depth);
        // On a store with one writer a batch is claimed ahead only while every place at the
        // broker is publishing (module docs, "One writer").
        let one_writer = depth > 1 && self.store.one_writer();
        let slots = Semaphore::new(in_flight);
        let unpublished = Semaphore::new(unpublished);
        let refused = AtomicBool::new(false);
        // Publishes running, and a signal whenever one starts or ends or a batch is settled.
        let at_broker = AtomicUsize::new(0);
        let moved = Notify::new();
        let (slots, unpublished, refused, at_broker, moved) = (&slots, &unpublished, &refused, &at_broker, &moved);
        let (to_publish, mut claimed) = mpsc::channel::<(Batch, SemaphorePermit<'_>, SemaphorePermit<'_>)>(in_flight);
        let (to_settle, mut decided) = mpsc::channel::<(Decided, SemaphorePermit<'_>)>(in_flight);

        let claim_stage = async move {
            let mut wakeup = wakeup;
            let mut batches = 0_usize;
            // What to wait for before the next claim (module docs, "After a short claim").
            let mut settle_first = Settle::Nothing;
            loop {
                if self.shutdown.is_triggered() {
                    return Stop::Shutdown;
                }
                if refused.load(Ordering::SeqCst) {
                    return Stop::Refused;
                }
                if until == Until::OneBatch && batches == 1 {
                    return Stop::Idle;
                }
                // Closed never: the semaphore lives as long as this future. No permit is held
                // here, so the slots free now are all the batches not in flight.
                match std::mem::replace(&mut settle_first, Settle::Nothing) {
                    Settle::Nothing => {}
                    Settle::One => {
                        let one_more = (slots.available_permits() + 1).min(in_flight);
                        drop(slots.acquire_many(one_more as u32).await);
                        continue;
                    }
                    Settle::All => {
                        drop(slots.acquire_many(in_flight as u32).await);
                        continue;
                    }
                }
                let Ok(slot) = slots.acquire().await else { return Stop::Idle };
                let Ok(early) = unpublished.acquire().await else { return Stop::Idle };
                if one_writer {
                    self.wait_for_a_busy_broker(depth, in_flight, slots, at_broker, moved).await;
                }
                // The wait for the permits may have been long: look at the flags again.
                if self.shutdown.is_triggered() {
                    return Stop::Shutdown;
                }
                if refused.load(Ordering::SeqCst) {
                    return Stop::Refused;
                }
                // Nothing else between claim and settled: a claim that finds nothing now means
                // the relay is idle.
                let alone = slots.available_permits() + 1 == in_flight;
                // Whatever was signalled so far is visible to the claim that follows.
                if let Some(w) = wakeup.as_deref_mut() {
                    w.mark_seen();
                }
                let started = Instant::now();
                let span = info_span!("outbox.relay.batch", owner = %self.config.owner);
                let limit = self.batch_limit();
                let claimed =
                    self.store.claim(&self.config.owner, limit, self.config.lease).instrument(span.clone()).await;
                self.meters.claim_seconds.record(started.elapsed());
                let rows = match claimed {
                    Ok(rows) => rows,
                    Err(e) => return Stop::Failed(e),
                };
                if rows.is_empty() {
                    if alone {
                        return Stop::Idle;
                    }
                    // Rows released or retried by the batches in flight may be due at once.
                    settle_first = Settle::All;
                    continue;
                }
                // A short batch: the backlog is drained, or the keys ahead are in flight, or a
                // claim beside this one took rows of its keys; a batch settled frees keys.
                if rows.len() < limit {
                    settle_first = Settle::One;
                }
                batches += 1;
                let n = rows.len() as u64;
                self.counters.claimed.fetch_add(n, Ordering::Relaxed);
                self.meters.claimed.increment(n);
                if to_publish.send((Batch { rows, span, started }, slot, early)).await.is_err() {
                    return Stop::Idle; // the publish stage is gone: cannot happen while joined
                }
            }
        };

        // Publishes of claimed batches run at once (up to `depth`; a batch claimed ahead waits in
        // the queue for a place, its `early` permit keeping the claim stage one batch ahead): the
        // batches in flight never share a key, so their messages may be in flight together.
        // Each batch's outcomes go to the completion stage as soon as its publish ends, so a slow
        // batch does not hold back the completions (and leases) of the ones claimed after it.
        let publish_stage = async move {
            use futures::StreamExt;
            let mut publishing = futures::stream::FuturesUnordered::new();
            let mut open = true;
            loop {
                tokio::select! {
                    biased;
                    Some((d, slot)) = publishing.next(), if !publishing.is_empty() => {
                        at_broker.fetch_sub(1, Ordering::SeqCst);
                        moved.notify_waiters();
                        if to_settle.send((d, slot)).await.is_err() {
                            break;
                        }
                    }
                    next = claimed.recv(), if open && publishing.len() < depth => match next {
                        Some((batch, slot, early)) => {
                            let span = batch.span.clone();
                            at_broker.fetch_add(1, Ordering::SeqCst);
                            moved.notify_waiters();
                            publishing.push(async move {
                                let d = self.publish(batch, refused).instrument(span).await;
                                drop(early);
                                (d, slot)
                            });
                        }
                        None => open = false,
                    },
                    else => break,
                }
            }
        };

        // Batches whose publish ended while the last completion ran are settled together: one
        // `complete_many` for all their accepted rows (module docs, "Why completions are
        // settled together").
        let settle_stage = async move {
            let mut total = BatchReport::default();
            // A batch taken from the queue that would have made the call too big: the next.
            let mut carried = None;
            loop {
                let first = match carried.take() {
                    Some(first) => first,
                    None => match decided.recv().await {
                        Some(first) => first,
                        None => break,
                    },
                };
                let mut rows = first.0.sent.len();
                let mut ready = vec![first];
                while let Ok(next) = decided.try_recv() {
                    if rows + next.0.sent.len() > ROWS_COMPLETED_TOGETHER {
                        carried = Some(next);
                        break;
                    }
                    rows += next.0.sent.len();
                    ready.push(next);
                }
                let (ds, slots): (Vec<_>, Vec<_>) = ready.into_iter().unzip();
                for report in self.settle(ds).await {
                    total.add(&report);
                }
                drop(slots);
                moved.notify_waiters();
            }
            total
        };

        let (stop, (), total) = tokio::join!(claim_stage, publish_stage, settle_stage);
        (total, stop)
    }

    /// Permits of the pipeline at `depth` batches at the broker: (claimed and not yet published,
    /// claimed and not yet settled). Depth 1 is the serial relay: one batch from claim to settled.
    fn bounds(depth: usize) -> (usize, usize) {
        match depth {
            0 | 1 => (1, 1),
            _ => (depth + 1, 2 * depth + 1),
        }
    }

    /// On a store with one writer, before a claim (the claim stage holds its permits): wait while
    /// `depth` or more other batches are between claim and outcome and a place at the broker is
    /// free, so that a batch is claimed ahead only while every place is publishing. Returns at
    /// once on shutdown (the caller looks at the flag). Never waits forever: each batch counted
    /// is waiting for a place, publishing, or waiting for or in its completion, and each publish
    /// that starts or ends and each batch settled signals `moved`.
    async fn wait_for_a_busy_broker(
        &self,
        depth: usize,
        in_flight: usize,
        slots: &Semaphore,
        at_broker: &AtomicUsize,
        moved: &Notify,
    ) {
        loop {
            let signal = moved.notified();
            tokio::pin!(signal);
            // Registered before the counts are read, so no change between the two is missed.
            signal.as_mut().enable();
            let others = in_flight.saturating_sub(slots.available_permits() + 1);
            if others < depth || at_broker.load(Ordering::SeqCst) >= depth || self.shutdown.is_triggered() {
                return;
            }
            tokio::select! {
                () = signal => {}
                () = self.shutdown.wait() => return,
            }
        }
    }

    /// The publish stage for one batch: hand the whole batch to [`Broker::publish_batch`] (rows
    /// in row-id order, as claimed), then walk the results per key.
    async fn publish(&self, batch: Batch, refused: &AtomicBool) -> Decided {
        let Batch { rows, span, started } = batch;
        let mut d = Decided::new(span.clone(), started, rows.len());
        let waited = started.elapsed();
        let hold = if self.shutdown.is_triggered() {
            Some("shutdown")
        } else if refused.load(Ordering::SeqCst) {
            Some("the broker refused the relay's credentials")
        } else if waited >= self.config.lease / 2 {
            warn!(
                target: "outbox.relay",
                owner = %self.config.owner,
                rows = rows.len(),
                ?waited,
                lease = ?self.config.lease,
                "a batch waited in the pipeline for half its lease or more; released unpublished \
                 (lower pipeline_depth or batch_size, or raise the lease)"
            );
            Some("lease")
        } else {
            None
        };
        if let Some(why) = hold {
            debug!(target: "outbox.relay", rows = rows.len(), why, "batch released unpublished");
            d.released.extend(rows.into_iter().map(|c| (c.record.row_id, c.lease)));
            return d;
        }

        let mut meta = Vec::with_capacity(rows.len());
        let mut events: Vec<Event> = Vec::with_capacity(rows.len());
        for c in rows {
            meta.push((c.record.row_id, c.lease, c.record.attempts));
            events.push(c.record.event);
        }
        let events = Arc::new(events);
        // One span per event, open while its publish is outstanding.
        let spans: Vec<Span> = events.iter().map(crate::telemetry::publish_span).collect();
        let t = Instant::now();
        let results = self.publish_on_a_task(events.clone()).await;
        self.meters.publish_seconds.record(t.elapsed());
        if results.len() != events.len() {
            error!(
                target: "outbox.relay",
                backend = self.broker.backend(),
                events = events.len(),
                results = results.len(),
                "publish_batch returned the wrong number of results; rows without one are released"
            );
        }

        // Keys whose first failure in this batch was seen: their later rows are released, even
        // when the broker accepted them, so the key is offered again in order after the failure.
        let mut stopped: HashSet<&str> = HashSet::new();
        let mut results = results.into_iter();
        for ((event, (row, lease, attempts)), span) in events.iter().zip(meta).zip(spans) {
            let result = results.next().unwrap_or_else(|| {
                Err(Error::transient(ErrorKind::Skipped, self.broker.backend(), "publish_batch returned no result"))
            });
            let key = event.key.as_deref();
            let outcome = if key.is_some_and(|k| stopped.contains(k)) {
                d.released.push((row, lease));
                "held"
            } else {
                match result {
                    Ok(()) => {
                        d.sent.push((row, lease));
                        "accepted"
                    }
                    Err(error) => {
                        if let Some(k) = key {
                            stopped.insert(k);
                        }
                        match error.kind() {
                            ErrorKind::Skipped => {
                                d.released.push((row, lease));
                                "skipped"
                            }
                            ErrorKind::Auth => {
                                refused.store(true, Ordering::SeqCst);
                                error!(target: "outbox.relay", row, error = %error, "the broker refused the relay's credentials; row released, not parked");
                                d.refused.push((row, lease));
                                "refused"
                            }
                            _ => {
                                d.failed.push(FailedRow { row, lease, attempts, event_id: event.id.clone(), error });
                                "failed"
                            }
                        }
                    }
                }
            };
            span.record("outcome", outcome);
        }
        d
    }

    /// [`Broker::publish_batch`] of `events` on a task of its own (module docs, "Why the broker's
    /// call runs on a task of its own"), in the batch's span and with [`stopping`] answering for
    /// this relay's shutdown. A panic in the broker is resumed here, as if it had been called
    /// in place; the task is aborted if this future is dropped before it ends.
    async fn publish_on_a_task(&self, events: Arc<Vec<Event>>) -> Vec<Result<()>> {
        let (broker, shutdown, n) = (self.broker.clone(), self.shutdown.clone(), events.len());
        let task = AbortOnDrop(tokio::spawn(
            async move { STOPPING.scope(shutdown, broker.publish_batch(&events)).await }.instrument(Span::current()),
        ));
        match task.join().await {
            Ok(results) => results,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Cancelled: the runtime is shutting down (`AbortOnDrop` aborts only once nothing
            // awaits the task). The rows are answered as not sent; their leases expire.
            Err(e) => {
                let error =
                    Error::transient(ErrorKind::Closed, self.broker.backend(), format!("publish task ended: {e}"));
                (0..n).map(|_| Err(error.clone())).collect()
            }
        }
    }

    /// The completion stage for the batches `ds` (one or more whose publishes have ended): one
    /// [`OutboxStore::complete_many`] for every accepted row of them all, then each batch's
    /// failures and releases, token-conditional, and a report per batch, in the order given.
    async fn settle(&self, ds: Vec<Decided>) -> Vec<BatchReport> {
        let mut reports: Vec<BatchReport> =
            ds.iter().map(|d| BatchReport { claimed: d.claimed, ..BatchReport::default() }).collect();
        // One batch (the usual case): its rows as they are, no copy of the leases.
        let merged: Vec<(RowId, Lease)>;
        let sent: &[(RowId, Lease)] = match ds.as_slice() {
            [d] => &d.sent,
            _ => {
                merged = ds.iter().flat_map(|d| d.sent.iter().cloned()).collect();
                &merged
            }
        };
        if !sent.is_empty() {
            // The completion runs in the span of the first batch it completes.
            let span = ds.iter().find(|d| !d.sent.is_empty()).map_or_else(Span::none, |d| d.span.clone());
            let t = Instant::now();
            let completed = self.store.complete_many(sent).instrument(span.clone()).await;
            self.meters.complete_seconds.record(t.elapsed());
            match completed {
                Ok(outcomes) => {
                    let mut outcomes = outcomes.into_iter();
                    for (d, report) in ds.iter().zip(&mut reports) {
                        let _entered = d.span.enter();
                        for (row, lease) in &d.sent {
                            // A store answering fewer entries than rows: the rest stay leased.
                            match outcomes.next() {
                                Some(Completion::Published) => report.published += 1,
                                Some(Completion::Fenced) => self.fenced(lease, *row, "complete", report),
                                None => {}
                            }
                        }
                    }
                }
                // The rows stay leased; after expiry they are offered again (duplicates, not loss).
                Err(e) => {
                    let _entered = span.enter();
                    warn!(target: "outbox.relay", rows = sent.len(), error = %e, "completion failed; rows will be offered again")
                }
            }
        }
        for (d, report) in ds.into_iter().zip(&mut reports) {
            let Decided { span, started, failed, refused, released, .. } = d;
            async {
                for f in failed {
                    self.on_failure(f, report).await;
                }
                // Refused credentials are not the row's fault: released without counting an
                // attempt, counted as refused; an operator fixes the credentials.
                for (rows, refused) in [(refused, true), (released, false)] {
                    for (row, lease) in rows {
                        match self.store.release(row, &lease).await {
                            Ok(Outcome::Applied) if refused => report.refused += 1,
                            Ok(Outcome::Applied) => report.released += 1,
                            Ok(Outcome::Fenced) => self.fenced(&lease, row, "release", report),
                            Err(e) => {
                                warn!(target: "outbox.relay", row, error = %e, "release failed; the lease will expire")
                            }
                        }
                    }
                }
            }
            .instrument(span)
            .await;
            self.record(report, started);
            self.adapt(report, started);
        }
        reports
    }

    /// Size the next claims after a settled batch (module docs, "Why the batch shrinks"):
    /// halve after a fenced transition, grow by a tenth of `batch_size` after a full batch that
    /// settled within half the lease.
    fn adapt(&self, report: &BatchReport, started: Instant) {
        let max = self.config.batch_size.max(1);
        let claimed = usize::try_from(report.claimed).unwrap_or(usize::MAX);
        let now = self.limit.load(Ordering::Relaxed);
        let next = if report.fenced > 0 {
            // Half of the batch that outlasted its lease; a batch claimed before an earlier
            // shrink does not shrink the limit twice for the same stall.
            (claimed / 2).max(1).min(now)
        } else if claimed >= now && now < max && started.elapsed() < self.config.lease / 2 {
            (now + (max / 10).max(1)).min(max)
        } else {
            return;
        };
        // Batches in flight settle one at a time in this stage, so nothing races this store.
        self.limit.store(next, Ordering::Relaxed);
        self.meters.batch_limit.set(next as f64);
        if next < now {
            warn!(
                target: "outbox.relay",
                owner = %self.config.owner,
                claimed,
                fenced = report.fenced,
                lease = ?self.config.lease,
                batch_limit = next,
                "a batch outlasted its lease (another relay re-claimed its rows before their outcomes were \
                 recorded); claiming fewer rows per batch until batches settle within half the lease \
                 (raise the lease or lower batch_size if this repeats)"
            );
        } else if report.fenced > 0 && claimed == 1 {
            warn!(
                target: "outbox.relay",
                owner = %self.config.owner,
                lease = ?self.config.lease,
                "a one-row batch outlasted its lease: no smaller batch can help; raise the lease"
            );
        }
    }

    /// Add a settled batch to the totals, the metrics and the log.
    fn record(&self, report: &BatchReport, started: Instant) {
        let (c, m) = (&self.counters, &self.meters);
        for (total, meter, n) in [
            (&c.published, &m.published, report.published),
            (&c.fenced, &m.fenced, report.fenced),
            (&c.retried, &m.retried, report.retried),
            (&c.parked, &m.parked, report.parked),
            (&c.released, &m.released, report.released),
            (&c.refused, &m.refused, report.refused),
        ] {
            total.fetch_add(n, Ordering::Relaxed);
            meter.increment(n);
        }
        let now = Instant::now();
        m.batch_seconds.record(now.saturating_duration_since(started));
        debug!(
            target: "outbox.relay",
            owner = %self.config.owner,
            claimed = report.claimed,
            published = report.published,
            fenced = report.fenced,
            retried = report.retried,
            parked = report.parked,
            released = report.released,
            refused = report.refused,
            "batch done"
        );
        let due = self.summary.lock().unwrap_or_else(PoisonError::into_inner).add(report, now, LOG_SUMMARY_EVERY);
        if let Some(line) = due {
            self.summary_line(line);
        }
    }

    /// Log the batches settled since the last summary line, if any.
    fn log_summary(&self) {
        let line = self.summary.lock().unwrap_or_else(PoisonError::into_inner).take(Instant::now());
        if let Some(line) = line {
            self.summary_line(line);
        }
    }

    fn summary_line(&self, (batches, r, over): (u64, BatchReport, Duration)) {
        tracing::info!(
            target: "outbox.relay",
            owner = %self.config.owner,
            batches,
            claimed = r.claimed,
            published = r.published,
            fenced = r.fenced,
            retried = r.retried,
            parked = r.parked,
            released = r.released,
            refused = r.refused,
            over = ?over,
            "relayed"
        );
    }

    async fn on_failure(&self, f: FailedRow, report: &mut BatchReport) {
        let FailedRow { row, lease, attempts: before, event_id, error: e } = f;
        let attempts = before + 1;
        let park = e.retry() == Retry::Permanent || attempts >= self.config.max_attempts;
        if park {
            let reason = format!("attempt {attempts}: {e}");
            match self.store.park(row, &lease, &reason).await {
                Ok(Outcome::Applied) => {
                    warn!(target: "outbox.relay", row, event_id = %event_id, attempts, error = %e, "parked");
                    report.parked += 1;
                }
                Ok(Outcome::Fenced) => self.fenced(&lease, row, "park", report),
                Err(se) => warn!(target: "outbox.relay", row, error = %se, "park failed; the lease will expire"),
            }
        } else {
            let unit = self.rng.lock().map(|mut r| r.next_f64()).unwrap_or(0.5);
            let delay = self.config.backoff.delay(before, unit);
            match self.store.fail(row, &lease, delay, &e.to_string()).await {
                Ok(Outcome::Applied) => {
                    debug!(target: "outbox.relay", row, attempts, ?delay, retry = ?e.retry(), error = %e, "publish failed; will retry");
                    report.retried += 1;
                }
                Ok(Outcome::Fenced) => self.fenced(&lease, row, "fail", report),
                Err(se) => {
                    warn!(target: "outbox.relay", row, error = %se, "recording the failure failed; the lease will expire")
                }
            }
        }
    }

    fn fenced(&self, lease: &Lease, row: RowId, op: &str, report: &mut BatchReport) {
        report.fenced += 1;
        // The relay holds only the relay side of the store; `outbox inspect` shows the row's
        // current token and status.
        warn!(
            target: "outbox.relay",
            row,
            op,
            owner = %lease.owner,
            our_token = lease.token,
            "fenced: this lease is stale; the row was re-claimed or finished by another relay"
        );
    }
}

tokio::task_local! {
    /// The shutdown of the relay whose publish stage is polling the current
    /// [`Broker::publish_batch`].
    static STOPPING: Shutdown;
}

/// Whether the relay that called the current [`Broker::publish_batch`] is shutting down
/// (`false` outside a relay's publish): the default `publish_batch` then starts no further
/// publish, so a shutdown stops a batch between two publishes, not only between batches.
pub(crate) fn stopping() -> bool {
    STOPPING.try_with(Shutdown::is_triggered).unwrap_or(false)
}

/// Metric names (the crate README's "Metrics" table).
const CLAIMED: &str = "outbox_relay_claimed_total";
const PUBLISHED: &str = "outbox_relay_published_total";
const FENCED: &str = "outbox_relay_fenced_total";
const RETRIED: &str = "outbox_relay_retried_total";
const PARKED: &str = "outbox_relay_parked_total";
const RELEASED: &str = "outbox_relay_released_total";
const REFUSED: &str = "outbox_relay_refused_total";
const CLAIM_SECONDS: &str = "outbox_relay_claim_seconds";
const PUBLISH_SECONDS: &str = "outbox_relay_publish_seconds";
const COMPLETE_SECONDS: &str = "outbox_relay_complete_seconds";
const BATCH_SECONDS: &str = "outbox_relay_batch_seconds";
const BATCH_LIMIT: &str = "outbox_relay_batch_limit";
/// The label every relay metric carries: [`RelayConfig::owner`].
const OWNER: &str = "owner";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_counts_batches_until_its_interval_has_passed_then_starts_again() {
        let t0 = Instant::now();
        let every = Duration::from_secs(10);
        let batch =
            |published| BatchReport { claimed: 100, published, fenced: 100 - published, ..BatchReport::default() };
        let mut s = Summary::new(t0);
        assert_eq!(s.take(t0 + every), None, "no batch, no line");
        assert_eq!(s.add(&batch(100), t0 + Duration::from_secs(1), every), None);
        assert_eq!(s.add(&batch(90), t0 + Duration::from_secs(9), every), None);
        let (batches, r, over) = s.add(&batch(80), t0 + every, every).expect("the interval has passed");
        assert_eq!((batches, r.claimed, r.published, r.fenced, over), (3, 300, 270, 30, every));
        // Counting starts again from that line.
        assert_eq!(s.add(&batch(100), t0 + every + Duration::from_secs(9), every), None);
        let (batches, r, over) = s.take(t0 + every + Duration::from_secs(9)).expect("one batch pending");
        assert_eq!((batches, r.published, over), (1, 100, Duration::from_secs(9)));
        assert_eq!(s.take(t0 + every * 5), None, "taken once");
        // A batch after a long idle spell is reported at once.
        let (batches, _, over) = s.add(&batch(100), t0 + every * 100, every).expect("long past the interval");
        assert_eq!((batches, over), (1, every * 100 - (every + Duration::from_secs(9))));
    }

    #[test]
    fn backoff_grows_and_caps() {
        let b = Backoff { initial: Duration::from_secs(1), max: Duration::from_secs(10), multiplier: 2.0, jitter: 0.0 };
        assert_eq!(b.delay(0, 0.5), Duration::from_secs(1));
        assert_eq!(b.delay(1, 0.5), Duration::from_secs(2));
        assert_eq!(b.delay(3, 0.5), Duration::from_secs(8));
        assert_eq!(b.delay(9, 0.5), Duration::from_secs(10));
        let j = Backoff { jitter: 0.5, ..b };
        assert_eq!(j.delay(0, 0.0), Duration::from_millis(500));
        assert_eq!(j.delay(0, 0.999_999).as_millis(), 1499);
    }
}
