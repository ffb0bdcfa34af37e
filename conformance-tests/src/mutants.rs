//! Deliberately wrong variants of the reference backends: the suite's proof that it has teeth.
//!
//! Each variant wraps a correct reference component and breaks exactly one rule of the
//! contract. A suite that passes any of them is not judging what it claims to judge.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::memory::{MemoryBroker, MemoryInbox, MemoryOutbox, MemoryTx};
use outbox_core::store::all_rows;
use outbox_core::{
    Acknowledge, Broker, Claimed, Completion, ConsumerGroup, DeadLetter, Delivery, Destination, Event, EventId,
    Fingerprint, Inbox, InboxAdmin, Lease, LedgerState, ManualClock, MarkOutcome, Marker, OutboxStats, OutboxStore,
    Outcome, ParkedRow, Result, RowId, RowSnapshot, RowStatus, Subscription, VersionOutcome,
};

use crate::harness::{Capabilities, EffectRow, EffectTable, Fixture, Harness};
use crate::reference::{decode_effect, encode_effect, memory_capabilities};

/// A wrong variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// Completion without the token (or owner) check.
    NoFencing,
    /// Claim that ignores lease expiry (steals live leases).
    ClaimIgnoresExpiry,
    /// Claim that does not increment the token.
    ClaimKeepsToken,
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
}

impl Mutant {
    /// Every wrong variant.
    pub const ALL: [Mutant; 8] = [
        Mutant::NoFencing,
        Mutant::ClaimIgnoresExpiry,
        Mutant::ClaimKeepsToken,
        Mutant::PublishedOnClaim,
        Mutant::MarkerFirst,
        Mutant::EffectFirst,
        Mutant::AckBeforeCommit,
        Mutant::ProcessLocalDedupe,
    ];
}

impl fmt::Display for Mutant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoFencing => "completion without the token check",
            Self::ClaimIgnoresExpiry => "claim that ignores lease expiry",
            Self::ClaimKeepsToken => "claim that does not increment the token",
            Self::PublishedOnClaim => "mark published before publishing",
            Self::MarkerFirst => "marker and effect in separate transactions (marker first)",
            Self::EffectFirst => "marker and effect in separate transactions (effect first)",
            Self::AckBeforeCommit => "ack before commit",
            Self::ProcessLocalDedupe => "dedupe in a process-local set",
        })
    }
}

/// The reference store with one rule broken.
struct MutantStore {
    inner: MemoryOutbox,
    mode: Mutant,
    first_tokens: Mutex<std::collections::HashMap<RowId, u64>>,
}

impl MutantStore {
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
        self.inner.enqueue(events).await
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
        let mut claimed = self.inner.claim(owner, limit, lease).await?;
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
        self.inner.complete(row, &lease).await
    }

    async fn fail(&self, row: RowId, lease: &Lease, retry_after: Duration, error: &str) -> Result<Outcome> {
        let lease = self.translate(row, lease).await?;
        self.inner.fail(row, &lease, retry_after, error).await
    }

    async fn park(&self, row: RowId, lease: &Lease, reason: &str) -> Result<Outcome> {
        let lease = self.translate(row, lease).await?;
        self.inner.park(row, &lease, reason).await
    }

    async fn extend(&self, row: RowId, lease: &Lease, by: Duration) -> Result<Outcome> {
        let lease = self.translate(row, lease).await?;
        self.inner.extend(row, &lease, by).await
    }

    async fn release(&self, row: RowId, lease: &Lease) -> Result<Outcome> {
        let lease = self.translate(row, lease).await?;
        self.inner.release(row, &lease).await
    }

    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedRow>> {
        self.inner.list_parked(limit).await
    }

    async fn requeue_parked(&self, rows: &[RowId]) -> Result<u64> {
        self.inner.requeue_parked(rows).await
    }

    async fn purge_parked(&self, rows: &[RowId]) -> Result<u64> {
        self.inner.purge_parked(rows).await
    }

    async fn stats(&self) -> Result<OutboxStats> {
        self.inner.stats().await
    }

    async fn inspect(&self, after: RowId, limit: usize) -> Result<Vec<RowSnapshot>> {
        self.inner.inspect(after, limit).await
    }
}

/// The reference inbox with one rule broken.
#[derive(Clone)]
pub struct MutantInbox {
    inner: MemoryInbox,
    mode: Mutant,
    local: Arc<Mutex<HashSet<(String, EventId)>>>,
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
            _ => self.inner.mark(&mut tx.inner, consumer, event_id, fp).await,
        }
    }

    async fn advance_version(&self, tx: &mut MutantTx, c: &str, s: &str, v: u64) -> Result<VersionOutcome> {
        self.inner.advance_version(&mut tx.inner, c, s, v).await
    }

    async fn ledger_state(&self, tx: &mut MutantTx, c: &str, id: &EventId) -> Result<LedgerState> {
        self.inner.ledger_state(&mut tx.inner, c, id).await
    }

    async fn set_ledger_state(&self, tx: &mut MutantTx, c: &str, id: &EventId, s: LedgerState) -> Result<()> {
        self.inner.set_ledger_state(&mut tx.inner, c, id, s).await
    }

    async fn dead_letter(&self, tx: &mut MutantTx, record: &DeadLetter) -> Result<()> {
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
        self.inner.markers(c).await
    }

    async fn dead_letters(&self, c: &str) -> Result<Vec<DeadLetter>> {
        self.inner.dead_letters(c).await
    }

    async fn remove_dead_letters(&self, c: &str, ids: &[i64]) -> Result<u64> {
        self.inner.remove_dead_letters(c, ids).await
    }

    async fn prune_markers(&self, c: &str, older_than: Duration) -> Result<u64> {
        self.inner.prune_markers(c, older_than).await
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

/// The reference broker, acknowledging on receipt.
struct AckOnReceipt(MemoryBroker);

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
    async fn next(&mut self, wait: Duration) -> Result<Option<Delivery>> {
        let Some(d) = self.0.next(wait).await? else { return Ok(None) };
        let (redelivered, attempt) = (d.redelivered, d.attempt);
        let (event, acker) = d.into_parts();
        acker.ack().await?;
        Ok(Some(Delivery::new(event, redelivered, attempt, Box::new(AlreadyAcked))))
    }
}

#[async_trait]
impl Broker for AckOnReceipt {
    fn backend(&self) -> &'static str {
        "mutant"
    }
    async fn declare(&self, d: &Destination, g: &[ConsumerGroup]) -> Result<()> {
        self.0.declare(d, g).await
    }
    async fn publish(&self, e: &Event) -> Result<()> {
        self.0.publish(e).await
    }
    async fn subscribe(&self, d: &Destination, g: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        Ok(Box::new(EarlyAckSubscription(self.0.subscribe(d, g).await?)))
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
        memory_capabilities()
    }

    async fn fixture(&self, _case: &str, clock: ManualClock) -> Result<Fixture<MutantInbox>> {
        let mode = self.0;
        let memory = MemoryInbox::new(Arc::new(clock.clone()));
        let store = MutantStore { inner: MemoryOutbox::new(Arc::new(clock)), mode, first_tokens: Mutex::default() };
        let broker: Arc<dyn Broker> = if mode == Mutant::AckBeforeCommit {
            Arc::new(AckOnReceipt(MemoryBroker::new()))
        } else {
            Arc::new(MemoryBroker::new())
        };
        let inbox = MutantInbox { inner: memory.clone(), mode, local: Arc::default() };
        let mut fx = Fixture::new(
            Arc::new(store),
            broker,
            inbox,
            Arc::new(MutantEffects(memory.clone())),
            Destination::new("suite")?,
        );
        // A restarted process starts with an empty process-local set.
        fx.restart_inbox = Arc::new(move || MutantInbox { inner: memory.clone(), mode, local: Arc::default() });
        Ok(fx)
    }
}
