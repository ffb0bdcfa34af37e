//! The consumer side of the contract: a marker per `(consumer, event_id)` written in the same
//! local transaction as the business effect.
//!
//! Every guard method takes the caller's open transaction (`&mut Self::Tx`); there is no way to
//! write a marker outside it. So an adapter cannot offer "marker in one transaction, effect in
//! another", and the consumer runtime acknowledges the broker only after
//! [`Inbox::commit`] returned.
//!
//! What an operator does — read markers and dead letters, remove dead letters after a replay,
//! prune old markers — needs no transaction type, so it lives in the object-safe supertrait
//! [`InboxAdmin`]: a command-line tool holds a `Box<dyn InboxAdmin>` chosen at run time, while
//! consumers stay generic over their store's transaction.

use std::time::Duration;

use async_trait::async_trait;

use crate::clock::Timestamp;
use crate::error::Result;
use crate::event::{Event, EventId, Fingerprint};

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
    /// The message was not an outbox event this consumer can read (no or a bad event id, an
    /// unknown format, bad header names, duplicate headers, oversized headers): see
    /// [`Malformed`](crate::broker::Malformed). The record keeps the raw payload byte-for-byte,
    /// the headers as far as an [`Event`] can hold them, and the broker position; its event id is
    /// the message's own when it had a valid one, else derived from the position
    /// (`malformed:<position>`). It cannot be replayed as an event.
    Malformed,
}

impl DeadLetterReason {
    /// Stable text form for storage.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Conflict => "conflict",
            Self::HandlerFailed => "handler_failed",
            Self::Uncertain => "uncertain",
            Self::Malformed => "malformed",
        }
    }

    /// Parse the stable text form.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "conflict" => Self::Conflict,
            "handler_failed" => Self::HandlerFailed,
            "uncertain" => Self::Uncertain,
            "malformed" => Self::Malformed,
            _ => return None,
        })
    }
}

/// The destination that dead letters recorded before the stores kept the whole event read back
/// with.
///
/// Schema version 1 of the SQLite and PostgreSQL stores kept only a dead letter's event id and
/// payload; migrating to version 2 gives those records this destination, no key and no headers.
/// It is a valid [`Destination`](crate::Destination) so that the records can still be listed and
/// removed, but nothing is published there on purpose: a replay tool must check
/// [`DeadLetter::destination_known`] and ask the operator where to send such a record.
pub const UNKNOWN_DESTINATION: &str = "_outbox.unknown-destination";

/// A durable record of a delivery the consumer gave up on.
///
/// It keeps the whole event as it was delivered — id, destination, key, headers and payload,
/// byte-for-byte — so an operator can inspect it and replay it faithfully. For a
/// [`Conflict`](DeadLetterReason::Conflict) that is the *conflicting* delivery, not the one the
/// stored marker came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// Identity assigned by the store when the record is written: unique within the store and
    /// increasing in write order. Ignored by [`Inbox::dead_letter`] (write 0); set on read. An
    /// operator selects records by it ([`InboxAdmin::remove_dead_letters`]).
    pub id: i64,
    /// Consumer name.
    pub consumer: String,
    /// The delivered event.
    pub event: Event,
    /// Why.
    pub reason: DeadLetterReason,
    /// Error text.
    pub error: String,
    /// When (store clock; set by the store on write).
    pub at: Timestamp,
}

impl DeadLetter {
    /// A record to write: `id` and `at` are left for the store to set.
    pub fn new(consumer: impl Into<String>, event: Event, reason: DeadLetterReason, error: impl Into<String>) -> Self {
        Self { id: 0, consumer: consumer.into(), event, reason, error: error.into(), at: Timestamp::default() }
    }

    /// Whether the record knows where its event was published: `false` for records migrated
    /// from a schema that did not keep it (their destination is [`UNKNOWN_DESTINATION`]).
    pub fn destination_known(&self) -> bool {
        self.event.destination.as_str() != UNKNOWN_DESTINATION
    }
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

/// The operator's side of an inbox: read what consumers recorded, remove dead letters, prune
/// markers. Object safe, so a tool can hold a `Box<dyn InboxAdmin>` for whichever store a URL
/// names; every [`Inbox`] is one.
///
/// Nothing here takes part in a consumer's transaction: each call is its own transaction on
/// committed state.
#[async_trait]
pub trait InboxAdmin: Send + Sync {
    /// Short backend name (`"sqlite"`, `"postgres"`, `"memory"`).
    ///
    /// # Behavior
    /// - constant for the value; the same name the store's errors carry.
    fn backend(&self) -> &'static str;

    /// All markers of `consumer`, in event-id order.
    ///
    /// # Behavior
    /// - committed state only; other consumers' markers are not returned.
    async fn markers(&self, consumer: &str) -> Result<Vec<Marker>>;

    /// All dead letters of `consumer`, oldest first (in [`DeadLetter::id`] order).
    ///
    /// # Behavior
    /// - committed state only; other consumers' records are not returned;
    /// - each record has its store-assigned `id` and the whole delivered event, byte-for-byte;
    /// - records written before the store kept destination, key and headers read back with
    ///   [`UNKNOWN_DESTINATION`], no key and no headers.
    async fn dead_letters(&self, consumer: &str) -> Result<Vec<DeadLetter>>;

    /// Delete the dead letters of `consumer` whose [`id`](DeadLetter::id) is in `ids` (after a
    /// replay, or to discard them), and return how many were deleted.
    ///
    /// # Behavior
    /// - deletes only records of `consumer`: an id of another consumer's record, or one that does
    ///   not exist, is skipped (not an error) and not counted;
    /// - also deletes the durable failure count ([`Inbox::record_failure`]) of `consumer` for the
    ///   event ids of the deleted records, so a replayed event gets its full attempts again;
    ///   counts of other consumers and of events whose records were not deleted stay;
    /// - markers, projection versions and the notification ledger are not touched;
    /// - all-or-nothing: records and counts are deleted in one transaction; an empty `ids`
    ///   changes nothing and returns 0.
    async fn remove_dead_letters(&self, consumer: &str, ids: &[i64]) -> Result<u64>;

    /// Delete markers of `consumer` committed more than `older_than` ago (store clock).
    ///
    /// # Behavior
    /// - deletes nothing younger than `older_than`; returns how many were deleted. Callers go
    ///   through the consumer runtime, which checks the retention against redelivery first.
    async fn prune_markers(&self, consumer: &str, older_than: Duration) -> Result<u64>;
}

/// [`Inbox::begin`] then [`Inbox::mark`]: what [`Inbox::begin_marked`] does by default, for an
/// override that takes its one-step path only sometimes (or wraps the two calls).
///
/// # Errors
/// Those of `begin` and `mark`.
pub async fn begin_then_mark<I: Inbox + ?Sized>(
    inbox: &I,
    consumer: &str,
    event_id: &EventId,
    fingerprint: &Fingerprint,
) -> Result<(I::Tx, MarkOutcome)> {
    let mut tx = inbox.begin().await?;
    let outcome = inbox.mark(&mut tx, consumer, event_id, fingerprint).await?;
    Ok((tx, outcome))
}

/// Consumer-side durable state, written only inside the caller's transaction.
///
/// `Tx` is the store's transaction handle; the consumer's handler runs its business effect on
/// the same handle, and [`commit`](Inbox::commit) makes marker and effect durable together.
/// Dropping a `Tx` without committing rolls it back. The read and maintenance methods are on
/// the supertrait [`InboxAdmin`].
#[async_trait]
pub trait Inbox: InboxAdmin + 'static {
    /// An open transaction. The handler's effect runs on it.
    type Tx: Send;

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

    /// Open a transaction and [`mark`](Inbox::mark) `(consumer, event_id, fingerprint)` in it:
    /// what the consumer runtime does first for an additive effect. The default calls
    /// [`begin`](Inbox::begin) then `mark`; a store that talks to a server may do both in one
    /// round trip (the PostgreSQL store does).
    ///
    /// # Behavior
    /// - the outcome is the one `begin` then `mark` would give, and so is what is written:
    ///   `New` with the marker written in the returned transaction (durable only when it
    ///   commits, gone when it is dropped); `Duplicate` or `Conflict` with an open transaction in
    ///   which nothing is written;
    /// - two transactions marking the same key concurrently: at most one commits the marker.
    async fn begin_marked(
        &self,
        consumer: &str,
        event_id: &EventId,
        fingerprint: &Fingerprint,
    ) -> Result<(Self::Tx, MarkOutcome)> {
        begin_then_mark(self, consumer, event_id, fingerprint).await
    }

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

    /// Write a dead letter in `tx`.
    ///
    /// # Behavior
    /// - one record per call, durable when `tx` commits; the store assigns its `id` and sets `at`
    ///   to the commit time (the values in `record` are ignored);
    /// - the whole event is kept: id, destination, key, headers and payload read back
    ///   byte-for-byte from [`InboxAdmin::dead_letters`];
    /// - records are kept until removed ([`InboxAdmin::remove_dead_letters`]).
    async fn dead_letter(&self, tx: &mut Self::Tx, record: &DeadLetter) -> Result<()>;

    /// Count a failed handling attempt durably, in a transaction of its own, and return the count
    /// so far (including this one).
    ///
    /// # Behavior
    /// - counts survive restarts; the count is per `(consumer, event_id)`;
    /// - [`InboxAdmin::remove_dead_letters`] resets it: the next failure counts 1 again.
    async fn record_failure(&self, consumer: &str, event_id: &EventId) -> Result<u32>;
}
