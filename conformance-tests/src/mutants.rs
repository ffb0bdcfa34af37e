//! Deliberately wrong variants of the reference backends: the suite's proof that it has teeth.
//!
//! Each variant wraps a correct reference component and breaks exactly one rule of the
//! contract. A suite that passes any of them is not judging what it claims to judge.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use outbox_consumer_inbox::{Consumer, Handled, Handler};
use outbox_core::memory::{MemoryBroker, MemoryInbox, MemoryOutbox, MemoryTx};
use outbox_core::store::all_rows;
use outbox_core::{
    Acknowledge, BatchReport, Broker, Claimed, Completion, ConsumerGroup, DeadLetter, DeadLetterReason, Delivery,
    Destination, Error, ErrorKind, Event, EventId, Fingerprint, ForeignDelivery, Inbox, InboxAdmin, Lease, LedgerState,
    ManualClock, MarkOutcome, Marker, OutboxAdmin, OutboxStats, OutboxStore, Outcome, ParkedHead, ParkedRow, Received,
    RelayConfig, Result, Retry, RowId, RowSnapshot, RowStatus, Subscription, Timestamp, VersionOutcome,
};
use tokio::sync::Notify;

use crate::engines::{ConsumerRuntime, Engines, RelayUnderTest};
use crate::harness::{
    Capabilities, EffectRow, EffectTable, Fixture, Foreign, ForeignKind, ForeignWriter, Harness, MemoryForeign,
};
use crate::reference::{decode_effect, encode_effect, memory_capabilities};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A wrong variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// Completion without the token (or owner) check.
    NoFencing,
    /// Claim that ignores lease expiry (steals live leases).
    ClaimIgnoresExpiry,
    /// Claim that does not increment the token.
    ClaimKeepsToken,
    /// Claim that ignores key order: any due, unleased row is claimable, whatever earlier rows
    /// of its key are doing (the claim before issue 16).
    ClaimIgnoresKeyOrder,
    /// Claim that passes over a parked head row although the store is configured to block
    /// ([`ParkedHead::Block`]).
    ClaimSkipsParkedHead,
    /// Claim that checks a keyed row against its key's head and its direct predecessor only, not
    /// the whole prefix: a row blocked in the middle of a key holds back the row after it, but
    /// not the rows after that.
    ClaimChecksHeadAndPredecessorOnly,
    /// Claim that lets a later row of a key overtake an earlier row that is leased (in flight at
    /// another batch or relay), while still holding it back behind a parked or backing-off one:
    /// harmless to a relay that publishes one batch at a time, wrong once batches overlap.
    ClaimIgnoresLeasedEarlierRow,
    /// Claim that holds back every row of a key with a row leased, parked or backing off, the
    /// rows before that row too: a shortcut over a list of held keys that forgets where in the
    /// key the holding row is.
    ClaimHeldRowHoldsWholeKey,
    /// Claim that picks its `limit` rows first and only then leaves out those held back by an
    /// earlier row of their key: key order holds, but rows waiting behind a held row take the
    /// claim's places, and with more of them than the limit the claim comes back empty while
    /// other keys' rows are claimable.
    ClaimLimitsBeforeHolds,
    /// An `enqueue` that, when other enqueues are in flight at the same moment, answers its
    /// caller before the commit that makes the rows durable (a group commit that hands each
    /// write of a group its result first and commits afterwards): readers see those rows only
    /// [`UNCOMMITTED_FOR`] later. An enqueue alone is committed before it returns.
    EnqueueAnswersBeforeCommit,
    /// An `enqueue` rejected while another enqueue is in flight keeps the rows of its batch it
    /// could write (a group commit that commits a failed write's rows with its transaction when
    /// no savepoint undoes them). A rejected enqueue alone writes nothing.
    RejectedEnqueueKeepsRowsBesideOthers,
    /// Retention that deletes parked rows (dead letters awaiting an operator) along with old
    /// published ones.
    PurgeTakesParked,
    /// Rows marked published when claimed, before anything is sent.
    PublishedOnClaim,
    /// The inbox marker committed in its own transaction, before the effect.
    MarkerFirst,
    /// The effect committed first, the marker afterwards in a second transaction.
    EffectFirst,
    /// Deliveries acknowledged on receipt, before the effect commits.
    AckBeforeCommit,
    /// Deduplication in a process-local set that a crash forgets.
    ProcessLocalDedupe,
    /// A one-step [`Inbox::begin_marked`] that reports `New` when the marker is already there
    /// (a fast path that, its insert refused, opens a plain transaction and goes on).
    BeginMarkedIgnoresDuplicate,
    /// `complete_many` that checks the lease of the first row only; the others complete under
    /// whatever lease they have now.
    CompleteManyChecksFirstRowOnly,
    /// `complete_many` that completes the first 1,000 rows of a call and answers the rest
    /// fenced, changing nothing (a store whose statement holds a bounded number of rows and
    /// drops what is past it): a relay settling several batches together passes more.
    CompleteManyStopsAtAThousandRows,
    /// A store whose wake-up subscription is never signalled: an idle relay publishes new rows
    /// only at its next poll.
    WakeupNeverSignals,
    /// A store that signals an enqueue when it starts, before its rows can be claimed, and not
    /// again (a notification sent before the commit): a relay woken early claims nothing and
    /// waits for its poll.
    WakeupBeforeRowsAreClaimable,
    /// `requeue_parked` that answers how many ids it was given, not how many parked rows it
    /// requeued (a count taken from the input instead of the rows changed).
    RequeueCountsEveryId,
    /// `prune_markers` that deletes the old markers of every consumer, not only the one named
    /// (a delete without the consumer in its condition).
    PruneMarkersOfEveryConsumer,
    /// `prune_markers` that deletes every marker of the consumer, whatever its age (a delete
    /// without the age in its condition): a redelivery then applies the effect again.
    PruneMarkersIgnoresAge,
    /// `advance_version` that advances on an equal version (`<=` where `<` belongs): a
    /// redelivered projection event is applied again.
    AdvanceVersionOnEqual,
    /// `list_parked` that returns every parked row, whatever the limit (a query without its
    /// `LIMIT`): a tool paging through dead letters reads the whole table at once.
    ListParkedIgnoresLimit,
    /// `list_parked` that returns the most recent rows first (ordered by id descending): a tool
    /// paging by the last id it saw skips rows.
    ListParkedNewestFirst,
    /// `inspect` that returns every row after `after`, whatever the limit.
    InspectIgnoresLimit,
    /// `release` that resets the row's attempts (the requeue statement reused): a row that keeps
    /// failing gets a fresh set of retries at every relay restart and is never dead-lettered.
    ReleaseResetsAttempts,
    /// `complete` that does not check whether the row is parked, beside a `park` that keeps the
    /// row's owner and token (a condition left out of the completion's `WHERE`): a publish
    /// confirmed after the relay parked the row publishes the dead letter, and the operator's
    /// list loses it.
    CompletePublishesParkedRow,
    /// `markers` that reads back in descending event-id order (a query ordered the wrong way).
    MarkersOutOfOrder,
    /// `dead_letters` that reads back newest first: a replay of the oldest goes to the newest.
    DeadLettersNewestFirst,
    /// `dead_letter` that keeps the record's `at` instead of the store's clock at commit (an
    /// insert that binds the caller's field).
    DeadLetterKeepsRecordTime,
    /// A subscription whose `next` reports a foreign message as an error without rejecting it:
    /// the message stays unacknowledged and comes back to the group, to be reported again.
    NextLeavesForeignUnacknowledged,
    /// A subscription whose `next` rejects a foreign message and returns the event after it,
    /// reporting nothing: the message is lost and nobody hears of it.
    NextSkipsForeignSilently,
    /// A broker that hands a delivery one member holds unacknowledged to another member that
    /// finds nothing new (a Redis adapter reclaiming pending entries with no idle time): two
    /// live members process one message at once.
    HandsHeldToAnotherMember,
    /// `extend` that checks the lease and answers `Applied` without moving it: a relay keeping a
    /// slow publish's lease loses the row to another relay at the claim's expiry.
    ExtendDoesNotMoveTheLease,
    /// A notification ledger whose `set_ledger_state` writes only where there is no entry yet
    /// (an insert that ignores conflicts instead of an upsert): `Done` is never recorded over
    /// `Attempted`, so a redelivered notification that was done is dead-lettered as uncertain.
    LedgerKeepsFirstState,
    /// A broker whose `declare` of a group that exists already starts it anew past everything
    /// published so far (a Redis group destroyed and created at `$`, an AMQP queue deleted and
    /// declared again): its unread and unacknowledged messages are lost.
    RedeclareSkipsToTheEnd,
    /// A relay that completes at most 1,000 accepted rows of a batch and leaves the rest leased
    /// (a bound on one completion call without a second call for the rest).
    RelayCompletesAThousandRowsOfABatch,
    /// A broker that accepts a publish to a destination no group is bound to and drops it (an
    /// AMQP publisher without `mandatory`).
    DropsUnboundPublishes,
    /// A broker that names each group's queue `<destination>.<group>`: `(d.eu, billing)` and
    /// `(d, eu.billing)` share one queue.
    JoinedQueueNames,
    /// A broker whose `publish_batch` sends the batch in reverse slice order: a key's later
    /// events reach the broker before its earlier ones.
    BatchReversesOrder,
    /// A broker whose `publish_batch` publishes every event on its own: after an event fails,
    /// the later events of its key are still sent and reported `Ok`.
    BatchDoesNotSkipAfterFailure,
    /// A broker whose `publish_batch` fails the whole batch, outcome unknown, when one event is
    /// unroutable (as an AMQP client does when the server closes the connection under a window).
    BatchFailsWholeOnUnroutable,
    /// A relay that completes a row whose publish failed transiently.
    RelayCompletesFailedPublish,
    /// A relay that publishes all rows of a batch at once, whatever their keys.
    RelayPublishesOneKeyConcurrently,
    /// A relay that leaves its claimed, unpublished rows leased when it shuts down.
    RelayKeepsLeasesOnShutdown,
    /// A relay that parks a row because the broker refused the relay's credentials.
    RelayParksOnRefusedCredentials,
    /// A relay that claims as many rows again after a batch outlasted its lease: two relays
    /// can take one slow batch from each other forever.
    RelayKeepsBatchSizeAfterLeaseLost,
    /// A relay whose `run`, after a full batch, waits for a signal nobody sends before it claims
    /// again (as a pipeline's claim stage waiting for an outcome that the completion stage no
    /// longer announces): the rows still due stay pending until shutdown.
    RelayStallsAfterAFullBatch,
    /// A consumer runtime that acknowledges after the effect, before the inbox commit.
    AckThenCommit,
    /// A consumer runtime that acknowledges a foreign message without a dead letter.
    DropsForeign,
    /// A consumer runtime that acknowledges a foreign message before its dead letter commits.
    AckForeignBeforeRecord,
    /// A consumer runtime that records a foreign message on every delivery (no inbox marker).
    RecordsForeignEachDelivery,
    /// A batch commit that acknowledges the deliveries before a failing one although the
    /// failure rolled their effects back.
    BatchAcksRolledBack,
}

impl Mutant {
    /// Every wrong variant.
    pub const ALL: [Mutant; 57] = [
        Mutant::NoFencing,
        Mutant::ClaimIgnoresExpiry,
        Mutant::ClaimKeepsToken,
        Mutant::ClaimIgnoresKeyOrder,
        Mutant::ClaimSkipsParkedHead,
        Mutant::ClaimChecksHeadAndPredecessorOnly,
        Mutant::ClaimIgnoresLeasedEarlierRow,
        Mutant::ClaimHeldRowHoldsWholeKey,
        Mutant::ClaimLimitsBeforeHolds,
        Mutant::EnqueueAnswersBeforeCommit,
        Mutant::RejectedEnqueueKeepsRowsBesideOthers,
        Mutant::PurgeTakesParked,
        Mutant::PublishedOnClaim,
        Mutant::MarkerFirst,
        Mutant::EffectFirst,
        Mutant::AckBeforeCommit,
        Mutant::ProcessLocalDedupe,
        Mutant::BeginMarkedIgnoresDuplicate,
        Mutant::CompleteManyChecksFirstRowOnly,
        Mutant::CompleteManyStopsAtAThousandRows,
        Mutant::WakeupNeverSignals,
        Mutant::WakeupBeforeRowsAreClaimable,
        Mutant::RequeueCountsEveryId,
        Mutant::PruneMarkersOfEveryConsumer,
        Mutant::PruneMarkersIgnoresAge,
        Mutant::RedeclareSkipsToTheEnd,
        Mutant::LedgerKeepsFirstState,
        Mutant::ExtendDoesNotMoveTheLease,
        Mutant::AdvanceVersionOnEqual,
        Mutant::ListParkedIgnoresLimit,
        Mutant::ListParkedNewestFirst,
        Mutant::InspectIgnoresLimit,
        Mutant::ReleaseResetsAttempts,
        Mutant::CompletePublishesParkedRow,
        Mutant::MarkersOutOfOrder,
        Mutant::DeadLettersNewestFirst,
        Mutant::DeadLetterKeepsRecordTime,
        Mutant::NextLeavesForeignUnacknowledged,
        Mutant::NextSkipsForeignSilently,
        Mutant::HandsHeldToAnotherMember,
        Mutant::RelayCompletesAThousandRowsOfABatch,
        Mutant::DropsUnboundPublishes,
        Mutant::JoinedQueueNames,
        Mutant::BatchReversesOrder,
        Mutant::BatchDoesNotSkipAfterFailure,
        Mutant::BatchFailsWholeOnUnroutable,
        Mutant::RelayCompletesFailedPublish,
        Mutant::RelayPublishesOneKeyConcurrently,
        Mutant::RelayKeepsLeasesOnShutdown,
        Mutant::RelayParksOnRefusedCredentials,
        Mutant::RelayKeepsBatchSizeAfterLeaseLost,
        Mutant::RelayStallsAfterAFullBatch,
        Mutant::AckThenCommit,
        Mutant::DropsForeign,
        Mutant::AckForeignBeforeRecord,
        Mutant::RecordsForeignEachDelivery,
        Mutant::BatchAcksRolledBack,
    ];

    /// The relay and consumer runtime to run the suite with: wrong ones for the relay and
    /// consumer variants, the reference ones otherwise (the wrong part is then in
    /// [`MutantHarness`]).
    pub fn engines(self) -> Engines {
        let relay = |fault: Mutant| {
            Engines::default().with_relay(
                format!("mutant relay: {fault}"),
                Arc::new(move |store, broker, config| {
                    Arc::new(WrongRelay::new(store, broker, config, fault)) as Arc<dyn RelayUnderTest>
                }),
            )
        };
        match self {
            Self::RelayCompletesFailedPublish
            | Self::RelayPublishesOneKeyConcurrently
            | Self::RelayKeepsLeasesOnShutdown
            | Self::RelayParksOnRefusedCredentials
            | Self::RelayKeepsBatchSizeAfterLeaseLost
            | Self::RelayStallsAfterAFullBatch
            | Self::RelayCompletesAThousandRowsOfABatch => relay(self),
            Self::AckThenCommit => {
                Engines::default().with_consumer(format!("mutant consumer: {self}"), ConsumerRuntime::AckThenCommit)
            }
            Self::DropsForeign => {
                Engines::default().with_consumer(format!("mutant consumer: {self}"), ConsumerRuntime::DropsForeign)
            }
            Self::AckForeignBeforeRecord => Engines::default()
                .with_consumer(format!("mutant consumer: {self}"), ConsumerRuntime::AckForeignThenRecord),
            Self::RecordsForeignEachDelivery => Engines::default()
                .with_consumer(format!("mutant consumer: {self}"), ConsumerRuntime::RecordsForeignEachDelivery),
            Self::BatchAcksRolledBack => Engines::default()
                .with_consumer(format!("mutant consumer: {self}"), ConsumerRuntime::BatchAcksRolledBack),
            _ => Engines::default(),
        }
    }
}

impl fmt::Display for Mutant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoFencing => "completion without the token check",
            Self::ClaimIgnoresExpiry => "claim that ignores lease expiry",
            Self::ClaimKeepsToken => "claim that does not increment the token",
            Self::ClaimIgnoresKeyOrder => "claim that ignores key order (a later row overtakes its key's head)",
            Self::ClaimSkipsParkedHead => "claim that passes over a parked head under ParkedHead::Block",
            Self::ClaimChecksHeadAndPredecessorOnly => {
                "claim that checks only a key's head and the row's predecessor (a row blocked mid-key is overtaken)"
            }
            Self::ClaimIgnoresLeasedEarlierRow => {
                "claim that lets a later row of a key overtake an earlier row still leased (in flight)"
            }
            Self::ClaimHeldRowHoldsWholeKey => {
                "claim that holds back a whole key behind a held row (rows before it too)"
            }
            Self::ClaimLimitsBeforeHolds => {
                "claim that picks its limit of rows before leaving out those held back by their key"
            }
            Self::EnqueueAnswersBeforeCommit => {
                "enqueue that, beside other enqueues, returns before the commit that makes its rows visible"
            }
            Self::RejectedEnqueueKeepsRowsBesideOthers => {
                "enqueue rejected beside another enqueue that keeps the rows of its batch it could write"
            }
            Self::PurgeTakesParked => "retention that deletes parked rows too",
            Self::PublishedOnClaim => "mark published before publishing",
            Self::MarkerFirst => "marker and effect in separate transactions (marker first)",
            Self::EffectFirst => "marker and effect in separate transactions (effect first)",
            Self::AckBeforeCommit => "ack before commit",
            Self::ProcessLocalDedupe => "dedupe in a process-local set",
            Self::BeginMarkedIgnoresDuplicate => "begin_marked that reports New for a marker already there",
            Self::CompleteManyChecksFirstRowOnly => "complete_many that checks only the first row's lease",
            Self::CompleteManyStopsAtAThousandRows => {
                "complete_many that drops the rows past the first 1,000 of a call"
            }
            Self::WakeupNeverSignals => "store whose wake-up signal never fires",
            Self::WakeupBeforeRowsAreClaimable => {
                "store that signals an enqueue before its rows can be claimed, and not again"
            }
            Self::RequeueCountsEveryId => "requeue_parked that counts every id given, parked or not",
            Self::PruneMarkersOfEveryConsumer => "prune_markers that deletes other consumers' old markers too",
            Self::PruneMarkersIgnoresAge => "prune_markers that deletes the consumer's markers whatever their age",
            Self::AdvanceVersionOnEqual => "advance_version that advances on an equal version",
            Self::ListParkedIgnoresLimit => "list_parked that returns every parked row, whatever the limit",
            Self::ListParkedNewestFirst => "list_parked that returns the newest rows first",
            Self::InspectIgnoresLimit => "inspect that returns every later row, whatever the limit",
            Self::ReleaseResetsAttempts => "release that resets the row's attempts",
            Self::CompletePublishesParkedRow => "complete that publishes a row parked with the same lease",
            Self::MarkersOutOfOrder => "markers that read back in descending event-id order",
            Self::DeadLettersNewestFirst => "dead_letters that read back newest first",
            Self::DeadLetterKeepsRecordTime => "dead_letter that keeps the record's time, not the store's",
            Self::NextLeavesForeignUnacknowledged => "next that reports a foreign message without rejecting it",
            Self::NextSkipsForeignSilently => "next that rejects a foreign message without reporting it",
            Self::HandsHeldToAnotherMember => "broker that hands a held delivery to another live member",
            Self::ExtendDoesNotMoveTheLease => "extend that answers Applied without moving the lease",
            Self::LedgerKeepsFirstState => "notification ledger that never overwrites an entry",
            Self::RedeclareSkipsToTheEnd => "declare that starts an existing group anew past what was published",
            Self::RelayCompletesAThousandRowsOfABatch => {
                "relay that completes 1,000 accepted rows of a batch and leaves the rest leased"
            }
            Self::DropsUnboundPublishes => "publish without mandatory: unbound destinations drop messages",
            Self::JoinedQueueNames => "queue names joined with '.' (destination and group names collide)",
            Self::BatchReversesOrder => "publish_batch that sends a batch in reverse order",
            Self::BatchDoesNotSkipAfterFailure => "publish_batch that goes on with a key after its event failed",
            Self::BatchFailsWholeOnUnroutable => "publish_batch that fails every event when one is unroutable",
            Self::RelayCompletesFailedPublish => "relay that completes a row whose publish failed transiently",
            Self::RelayPublishesOneKeyConcurrently => "relay that publishes one key's rows concurrently",
            Self::RelayKeepsLeasesOnShutdown => "relay that does not release claimed rows on shutdown",
            Self::RelayParksOnRefusedCredentials => "relay that parks a row when the broker refuses its credentials",
            Self::RelayKeepsBatchSizeAfterLeaseLost => {
                "relay that claims as many rows again after a batch outlasted its lease"
            }
            Self::RelayStallsAfterAFullBatch => {
                "relay whose run waits after a full batch for a signal nobody sends (rows due stay pending)"
            }
            Self::AckThenCommit => "ack inside commit, before the inbox commit",
            Self::DropsForeign => "foreign messages acknowledged without a dead letter",
            Self::AckForeignBeforeRecord => "foreign messages acknowledged before their dead letter commits",
            Self::RecordsForeignEachDelivery => "foreign messages recorded again on every redelivery",
            Self::BatchAcksRolledBack => {
                "batch commit that acknowledges the deliveries before a failing one, their effects rolled back"
            }
        })
    }
}

/// The reference store with one rule broken.
struct MutantStore {
    inner: MemoryOutbox,
    mode: Mutant,
    first_tokens: Mutex<std::collections::HashMap<RowId, u64>>,
    /// [`Mutant::ClaimIgnoresKeyOrder`]: the keys of the events, stored without them in `inner`
    /// (so its claim sees no key) and put back on everything read out.
    keys: Mutex<std::collections::HashMap<EventId, String>>,
    /// [`Mutant::EnqueueAnswersBeforeCommit`]: rows enqueued and answered for whose commit has
    /// not happened yet; readers do not see them.
    uncommitted: Arc<Mutex<HashSet<RowId>>>,
    /// [`Mutant::EnqueueAnswersBeforeCommit`], [`Mutant::RejectedEnqueueKeepsRowsBesideOthers`]:
    /// enqueues in flight now.
    enqueues: AtomicUsize,
    /// [`Mutant::WakeupNeverSignals`], [`Mutant::WakeupBeforeRowsAreClaimable`]: the signal they
    /// hand out instead of the inner store's (the other variants hand out the inner store's).
    signal: outbox_core::WakeupSender,
    /// [`Mutant::CompletePublishesParkedRow`]: the lease each parked row was parked with.
    parked_with: Mutex<std::collections::HashMap<RowId, Lease>>,
}

/// How long after its `enqueue` returned a row of [`Mutant::EnqueueAnswersBeforeCommit`] is
/// committed (the length of a slow commit).
pub const UNCOMMITTED_FOR: Duration = Duration::from_millis(50);

impl MutantStore {
    fn new(inner: MemoryOutbox, mode: Mutant) -> Self {
        Self {
            inner,
            mode,
            first_tokens: Mutex::default(),
            keys: Mutex::default(),
            uncommitted: Arc::default(),
            enqueues: AtomicUsize::new(0),
            signal: outbox_core::WakeupSender::new(),
            parked_with: Mutex::default(),
        }
    }

    /// Put back the key [`Mutant::ClaimIgnoresKeyOrder`] kept from the inner store.
    fn rekey(&self, event: &mut Event) {
        if let Some(k) = lock(&self.keys).get(&event.id) {
            event.key = Some(k.clone());
        }
    }

    /// [`Mutant::ClaimChecksHeadAndPredecessorOnly`]: of the rows the key-blind inner claim took,
    /// release those whose key's head or direct predecessor (in `before`, the rows as the claim
    /// found them) is blocked: leased, parked or backing off.
    /// [`Mutant::ClaimIgnoresLeasedEarlierRow`]: release those with any earlier row of their key
    /// parked or backing off; a leased one does not count.
    /// [`Mutant::ClaimHeldRowHoldsWholeKey`]: release those with any other row of their key
    /// blocked, before or after them.
    /// [`Mutant::ClaimLimitsBeforeHolds`]: release those with any earlier row of their key
    /// blocked (the rule is right; it comes after the limit).
    async fn hold_back_after_claim(
        &self,
        claimed: Vec<Claimed>,
        before: &[RowSnapshot],
        lease: Duration,
    ) -> Result<Vec<Claimed>> {
        let keys = lock(&self.keys).clone();
        let mut kept = Vec::with_capacity(claimed.len());
        for c in claimed {
            let now = c.lease.expires_at.as_millis().saturating_sub(i64::try_from(lease.as_millis()).unwrap_or(0));
            let leased_blocks = self.mode != Mutant::ClaimIgnoresLeasedEarlierRow;
            let blocked = |r: &RowSnapshot| match r.status {
                RowStatus::Leased => leased_blocks,
                RowStatus::Parked => self.inner.parked_head() == ParkedHead::Block,
                RowStatus::Pending => r.available_at.as_millis() > now,
                RowStatus::Published => false,
            };
            let whole_key = self.mode == Mutant::ClaimHeldRowHoldsWholeKey;
            let earlier: Vec<&RowSnapshot> = match keys.get(&c.record.event.id) {
                Some(k) => before
                    .iter()
                    .filter(|r| {
                        (r.row_id < c.record.row_id || whole_key && r.row_id != c.record.row_id)
                            && r.status != RowStatus::Published
                            && keys.get(&r.event.id) == Some(k)
                    })
                    .collect(),
                None => Vec::new(),
            };
            let holds_back = if self.mode == Mutant::ClaimChecksHeadAndPredecessorOnly {
                earlier.first().is_some_and(|r| blocked(r)) || earlier.last().is_some_and(|r| blocked(r))
            } else {
                earlier.iter().any(|r| blocked(r))
            };
            if holds_back {
                let _ = self.inner.release(c.record.row_id, &c.lease).await?;
            } else {
                kept.push(c);
            }
        }
        Ok(kept)
    }

    /// [`Mutant::CompletePublishesParkedRow`]'s completion of a parked row: published as a
    /// completion that ignores `parked_at` would, through the reference store's own calls
    /// (requeued, claimed, completed; any other row the claim took is released).
    async fn publish_parked(&self, row: RowId, owner: &str) -> Result<Completion> {
        lock(&self.parked_with).remove(&row);
        self.inner.requeue_parked(&[row]).await?;
        for c in self.inner.claim(owner, usize::MAX, Duration::from_secs(60)).await? {
            if c.record.row_id == row {
                let _ = self.inner.complete(row, &c.lease).await?;
            } else {
                let _ = self.inner.release(c.record.row_id, &c.lease).await?;
            }
        }
        Ok(Completion::Published)
    }

    async fn row(&self, row: RowId) -> Result<Option<RowSnapshot>> {
        Ok(self.inner.inspect(row - 1, 1).await?.into_iter().find(|r| r.row_id == row))
    }

    /// The lease the reference store would accept for `row` right now, if any.
    async fn current_lease(&self, row: RowId, owner: Option<&str>) -> Result<Option<Lease>> {
        Ok(self.row(row).await?.and_then(|r| {
            Some(Lease {
                owner: owner.map(str::to_string).or(r.owner)?,
                token: r.token,
                expires_at: r.lease_expires_at.unwrap_or_default(),
            })
        }))
    }

    async fn translate(&self, row: RowId, lease: &Lease) -> Result<Lease> {
        Ok(match self.mode {
            Mutant::ClaimKeepsToken => {
                self.current_lease(row, Some(&lease.owner)).await?.unwrap_or_else(|| lease.clone())
            }
            _ => lease.clone(),
        })
    }
}

#[async_trait]
impl OutboxStore for MutantStore {
    fn backend(&self) -> &'static str {
        "mutant"
    }

    async fn enqueue(&self, events: &[Event]) -> Result<Vec<RowId>> {
        if self.mode == Mutant::WakeupBeforeRowsAreClaimable && self.signal.subscribers() > 0 {
            // Signalled first; the rows are written as long as a slow commit takes after it
            // (only while someone listens: the cases that explore many paths do not).
            self.signal.notify();
            tokio::time::sleep(UNCOMMITTED_FOR).await;
            return self.inner.enqueue(events).await;
        }
        if self.mode == Mutant::EnqueueAnswersBeforeCommit {
            let others = self.enqueues.fetch_add(1, Ordering::SeqCst) > 0;
            // Let enqueues started at the same moment join: a group.
            tokio::task::yield_now().await;
            let ids = self.inner.enqueue(events).await;
            let grouped = others || self.enqueues.load(Ordering::SeqCst) > 1;
            self.enqueues.fetch_sub(1, Ordering::SeqCst);
            let ids = ids?;
            if !grouped {
                return Ok(ids);
            }
            lock(&self.uncommitted).extend(ids.iter().copied());
            let (uncommitted, committed) = (Arc::clone(&self.uncommitted), ids.clone());
            tokio::spawn(async move {
                tokio::time::sleep(UNCOMMITTED_FOR).await;
                let mut u = lock(&uncommitted);
                for id in committed {
                    u.remove(&id);
                }
            });
            return Ok(ids);
        }
        if self.mode == Mutant::RejectedEnqueueKeepsRowsBesideOthers {
            let others = self.enqueues.fetch_add(1, Ordering::SeqCst) > 0;
            // Let enqueues started at the same moment join: a group.
            tokio::task::yield_now().await;
            let out = self.inner.enqueue(events).await;
            let grouped = others || self.enqueues.load(Ordering::SeqCst) > 1;
            if out.is_err() && grouped {
                // What the rejected batch could write is committed with the group.
                for e in events {
                    let _ = self.inner.enqueue(std::slice::from_ref(e)).await;
                }
            }
            self.enqueues.fetch_sub(1, Ordering::SeqCst);
            return out;
        }
        if !matches!(
            self.mode,
            Mutant::ClaimIgnoresKeyOrder
                | Mutant::ClaimChecksHeadAndPredecessorOnly
                | Mutant::ClaimIgnoresLeasedEarlierRow
                | Mutant::ClaimHeldRowHoldsWholeKey
                | Mutant::ClaimLimitsBeforeHolds
        ) {
            return self.inner.enqueue(events).await;
        }
        let keyless: Vec<Event> = events.iter().map(|e| Event { key: None, ..e.clone() }).collect();
        let ids = self.inner.enqueue(&keyless).await?;
        let mut keys = lock(&self.keys);
        for e in events {
            if let Some(k) = &e.key {
                keys.insert(e.id.clone(), k.clone());
            }
        }
        Ok(ids)
    }

    async fn claim(&self, owner: &str, limit: usize, lease: Duration) -> Result<Vec<Claimed>> {
        if self.mode == Mutant::ClaimIgnoresExpiry {
            for r in all_rows(&self.inner).await? {
                if r.status == RowStatus::Leased
                    && let Some(l) = self.current_lease(r.row_id, None).await?
                {
                    let _ = self.inner.release(r.row_id, &l).await?;
                }
            }
        }
        let filtered = matches!(
            self.mode,
            Mutant::ClaimChecksHeadAndPredecessorOnly
                | Mutant::ClaimIgnoresLeasedEarlierRow
                | Mutant::ClaimHeldRowHoldsWholeKey
                | Mutant::ClaimLimitsBeforeHolds
        );
        let before = if filtered { all_rows(&self.inner).await? } else { Vec::new() };
        let mut claimed = self.inner.claim(owner, limit, lease).await?;
        if filtered {
            claimed = self.hold_back_after_claim(claimed, &before, lease).await?;
        }
        match self.mode {
            Mutant::PublishedOnClaim => {
                for c in &claimed {
                    let _ = self.inner.complete(c.record.row_id, &c.lease).await?;
                }
            }
            Mutant::ClaimKeepsToken => {
                let mut first = self.first_tokens.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                for c in &mut claimed {
                    c.lease.token = *first.entry(c.record.row_id).or_insert(c.lease.token);
                }
            }
            _ => {}
        }
        for c in &mut claimed {
            self.rekey(&mut c.record.event);
        }
        Ok(claimed)
    }

    async fn complete(&self, row: RowId, lease: &Lease) -> Result<Completion> {
        if self.mode == Mutant::NoFencing {
            return match self.current_lease(row, None).await? {
                Some(current) => self.inner.complete(row, &current).await,
                None => Ok(Completion::Fenced),
            };
        }
        let lease = self.translate(row, lease).await?;
        if self.mode == Mutant::CompletePublishesParkedRow {
            let parked_with = lock(&self.parked_with).get(&row).cloned();
            if parked_with.is_some_and(|p| p.owner == lease.owner && p.token == lease.token) {
                return self.publish_parked(row, &lease.owner).await;
            }
        }
        self.inner.complete(row, &lease).await
    }

    async fn complete_many(&self, rows: &[(RowId, Lease)]) -> Result<Vec<Completion>> {
        let mut out = Vec::with_capacity(rows.len());
        for (i, (row, lease)) in rows.iter().enumerate() {
            out.push(if self.mode == Mutant::CompleteManyStopsAtAThousandRows && i >= 1_000 {
                Completion::Fenced
            } else if self.mode == Mutant::CompleteManyChecksFirstRowOnly && i > 0 {
                // "The batch's lease was checked": the rest complete under their current lease.
                match self.current_lease(*row, None).await? {
                    Some(current) => self.inner.complete(*row, &current).await?,
                    None => Completion::Fenced,
                }
            } else {
                self.complete(*row, lease).await?
            });
        }
        Ok(out)
    }

    async fn fail(&self, row: RowId, lease: &Lease, retry_after: Duration, error: &str) -> Result<Outcome> {
        let lease = self.translate(row, lease).await?;
        self.inner.fail(row, &lease, retry_after, error).await
    }

    async fn park(&self, row: RowId, lease: &Lease, reason: &str) -> Result<Outcome> {
        let lease = self.translate(row, lease).await?;
        let o = self.inner.park(row, &lease, reason).await?;
        if self.mode == Mutant::CompletePublishesParkedRow && o == Outcome::Applied {
            lock(&self.parked_with).insert(row, lease);
        }
        Ok(o)
    }

    async fn extend(&self, row: RowId, lease: &Lease, by: Duration) -> Result<Outcome> {
        let lease = self.translate(row, lease).await?;
        if self.mode == Mutant::ExtendDoesNotMoveTheLease {
            // The token check, then the expiry put back where it was: extended to "now" (which
            // reads the store's clock back), then by what was left.
            let Some(before) = self.row(row).await?.and_then(|r| r.lease_expires_at) else {
                return self.inner.extend(row, &lease, by).await;
            };
            let o = self.inner.extend(row, &lease, Duration::ZERO).await?;
            if o == Outcome::Applied
                && let Some(now) = self.row(row).await?.and_then(|r| r.lease_expires_at)
            {
                let _ = self.inner.extend(row, &lease, before.since(now)).await?;
            }
            return Ok(o);
        }
        self.inner.extend(row, &lease, by).await
    }

    async fn release(&self, row: RowId, lease: &Lease) -> Result<Outcome> {
        let lease = self.translate(row, lease).await?;
        if self.mode == Mutant::ReleaseResetsAttempts {
            // Parked and requeued at once: pending, claimable now, attempts 0.
            let parked = self.inner.park(row, &lease, "released").await?;
            if parked == Outcome::Applied {
                self.inner.requeue_parked(&[row]).await?;
            }
            return Ok(parked);
        }
        self.inner.release(row, &lease).await
    }

    fn wakeup(&self) -> Option<outbox_core::Wakeup> {
        match self.mode {
            Mutant::WakeupNeverSignals | Mutant::WakeupBeforeRowsAreClaimable => Some(self.signal.subscribe()),
            _ => self.inner.wakeup(),
        }
    }
}

#[async_trait]
impl OutboxAdmin for MutantStore {
    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedRow>> {
        let mut rows = match self.mode {
            Mutant::ListParkedIgnoresLimit => self.inner.list_parked(usize::MAX).await?,
            Mutant::ListParkedNewestFirst => {
                let mut all = self.inner.list_parked(usize::MAX).await?;
                all.reverse();
                all.truncate(limit);
                all
            }
            _ => self.inner.list_parked(limit).await?,
        };
        for r in &mut rows {
            self.rekey(&mut r.record.event);
        }
        Ok(rows)
    }

    async fn requeue_parked(&self, rows: &[RowId]) -> Result<u64> {
        let requeued = self.inner.requeue_parked(rows).await?;
        Ok(if self.mode == Mutant::RequeueCountsEveryId { rows.len() as u64 } else { requeued })
    }

    async fn purge_parked(&self, rows: &[RowId]) -> Result<u64> {
        self.inner.purge_parked(rows).await
    }

    async fn purge_published(&self, older_than: Duration, limit: usize) -> Result<u64> {
        let mut purged = self.inner.purge_published(older_than, limit).await?;
        if self.mode == Mutant::PurgeTakesParked {
            let parked: Vec<RowId> =
                self.inner.list_parked(limit).await?.into_iter().map(|p| p.record.row_id).collect();
            purged += self.inner.purge_parked(&parked).await?;
        }
        Ok(purged)
    }

    async fn stats(&self) -> Result<OutboxStats> {
        self.inner.stats().await
    }

    async fn inspect(&self, after: RowId, limit: usize) -> Result<Vec<RowSnapshot>> {
        let limit = if self.mode == Mutant::InspectIgnoresLimit { usize::MAX } else { limit };
        let mut rows = self.inner.inspect(after, limit).await?;
        let uncommitted = lock(&self.uncommitted).clone();
        rows.retain(|r| !uncommitted.contains(&r.row_id));
        for r in &mut rows {
            self.rekey(&mut r.event);
        }
        Ok(rows)
    }
}

/// The reference inbox with one rule broken.
#[derive(Clone)]
pub struct MutantInbox {
    inner: MemoryInbox,
    mode: Mutant,
    local: Arc<Mutex<HashSet<(String, EventId)>>>,
    /// [`Mutant::PruneMarkersOfEveryConsumer`]: the consumers that marked an event.
    consumers: Arc<Mutex<BTreeSet<String>>>,
    /// [`Mutant::DeadLetterKeepsRecordTime`]: the `at` each dead letter was written with.
    record_times: Arc<Mutex<HashMap<(String, EventId), Timestamp>>>,
}

/// A transaction of [`MutantInbox`].
pub struct MutantTx {
    inner: MemoryTx,
    deferred: Vec<(String, EventId, Fingerprint)>,
}

#[async_trait]
impl Inbox for MutantInbox {
    type Tx = MutantTx;

    async fn begin(&self) -> Result<MutantTx> {
        Ok(MutantTx { inner: self.inner.begin().await?, deferred: Vec::new() })
    }

    async fn commit(&self, tx: MutantTx) -> Result<()> {
        self.inner.commit(tx.inner).await?;
        for (c, id, fp) in tx.deferred {
            let mut t2 = self.inner.begin().await?;
            let _ = self.inner.mark(&mut t2, &c, &id, &fp).await?;
            let _ = self.inner.commit(t2).await;
        }
        Ok(())
    }

    async fn mark(
        &self,
        tx: &mut MutantTx,
        consumer: &str,
        event_id: &EventId,
        fp: &Fingerprint,
    ) -> Result<MarkOutcome> {
        match self.mode {
            Mutant::MarkerFirst => {
                let mut own = self.inner.begin().await?;
                let r = self.inner.mark(&mut own, consumer, event_id, fp).await?;
                self.inner.commit(own).await?;
                Ok(r)
            }
            Mutant::EffectFirst => {
                let mut scratch = self.inner.begin().await?;
                let r = self.inner.mark(&mut scratch, consumer, event_id, fp).await?;
                if r == MarkOutcome::New {
                    tx.deferred.push((consumer.to_string(), event_id.clone(), *fp));
                }
                Ok(r)
            }
            Mutant::ProcessLocalDedupe => {
                let mut set = self.local.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                Ok(if set.insert((consumer.to_string(), event_id.clone())) {
                    MarkOutcome::New
                } else {
                    MarkOutcome::Duplicate
                })
            }
            _ => {
                if self.mode == Mutant::PruneMarkersOfEveryConsumer {
                    lock(&self.consumers).insert(consumer.to_string());
                }
                self.inner.mark(&mut tx.inner, consumer, event_id, fp).await
            }
        }
    }

    async fn begin_marked(
        &self,
        consumer: &str,
        event_id: &EventId,
        fp: &Fingerprint,
    ) -> Result<(MutantTx, MarkOutcome)> {
        let (tx, outcome) = outbox_core::inbox::begin_then_mark(self, consumer, event_id, fp).await?;
        if self.mode == Mutant::BeginMarkedIgnoresDuplicate && outcome != MarkOutcome::New {
            // The refused insert is forgotten: a fresh transaction, reported new.
            return Ok((self.begin().await?, MarkOutcome::New));
        }
        Ok((tx, outcome))
    }

    async fn advance_version(&self, tx: &mut MutantTx, c: &str, s: &str, v: u64) -> Result<VersionOutcome> {
        match self.inner.advance_version(&mut tx.inner, c, s, v).await? {
            VersionOutcome::Stale { current } if self.mode == Mutant::AdvanceVersionOnEqual && current == v => {
                Ok(VersionOutcome::Advanced { previous: Some(current) })
            }
            o => Ok(o),
        }
    }

    async fn ledger_state(&self, tx: &mut MutantTx, c: &str, id: &EventId) -> Result<LedgerState> {
        self.inner.ledger_state(&mut tx.inner, c, id).await
    }

    async fn set_ledger_state(&self, tx: &mut MutantTx, c: &str, id: &EventId, s: LedgerState) -> Result<()> {
        if self.mode == Mutant::LedgerKeepsFirstState
            && self.inner.ledger_state(&mut tx.inner, c, id).await? != LedgerState::Fresh
        {
            return Ok(());
        }
        self.inner.set_ledger_state(&mut tx.inner, c, id, s).await
    }

    async fn dead_letter(&self, tx: &mut MutantTx, record: &DeadLetter) -> Result<()> {
        if self.mode == Mutant::DeadLetterKeepsRecordTime {
            lock(&self.record_times).insert((record.consumer.clone(), record.event.id.clone()), record.at);
        }
        self.inner.dead_letter(&mut tx.inner, record).await
    }

    async fn record_failure(&self, c: &str, id: &EventId) -> Result<u32> {
        self.inner.record_failure(c, id).await
    }
}

#[async_trait]
impl InboxAdmin for MutantInbox {
    fn backend(&self) -> &'static str {
        "mutant"
    }

    async fn markers(&self, c: &str) -> Result<Vec<Marker>> {
        let mut markers = self.inner.markers(c).await?;
        if self.mode == Mutant::MarkersOutOfOrder {
            markers.reverse();
        }
        Ok(markers)
    }

    async fn dead_letters(&self, c: &str) -> Result<Vec<DeadLetter>> {
        let mut letters = self.inner.dead_letters(c).await?;
        match self.mode {
            Mutant::DeadLettersNewestFirst => letters.reverse(),
            Mutant::DeadLetterKeepsRecordTime => {
                let times = lock(&self.record_times);
                for d in &mut letters {
                    if let Some(at) = times.get(&(d.consumer.clone(), d.event.id.clone())) {
                        d.at = *at;
                    }
                }
            }
            _ => {}
        }
        Ok(letters)
    }

    async fn remove_dead_letters(&self, c: &str, ids: &[i64]) -> Result<u64> {
        self.inner.remove_dead_letters(c, ids).await
    }

    async fn prune_markers(&self, c: &str, older_than: Duration) -> Result<u64> {
        match self.mode {
            Mutant::PruneMarkersOfEveryConsumer => {
                let consumers: Vec<String> = lock(&self.consumers).iter().cloned().collect();
                let mut pruned = self.inner.prune_markers(c, older_than).await?;
                for other in consumers.iter().filter(|o| o.as_str() != c) {
                    pruned += self.inner.prune_markers(other, older_than).await?;
                }
                Ok(pruned)
            }
            Mutant::PruneMarkersIgnoresAge => self.inner.prune_markers(c, Duration::ZERO).await,
            _ => self.inner.prune_markers(c, older_than).await,
        }
    }
}

struct MutantEffects(MemoryInbox);

#[async_trait]
impl EffectTable<MutantInbox> for MutantEffects {
    async fn insert(&self, tx: &mut MutantTx, row: &EffectRow) -> Result<()> {
        tx.inner.insert("effects", encode_effect(row));
        Ok(())
    }

    async fn rows(&self) -> Result<Vec<EffectRow>> {
        self.0.table("effects").iter().map(|r| decode_effect(r)).collect()
    }
}

/// [`Mutant::AckBeforeCommit`]: a subscription that acknowledges on receipt.
struct EarlyAckSubscription(Box<dyn Subscription>);

struct AlreadyAcked;

#[async_trait]
impl Acknowledge for AlreadyAcked {
    async fn ack(self: Box<Self>) -> Result<()> {
        Ok(())
    }
    async fn nack(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}

#[async_trait]
impl Subscription for EarlyAckSubscription {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        Ok(Some(match self.0.receive(wait).await? {
            None => return Ok(None),
            Some(Received::Event(d)) => {
                let (redelivered, attempt) = (d.redelivered, d.attempt);
                let (event, acker) = d.into_parts();
                acker.ack().await?;
                Received::Event(Delivery::new(event, redelivered, attempt, Box::new(AlreadyAcked)))
            }
            Some(Received::Foreign(f)) => {
                let (problem, detail, redelivered) = (f.problem, f.detail.clone(), f.redelivered);
                let (message, acker) = f.into_parts();
                acker.ack().await?;
                Received::Foreign(ForeignDelivery::new(message, problem, detail, redelivered, Box::new(AlreadyAcked)))
            }
        }))
    }
}

/// [`Mutant::NextLeavesForeignUnacknowledged`], [`Mutant::NextSkipsForeignSilently`]: a
/// subscription that overrides `Subscription::next`.
struct WrongNextSubscription {
    inner: Box<dyn Subscription>,
    mode: Mutant,
}

#[async_trait]
impl Subscription for WrongNextSubscription {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        self.inner.receive(wait).await
    }

    async fn next(&mut self, wait: Duration) -> Result<Option<Delivery>> {
        // Bounded: a log of foreign messages only ends the call with nothing.
        for _ in 0..1_000 {
            match self.inner.receive(wait).await? {
                None => return Ok(None),
                Some(Received::Event(d)) => return Ok(Some(d)),
                Some(Received::Foreign(f)) if self.mode == Mutant::NextLeavesForeignUnacknowledged => {
                    return Err(f.error()); // dropped unsettled: held until the subscription goes
                }
                Some(Received::Foreign(f)) => f.reject().await?,
            }
        }
        Ok(None)
    }
}

/// Numbers the members of [`Mutant::HandsHeldToAnotherMember`]'s groups.
static NEXT_MEMBER: AtomicU64 = AtomicU64::new(0);

/// [`Mutant::HandsHeldToAnotherMember`]: a member of a group that records what it holds
/// unacknowledged in `held` (shared by the members) and, finding nothing new, takes what another
/// member holds.
struct SharingSubscription {
    inner: Box<dyn Subscription>,
    held: Arc<Mutex<Vec<(u64, Event)>>>,
    member: u64,
}

/// Forgets a held delivery once its holder settles it.
struct Settles {
    inner: Box<dyn Acknowledge>,
    held: Arc<Mutex<Vec<(u64, Event)>>>,
    member: u64,
    id: EventId,
}

impl Settles {
    fn forget(&self) {
        lock(&self.held).retain(|(m, e)| !(*m == self.member && e.id == self.id));
    }
}

#[async_trait]
impl Acknowledge for Settles {
    async fn ack(self: Box<Self>) -> Result<()> {
        self.forget();
        self.inner.ack().await
    }
    async fn nack(self: Box<Self>) -> Result<()> {
        self.forget();
        self.inner.nack().await
    }
}

#[async_trait]
impl Subscription for SharingSubscription {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        match self.inner.receive(wait).await? {
            Some(Received::Event(d)) => {
                let (redelivered, attempt) = (d.redelivered, d.attempt);
                let (event, acker) = d.into_parts();
                lock(&self.held).push((self.member, event.clone()));
                let acker =
                    Settles { inner: acker, held: self.held.clone(), member: self.member, id: event.id.clone() };
                Ok(Some(Received::Event(Delivery::new(event, redelivered, attempt, Box::new(acker)))))
            }
            Some(foreign) => Ok(Some(foreign)),
            None => {
                let mut held = lock(&self.held);
                let Some(i) = held.iter().position(|(m, _)| *m != self.member) else { return Ok(None) };
                let (_, event) = held.remove(i);
                Ok(Some(Received::Event(Delivery::new(event, true, None, Box::new(AlreadyAcked)))))
            }
        }
    }
}

impl Drop for SharingSubscription {
    fn drop(&mut self) {
        lock(&self.held).retain(|(m, _)| *m != self.member);
    }
}

/// What a subscription-level mutant does to each subscription of the reference broker.
type WrapSubscription = Box<dyn Fn(Box<dyn Subscription>) -> Box<dyn Subscription> + Send + Sync>;

/// The reference broker whose subscriptions a mutant wraps; `declare` and `publish` go through.
struct WrappedSubscriptions {
    inner: MemoryBroker,
    wrap: WrapSubscription,
}

#[async_trait]
impl Broker for WrappedSubscriptions {
    fn backend(&self) -> &'static str {
        "mutant"
    }
    async fn declare(&self, d: &Destination, g: &[ConsumerGroup]) -> Result<()> {
        self.inner.declare(d, g).await
    }
    async fn publish(&self, e: &Event) -> Result<()> {
        self.inner.publish(e).await
    }
    async fn subscribe(&self, d: &Destination, g: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        Ok((self.wrap)(self.inner.subscribe(d, g).await?))
    }
}

/// A harness over the reference backends with one [`Mutant`] applied.
#[derive(Debug, Clone, Copy)]
pub struct MutantHarness(pub Mutant);

#[async_trait]
impl Harness for MutantHarness {
    type Inbox = MutantInbox;

    fn name(&self) -> String {
        format!("mutant: {}", self.0)
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = memory_capabilities();
        caps.present.push(crate::harness::Capability::ParkedHeadSkip);
        caps
    }

    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<Fixture<MutantInbox>> {
        self.fixture_with_parked_head(case, clock, ParkedHead::Block).await
    }

    async fn fixture_with_parked_head(
        &self,
        _case: &str,
        clock: ManualClock,
        parked_head: ParkedHead,
    ) -> Result<Fixture<MutantInbox>> {
        let mode = self.0;
        let memory = MemoryInbox::new(Arc::new(clock.clone()));
        let parked_head = if mode == Mutant::ClaimSkipsParkedHead { ParkedHead::Skip } else { parked_head };
        let store = MutantStore::new(MemoryOutbox::new(Arc::new(clock)).with_parked_head(parked_head), mode);
        let mem = MemoryBroker::new();
        let mut foreign: Arc<dyn ForeignWriter> = Arc::new(MemoryForeign(mem.clone()));
        let broker: Arc<dyn Broker> = match mode {
            Mutant::AckBeforeCommit => {
                Arc::new(WrappedSubscriptions { inner: mem, wrap: Box::new(|s| Box::new(EarlyAckSubscription(s))) })
            }
            Mutant::DropsUnboundPublishes => Arc::new(DropsUnbound { inner: mem, groups: Mutex::default() }),
            Mutant::BatchReversesOrder | Mutant::BatchDoesNotSkipAfterFailure | Mutant::BatchFailsWholeOnUnroutable => {
                Arc::new(WrongBatch { inner: mem, mode })
            }
            Mutant::RedeclareSkipsToTheEnd => Arc::new(Redeclaring { inner: mem, groups: Mutex::default() }),
            Mutant::HandsHeldToAnotherMember => {
                let held: Arc<Mutex<Vec<(u64, Event)>>> = Arc::default();
                let wrap = move |inner| -> Box<dyn Subscription> {
                    let member = NEXT_MEMBER.fetch_add(1, Ordering::Relaxed);
                    Box::new(SharingSubscription { inner, held: held.clone(), member })
                };
                Arc::new(WrappedSubscriptions { inner: mem, wrap: Box::new(wrap) })
            }
            Mutant::NextLeavesForeignUnacknowledged | Mutant::NextSkipsForeignSilently => {
                let wrap = move |inner| -> Box<dyn Subscription> { Box::new(WrongNextSubscription { inner, mode }) };
                Arc::new(WrappedSubscriptions { inner: mem, wrap: Box::new(wrap) })
            }
            Mutant::JoinedQueueNames => {
                foreign = Arc::new(QueueForeign(mem.clone()));
                Arc::new(JoinedQueues { inner: mem, bindings: Mutex::default() })
            }
            _ => Arc::new(mem),
        };
        // The consumers that marked events are the inbox's durable state: shared by restarts.
        let consumers: Arc<Mutex<BTreeSet<String>>> = Arc::default();
        let record_times: Arc<Mutex<HashMap<(String, EventId), Timestamp>>> = Arc::default();
        let inbox = MutantInbox {
            inner: memory.clone(),
            mode,
            local: Arc::default(),
            consumers: consumers.clone(),
            record_times: record_times.clone(),
        };
        let mut fx = Fixture::new(
            Arc::new(store),
            broker,
            inbox,
            Arc::new(MutantEffects(memory.clone())),
            Destination::new("suite")?,
        );
        // A restarted process starts with an empty process-local set.
        fx.restart_inbox = Arc::new(move || MutantInbox {
            inner: memory.clone(),
            mode,
            local: Arc::default(),
            consumers: consumers.clone(),
            record_times: record_times.clone(),
        });
        fx.foreign = Some(foreign);
        Ok(fx)
    }
}

/// The reference broker, dropping what is published to a destination no group is bound to.
struct DropsUnbound {
    inner: MemoryBroker,
    groups: Mutex<BTreeMap<Destination, BTreeSet<ConsumerGroup>>>,
}

#[async_trait]
impl Broker for DropsUnbound {
    fn backend(&self) -> &'static str {
        "mutant"
    }
    async fn declare(&self, d: &Destination, g: &[ConsumerGroup]) -> Result<()> {
        lock(&self.groups).entry(d.clone()).or_default().extend(g.iter().cloned());
        self.inner.declare(d, g).await
    }
    async fn publish(&self, e: &Event) -> Result<()> {
        if lock(&self.groups).get(&e.destination).is_some_and(BTreeSet::is_empty) {
            return Ok(()); // "routed to no queue": gone, and the publisher was never told
        }
        self.inner.publish(e).await
    }
    async fn subscribe(&self, d: &Destination, g: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        lock(&self.groups).entry(d.clone()).or_default().insert(g.clone());
        self.inner.subscribe(d, g).await
    }
}

/// The reference broker with a wrong `publish_batch` ([`Mutant::BatchReversesOrder`],
/// [`Mutant::BatchDoesNotSkipAfterFailure`] or [`Mutant::BatchFailsWholeOnUnroutable`]).
struct WrongBatch {
    inner: MemoryBroker,
    mode: Mutant,
}

#[async_trait]
impl Broker for WrongBatch {
    fn backend(&self) -> &'static str {
        "mutant"
    }
    async fn declare(&self, d: &Destination, g: &[ConsumerGroup]) -> Result<()> {
        self.inner.declare(d, g).await
    }
    async fn publish(&self, e: &Event) -> Result<()> {
        self.inner.publish(e).await
    }
    async fn publish_batch(&self, events: &[Event]) -> Vec<Result<()>> {
        let mut out = Vec::with_capacity(events.len());
        match self.mode {
            Mutant::BatchFailsWholeOnUnroutable => {
                // The reference batch (key lanes, skips after a failure), then the whole batch lost.
                out = self.inner.publish_batch(events).await;
                if out.iter().any(|r| r.as_ref().is_err_and(|e| e.kind() == ErrorKind::Unroutable)) {
                    let lost = Error::outcome_unknown(ErrorKind::Connection, "mutant", "the connection was closed");
                    out = events.iter().map(|_| Err(lost.clone())).collect();
                }
            }
            Mutant::BatchReversesOrder => {
                for e in events.iter().rev() {
                    out.push(self.inner.publish(e).await);
                }
                out.reverse();
            }
            _ => {
                for e in events {
                    out.push(self.inner.publish(e).await);
                }
            }
        }
        out
    }
    async fn subscribe(&self, d: &Destination, g: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        self.inner.subscribe(d, g).await
    }
}

/// [`Mutant::RedeclareSkipsToTheEnd`] on the reference broker: a group declared (or created by a
/// subscription) before is, on the next `declare`, told to pass over every event in the
/// destination's log at that moment; its subscriptions acknowledge those unseen.
struct Redeclaring {
    inner: MemoryBroker,
    /// Per (destination, group): `None` while never re-declared, else the events it passes over.
    groups: Mutex<BTreeMap<(String, String), Option<PassedOver>>>,
}

/// The events a re-declared group of [`Redeclaring`] passes over.
type PassedOver = Arc<HashSet<EventId>>;

impl Redeclaring {
    fn key(d: &Destination, g: &ConsumerGroup) -> (String, String) {
        (d.as_str().to_owned(), g.as_str().to_owned())
    }
}

#[async_trait]
impl Broker for Redeclaring {
    fn backend(&self) -> &'static str {
        "mutant"
    }
    async fn declare(&self, d: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        self.inner.declare(d, groups).await?;
        let logged: PassedOver = Arc::new(self.inner.log(d).into_iter().map(|e| e.id).collect());
        let mut known = lock(&self.groups);
        for g in groups {
            match known.get_mut(&Self::key(d, g)) {
                Some(skip) => *skip = Some(logged.clone()),
                None => {
                    known.insert(Self::key(d, g), None);
                }
            }
        }
        Ok(())
    }
    async fn publish(&self, e: &Event) -> Result<()> {
        self.inner.publish(e).await
    }
    async fn subscribe(&self, d: &Destination, g: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        let inner = self.inner.subscribe(d, g).await?;
        let skip = lock(&self.groups).entry(Self::key(d, g)).or_insert(None).clone();
        Ok(match skip {
            Some(skip) => Box::new(Skipping { inner, skip }),
            None => inner,
        })
    }
}

/// A subscription of [`Redeclaring`] that acknowledges, unseen, the events it passes over.
struct Skipping {
    inner: Box<dyn Subscription>,
    skip: Arc<HashSet<EventId>>,
}

#[async_trait]
impl Subscription for Skipping {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        loop {
            match self.inner.receive(wait).await? {
                Some(Received::Event(d)) if self.skip.contains(&d.event.id) => d.ack().await?,
                other => return Ok(other),
            }
        }
    }
}

/// An AMQP-like model on the reference broker: each destination is an exchange, each group a
/// queue named `q.<destination>.<group>` bound to it, and a publish goes to every bound queue
/// (`mandatory`: no queue bound is Unroutable). The join is the bug: two pairs whose joined
/// names are equal share one queue.
struct JoinedQueues {
    inner: MemoryBroker,
    bindings: Mutex<BTreeMap<Destination, BTreeSet<Destination>>>,
}

fn queue_group() -> ConsumerGroup {
    ConsumerGroup::new("queue").expect("valid group name")
}

impl JoinedQueues {
    fn queue(d: &Destination, g: &ConsumerGroup) -> Result<Destination> {
        Destination::new(format!("q.{d}.{g}"))
    }
}

/// The event as stored in a queue: its destination is the queue's, so the original one travels
/// in front of the payload.
fn envelope(e: &Event, queue: &Destination) -> Event {
    let d = e.destination.as_str().as_bytes();
    let mut payload = Vec::with_capacity(1 + d.len() + e.payload.len());
    payload.push(u8::try_from(d.len()).unwrap_or(u8::MAX));
    payload.extend_from_slice(d);
    payload.extend_from_slice(&e.payload);
    Event { destination: queue.clone(), payload, ..e.clone() }
}

fn open_envelope(mut e: Event) -> Result<Event> {
    let bad = || Error::permanent(ErrorKind::Corrupt, "mutant", "bad envelope");
    let n = usize::from(*e.payload.first().ok_or_else(bad)?);
    let d = e.payload.get(1..=n).ok_or_else(bad)?;
    e.destination = Destination::new(String::from_utf8(d.to_vec()).map_err(|_| bad())?)?;
    e.payload.drain(..=n);
    Ok(e)
}

/// Raw messages for [`JoinedQueues`]: written to the suite group's queue.
struct QueueForeign(MemoryBroker);

#[async_trait]
impl ForeignWriter for QueueForeign {
    async fn write(&self, d: &Destination, kind: ForeignKind, id: &str, payload: &[u8]) -> Result<Foreign> {
        let queue = JoinedQueues::queue(d, &crate::world::suite_group())?;
        self.0.declare(&queue, &[queue_group()]).await?;
        MemoryForeign(self.0.clone()).write(&queue, kind, id, payload).await
    }
}

struct OpenEnvelopes(Box<dyn Subscription>);

#[async_trait]
impl Subscription for OpenEnvelopes {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        match self.0.receive(wait).await? {
            Some(Received::Event(d)) => {
                let (redelivered, attempt) = (d.redelivered, d.attempt);
                let (event, acker) = d.into_parts();
                Ok(Some(Received::Event(Delivery::new(open_envelope(event)?, redelivered, attempt, acker))))
            }
            other => Ok(other),
        }
    }
}

#[async_trait]
impl Broker for JoinedQueues {
    fn backend(&self) -> &'static str {
        "mutant"
    }
    async fn declare(&self, d: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        let mut queues = Vec::new();
        for g in groups {
            let q = Self::queue(d, g)?;
            self.inner.declare(&q, &[queue_group()]).await?;
            queues.push(q);
        }
        lock(&self.bindings).entry(d.clone()).or_default().extend(queues);
        Ok(())
    }
    async fn publish(&self, e: &Event) -> Result<()> {
        let queues = lock(&self.bindings).get(&e.destination).cloned();
        let Some(queues) = queues.filter(|q| !q.is_empty()) else {
            return Err(Error::transient(
                ErrorKind::Unroutable,
                "mutant",
                format!("no queue bound to {}", e.destination),
            ));
        };
        for q in &queues {
            self.inner.publish(&envelope(e, q)).await?;
        }
        Ok(())
    }
    async fn subscribe(&self, d: &Destination, g: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        self.declare(d, std::slice::from_ref(g)).await?;
        Ok(Box::new(OpenEnvelopes(self.inner.subscribe(&Self::queue(d, g)?, &queue_group()).await?)))
    }
}

/// A plain relay with one fault ([`Mutant::RelayCompletesFailedPublish`],
/// [`Mutant::RelayPublishesOneKeyConcurrently`], [`Mutant::RelayKeepsLeasesOnShutdown`] or
/// [`Mutant::RelayParksOnRefusedCredentials`]). Without its fault it is correct: rows in row
/// order, one at a time; a failed row holds back the rest of its key; refused credentials
/// release the row; shutdown releases what was not published.
struct WrongRelay {
    store: Arc<dyn OutboxStore>,
    broker: Arc<dyn Broker>,
    config: RelayConfig,
    fault: Mutant,
    stop: AtomicBool,
    stopped: Notify,
    totals: Mutex<BatchReport>,
    /// Rows the next claim asks for: halved after a fenced batch, as the reference relay does
    /// (not under [`Mutant::RelayKeepsBatchSizeAfterLeaseLost`]).
    limit: AtomicUsize,
}

impl WrongRelay {
    fn new(store: Arc<dyn OutboxStore>, broker: Arc<dyn Broker>, config: RelayConfig, fault: Mutant) -> Self {
        Self {
            store,
            broker,
            fault,
            stop: AtomicBool::new(false),
            stopped: Notify::new(),
            totals: Mutex::default(),
            limit: AtomicUsize::new(config.batch_size.max(1)),
            config,
        }
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    async fn settle(&self, c: &Claimed, r: Result<()>, report: &mut BatchReport, sent: &mut Vec<(RowId, Lease)>) {
        match r {
            Ok(()) => sent.push((c.record.row_id, c.lease.clone())),
            Err(e) if self.fault == Mutant::RelayCompletesFailedPublish && e.retry() != Retry::Permanent => {
                // "It will surely go through": completed without being on the broker.
                sent.push((c.record.row_id, c.lease.clone()));
            }
            Err(e) if e.kind() == ErrorKind::Auth && self.fault != Mutant::RelayParksOnRefusedCredentials => {
                if self.store.release(c.record.row_id, &c.lease).await.ok() == Some(Outcome::Applied) {
                    report.refused += 1;
                }
            }
            Err(e) if e.retry() == Retry::Permanent || c.record.attempts + 1 >= self.config.max_attempts => {
                if self.store.park(c.record.row_id, &c.lease, &e.to_string()).await.ok() == Some(Outcome::Applied) {
                    report.parked += 1;
                }
            }
            Err(e) => {
                if self.store.fail(c.record.row_id, &c.lease, Duration::ZERO, &e.to_string()).await.ok()
                    == Some(Outcome::Applied)
                {
                    report.retried += 1;
                }
            }
        }
    }

    async fn release(&self, c: &Claimed, report: &mut BatchReport) {
        if self.store.release(c.record.row_id, &c.lease).await.ok() == Some(Outcome::Applied) {
            report.released += 1;
        }
    }

    async fn batch(&self) -> Result<BatchReport> {
        let limit = self.limit.load(Ordering::SeqCst);
        let claimed = self.store.claim(&self.config.owner, limit, self.config.lease).await?;
        let mut report = BatchReport { claimed: claimed.len() as u64, ..BatchReport::default() };
        let mut sent = Vec::new();
        if self.fault == Mutant::RelayPublishesOneKeyConcurrently {
            let results = futures::future::join_all(claimed.iter().map(|c| self.broker.publish(&c.record.event))).await;
            for (c, r) in claimed.iter().zip(results) {
                self.settle(c, r, &mut report, &mut sent).await;
            }
        } else {
            let mut failed_keys = HashSet::new();
            for c in &claimed {
                if self.stopping() {
                    if self.fault != Mutant::RelayKeepsLeasesOnShutdown {
                        self.release(c, &mut report).await;
                    }
                    continue;
                }
                if c.record.event.key.as_ref().is_some_and(|k| failed_keys.contains(k)) {
                    self.release(c, &mut report).await;
                    continue;
                }
                let r = self.broker.publish(&c.record.event).await;
                if r.is_err()
                    && let Some(k) = &c.record.event.key
                {
                    failed_keys.insert(k.clone());
                }
                self.settle(c, r, &mut report, &mut sent).await;
            }
        }
        if self.fault == Mutant::RelayCompletesAThousandRowsOfABatch {
            sent.truncate(1_000);
        }
        if !sent.is_empty() {
            for outcome in self.store.complete_many(&sent).await? {
                match outcome {
                    Completion::Published => report.published += 1,
                    Completion::Fenced => report.fenced += 1,
                }
            }
        }
        if report.fenced > 0 && self.fault != Mutant::RelayKeepsBatchSizeAfterLeaseLost {
            self.limit.store((claimed.len() / 2).max(1), Ordering::SeqCst);
        }
        let mut t = lock(&self.totals);
        t.claimed += report.claimed;
        t.published += report.published;
        t.fenced += report.fenced;
        t.retried += report.retried;
        t.parked += report.parked;
        t.released += report.released;
        Ok(report)
    }
}

#[async_trait]
impl RelayUnderTest for WrongRelay {
    async fn run_once(&self) -> Result<BatchReport> {
        if self.stopping() {
            return Ok(BatchReport::default());
        }
        self.batch().await
    }

    async fn run(&self) -> Result<BatchReport> {
        while !self.stopping() {
            let stopped = self.stopped.notified();
            let limit = self.limit.load(Ordering::SeqCst) as u64;
            match self.batch().await {
                Ok(r) if r.claimed == limit && self.fault == Mutant::RelayStallsAfterAFullBatch => {
                    // "The completion will wake us": it never does; only shutdown ends the wait.
                    stopped.await;
                    continue;
                }
                Ok(r) if r.claimed > 0 => continue,
                _ => {}
            }
            if self.stopping() {
                break;
            }
            let _ = tokio::time::timeout(self.config.idle_poll, stopped).await;
        }
        Ok(*lock(&self.totals))
    }

    fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.stopped.notify_waiters();
    }
}

struct AckedElsewhere;

#[async_trait]
impl Acknowledge for AckedElsewhere {
    async fn ack(self: Box<Self>) -> Result<()> {
        Ok(())
    }
    async fn nack(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}

/// [`Mutant::AckThenCommit`]: the consumer runtime's steps with the acknowledgement moved in
/// front of the commit ("the commit cannot fail now").
/// [`Mutant::DropsForeign`]: acknowledge and forget.
pub(crate) async fn drop_foreign(foreign: ForeignDelivery) -> Result<Handled> {
    let problem = foreign.problem;
    foreign.ack().await?;
    Ok(Handled::Malformed { problem })
}

/// [`Mutant::RecordsForeignEachDelivery`]: write the dead letter without the inbox marker that
/// recognises a redelivery, commit, acknowledge.
pub(crate) async fn record_foreign_each_delivery<I: Inbox, H: Handler<I>>(
    consumer: &Consumer<I, H>,
    foreign: ForeignDelivery,
) -> Result<Handled> {
    let (problem, error) = (foreign.problem, foreign.describe());
    let (event, _) = foreign.message.to_event();
    let record = DeadLetter::new(consumer.config().name.clone(), event, DeadLetterReason::Malformed, error);
    let inbox = consumer.inbox();
    let written = async {
        let mut tx = inbox.begin().await?;
        inbox.dead_letter(&mut tx, &record).await?;
        inbox.commit(tx).await
    }
    .await;
    match written {
        Ok(()) => {
            foreign.ack().await?;
            Ok(Handled::Malformed { problem })
        }
        Err(e) => {
            foreign.nack().await?;
            Ok(Handled::Retry { attempts: 0, error: e.to_string() })
        }
    }
}

/// [`Mutant::AckForeignBeforeRecord`]: acknowledge, then write the dead letter.
pub(crate) async fn ack_foreign_then_record<I: Inbox, H: Handler<I>>(
    consumer: &Consumer<I, H>,
    foreign: ForeignDelivery,
) -> Result<Handled> {
    let (problem, error) = (foreign.problem, foreign.describe());
    let (event, _) = foreign.message.to_event();
    foreign.ack().await?;
    let record = DeadLetter::new(consumer.config().name.clone(), event, DeadLetterReason::Malformed, error);
    let inbox = consumer.inbox();
    let written = async {
        let mut tx = inbox.begin().await?;
        inbox.dead_letter(&mut tx, &record).await?;
        inbox.commit(tx).await
    }
    .await;
    Ok(match written {
        Ok(()) => Handled::Malformed { problem },
        Err(e) => Handled::Retry { attempts: 0, error: e.to_string() },
    })
}

/// [`Mutant::BatchAcksRolledBack`]: the batch's deliveries guarded and applied in one
/// transaction; when one fails, the transaction is dropped (rolled back) but the deliveries
/// before it are acknowledged as applied ("they went through"), and the rest are handled alone.
pub(crate) async fn batch_acks_rolled_back<I: Inbox, H: Handler<I>>(
    consumer: &Consumer<I, H>,
    deliveries: Vec<Delivery>,
) -> Vec<Result<Handled>> {
    let (inbox, name) = (consumer.inbox(), consumer.config().name.clone());
    let mut done = 0;
    let attempt = async {
        let mut tx = inbox.begin().await?;
        for d in &deliveries {
            if inbox.mark(&mut tx, &name, &d.event.id, &d.event.fingerprint()).await? == MarkOutcome::New {
                consumer.handler().apply(&mut tx, &d.event).await?;
            }
            done += 1;
        }
        inbox.commit(tx).await
    }
    .await;
    let mut out = Vec::new();
    let mut rest = deliveries.into_iter();
    if attempt.is_ok() {
        for d in rest {
            out.push(d.ack().await.map(|()| Handled::Applied));
        }
        return out;
    }
    for d in rest.by_ref().take(done) {
        out.push(d.ack().await.map(|()| Handled::Applied));
    }
    for d in rest {
        out.push(consumer.process(d).await);
    }
    out
}

pub(crate) async fn ack_then_commit<I: Inbox, H: Handler<I>>(
    consumer: &Consumer<I, H>,
    delivery: Delivery,
) -> Result<Handled> {
    let (redelivered, attempt) = (delivery.redelivered, delivery.attempt);
    let (event, acker) = delivery.into_parts();
    let mut f = consumer.receive(Delivery::new(event, redelivered, attempt, Box::new(AckedElsewhere)));
    if f.guard().await.is_ok() && f.apply().await.is_ok() {
        acker.ack().await?;
        let _ = f.commit().await;
    } else {
        acker.nack().await?;
    }
    f.acknowledge().await
}
