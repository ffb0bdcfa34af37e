//! The relay: claim a batch of rows, publish them, record the outcome.
//!
//! The relay knows a store and a broker only through their traits and branches only on
//! [`Retry`]: transient → back off and try again, permanent → park, outcome unknown → treat as
//! not published (it will be offered again; duplicates are the consumer's job). A fenced
//! completion means another relay re-claimed the row after this relay's lease expired; it is
//! counted and logged, never treated as success.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;
use tracing::{Instrument, debug, error, info_span, warn};

use crate::broker::Broker;
use crate::error::{Error, ErrorKind, Result, Retry};
use crate::rng::SplitMix64;
use crate::store::{Claimed, Completion, Lease, OutboxStore, Outcome, RowId};

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

/// How a relay behaves. `Default` gives production values.
///
/// `#[non_exhaustive]`: build it with [`RelayConfig::new`] (or `default`) and the `with_*`
/// setters; the fields stay readable and assignable, so a new setting is not a breaking change.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// Lease owner name; must be unique among live relays.
    pub owner: String,
    /// Rows claimed per batch.
    pub batch_size: usize,
    /// Lease length per claim.
    pub lease: Duration,
    /// Publishes in flight at once (different keys; one key is always sequential).
    pub concurrency: usize,
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
    fn default() -> Self {
        Self {
            owner: format!("relay-{}", std::process::id()),
            batch_size: 100,
            lease: Duration::from_secs(30),
            concurrency: 16,
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

    /// Set [`concurrency`](Self::concurrency).
    #[must_use]
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
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

/// Stops a relay gracefully: no new claims, in-flight publishes finish, unpublished rows of the
/// current batch are released.
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

    async fn wait(&self) {
        let notified = self.0.1.notified();
        if self.is_triggered() {
            return;
        }
        notified.await;
    }
}

/// Moves rows from an [`OutboxStore`] to a [`Broker`].
pub struct Relay {
    store: Arc<dyn OutboxStore>,
    broker: Arc<dyn Broker>,
    config: RelayConfig,
    counters: Counters,
    rng: Mutex<SplitMix64>,
    shutdown: Shutdown,
}

enum RowResult {
    Sent(RowId, Lease),
    Failed(Claimed, Error),
    Released(Claimed),
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
        Self {
            store,
            broker,
            config,
            counters: Counters::default(),
            rng: Mutex::new(SplitMix64::new(seed)),
            shutdown: Shutdown::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// A handle that stops [`run`](Relay::run) gracefully.
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shutdown.clone()
    }

    /// Totals since the relay was built.
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

    /// Claim one batch, publish it, record the outcomes.
    ///
    /// Returns an empty report when nothing was claimable or shutdown was triggered.
    ///
    /// # Errors
    /// Store errors while claiming. Errors after the claim are handled per row (retry, park,
    /// or leave the lease to expire) and show in the report and the logs.
    pub async fn run_once(&self) -> Result<BatchReport> {
        if self.shutdown.is_triggered() {
            return Ok(BatchReport::default());
        }
        let span = info_span!("outbox.relay.batch", owner = %self.config.owner);
        let report = self.batch().instrument(span).await?;
        let c = &self.counters;
        c.claimed.fetch_add(report.claimed, Ordering::Relaxed);
        c.published.fetch_add(report.published, Ordering::Relaxed);
        c.fenced.fetch_add(report.fenced, Ordering::Relaxed);
        c.retried.fetch_add(report.retried, Ordering::Relaxed);
        c.parked.fetch_add(report.parked, Ordering::Relaxed);
        c.released.fetch_add(report.released, Ordering::Relaxed);
        c.refused.fetch_add(report.refused, Ordering::Relaxed);
        if report.claimed > 0 {
            tracing::info!(
                target: "outbox.relay",
                owner = %self.config.owner,
                claimed = report.claimed,
                published = report.published,
                fenced = report.fenced,
                retried = report.retried,
                parked = report.parked,
                released = report.released,
                "batch done"
            );
        }
        Ok(report)
    }

    /// Run batches until nothing is claimable; returns the summed report. For tests and tools.
    ///
    /// # Errors
    /// As [`run_once`](Relay::run_once).
    pub async fn drain(&self) -> Result<BatchReport> {
        let mut total = BatchReport::default();
        loop {
            let r = self.run_once().await?;
            total.add(&r);
            if r.claimed == 0 {
                return Ok(total);
            }
        }
    }

    /// Run until [`Shutdown::trigger`]: batches back to back while there is work; when there is
    /// none, wait for the first of the store's wake-up signal ([`OutboxStore::wakeup`], if
    /// [`RelayConfig::wakeup`] is on and the store has one), `idle_poll` and shutdown. Claim
    /// errors are logged and retried after `idle_poll` (a signal does not cut that wait short,
    /// so a failing store is not hammered at the enqueue rate).
    ///
    /// Never spins: every wait ends on a timer, on shutdown, or on a signal sent after the last
    /// claim started.
    ///
    /// # Errors
    /// None today; the signature leaves room for fatal errors.
    pub async fn run(&self) -> Result<BatchReport> {
        // Subscribe before the first claim, so nothing enqueued after it goes unnoticed.
        let mut wakeup = if self.config.wakeup { self.store.wakeup() } else { None };
        while !self.shutdown.is_triggered() {
            // Whatever was signalled so far is visible to the claim that follows.
            if let Some(w) = wakeup.as_mut() {
                w.mark_seen();
            }
            let idle = match self.run_once().await {
                // Refused credentials: claiming again at once would hammer the broker (and may
                // lock the account); wait `idle_poll`, not cut short by a wake-up signal.
                Ok(r) if r.refused > 0 => false,
                Ok(r) if r.claimed > 0 => continue,
                Ok(_) => true,
                Err(e) => {
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

    async fn batch(&self) -> Result<BatchReport> {
        let claimed = self.store.claim(&self.config.owner, self.config.batch_size, self.config.lease).await?;
        let mut report = BatchReport { claimed: claimed.len() as u64, ..BatchReport::default() };
        if claimed.is_empty() {
            return Ok(report);
        }
        // One sequential lane per key, in row order; rows without a key are lanes of their own.
        let mut lanes: BTreeMap<(bool, String, RowId), Vec<Claimed>> = BTreeMap::new();
        let mut by_key: BTreeMap<String, (bool, String, RowId)> = BTreeMap::new();
        for c in claimed {
            let lane = match &c.record.event.key {
                Some(k) => by_key.entry(k.clone()).or_insert_with(|| (true, k.clone(), c.record.row_id)).clone(),
                None => (false, String::new(), c.record.row_id),
            };
            lanes.entry(lane).or_default().push(c);
        }
        let results: Vec<Vec<RowResult>> =
            futures::stream::iter(lanes.into_values().map(|lane| self.publish_lane(lane)))
                .buffer_unordered(self.config.concurrency.max(1))
                .collect()
                .await;

        let mut sent = Vec::new();
        for r in results.into_iter().flatten() {
            match r {
                RowResult::Sent(row, lease) => sent.push((row, lease)),
                RowResult::Failed(c, e) => self.on_failure(c, &e, &mut report).await,
                RowResult::Released(c) => match self.store.release(c.record.row_id, &c.lease).await {
                    Ok(Outcome::Applied) => report.released += 1,
                    Ok(Outcome::Fenced) => self.fenced(&c.lease, c.record.row_id, "release", &mut report).await,
                    Err(e) => {
                        warn!(target: "outbox.relay", row = c.record.row_id, error = %e, "release failed; the lease will expire")
                    }
                },
            }
        }
        if !sent.is_empty() {
            match self.store.complete_many(&sent).await {
                Ok(outcomes) => {
                    for ((row, lease), outcome) in sent.iter().zip(outcomes) {
                        match outcome {
                            Completion::Published => report.published += 1,
                            Completion::Fenced => self.fenced(lease, *row, "complete", &mut report).await,
                        }
                    }
                }
                // The rows stay leased; after expiry they are offered again (duplicates, not loss).
                Err(e) => {
                    warn!(target: "outbox.relay", rows = sent.len(), error = %e, "completion failed; rows will be offered again")
                }
            }
        }
        Ok(report)
    }

    async fn publish_lane(&self, lane: Vec<Claimed>) -> Vec<RowResult> {
        let mut out = Vec::with_capacity(lane.len());
        let mut rows = lane.into_iter();
        while let Some(c) = rows.next() {
            if self.shutdown.is_triggered() {
                out.push(RowResult::Released(c));
                continue;
            }
            match self.broker.publish(&c.record.event).await {
                Ok(()) => {
                    debug!(target: "outbox.relay", row = c.record.row_id, event_id = %c.record.event.id, token = c.lease.token, "published");
                    out.push(RowResult::Sent(c.record.row_id, c.lease));
                }
                Err(e) => {
                    out.push(RowResult::Failed(c, e));
                    // Keep the key's order: later rows of this key wait for the failed one.
                    out.extend(rows.by_ref().map(RowResult::Released));
                }
            }
        }
        out
    }

    async fn on_failure(&self, c: Claimed, e: &Error, report: &mut BatchReport) {
        let row = c.record.row_id;
        if e.kind() == ErrorKind::Auth {
            // The broker refused our credentials: no row can be published and none is at fault.
            // Release without counting an attempt; an operator fixes the credentials.
            error!(target: "outbox.relay", row, error = %e, "the broker refused the relay's credentials; row released, not parked");
            match self.store.release(row, &c.lease).await {
                Ok(Outcome::Applied) => report.refused += 1,
                Ok(Outcome::Fenced) => self.fenced(&c.lease, row, "release", report).await,
                Err(se) => warn!(target: "outbox.relay", row, error = %se, "release failed; the lease will expire"),
            }
            return;
        }
        let attempts = c.record.attempts + 1;
        let park = e.retry() == Retry::Permanent || attempts >= self.config.max_attempts;
        if park {
            let reason = format!("attempt {attempts}: {e}");
            match self.store.park(row, &c.lease, &reason).await {
                Ok(Outcome::Applied) => {
                    warn!(target: "outbox.relay", row, event_id = %c.record.event.id, attempts, error = %e, "parked");
                    report.parked += 1;
                }
                Ok(Outcome::Fenced) => self.fenced(&c.lease, row, "park", report).await,
                Err(se) => warn!(target: "outbox.relay", row, error = %se, "park failed; the lease will expire"),
            }
        } else {
            let unit = self.rng.lock().map(|mut r| r.next_f64()).unwrap_or(0.5);
            let delay = self.config.backoff.delay(c.record.attempts, unit);
            match self.store.fail(row, &c.lease, delay, &e.to_string()).await {
                Ok(Outcome::Applied) => {
                    debug!(target: "outbox.relay", row, attempts, ?delay, retry = ?e.retry(), error = %e, "publish failed; will retry");
                    report.retried += 1;
                }
                Ok(Outcome::Fenced) => self.fenced(&c.lease, row, "fail", report).await,
                Err(se) => {
                    warn!(target: "outbox.relay", row, error = %se, "recording the failure failed; the lease will expire")
                }
            }
        }
    }

    async fn fenced(&self, lease: &Lease, row: RowId, op: &str, report: &mut BatchReport) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
