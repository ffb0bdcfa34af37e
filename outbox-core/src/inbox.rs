//! The consumer side of the contract: a marker per `(consumer, event_id)` written in the same
//! local transaction as the business effect.
//!
//! Every guard method takes the caller's open transaction (`&mut Self::Tx`); there is no way to
//! write a marker outside it. So an adapter cannot offer "marker in one transaction, effect in
//! another", and the consumer runtime acknowledges the broker only after
//! [`Inbox::commit`] returned.

use std::time::Duration;

use async_trait::async_trait;

use crate::clock::Timestamp;
use crate::error::Result;
use crate::event::{EventId, Fingerprint};

/// Result of [`Inbox::mark`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum MarkOutcome {
    /// First time: the effect should run in this transaction.
    New,
    /// Seen before with the same fingerprint: a harmless duplicate; apply nothing.
    Duplicate,
    /// Seen before with a different fingerprint: apply nothing; dead-letter it.
    Conflict {
        /// The fingerprint stored with the first delivery.
        stored: Fingerprint,
    },
}

/// Result of [`Inbox::advance_version`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum VersionOutcome {
    /// The projection moved forward from `previous` to the given version.
    Advanced {
        /// The version before, if any.
        previous: Option<u64>,
    },
    /// The offered version is not newer than the stored one: apply nothing.
    Stale {
        /// The stored version.
        current: u64,
    },
}

/// State of a notification in the delivery ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerState {
    /// Never attempted.
    Fresh,
    /// Attempted, outcome not recorded: the external call may or may not have happened.
    Attempted,
    /// Done.
    Done,
}

/// Why a delivery was dead-lettered by a consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterReason {
    /// Same event id, different payload.
    Conflict,
    /// The handler failed on every allowed attempt.
    HandlerFailed,
    /// A notification was attempted but its outcome is unknown; retrying could repeat it.
    Uncertain,
}

impl DeadLetterReason {
    /// Stable text form for storage.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Conflict => "conflict",
            Self::HandlerFailed => "handler_failed",
            Self::Uncertain => "uncertain",
        }
    }

    /// Parse the stable text form.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "conflict" => Self::Conflict,
            "handler_failed" => Self::HandlerFailed,
            "uncertain" => Self::Uncertain,
            _ => return None,
        })
    }
}

/// A durable record of a delivery the consumer gave up on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// Consumer name.
    pub consumer: String,
    /// Event id.
    pub event_id: EventId,
    /// Why.
    pub reason: DeadLetterReason,
    /// Error text.
    pub error: String,
    /// The delivered payload, for replay or inspection.
    pub payload: Vec<u8>,
    /// When (store clock; set by the store on write).
    pub at: Timestamp,
}

/// A stored inbox marker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marker {
    /// Consumer name.
    pub consumer: String,
    /// Event id.
    pub event_id: EventId,
    /// Fingerprint of the first delivery.
    pub fingerprint: Fingerprint,
    /// When it was committed (store clock).
    pub at: Timestamp,
}

/// Consumer-side durable state, written only inside the caller's transaction.
///
/// `Tx` is the store's transaction handle; the consumer's handler runs its business effect on
/// the same handle, and [`commit`](Inbox::commit) makes marker and effect durable together.
/// Dropping a `Tx` without committing rolls it back.
#[async_trait]
pub trait Inbox: Send + Sync + 'static {
    /// An open transaction. The handler's effect runs on it.
    type Tx: Send;

    /// Short backend name.
    fn backend(&self) -> &'static str;

    /// Open a transaction.
    ///
    /// # Behavior
    /// - nothing written on it is visible to others before `commit`.
    async fn begin(&self) -> Result<Self::Tx>;

    /// Commit marker and effect together.
    ///
    /// # Behavior
    /// - all-or-nothing;
    /// - of two transactions marking the same key concurrently at most one commits the marker:
    ///   the other either fails with a transient error (at `mark` or here) and nothing of it is
    ///   durable, or its `mark` waits and reports `Duplicate` once the first committed;
    /// - a connection lost during commit is [`Retry::OutcomeUnknown`](crate::Retry::OutcomeUnknown).
    async fn commit(&self, tx: Self::Tx) -> Result<()>;

    /// Record `(consumer, event_id, fingerprint)` in `tx`.
    ///
    /// # Behavior
    /// - `New` when absent (the marker is written in `tx`);
    /// - `Duplicate` when present with the same fingerprint; `Conflict` when different;
    /// - two transactions marking the same key concurrently: at most one commits the marker.
    async fn mark(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        event_id: &EventId,
        fingerprint: &Fingerprint,
    ) -> Result<MarkOutcome>;

    /// Move the projection `(consumer, subject)` to `version` if it is newer.
    ///
    /// # Behavior
    /// - `Advanced` when absent or older (the new version is written in `tx`);
    /// - `Stale` when the stored version is equal or newer: nothing is written.
    async fn advance_version(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        subject: &str,
        version: u64,
    ) -> Result<VersionOutcome>;

    /// Read the notification ledger entry.
    ///
    /// # Behavior
    /// - `Fresh` when absent.
    async fn ledger_state(&self, tx: &mut Self::Tx, consumer: &str, event_id: &EventId) -> Result<LedgerState>;

    /// Write the notification ledger entry in `tx`.
    ///
    /// # Behavior
    /// - overwrites the previous state.
    async fn set_ledger_state(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        event_id: &EventId,
        state: LedgerState,
    ) -> Result<()>;

    /// Write a dead letter in `tx` (its `at` is set by the store).
    ///
    /// # Behavior
    /// - one record per call; records are kept until removed by an operator.
    async fn dead_letter(&self, tx: &mut Self::Tx, record: &DeadLetter) -> Result<()>;

    /// Count a failed handling attempt durably, in a transaction of its own, and return the count
    /// so far (including this one).
    ///
    /// # Behavior
    /// - counts survive restarts; the count is per `(consumer, event_id)`.
    async fn record_failure(&self, consumer: &str, event_id: &EventId) -> Result<u32>;

    /// All markers of `consumer`, in event-id order.
    ///
    /// # Behavior
    /// - committed state only.
    async fn markers(&self, consumer: &str) -> Result<Vec<Marker>>;

    /// All dead letters of `consumer`, oldest first.
    ///
    /// # Behavior
    /// - committed state only.
    async fn dead_letters(&self, consumer: &str) -> Result<Vec<DeadLetter>>;

    /// Delete markers of `consumer` committed more than `older_than` ago (store clock).
    ///
    /// # Behavior
    /// - deletes nothing younger than `older_than`; returns how many were deleted. Callers go
    ///   through the consumer runtime, which checks the retention against redelivery first.
    async fn prune_markers(&self, consumer: &str, older_than: Duration) -> Result<u64>;
}
