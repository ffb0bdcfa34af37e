//! The outbox side of the contract: rows, leases and fencing tokens.
//!
//! A row moves `pending → leased → published`, or back to `pending` on failure, or to `parked`
//! (dead letter). Every transition after a claim is conditional on the claim's fencing token, so
//! a relay that lost its lease can never mark a newer lease's work as done. The token cannot
//! retract what a stale relay already sent; that duplicate is what the inbox exists for.
//!
//! The contract is two traits because its users are two: a relay needs only the state machine
//! ([`OutboxStore`]), an operator needs parked rows, counts and rows read back
//! ([`OutboxAdmin`]). A new backend gets a running relay from the small trait alone.

use std::time::Duration;

use async_trait::async_trait;

use crate::clock::Timestamp;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::wakeup::Wakeup;

/// Database identity of an outbox row. Sequence order is not commit order: rows are claimed by
/// state, never by an id high-water mark.
pub type RowId = i64;

/// A relay's exclusive, time-bounded ownership of a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The relay that holds it.
    pub owner: String,
    /// Fencing token: incremented by every claim of the row; only the latest token may complete.
    pub token: u64,
    /// When the lease stops protecting the row from other claims (store clock).
    pub expires_at: Timestamp,
}

/// A stored, unpublished event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRecord {
    /// Row identity.
    pub row_id: RowId,
    /// The event as enqueued.
    pub event: Event,
    /// How many publish attempts failed so far.
    pub attempts: u32,
    /// When the row was enqueued (store clock).
    pub created_at: Timestamp,
}

/// A row claimed by a relay: the record plus the lease that must accompany every later call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// The row.
    pub record: OutboxRecord,
    /// The lease this claim created.
    pub lease: Lease,
}

/// Result of [`OutboxStore::complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use]
pub enum Completion {
    /// The row is now published, by this lease's token.
    Published,
    /// Nothing changed: the token is stale (the row was claimed again) or the row was already
    /// published or parked.
    Fenced,
}

/// Result of the other token-conditional calls (fail, park, extend, release).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use]
pub enum Outcome {
    /// The transition happened.
    Applied,
    /// Nothing changed: the token is not the row's latest, or the row is published or parked.
    Fenced,
}

/// Where a row is in its life, as read back from durable state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowStatus {
    /// Waiting to be claimed (possibly not before `available_at`, possibly with an expired lease).
    Pending,
    /// Claimed under a lease that has not expired.
    Leased,
    /// Completed by the token in `published_token`.
    Published,
    /// Dead-lettered: visible, not offered, replayable with [`OutboxAdmin::requeue_parked`].
    Parked,
}

impl RowStatus {
    /// The status of a row from its durable columns at time `now` — the one rule every store
    /// applies: published wins, then parked, then a lease that has not expired, else pending.
    pub fn of(published: bool, parked: bool, lease_expires_at: Option<Timestamp>, now: Timestamp) -> Self {
        if published {
            Self::Published
        } else if parked {
            Self::Parked
        } else if lease_expires_at.is_some_and(|e| e > now) {
            Self::Leased
        } else {
            Self::Pending
        }
    }
}

/// What a parked row does to the later rows of its key, as a store's claim sees it (see
/// [`OutboxStore::claim`]). Set on each store's configuration (`with_parked_head`); the default
/// is [`Block`](ParkedHead::Block).
///
/// A parked row is the oldest unpublished row of its key until it is requeued or purged. Under
/// `Block` the key stops there, so its events are never published out of order: an operator
/// decides (requeue it, which makes it the key's head again, or purge it, which lets the next row
/// go). Under `Skip` the key flows on past its dead letters; a parked row that is requeued later
/// is published after the rows that overtook it — order is traded for availability, explicitly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ParkedHead {
    /// A parked row holds back every later row of its key until it is requeued or purged.
    #[default]
    Block,
    /// Parked rows are passed over: the key's later rows are claimed as if they were not there.
    Skip,
}

impl ParkedHead {
    /// The configuration value: `"block"` or `"skip"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Block => "block",
            Self::Skip => "skip",
        }
    }
}

impl std::fmt::Display for ParkedHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ParkedHead {
    type Err = Error;

    /// `block` or `skip` (any case).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "block" => Ok(Self::Block),
            "skip" => Ok(Self::Skip),
            _ => Err(Error::config("outbox", format!("expected `block` or `skip` for the parked head, not {s:?}"))),
        }
    }
}

/// Everything durable about one row, for tests, operators and the conformance suite.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowSnapshot {
    /// Row identity.
    pub row_id: RowId,
    /// The event.
    pub event: Event,
    /// Status at the store's current time.
    pub status: RowStatus,
    /// Failed attempts.
    pub attempts: u32,
    /// Latest fencing token handed out (0 if never claimed).
    pub token: u64,
    /// Owner of the latest claim, if any.
    pub owner: Option<String>,
    /// Expiry of the latest lease, if any.
    pub lease_expires_at: Option<Timestamp>,
    /// The token that completed the row; the contract requires it to equal `token`.
    pub published_token: Option<u64>,
    /// Not claimable before this time (retry backoff).
    pub available_at: Timestamp,
    /// Enqueue time.
    pub created_at: Timestamp,
    /// Last failure or park reason.
    pub last_error: Option<String>,
}

/// A dead-lettered row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedRow {
    /// The row.
    pub record: OutboxRecord,
    /// Why it was parked.
    pub reason: String,
    /// When it was parked (store clock).
    pub parked_at: Timestamp,
}

/// Counts for dashboards and alerts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutboxStats {
    /// Unpublished, unparked rows without a live lease.
    pub pending: u64,
    /// Rows under a live lease.
    pub leased: u64,
    /// Dead-lettered rows.
    pub parked: u64,
    /// Published rows still stored.
    pub published: u64,
    /// Age of the oldest pending row (by enqueue time), if any.
    pub oldest_pending_age: Option<Duration>,
}

/// Durable outbox storage with leases and fencing tokens: what a relay needs, and all a new
/// backend must implement before a relay can run on it.
///
/// Object safe: the relay holds an `Arc<dyn OutboxStore>`. Enqueueing inside the caller's own
/// database transaction is offered by each store crate in its native transaction type; the
/// [`enqueue`](OutboxStore::enqueue) here is the store's own transaction.
///
/// The operator's side — parked rows, counts, reading rows back — is the subtrait
/// [`OutboxAdmin`], implemented next; tools and tests hold an `Arc<dyn OutboxAdmin>`, which
/// also converts to the `Arc<dyn OutboxStore>` a relay takes.
#[async_trait]
pub trait OutboxStore: Send + Sync {
    /// Short backend name for logs and errors (`"sqlite"`, `"postgres"`, `"memory"`).
    fn backend(&self) -> &'static str;

    /// Enqueue events in one transaction of the store's own.
    ///
    /// # Behavior
    /// - All events are validated first; one invalid event rejects the batch and writes nothing.
    /// - Event ids are unique: an id already stored is rejected with
    ///   [`ErrorKind::Conflict`](crate::ErrorKind::Conflict) and nothing of the batch is written.
    /// - New rows are pending, available now, attempts 0, token 0; returned ids are in input order.
    /// - Durable when it returns, also while other enqueues through the same store run at once:
    ///   each returned id reads back through [`inspect`](OutboxAdmin::inspect) with its event.
    /// - A rejected batch writes nothing, also while other enqueues through the same store run at
    ///   once (a bad one or a good one, which is written).
    async fn enqueue(&self, events: &[Event]) -> Result<Vec<RowId>>;

    /// Claim up to `limit` rows for `owner` for `lease` (store clock).
    ///
    /// # Behavior
    /// - claims only rows that are unpublished, not parked, due (`available_at <= now`), and
    ///   whose lease is absent or expired;
    /// - increments each claimed row's token, sets owner and `expires_at = now + lease`;
    /// - concurrent claims never return the same row while its lease is valid;
    /// - key order: a row with a key is claimed only if every earlier (lower row id) unpublished
    ///   row of its key is claimed in the same call — per key, a claim takes only a prefix that
    ///   starts at the key's oldest unpublished row. A row that backs off (after
    ///   [`fail`](OutboxStore::fail)) or is leased by another relay holds back only the later rows
    ///   of its own key; other keys, and rows without a key, keep flowing;
    /// - a parked row holds back the later rows of its key under [`ParkedHead::Block`] (the
    ///   default) and is passed over under [`ParkedHead::Skip`], as the store is configured;
    ///   requeueing a parked row makes it its key's head again;
    /// - so rows of one key are first offered to the broker in row-id order across batches,
    ///   retries and relays, as long as each relay publishes a claimed key's rows in row order
    ///   and stops the key at its first failure (as [`Relay`](crate::Relay) does). A relay may
    ///   claim its next batch while the previous one is still in flight: the later rows of a key
    ///   whose earlier row is in flight are leased-blocked, so an overlapped claim can never
    ///   overtake it;
    /// - row-id order is the order in which ids were allocated, not commit order: two
    ///   transactions enqueueing rows of one key at the same time should serialize on the
    ///   aggregate's own row (`SELECT … FOR UPDATE`); if they don't, the later-committing one may
    ///   hold the lower id, and a claim between the two commits can publish the higher id first;
    /// - returns rows in row-id order; an empty result means nothing is claimable.
    async fn claim(&self, owner: &str, limit: usize, lease: Duration) -> Result<Vec<Claimed>>;

    /// Mark a row published.
    ///
    /// # Behavior
    /// - publishes only if the row's owner and token equal the lease's and the row is neither
    ///   published nor parked; records the token that published it;
    /// - otherwise returns [`Completion::Fenced`] and changes nothing;
    /// - an expired but not re-claimed lease may still complete (its token is still the latest).
    async fn complete(&self, row: RowId, lease: &Lease) -> Result<Completion>;

    /// Complete several rows; the default calls [`complete`](OutboxStore::complete) for each.
    ///
    /// # Behavior
    /// - the result has one entry per input, in order, each as `complete` would return it;
    /// - takes rows of several batches, each with its own lease, in one call (a relay completes
    ///   every batch whose publish has ended together, up to 1,000 rows or one batch if larger).
    async fn complete_many(&self, rows: &[(RowId, Lease)]) -> Result<Vec<Completion>> {
        let mut out = Vec::with_capacity(rows.len());
        for (row, lease) in rows {
            out.push(self.complete(*row, lease).await?);
        }
        Ok(out)
    }

    /// Record a failed publish: back to pending, not before `now + retry_after`.
    ///
    /// # Behavior
    /// - token-conditional like `complete`; a stale token returns [`Outcome::Fenced`];
    /// - increments `attempts`, stores `error`, clears the lease.
    async fn fail(&self, row: RowId, lease: &Lease, retry_after: Duration, error: &str) -> Result<Outcome>;

    /// Dead-letter a row.
    ///
    /// # Behavior
    /// - token-conditional; a parked row is never claimed until requeued;
    /// - stores `reason` and the park time.
    async fn park(&self, row: RowId, lease: &Lease, reason: &str) -> Result<Outcome>;

    /// Extend a lease to `now + by` (store clock).
    ///
    /// # Behavior
    /// - token-conditional; the token does not change.
    async fn extend(&self, row: RowId, lease: &Lease, by: Duration) -> Result<Outcome>;

    /// Give a row back without counting an attempt (graceful shutdown).
    ///
    /// # Behavior
    /// - token-conditional; the row becomes claimable at once, attempts unchanged.
    async fn release(&self, row: RowId, lease: &Lease) -> Result<Outcome>;

    /// A signal that rows were enqueued, for relays in this process (see [`Wakeup`]).
    ///
    /// [`Relay::run`](crate::Relay::run) waits for the first of this signal, its poll timer
    /// and shutdown, so a relay claims new rows as soon as they are visible instead of at the
    /// next poll.
    ///
    /// # Behavior
    /// - the default returns `None`: the store cannot tell, and relays find new rows by polling;
    /// - each call returns a new subscriber that has seen every signal sent before the call;
    /// - rows enqueued through this store (or a clone of it) trigger a signal no earlier than a
    ///   claim can find them: after the commit, or, for an enqueue in the caller's transaction,
    ///   at that commit or at a point from which a claim waits for it (each store documents
    ///   which); a rolled-back enqueue leaves nothing to find;
    /// - a signal is a hint: it may be spurious (a woken relay that finds nothing waits again)
    ///   and it may be missing (rows written where the store cannot see, retry times coming due,
    ///   expired leases), which is why relays keep polling as a safety net;
    /// - sending is cheap and never blocks the enqueue that triggers it.
    fn wakeup(&self) -> Option<Wakeup> {
        None
    }

    /// Whether this store's writes run one at a time whoever sends them (SQLite: one writer per
    /// database file), so that two of a relay's statements at once only wait for each other.
    ///
    /// # Behavior
    /// - the default returns `false`: statements at once may run at once (PostgreSQL);
    /// - a hint for throughput, not part of the contract: with `true`, a [`Relay`](crate::Relay)
    ///   claims a batch ahead of its places at the broker only while every place is publishing
    ///   (else at most [`pipeline_depth`](crate::RelayConfig::pipeline_depth) batches are between
    ///   claim and recorded outcome), and every rule of the other methods holds either way;
    /// - a decorator around a store returns its inner store's answer.
    fn one_writer(&self) -> bool {
        false
    }
}

/// The operator's side of an outbox: dead-lettered (parked) rows, counts for dashboards, and
/// rows read back. Object safe, so a tool holds an `Arc<dyn OutboxAdmin>` for whichever store a
/// URL names; every method is one short transaction of its own on committed state and takes no
/// part in a relay's leases.
///
/// Split from [`OutboxStore`] the way a relay's needs differ from an operator's: a new backend
/// implements `OutboxStore` first (a relay runs on it), then this.
#[async_trait]
pub trait OutboxAdmin: OutboxStore {
    /// Parked rows, oldest first.
    ///
    /// # Behavior
    /// - at most `limit` rows, in row-id order.
    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedRow>>;

    /// Make parked rows pending again (attempts reset to 0).
    ///
    /// # Behavior
    /// - ids that are not parked are ignored; returns how many rows were requeued.
    async fn requeue_parked(&self, rows: &[RowId]) -> Result<u64>;

    /// Delete parked rows.
    ///
    /// # Behavior
    /// - deletes only rows that are parked; returns how many were deleted.
    async fn purge_parked(&self, rows: &[RowId]) -> Result<u64>;

    /// Counts by status and the age of the oldest pending row.
    ///
    /// # Behavior
    /// - computed at the store's current time, from durable state.
    async fn stats(&self) -> Result<OutboxStats>;

    /// Read rows back, in row-id order, starting after `after`.
    ///
    /// # Behavior
    /// - at most `limit` rows with `row_id > after`; status as of the store's current time.
    async fn inspect(&self, after: RowId, limit: usize) -> Result<Vec<RowSnapshot>>;

    /// Delete published rows whose `published_at` is older than `older_than` before the store's
    /// current time: retention, so the table does not grow forever.
    ///
    /// # Behavior
    /// - deletes at most `limit` rows, oldest first, in one short transaction; call again until
    ///   it returns less than `limit`;
    /// - never deletes a row that is pending, leased or parked;
    /// - returns how many rows were deleted;
    /// - the default is a permanent [`Rejected`](crate::ErrorKind::Rejected) error naming the backend,
    ///   so a backend written before retention existed still compiles.
    async fn purge_published(&self, older_than: Duration, limit: usize) -> Result<u64> {
        let _ = (older_than, limit);
        Err(Error::permanent(
            crate::error::ErrorKind::Rejected,
            self.backend(),
            "this store does not implement retention (OutboxAdmin::purge_published)",
        ))
    }
}

/// Read every row of a store, in row-id order (pages through [`OutboxAdmin::inspect`]): for tests
/// and tools that judge durable state; a relay never needs it.
///
/// # Errors
/// Whatever `inspect` returns.
pub async fn all_rows(store: &dyn OutboxAdmin) -> Result<Vec<RowSnapshot>> {
    let mut out = Vec::new();
    let mut after = RowId::MIN;
    loop {
        let page = store.inspect(after, 1000).await?;
        let Some(last) = page.last() else { break };
        after = last.row_id;
        out.extend(page);
    }
    Ok(out)
}
