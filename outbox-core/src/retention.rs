//! Retention: published rows and inbox markers are history, and history kept forever makes
//! tables, indexes and vacuums grow without bound.
//!
//! Deleting history is safe only within limits, so [`Cleanup`] is careful in three ways:
//!
//! - it deletes published rows only, through [`OutboxAdmin::purge_published`], which never
//!   touches a pending, leased or parked row;
//! - it deletes in bounded batches of one short transaction each and pauses between them, so a
//!   relay's claims and completions never wait long behind it;
//! - it prunes inbox markers only with a [`MarkerPruning`], which refuses to exist for a
//!   retention shorter than the redelivery horizon: a marker is what makes a redelivery
//!   harmless, and deleting it before the last possible redelivery reopens the effect (the
//!   design's retention rule; `outbox_consumer_inbox::Retention` computes the horizon from the
//!   broker's redelivery interval and the dead-letter queue's retention).
//!
//! A purged row's event id is forgotten with it: the outbox rejects a duplicate event id only
//! while the first row is stored, so the published-row retention is also how long the outbox
//! itself refuses an id twice.

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::error::{Error, Result, Retry};
use crate::inbox::InboxAdmin;
use crate::relay::Shutdown;
use crate::store::OutboxAdmin;

const WHO: &str = "retention";

/// Settings of a [`Cleanup`].
///
/// `#[non_exhaustive]`: build it with [`CleanupConfig::new`] and the `with_*` setters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CleanupConfig {
    /// Published rows are deleted once they were published this long ago (store clock).
    pub published_after: Duration,
    /// Rows deleted per transaction.
    pub batch: usize,
    /// Time between two rounds of [`Cleanup::run`].
    pub interval: Duration,
    /// Pause between two batches of one round, so the cleanup never holds the database for
    /// long.
    pub pause: Duration,
    /// Batches per round at most; the rest waits for the next round (a round always ends,
    /// however fast rows are published).
    pub max_batches: usize,
}

impl CleanupConfig {
    /// Delete rows published more than `published_after` ago: batches of 1000, a round every
    /// minute, 50 ms between batches, at most 1000 batches per round.
    pub fn new(published_after: Duration) -> Self {
        Self {
            published_after,
            batch: 1000,
            interval: Duration::from_secs(60),
            pause: Duration::from_millis(50),
            max_batches: 1000,
        }
    }

    /// Set [`batch`](Self::batch).
    #[must_use]
    pub fn with_batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    /// Set [`interval`](Self::interval).
    #[must_use]
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Set [`pause`](Self::pause).
    #[must_use]
    pub fn with_pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// Set [`max_batches`](Self::max_batches).
    #[must_use]
    pub fn with_max_batches(mut self, max_batches: usize) -> Self {
        self.max_batches = max_batches;
        self
    }

    /// Check the settings.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) for a zero retention, batch, interval or
    /// batch count, naming the setting.
    pub fn validate(&self) -> Result<()> {
        if self.published_after.is_zero() {
            return Err(Error::config(
                WHO,
                "published-row retention must be longer than zero: a zero retention would delete rows the moment \
                 they are published (give e.g. 7d)",
            ));
        }
        if self.batch == 0 {
            return Err(Error::config(WHO, "cleanup batch must be at least 1 row"));
        }
        if self.interval.is_zero() {
            return Err(Error::config(WHO, "cleanup interval must be longer than zero"));
        }
        if self.max_batches == 0 {
            return Err(Error::config(WHO, "cleanup max_batches must be at least 1"));
        }
        Ok(())
    }
}

/// Marker pruning for one consumer, checked against its redelivery horizon.
///
/// Build it from the consumer's checked retention
/// (`outbox_consumer_inbox::Retention`: `MarkerPruning::new(inbox, name, r.markers(),
/// r.horizon())`); the check is repeated here, so an unsafe pair is refused whichever way it
/// was built.
#[derive(Clone)]
pub struct MarkerPruning {
    inbox: Arc<dyn InboxAdmin>,
    consumer: String,
    keep: Duration,
    horizon: Duration,
}

impl std::fmt::Debug for MarkerPruning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MarkerPruning")
            .field("backend", &self.inbox.backend())
            .field("consumer", &self.consumer)
            .field("keep", &self.keep)
            .field("horizon", &self.horizon)
            .finish()
    }
}

impl MarkerPruning {
    /// Prune `consumer`'s markers older than `keep`, where `horizon` is the longest time after
    /// a first delivery that the message may be delivered again (redelivery interval plus
    /// dead-letter retention).
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) when `keep` is zero, when `keep` is
    /// shorter than `horizon` (the message names both), or for an empty consumer name.
    pub fn new(
        inbox: Arc<dyn InboxAdmin>,
        consumer: impl Into<String>,
        keep: Duration,
        horizon: Duration,
    ) -> Result<Self> {
        let consumer = consumer.into();
        if consumer.is_empty() {
            return Err(Error::config(WHO, "marker pruning needs a consumer name"));
        }
        if keep.is_zero() {
            return Err(Error::config(
                WHO,
                format!("marker retention of consumer {consumer:?} must be longer than zero"),
            ));
        }
        if keep < horizon {
            return Err(Error::config(
                WHO,
                format!(
                    "unsafe marker retention for consumer {consumer:?}: markers kept {keep:?} but a message can be \
                     redelivered up to {horizon:?} after its first delivery; deleting markers earlier would let a \
                     redelivery apply its effect again"
                ),
            ));
        }
        Ok(Self { inbox, consumer, keep, horizon })
    }

    /// The consumer whose markers are pruned.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// How long markers are kept.
    pub fn keep(&self) -> Duration {
        self.keep
    }

    /// The redelivery horizon `keep` was checked against.
    pub fn horizon(&self) -> Duration {
        self.horizon
    }
}

/// What one round of a [`Cleanup`] did (or all rounds, from [`Cleanup::run`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CleanupReport {
    /// Published rows deleted.
    pub published_deleted: u64,
    /// Purge transactions run.
    pub batches: u64,
    /// Inbox markers deleted.
    pub markers_deleted: u64,
    /// Rounds that stopped at [`CleanupConfig::max_batches`] with old rows possibly left.
    pub capped: u64,
}

impl CleanupReport {
    fn add(&mut self, other: &CleanupReport) {
        self.published_deleted += other.published_deleted;
        self.batches += other.batches;
        self.markers_deleted += other.markers_deleted;
        self.capped += other.capped;
    }
}

/// Deletes old published rows (and, if asked, old inbox markers) in bounded batches: the
/// retention task a relay process runs beside its relay, and what `outbox cleanup` runs once.
pub struct Cleanup {
    store: Arc<dyn OutboxAdmin>,
    config: CleanupConfig,
    markers: Vec<MarkerPruning>,
}

impl std::fmt::Debug for Cleanup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cleanup")
            .field("backend", &self.store.backend())
            .field("config", &self.config)
            .field("markers", &self.markers)
            .finish()
    }
}

impl Cleanup {
    /// A cleanup of `store` with `config`.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) when `config` is invalid
    /// ([`CleanupConfig::validate`]).
    pub fn new(store: Arc<dyn OutboxAdmin>, config: CleanupConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { store, config, markers: Vec::new() })
    }

    /// Also prune markers as `pruning` allows, after the rows of each round.
    #[must_use]
    pub fn with_markers(mut self, pruning: MarkerPruning) -> Self {
        self.markers.push(pruning);
        self
    }

    /// The settings.
    pub fn config(&self) -> &CleanupConfig {
        &self.config
    }

    /// One round: purge batches of [`batch`](CleanupConfig::batch) rows until one deletes fewer
    /// than that (or [`max_batches`](CleanupConfig::max_batches) ran), pausing
    /// [`pause`](CleanupConfig::pause) between them; then prune each consumer's markers.
    ///
    /// # Errors
    /// The store's or inbox's error; rows deleted by earlier batches stay deleted.
    pub async fn run_once(&self) -> Result<CleanupReport> {
        self.round(None).await
    }

    async fn round(&self, shutdown: Option<&Shutdown>) -> Result<CleanupReport> {
        let c = &self.config;
        let mut report = CleanupReport::default();
        loop {
            let n = self.store.purge_published(c.published_after, c.batch).await?;
            report.batches += 1;
            report.published_deleted += n;
            if n < c.batch as u64 {
                break;
            }
            if report.batches >= c.max_batches as u64 {
                report.capped += 1;
                break;
            }
            if wait(c.pause, shutdown).await {
                return Ok(report);
            }
        }
        for m in &self.markers {
            report.markers_deleted += m.inbox.prune_markers(&m.consumer, m.keep).await?;
        }
        debug!(
            target: "outbox.retention",
            backend = self.store.backend(),
            published_deleted = report.published_deleted,
            batches = report.batches,
            markers_deleted = report.markers_deleted,
            "cleanup round"
        );
        Ok(report)
    }

    /// Run rounds every [`interval`](CleanupConfig::interval) until `shutdown` is triggered
    /// (the first round at once); returns the totals.
    ///
    /// A transient or outcome-unknown error is logged and the round tried again at the next
    /// interval (a lost connection must not stop retention for good).
    ///
    /// # Errors
    /// A permanent error (the store does not implement retention, refused credentials, a
    /// configuration error): retrying cannot help, so the task stops and says why.
    pub async fn run(&self, shutdown: Shutdown) -> Result<CleanupReport> {
        let mut total = CleanupReport::default();
        while !shutdown.is_triggered() {
            match self.round(Some(&shutdown)).await {
                Ok(r) => {
                    if r.published_deleted > 0 || r.markers_deleted > 0 {
                        info!(
                            target: "outbox.retention",
                            backend = self.store.backend(),
                            published_deleted = r.published_deleted,
                            markers_deleted = r.markers_deleted,
                            batches = r.batches,
                            "cleanup round"
                        );
                    }
                    total.add(&r);
                }
                Err(e) if e.retry() == Retry::Permanent => return Err(e),
                Err(e) => warn!(target: "outbox.retention", error = %e, "cleanup round failed; trying again later"),
            }
            if wait(self.config.interval, Some(&shutdown)).await {
                break;
            }
        }
        Ok(total)
    }
}

/// Sleep `d`, ending early on shutdown; `true` when shutdown was triggered.
async fn wait(d: Duration, shutdown: Option<&Shutdown>) -> bool {
    let Some(shutdown) = shutdown else {
        tokio::time::sleep(d).await;
        return false;
    };
    tokio::select! {
        () = shutdown.wait() => true,
        () = tokio::time::sleep(d) => shutdown.is_triggered(),
    }
}
