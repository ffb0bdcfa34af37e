//! What an operator watches: one counter per outcome, one latency histogram, one span per
//! delivery.
//!
//! Outcomes are counted where a delivery ends (its acknowledgement), so that every delivery is
//! counted exactly once and a counter never runs ahead of durable state: `applied` moves only
//! after the commit and the acknowledgement. Metrics go through the `metrics` facade; without
//! an installed recorder they cost a lookup and nothing else.

use std::sync::Once;
use std::time::Duration;

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
pub(crate) fn describe() {
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

/// Count how one delivery ended and how long it took.
pub(crate) fn record(consumer: &str, outcome: &Result<Handled>, elapsed: Duration) {
    let name = match outcome {
        Ok(Handled::Applied) => APPLIED,
        Ok(Handled::Duplicate) => DUPLICATE,
        Ok(Handled::Stale { .. }) => STALE,
        Ok(Handled::Conflict) => CONFLICT,
        Ok(Handled::Uncertain | Handled::DeadLettered { .. }) => DEAD_LETTERED,
        Ok(Handled::Malformed { .. }) => MALFORMED,
        Ok(Handled::Retry { .. }) | Err(_) => FAILED,
    };
    metrics::counter!(name, "consumer" => consumer.to_owned()).increment(1);
    metrics::histogram!(HANDLE_SECONDS, "consumer" => consumer.to_owned()).record(elapsed.as_secs_f64());
}
