//! What an operator watches: one counter per outcome, one latency histogram, one span per
//! delivery.
//!
//! Outcomes are counted where a delivery ends (its acknowledgement), so that every delivery is
//! counted exactly once and a counter never runs ahead of durable state: `applied` moves only
//! after the commit and the acknowledgement. Metrics go through the `metrics` facade. Their
//! handles are registered once, when the consumer is built (with the recorder installed by
//! then), so a delivery pays an increment, not a label allocation and a registry lookup.

use std::sync::Once;
use std::time::Duration;

use metrics::{Counter, Histogram};
use outbox_core::Result;

use crate::runtime::Handled;

pub(crate) const APPLIED: &str = "outbox_consumer_applied_total";
pub(crate) const DUPLICATE: &str = "outbox_consumer_duplicate_total";
pub(crate) const STALE: &str = "outbox_consumer_stale_total";
pub(crate) const CONFLICT: &str = "outbox_consumer_conflict_total";
pub(crate) const DEAD_LETTERED: &str = "outbox_consumer_dead_lettered_total";
pub(crate) const MALFORMED: &str = "outbox_consumer_malformed_total";
pub(crate) const FAILED: &str = "outbox_consumer_failed_total";
pub(crate) const HANDLE_SECONDS: &str = "outbox_consumer_handle_seconds";

/// Describe the metrics to the installed recorder (once per process).
fn describe() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        use metrics::{Unit, describe_counter, describe_histogram};
        describe_counter!(APPLIED, Unit::Count, "Deliveries whose effect committed, then acknowledged");
        describe_counter!(
            DUPLICATE,
            Unit::Count,
            "Deliveries seen before with the same content: nothing applied, acknowledged"
        );
        describe_counter!(
            STALE,
            Unit::Count,
            "Projection events older than the stored version: nothing applied, acknowledged"
        );
        describe_counter!(
            CONFLICT,
            Unit::Count,
            "Same event id, different content: nothing applied, dead-lettered, acknowledged"
        );
        describe_counter!(
            DEAD_LETTERED,
            Unit::Count,
            "Handler failed max_attempts times, or a notification with an unknown outcome: dead-lettered, acknowledged"
        );
        describe_counter!(
            MALFORMED,
            Unit::Count,
            "Messages that are not outbox events: recorded as malformed dead letters, acknowledged"
        );
        describe_counter!(
            FAILED,
            Unit::Count,
            "Deliveries not done (handler or store error, failed acknowledgement): they come back"
        );
        describe_histogram!(
            HANDLE_SECONDS,
            Unit::Seconds,
            "Time from the start of handling a delivery to its (negative) acknowledgement"
        );
    });
}

/// One consumer's metric handles, labelled with its name.
pub(crate) struct Metrics {
    applied: Counter,
    duplicate: Counter,
    stale: Counter,
    conflict: Counter,
    dead_lettered: Counter,
    malformed: Counter,
    failed: Counter,
    handle_seconds: Histogram,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Describe the metrics (once per process) and register `consumer`'s handles with the
    /// recorder installed now.
    pub(crate) fn new(consumer: &str) -> Self {
        describe();
        let labels = [("consumer", consumer.to_owned())];
        Self {
            applied: metrics::counter!(APPLIED, &labels),
            duplicate: metrics::counter!(DUPLICATE, &labels),
            stale: metrics::counter!(STALE, &labels),
            conflict: metrics::counter!(CONFLICT, &labels),
            dead_lettered: metrics::counter!(DEAD_LETTERED, &labels),
            malformed: metrics::counter!(MALFORMED, &labels),
            failed: metrics::counter!(FAILED, &labels),
            handle_seconds: metrics::histogram!(HANDLE_SECONDS, &labels),
        }
    }

    /// Count how one delivery ended and how long it took.
    pub(crate) fn record(&self, outcome: &Result<Handled>, elapsed: Duration) {
        let counter = match outcome {
            Ok(Handled::Applied) => &self.applied,
            Ok(Handled::Duplicate) => &self.duplicate,
            Ok(Handled::Stale { .. }) => &self.stale,
            Ok(Handled::Conflict) => &self.conflict,
            Ok(Handled::Uncertain | Handled::DeadLettered { .. }) => &self.dead_lettered,
            Ok(Handled::Malformed { .. }) => &self.malformed,
            Ok(Handled::Retry { .. }) | Err(_) => &self.failed,
        };
        counter.increment(1);
        self.handle_seconds.record(elapsed.as_secs_f64());
    }
}
