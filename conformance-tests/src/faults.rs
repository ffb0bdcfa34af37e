//! Faults the suite injects between a backend and the code that drives it.
//!
//! Some promises are only visible when something fails at one precise moment: a publish that
//! fails transiently, a publish still in flight when shutdown comes, an inbox commit that fails
//! after the effect ran. Real servers can't be asked to fail on cue, so the suite wraps the
//! backend's own components in decorators that fail (or hold) exactly where a case needs it and
//! otherwise forward every call. What is judged is still the backend's durable state; the
//! decorators only decide *when* things go wrong, and record what the driving code asked for.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    Broker, Claimed, Completion, ConsumerGroup, DeadLetter, Destination, Error, ErrorKind, Event, EventId, Fingerprint,
    Inbox, InboxAdmin, Lease, LedgerState, MarkOutcome, Marker, OutboxStore, Outcome, Result, Retry, RowId,
    Subscription, VersionOutcome, Wakeup,
};
use tokio::sync::Notify;

use crate::harness::{EffectRow, EffectTable};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A one-way flag that can be awaited: once opened it stays open.
#[derive(Debug, Default)]
pub struct Latch {
    open: AtomicBool,
    notify: Notify,
}

impl Latch {
    /// Open it (wakes every waiter, now and later).
    pub fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// Whether it is open.
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::SeqCst)
    }

    /// Wait until it is open, at most `limit`; `false` when the time ran out.
    pub async fn wait(&self, limit: Duration) -> bool {
        tokio::time::timeout(limit, async {
            loop {
                let notified = self.notify.notified();
                if self.is_open() {
                    return;
                }
                notified.await;
            }
        })
        .await
        .is_ok()
    }
}

/// Holds one publish: the call says it started, then waits until the case lets it go.
#[derive(Debug, Default)]
pub struct Hold {
    /// Opened by the held publish when it starts.
    pub started: Latch,
    /// Opened by the case to let the held publish continue.
    pub release: Latch,
}

/// How long a held publish waits for its release before giving up (with a transient error), so
/// that a case whose driver never releases it still ends.
pub const HOLD_LIMIT: Duration = Duration::from_secs(30);

/// What the driving code asked a [`Faulty`] broker to do, and what happened.
#[derive(Debug, Clone, Default)]
pub struct PublishLog {
    /// Event ids in the order their publish calls started.
    pub started: Vec<EventId>,
    /// Event ids the wrapped broker accepted, in the order it accepted them.
    pub accepted: Vec<EventId>,
    /// Publishes that failed: the event id, the error's kind and retry class, its text.
    pub failed: Vec<(EventId, ErrorKind, Retry, String)>,
    /// Keys that had two or more publishes in flight at once, with the most seen together.
    pub overlapping_keys: BTreeMap<String, usize>,
}

impl PublishLog {
    /// A key that had two or more publishes in flight at once, said with every publish call;
    /// `None` when none did.
    pub fn overlap(&self) -> Option<String> {
        self.overlapping_keys.iter().next().map(|(key, n)| {
            format!("{n} rows of key {key} were being published at the same time (publish calls: {:?})", self.started)
        })
    }
}

/// An injected failure: kind, retry class, message.
type Injected = (ErrorKind, Retry, String);

#[derive(Default)]
struct FaultState {
    failures: Mutex<HashMap<EventId, VecDeque<Injected>>>,
    hold: Mutex<Option<Arc<Hold>>>,
    in_flight: Mutex<HashMap<String, usize>>,
    log: Mutex<PublishLog>,
}

/// A [`Broker`] decorator that injects publish faults and records the publishes it sees.
///
/// - [`fail_next`](Faulty::fail_next): the next publish of an event id fails with the given
///   error instead of reaching the broker;
/// - [`hold_next`](Faulty::hold_next): the next publish call waits until released;
/// - every publish yields to the scheduler a few times before it is forwarded, so publishes that
///   a relay runs concurrently are in flight together even on an in-process broker, and two
///   publishes of one key in flight at once are recorded ([`PublishLog::overlapping_keys`]).
///
/// Clones share the script and the log.
#[derive(Clone)]
pub struct Faulty {
    inner: Arc<dyn Broker>,
    state: Arc<FaultState>,
}

/// Yields per publish: enough for every concurrently polled publish to start before any ends.
const YIELDS: usize = 8;

impl Faulty {
    /// Wrap `inner`; with no faults scripted it forwards everything.
    pub fn new(inner: Arc<dyn Broker>) -> Self {
        Self { inner, state: Arc::default() }
    }

    /// The next publish of `id` fails with an error of `kind` and `retry` class (queued: call
    /// twice for two failures).
    pub fn fail_next(&self, id: &EventId, kind: ErrorKind, retry: Retry) {
        lock(&self.state.failures).entry(id.clone()).or_default().push_back((
            kind,
            retry,
            format!("{kind:?} failure injected by the suite for {id}"),
        ));
    }

    /// The next publish call (of any event) waits on the returned [`Hold`].
    pub fn hold_next(&self) -> Arc<Hold> {
        let hold = Arc::new(Hold::default());
        *lock(&self.state.hold) = Some(hold.clone());
        hold
    }

    /// Publishes the wrapped broker accepted so far (the length of [`PublishLog::accepted`],
    /// without copying the log).
    pub fn accepted(&self) -> usize {
        lock(&self.state.log).accepted.len()
    }

    /// What happened so far.
    pub fn log(&self) -> PublishLog {
        lock(&self.state.log).clone()
    }

    /// The wrapped broker as a trait object.
    pub fn shared(&self) -> Arc<dyn Broker> {
        Arc::new(self.clone())
    }
}

#[async_trait]
impl Broker for Faulty {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn capabilities(&self) -> outbox_core::Capabilities {
        self.inner.capabilities()
    }

    fn preferred_pipeline_depth(&self) -> Option<usize> {
        self.inner.preferred_pipeline_depth()
    }

    async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        self.inner.declare(destination, groups).await
    }

    async fn publish(&self, event: &Event) -> Result<()> {
        let st = &self.state;
        lock(&st.log).started.push(event.id.clone());
        if let Some(key) = &event.key {
            let mut flying = lock(&st.in_flight);
            let n = flying.entry(key.clone()).or_default();
            *n += 1;
            if *n > 1 {
                let mut log = lock(&st.log);
                let seen = log.overlapping_keys.entry(key.clone()).or_default();
                *seen = (*seen).max(*n);
            }
        }
        let result = self.forward(event).await;
        if let Some(key) = &event.key
            && let Some(n) = lock(&st.in_flight).get_mut(key)
        {
            *n = n.saturating_sub(1);
        }
        let mut log = lock(&st.log);
        match &result {
            Ok(()) => log.accepted.push(event.id.clone()),
            Err(e) => log.failed.push((event.id.clone(), e.kind(), e.retry(), e.to_string())),
        }
        result
    }

    async fn subscribe(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        self.inner.subscribe(destination, group).await
    }
}

impl Faulty {
    async fn forward(&self, event: &Event) -> Result<()> {
        let hold = lock(&self.state.hold).take();
        if let Some(hold) = hold {
            hold.started.open();
            if !hold.release.wait(HOLD_LIMIT).await {
                return Err(Error::transient(
                    ErrorKind::Timeout,
                    "suite",
                    format!("the held publish of {} was not released within {HOLD_LIMIT:?}", event.id),
                ));
            }
        }
        for _ in 0..YIELDS {
            tokio::task::yield_now().await;
        }
        let injected = lock(&self.state.failures).get_mut(&event.id).and_then(VecDeque::pop_front);
        match injected {
            Some((kind, retry, message)) => Err(Error::new(kind, retry, "suite", message)),
            None => self.inner.publish(event).await,
        }
    }
}

/// An [`Inbox`] decorator whose next `n` commits fail after the effect ran: the transaction is
/// rolled back (dropped) and a transient [`ErrorKind::Busy`] error is returned, as a database
/// does on a serialization failure at `COMMIT`.
pub struct FailingCommit<I> {
    inner: I,
    remaining: Arc<AtomicU32>,
    failed: Arc<AtomicU32>,
}

impl<I: Inbox> FailingCommit<I> {
    /// Wrap `inner`; its next `n` commits fail.
    pub fn new(inner: I, n: u32) -> Self {
        Self { inner, remaining: Arc::new(AtomicU32::new(n)), failed: Arc::default() }
    }

    /// How many commits were made to fail so far.
    pub fn failed(&self) -> u32 {
        self.failed.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl<I: Inbox> InboxAdmin for FailingCommit<I> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
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

#[async_trait]
impl<I: Inbox> Inbox for FailingCommit<I> {
    type Tx = I::Tx;

    async fn begin(&self) -> Result<I::Tx> {
        self.inner.begin().await
    }

    async fn commit(&self, tx: I::Tx) -> Result<()> {
        let fail = self.remaining.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if fail {
            drop(tx); // rolled back: nothing of it is durable
            self.failed.fetch_add(1, Ordering::SeqCst);
            return Err(Error::transient(
                ErrorKind::Busy,
                "suite",
                "commit failed: serialization failure injected by the suite; the transaction was rolled back",
            ));
        }
        self.inner.commit(tx).await
    }

    async fn mark(&self, tx: &mut I::Tx, c: &str, id: &EventId, fp: &Fingerprint) -> Result<MarkOutcome> {
        self.inner.mark(tx, c, id, fp).await
    }

    async fn begin_marked(&self, c: &str, id: &EventId, fp: &Fingerprint) -> Result<(I::Tx, MarkOutcome)> {
        self.inner.begin_marked(c, id, fp).await
    }

    async fn advance_version(&self, tx: &mut I::Tx, c: &str, s: &str, v: u64) -> Result<VersionOutcome> {
        self.inner.advance_version(tx, c, s, v).await
    }

    async fn ledger_state(&self, tx: &mut I::Tx, c: &str, id: &EventId) -> Result<LedgerState> {
        self.inner.ledger_state(tx, c, id).await
    }

    async fn set_ledger_state(&self, tx: &mut I::Tx, c: &str, id: &EventId, s: LedgerState) -> Result<()> {
        self.inner.set_ledger_state(tx, c, id, s).await
    }

    async fn dead_letter(&self, tx: &mut I::Tx, record: &DeadLetter) -> Result<()> {
        self.inner.dead_letter(tx, record).await
    }

    async fn record_failure(&self, c: &str, id: &EventId) -> Result<u32> {
        self.inner.record_failure(c, id).await
    }
}

/// A backend's effect table seen through a [`FailingCommit`] (same transaction type).
pub struct EffectsThrough<I: Inbox>(pub Arc<dyn EffectTable<I>>);

#[async_trait]
impl<I: Inbox> EffectTable<FailingCommit<I>> for EffectsThrough<I> {
    async fn insert(&self, tx: &mut I::Tx, row: &EffectRow) -> Result<()> {
        self.0.insert(tx, row).await
    }

    async fn rows(&self) -> Result<Vec<EffectRow>> {
        self.0.rows().await
    }
}

/// An [`OutboxStore`] decorator whose completions lag behind the relay's other stages, and that
/// counts the rows it saw completed.
///
/// Each `complete` and `complete_many` lets other tasks run [`LAG_YIELDS`] times before it is
/// forwarded, so a relay that pipelines its batches has several of them published and waiting
/// for their outcomes while it decides whether to claim again: the moment where a claim stage
/// that waits for a completion's signal, and is never sent one, stops for good. Every row the
/// inner store answers [`Completion::Published`] is counted and announced, so a case waits for a
/// drain to finish on a signal, with a deadline, instead of polling the store.
///
/// Everything else is forwarded, [`OutboxStore::one_writer`] and [`OutboxStore::wakeup`]
/// included (a relay treats the decorated store as it treats the backend's own).
pub struct LaggingCompletions {
    inner: Arc<dyn OutboxStore>,
    published: AtomicUsize,
    moved: Notify,
    /// What the first completion waits for, and for how long at most, if anything.
    hold_first: Option<(Box<dyn Fn() -> bool + Send + Sync>, Duration)>,
    held: AtomicBool,
}

/// Yields before each completion: more than a [`Faulty`] publish takes, so that on an in-process
/// broker the next batch's publish ends before this batch's outcomes are recorded.
pub const LAG_YIELDS: usize = 4 * YIELDS;

impl LaggingCompletions {
    /// Wrap `inner`.
    pub fn new(inner: Arc<dyn OutboxStore>) -> Self {
        Self {
            inner,
            published: AtomicUsize::new(0),
            moved: Notify::new(),
            hold_first: None,
            held: AtomicBool::new(false),
        }
    }

    /// The first completion also waits until `until` holds (checked between yields, for at most
    /// `limit`; then it goes on, and the case judges what the relay did), so that batches
    /// published meanwhile wait for the completion stage together. A relay that publishes
    /// nothing more while a completion is pending (a serial one) only waits out `limit`.
    #[must_use]
    pub fn with_first_held_until(mut self, until: impl Fn() -> bool + Send + Sync + 'static, limit: Duration) -> Self {
        self.hold_first = Some((Box::new(until), limit));
        self
    }

    /// Rows completed as published so far.
    pub fn published(&self) -> usize {
        self.published.load(Ordering::SeqCst)
    }

    /// Wait until at least `n` rows were completed as published; `false` if `limit` passed
    /// first.
    pub async fn wait_published(&self, n: usize, limit: Duration) -> bool {
        let waited = tokio::time::timeout(limit, async {
            loop {
                let signal = self.moved.notified();
                if self.published() >= n {
                    return;
                }
                signal.await;
            }
        });
        waited.await.is_ok()
    }

    async fn lag(&self) {
        if let Some((until, limit)) = &self.hold_first
            && !self.held.swap(true, Ordering::SeqCst)
        {
            let deadline = tokio::time::Instant::now() + *limit;
            while !until() && tokio::time::Instant::now() < deadline {
                tokio::task::yield_now().await;
            }
        }
        for _ in 0..LAG_YIELDS {
            tokio::task::yield_now().await;
        }
    }

    fn count(&self, outcomes: &[Completion]) {
        let n = outcomes.iter().filter(|c| **c == Completion::Published).count();
        self.published.fetch_add(n, Ordering::SeqCst);
        self.moved.notify_waiters();
    }
}

#[async_trait]
impl OutboxStore for LaggingCompletions {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    async fn enqueue(&self, events: &[Event]) -> Result<Vec<RowId>> {
        self.inner.enqueue(events).await
    }
    async fn claim(&self, owner: &str, limit: usize, lease: Duration) -> Result<Vec<Claimed>> {
        self.inner.claim(owner, limit, lease).await
    }
    async fn complete(&self, row: RowId, lease: &Lease) -> Result<Completion> {
        self.lag().await;
        let done = self.inner.complete(row, lease).await?;
        self.count(&[done]);
        Ok(done)
    }
    async fn complete_many(&self, rows: &[(RowId, Lease)]) -> Result<Vec<Completion>> {
        self.lag().await;
        let done = self.inner.complete_many(rows).await?;
        self.count(&done);
        Ok(done)
    }
    async fn fail(&self, row: RowId, lease: &Lease, retry_after: Duration, error: &str) -> Result<Outcome> {
        self.inner.fail(row, lease, retry_after, error).await
    }
    async fn park(&self, row: RowId, lease: &Lease, reason: &str) -> Result<Outcome> {
        self.inner.park(row, lease, reason).await
    }
    async fn extend(&self, row: RowId, lease: &Lease, by: Duration) -> Result<Outcome> {
        self.inner.extend(row, lease, by).await
    }
    async fn release(&self, row: RowId, lease: &Lease) -> Result<Outcome> {
        self.inner.release(row, lease).await
    }
    fn wakeup(&self) -> Option<Wakeup> {
        self.inner.wakeup()
    }
    fn one_writer(&self) -> bool {
        self.inner.one_writer()
    }
}
