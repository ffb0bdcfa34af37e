//! The relay and the reference store, judged by durable state: row status, tokens and the
//! broker's log.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::memory::{MemoryBroker, MemoryOutbox};
use outbox_core::store::all_rows;
use outbox_core::{
    Backoff, BatchReport, Broker, Clock, Completion, ConsumerGroup, Destination, Error, ErrorKind, Event, EventId,
    ManualClock, OutboxAdmin, OutboxStore, Relay, RelayConfig, Retry, RowStatus, Subscription,
};
use tokio::sync::Notify;

const LEASE: Duration = Duration::from_secs(10);

/// Longest any wait of these tests may take: a relay that never gets there fails the test with
/// a message instead of hanging it.
const LIMIT: Duration = Duration::from_secs(10);

/// Await `fut` for at most [`LIMIT`], panicking with `what` when it runs out.
async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, fut).await.unwrap_or_else(|_| panic!("{what} did not happen within {LIMIT:?}"))
}

fn dest() -> Destination {
    Destination::new("orders").unwrap()
}

fn event(id: &str) -> Event {
    Event::new(EventId::new(id).unwrap(), dest(), id.as_bytes().to_vec())
}

async fn setup() -> (ManualClock, MemoryOutbox, MemoryBroker) {
    let clock = ManualClock::default();
    let store = MemoryOutbox::new(Arc::new(clock.clone()));
    let broker = MemoryBroker::new();
    broker.declare(&dest(), &[]).await.unwrap();
    (clock, store, broker)
}

/// The design's own story: claim A, send, lease expires, claim B, send, A completes → fenced,
/// B completes → published; the broker holds two copies; the row is published by B's token.
#[tokio::test]
async fn stale_relay_is_fenced_and_the_duplicate_stays_visible() {
    let (clock, store, broker) = setup().await;
    store.enqueue(&[event("e1")]).await.unwrap();

    let a = store.claim("relay-a", 10, LEASE).await.unwrap();
    assert_eq!(a.len(), 1);
    broker.publish(&a[0].record.event).await.unwrap();

    // Relay A stalls; its lease expires; relay B claims the same row with a newer token.
    assert!(store.claim("relay-b", 10, LEASE).await.unwrap().is_empty(), "live lease must not be stolen");
    clock.advance(LEASE + Duration::from_millis(1));
    let b = store.claim("relay-b", 10, LEASE).await.unwrap();
    assert_eq!(b.len(), 1);
    assert!(b[0].lease.token > a[0].lease.token);
    broker.publish(&b[0].record.event).await.unwrap();

    assert_eq!(store.complete(a[0].record.row_id, &a[0].lease).await.unwrap(), Completion::Fenced);
    let rows = all_rows(&store).await.unwrap();
    assert_eq!(rows[0].status, RowStatus::Leased, "a fenced completion changes nothing");
    assert_eq!(rows[0].published_token, None);

    assert_eq!(store.complete(b[0].record.row_id, &b[0].lease).await.unwrap(), Completion::Published);
    let rows = all_rows(&store).await.unwrap();
    assert_eq!(rows[0].status, RowStatus::Published);
    assert_eq!(rows[0].published_token, Some(b[0].lease.token));
    assert_eq!(rows[0].token, b[0].lease.token);

    let log = broker.log(&dest());
    assert_eq!(log.len(), 2, "the duplicate offer is on the broker, not hidden");
    assert!(log.iter().all(|e| e.id.as_str() == "e1"));

    // Completing again with the winning lease is fenced too: already published.
    assert_eq!(store.complete(b[0].record.row_id, &b[0].lease).await.unwrap(), Completion::Fenced);
}

/// The same story through two `Relay`s: relay A publishes but its store calls stall until its
/// lease expired and relay B re-published; A's completion is counted as fenced.
#[tokio::test]
async fn relay_counts_fenced_completions() {
    let (clock, store, broker) = setup().await;
    store.enqueue(&[event("e1"), event("e2")]).await.unwrap();
    let gate = Arc::new(Notify::new());
    let stalled = Arc::new(StallComplete::new(store.clone(), gate.clone()));
    let relay_a = Relay::new(stalled, Arc::new(broker.clone()), config("relay-a"));
    let relay_b = Relay::new(Arc::new(store.clone()), Arc::new(broker.clone()), config("relay-b"));

    let a = tokio::spawn(async move { relay_a.run_once().await.unwrap() });
    // Wait (with a deadline) until A has published both events.
    wait_until("A published both events", || broker.log(&dest()).len() == 2).await;
    clock.advance(LEASE * 2);
    let rb = relay_b.run_once().await.unwrap();
    assert_eq!((rb.claimed, rb.published, rb.fenced), (2, 2, 0));
    gate.notify_one();
    let ra = within("relay A finishing its batch", a).await.unwrap();
    assert_eq!((ra.claimed, ra.published, ra.fenced), (2, 0, 2));

    let rows = all_rows(&store).await.unwrap();
    assert!(rows.iter().all(|r| r.status == RowStatus::Published && r.published_token == Some(r.token)));
    assert_eq!(broker.log(&dest()).len(), 4);
}

/// A store whose completions wait for `gate` (when `stall_complete`), and whose claim number
/// `hold_claim.0` (counting from 1) signals `hold_claim.1.0` and waits for `hold_claim.1.1`.
/// It answers `one_writer` as told, lets other tasks run `claim_yields` times before each claim
/// and `complete_yields` times before each completion, and records the most rows it had leased out (claimed, not yet completed) when a
/// claim began, and the number of rows of each `complete_many` call.
struct StallComplete {
    inner: MemoryOutbox,
    gate: Arc<Notify>,
    stall_complete: bool,
    claims: std::sync::atomic::AtomicUsize,
    hold_claim: Option<(usize, Arc<(Notify, Notify)>)>,
    one_writer: bool,
    claim_yields: usize,
    complete_yields: usize,
    leased: std::sync::atomic::AtomicUsize,
    most_leased_at_claim: std::sync::atomic::AtomicUsize,
    completions: Mutex<Vec<usize>>,
}

impl StallComplete {
    fn new(inner: MemoryOutbox, gate: Arc<Notify>) -> Self {
        Self {
            inner,
            gate,
            stall_complete: true,
            claims: Default::default(),
            hold_claim: None,
            one_writer: false,
            claim_yields: 0,
            complete_yields: 0,
            leased: Default::default(),
            most_leased_at_claim: Default::default(),
            completions: Mutex::default(),
        }
    }
}

#[async_trait]
impl OutboxStore for StallComplete {
    fn backend(&self) -> &'static str {
        "stall"
    }
    async fn enqueue(&self, events: &[Event]) -> outbox_core::Result<Vec<i64>> {
        self.inner.enqueue(events).await
    }
    async fn claim(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> outbox_core::Result<Vec<outbox_core::Claimed>> {
        use std::sync::atomic::Ordering::SeqCst;
        self.most_leased_at_claim.fetch_max(self.leased.load(SeqCst), SeqCst);
        let n = self.claims.fetch_add(1, SeqCst) + 1;
        if let Some((at, gate)) = &self.hold_claim
            && n == *at
        {
            gate.0.notify_one();
            if tokio::time::timeout(LIMIT, gate.1.notified()).await.is_err() {
                return Err(Error::transient(ErrorKind::Timeout, "stall", "the claim gate was never opened"));
            }
        }
        for _ in 0..self.claim_yields {
            tokio::task::yield_now().await;
        }
        let rows = self.inner.claim(owner, limit, lease).await?;
        self.leased.fetch_add(rows.len(), SeqCst);
        Ok(rows)
    }
    async fn complete(&self, row: i64, lease: &outbox_core::Lease) -> outbox_core::Result<Completion> {
        self.inner.complete(row, lease).await
    }
    async fn complete_many(&self, rows: &[(i64, outbox_core::Lease)]) -> outbox_core::Result<Vec<Completion>> {
        if self.stall_complete && tokio::time::timeout(LIMIT, self.gate.notified()).await.is_err() {
            return Err(Error::transient(ErrorKind::Timeout, "stall", "the gate was never opened"));
        }
        for _ in 0..self.complete_yields {
            tokio::task::yield_now().await;
        }
        self.completions.lock().unwrap().push(rows.len());
        let out = self.inner.complete_many(rows).await?;
        self.leased.fetch_sub(rows.len(), std::sync::atomic::Ordering::SeqCst);
        Ok(out)
    }
    async fn fail(
        &self,
        row: i64,
        lease: &outbox_core::Lease,
        d: Duration,
        e: &str,
    ) -> outbox_core::Result<outbox_core::Outcome> {
        self.inner.fail(row, lease, d, e).await
    }
    async fn park(&self, row: i64, lease: &outbox_core::Lease, r: &str) -> outbox_core::Result<outbox_core::Outcome> {
        self.inner.park(row, lease, r).await
    }
    async fn extend(
        &self,
        row: i64,
        lease: &outbox_core::Lease,
        by: Duration,
    ) -> outbox_core::Result<outbox_core::Outcome> {
        self.inner.extend(row, lease, by).await
    }
    async fn release(&self, row: i64, lease: &outbox_core::Lease) -> outbox_core::Result<outbox_core::Outcome> {
        self.inner.release(row, lease).await
    }
    fn one_writer(&self) -> bool {
        self.one_writer
    }
}

#[async_trait]
impl OutboxAdmin for StallComplete {
    async fn list_parked(&self, limit: usize) -> outbox_core::Result<Vec<outbox_core::ParkedRow>> {
        self.inner.list_parked(limit).await
    }
    async fn requeue_parked(&self, rows: &[i64]) -> outbox_core::Result<u64> {
        self.inner.requeue_parked(rows).await
    }
    async fn purge_parked(&self, rows: &[i64]) -> outbox_core::Result<u64> {
        self.inner.purge_parked(rows).await
    }
    async fn stats(&self) -> outbox_core::Result<outbox_core::OutboxStats> {
        self.inner.stats().await
    }
    async fn inspect(&self, after: i64, limit: usize) -> outbox_core::Result<Vec<outbox_core::RowSnapshot>> {
        self.inner.inspect(after, limit).await
    }
}

/// Yield until `cond` holds; a panic naming `what` after [`LIMIT`].
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "{what}: not reached within {LIMIT:?}");
        tokio::task::yield_now().await;
    }
}

fn config(owner: &str) -> RelayConfig {
    RelayConfig::default()
        .with_owner(owner)
        .with_lease(LEASE)
        .with_max_attempts(3)
        .with_backoff(
            Backoff::new(Duration::from_secs(1), Duration::from_secs(60)).with_multiplier(2.0).with_jitter(0.0),
        )
        .with_seed(Some(7))
}

/// A broker that answers publishes from a script of results, then delegates.
struct Scripted {
    inner: MemoryBroker,
    script: Mutex<VecDeque<Option<Error>>>,
    gate: Option<Arc<(Notify, Notify)>>,
}

impl Scripted {
    fn new(inner: MemoryBroker, script: Vec<Option<Error>>) -> Self {
        Self { inner, script: Mutex::new(script.into()), gate: None }
    }
}

#[async_trait]
impl Broker for Scripted {
    fn backend(&self) -> &'static str {
        "scripted"
    }
    async fn declare(&self, d: &Destination, g: &[ConsumerGroup]) -> outbox_core::Result<()> {
        self.inner.declare(d, g).await
    }
    async fn publish(&self, event: &Event) -> outbox_core::Result<()> {
        if let Some(gate) = &self.gate {
            gate.0.notify_one(); // "publish started"
            // Wait for permission, bounded: a relay that publishes more than the test lets
            // through gets an error instead of waiting forever.
            if tokio::time::timeout(LIMIT, gate.1.notified()).await.is_err() {
                return Err(Error::transient(ErrorKind::Timeout, "scripted", "the gate was never opened"));
            }
        }
        let next = self.script.lock().unwrap().pop_front().flatten();
        match next {
            Some(e) => Err(e),
            None => self.inner.publish(event).await,
        }
    }
    async fn subscribe(&self, d: &Destination, g: &ConsumerGroup) -> outbox_core::Result<Box<dyn Subscription>> {
        self.inner.subscribe(d, g).await
    }
}

fn transient() -> Option<Error> {
    Some(Error::transient(ErrorKind::Connection, "scripted", "connection reset"))
}

#[tokio::test]
async fn transient_failures_back_off_then_park_after_max_attempts() {
    let (clock, store, broker) = setup().await;
    store.enqueue(&[event("e1")]).await.unwrap();
    let scripted = Scripted::new(broker.clone(), vec![transient(), transient(), transient()]);
    let relay = Relay::new(Arc::new(store.clone()), Arc::new(scripted), config("r"));

    let r = relay.run_once().await.unwrap();
    assert_eq!((r.claimed, r.retried, r.parked), (1, 1, 0));
    let row = &all_rows(&store).await.unwrap()[0];
    assert_eq!((row.status, row.attempts), (RowStatus::Pending, 1));
    assert_eq!(row.available_at.as_millis() - clock.now().as_millis(), 1000, "first backoff is `initial`");
    assert!(row.last_error.as_deref().unwrap().contains("connection reset"));

    // Not due yet: nothing claimable until the backoff passed.
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    clock.advance(Duration::from_millis(1000));
    assert_eq!(relay.run_once().await.unwrap().retried, 1);
    let row = &all_rows(&store).await.unwrap()[0];
    assert_eq!(row.available_at.as_millis() - clock.now().as_millis(), 2000, "backoff doubles");

    clock.advance(Duration::from_secs(2));
    let r = relay.run_once().await.unwrap();
    assert_eq!(r.parked, 1, "third failure reaches max_attempts = 3");
    let parked = store.list_parked(10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert!(
        parked[0].reason.contains("attempt 3") && parked[0].reason.contains("connection reset"),
        "{}",
        parked[0].reason
    );
    assert!(broker.log(&dest()).is_empty());

    // Parked rows are visible and replayable.
    clock.advance(Duration::from_secs(3600));
    assert_eq!(relay.run_once().await.unwrap().claimed, 0, "parked rows are never claimed");
    assert_eq!(store.requeue_parked(&[parked[0].record.row_id]).await.unwrap(), 1);
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    assert_eq!(broker.log(&dest()).len(), 1);
    assert_eq!(all_rows(&store).await.unwrap()[0].status, RowStatus::Published);
}

#[tokio::test]
async fn permanent_failure_parks_at_once_and_outcome_unknown_is_offered_again() {
    let (_clock, store, broker) = setup().await;
    store.enqueue(&[event("too-big"), event("maybe")]).await.unwrap();
    let script = vec![
        Some(Error::permanent(ErrorKind::TooLarge, "scripted", "message too large")),
        Some(Error::outcome_unknown(ErrorKind::Timeout, "scripted", "delivery timed out")),
    ];
    let cfg = config("r").with_backoff(Backoff::none());
    let relay = Relay::new(Arc::new(store.clone()), Arc::new(Scripted::new(broker.clone(), script)), cfg);
    let r = relay.run_once().await.unwrap();
    assert_eq!((r.parked, r.retried), (1, 1));
    let rows = all_rows(&store).await.unwrap();
    assert_eq!(rows[0].status, RowStatus::Parked);
    assert_eq!(rows[1].status, RowStatus::Pending);
    assert_eq!(rows[1].attempts, 1);
    let r = relay.run_once().await.unwrap();
    assert_eq!(r.published, 1, "outcome unknown is treated as not published and offered again");
    assert_eq!(broker.log(&dest()).iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), ["maybe"]);
}

/// Shutdown while two batches are at the broker (the second was claimed and published while the
/// first still waited) and a third waits, claimed ahead, for a place: the two finish and are
/// completed, the third is released unpublished (no attempt counted), nothing else is claimed,
/// no lease is left.
#[tokio::test]
async fn graceful_shutdown_finishes_the_publishes_in_flight_and_releases_the_batch_claimed_ahead() {
    let (_clock, store, broker) = setup().await;
    let events: Vec<Event> = (1..=5).map(|i| event(&format!("e{i}"))).collect();
    store.enqueue(&events).await.unwrap();
    let gate = Gate::new();
    let flaky = Arc::new(Flaky { gate: Some(gate.clone()), ..Flaky::new(broker.clone()) });
    let relay = Arc::new(Relay::new(
        Arc::new(store.clone()),
        flaky.clone(),
        config("r").with_batch_size(1).with_pipeline_depth(2),
    ));
    let shutdown = relay.shutdown_handle();
    let running = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await.unwrap() }
    });
    // The second batch reaches the broker while the first is still there, and a third is
    // claimed ahead; it waits for a place at the broker (depth 2), and no fourth is claimed.
    wait_until("two batches at the broker and a third claimed", || {
        flaky.batches().len() >= 2 && relay.totals().claimed >= 3
    })
    .await;
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert_eq!(relay.totals().claimed, 3, "one batch claimed ahead, not more");
    assert_eq!(flaky.batches().len(), 2, "two batches at the broker at depth 2");
    shutdown.trigger();
    gate.open.add_permits(2);
    let totals = within("the relay stopping after shutdown", running).await.unwrap();
    assert_eq!((totals.claimed, totals.published, totals.released), (3, 2, 1), "{totals:?}");
    assert_eq!(flaky.batches(), [vec!["e1"], vec!["e2"]], "one batch per claim, in claim order");

    let rows = all_rows(&store).await.unwrap();
    for r in &rows[..2] {
        assert_eq!((r.status, r.token, r.published_token), (RowStatus::Published, 1, Some(1)), "{r:?}");
    }
    assert_eq!(
        (rows[2].status, rows[2].token, rows[2].attempts, rows[2].owner.as_deref()),
        (RowStatus::Pending, 1, 0, None),
        "e3 was claimed ahead, then released without an attempt"
    );
    for r in &rows[3..] {
        assert_eq!((r.status, r.token, r.owner.as_deref()), (RowStatus::Pending, 0, None), "never claimed: {r:?}");
    }
    let mut ids = log_ids(&broker);
    ids.sort();
    assert_eq!(ids, ["e1", "e2"]);
    // Another relay picks up the rest at once, in order.
    let other = Relay::new(Arc::new(store.clone()), Arc::new(broker.clone()), config("r2"));
    assert_eq!(other.drain().await.unwrap().published, 3);
    assert_eq!(log_ids(&broker)[2..], ["e3", "e4", "e5"]);
}

/// A batch whose claim returns after shutdown began is released unpublished (no attempt
/// counted, no lease left), while the batch already at the broker finishes and is completed.
#[tokio::test]
async fn a_batch_claimed_as_shutdown_begins_is_released_unpublished() {
    let (_clock, store, broker) = setup().await;
    let events: Vec<Event> = (1..=3).map(|i| event(&format!("e{i}"))).collect();
    store.enqueue(&events).await.unwrap();
    let claim_gate = Arc::new((Notify::new(), Notify::new()));
    let stalled = Arc::new(StallComplete {
        stall_complete: false,
        hold_claim: Some((2, claim_gate.clone())),
        ..StallComplete::new(store.clone(), Arc::new(Notify::new()))
    });
    let gate = Gate::new();
    let flaky = Arc::new(Flaky { gate: Some(gate.clone()), ..Flaky::new(broker.clone()) });
    let relay = Arc::new(Relay::new(stalled, flaky.clone(), config("r").with_batch_size(1).with_pipeline_depth(2)));
    let running = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await.unwrap() }
    });
    within("the first batch reaching the broker", gate.started.notified()).await;
    within("the second claim starting", claim_gate.0.notified()).await;
    relay.shutdown_handle().trigger();
    claim_gate.1.notify_one();
    gate.open.add_permits(1);
    let totals = within("the relay stopping after shutdown", running).await.unwrap();
    assert_eq!((totals.claimed, totals.published, totals.released), (2, 1, 1), "{totals:?}");
    assert_eq!(flaky.batches(), [vec!["e1"]], "the batch claimed during shutdown never reached the broker");

    let rows = all_rows(&store).await.unwrap();
    assert_eq!(rows[0].status, RowStatus::Published);
    for r in &rows[1..] {
        assert_eq!((r.status, r.attempts, r.owner.as_deref()), (RowStatus::Pending, 0, None), "{r:?}");
    }
    assert_eq!((rows[1].token, rows[2].token), (1, 0), "e2 was claimed once, then released; e3 never");
    let other = Relay::new(Arc::new(store.clone()), Arc::new(broker.clone()), config("r2"));
    assert_eq!(other.drain().await.unwrap().published, 2);
    assert_eq!(log_ids(&broker), ["e1", "e2", "e3"]);
}

#[tokio::test]
async fn key_order_holds_within_a_batch_and_a_failure_holds_back_its_key() {
    let (_clock, store, broker) = setup().await;
    let events = vec![
        event("a1").with_key("a"),
        event("b1").with_key("b"),
        event("a2").with_key("a"),
        event("b2").with_key("b"),
    ];
    store.enqueue(&events).await.unwrap();
    // The first publish (a1, the first lane) fails: a2 must not overtake it.
    let relay = Relay::new(
        Arc::new(store.clone()),
        Arc::new(Scripted::new(broker.clone(), vec![transient()])),
        config("r").with_backoff(Backoff::none()),
    );
    let r = relay.run_once().await.unwrap();
    assert_eq!((r.published, r.retried, r.released), (2, 1, 1));
    let ids: Vec<_> = broker.log(&dest()).iter().map(|e| e.id.to_string()).collect();
    assert_eq!(ids, ["b1", "b2"]);
    relay.run_once().await.unwrap();
    let ids: Vec<_> = broker.log(&dest()).iter().map(|e| e.id.to_string()).collect();
    assert_eq!(ids, ["b1", "b2", "a1", "a2"]);
}

#[tokio::test]
async fn invalid_input_is_rejected_and_nothing_is_written() {
    let err = EventId::new("bad id").unwrap_err();
    assert_eq!((err.kind(), err.retry()), (ErrorKind::InvalidInput, Retry::Permanent));
    assert!(err.to_string().contains("not visible ASCII"), "{err}");

    let (_clock, store, _broker) = setup().await;
    let store = store.with_max_payload(8);
    let big = Event::new(EventId::new("big").unwrap(), dest(), vec![0u8; 9]);
    let err = store.enqueue(&[event("ok"), big]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge);
    assert!(err.to_string().contains("big") && err.to_string().contains("limit of 8"), "{err}");
    assert!(all_rows(&store).await.unwrap().is_empty(), "one bad event rejects the whole batch");

    store.enqueue(&[event("dup")]).await.unwrap();
    let err = store.enqueue(&[event("dup2"), event("dup")]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert_eq!(all_rows(&store).await.unwrap().len(), 1);
}

#[tokio::test]
async fn token_conditional_transitions_and_stats() {
    let (clock, store, _broker) = setup().await;
    store.enqueue(&[event("e1"), event("e2"), event("e3")]).await.unwrap();
    let c = store.claim("a", 2, LEASE).await.unwrap();
    let stale = outbox_core::Lease { token: c[0].lease.token + 7, ..c[0].lease.clone() };
    for outcome in [
        store.fail(c[0].record.row_id, &stale, Duration::ZERO, "x").await.unwrap(),
        store.park(c[0].record.row_id, &stale, "x").await.unwrap(),
        store.extend(c[0].record.row_id, &stale, LEASE).await.unwrap(),
        store.release(c[0].record.row_id, &stale).await.unwrap(),
    ] {
        assert_eq!(outcome, outbox_core::Outcome::Fenced);
    }
    clock.advance(Duration::from_secs(3));
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.leased, s.parked, s.published), (1, 2, 0, 0));
    assert_eq!(s.oldest_pending_age, Some(Duration::from_secs(3)));

    // Extending keeps the lease alive past its original expiry; the token stays.
    assert_eq!(store.extend(c[0].record.row_id, &c[0].lease, LEASE).await.unwrap(), outbox_core::Outcome::Applied);
    clock.advance(LEASE - Duration::from_secs(1));
    let again = store.claim("b", 10, LEASE).await.unwrap();
    let ids: Vec<_> = again.iter().map(|c| c.record.event.id.to_string()).collect();
    assert_eq!(ids, ["e2", "e3"], "e1's extended lease is live; e2's expired");
    assert_eq!(store.complete(c[0].record.row_id, &c[0].lease).await.unwrap(), Completion::Published);
    assert_eq!(store.purge_parked(&[c[0].record.row_id]).await.unwrap(), 0, "only parked rows are purged");
}

/// The token, not the owner name, is the fence: a relay that restarts under the same name (or
/// re-claims its own expired row) cannot complete with its older token.
#[tokio::test]
async fn the_token_fences_even_when_the_owner_name_repeats() {
    let (clock, store, broker) = setup().await;
    store.enqueue(&[event("e1")]).await.unwrap();
    let first = store.claim("relay-a", 1, LEASE).await.unwrap().remove(0);
    broker.publish(&first.record.event).await.unwrap();
    clock.advance(LEASE);
    let second = store.claim("relay-a", 1, LEASE).await.unwrap().remove(0);
    assert_eq!(second.lease.token, first.lease.token + 1);
    assert_eq!(store.complete(first.record.row_id, &first.lease).await.unwrap(), Completion::Fenced);
    assert_eq!(all_rows(&store).await.unwrap()[0].published_token, None);
    assert_eq!(store.complete(second.record.row_id, &second.lease).await.unwrap(), Completion::Published);
    assert_eq!(all_rows(&store).await.unwrap()[0].published_token, Some(second.lease.token));
}

/// Refused credentials are not the row's fault: the row is released (no attempt counted, not
/// parked) and the broker is not asked again before `idle_poll`.
#[tokio::test]
async fn refused_credentials_release_the_row_without_parking_it() {
    let (_clock, store, broker) = setup().await;
    store.enqueue(&[event("e1")]).await.unwrap();
    let auth = || Some(Error::auth("scripted", "ACCESS_REFUSED: login refused for user 'outbox'"));
    let relay =
        Relay::new(Arc::new(store.clone()), Arc::new(Scripted::new(broker.clone(), vec![auth(), auth()])), config("r"));

    let r = relay.run_once().await.unwrap();
    assert_eq!((r.claimed, r.refused, r.parked, r.retried), (1, 1, 0, 0));
    let row = &all_rows(&store).await.unwrap()[0];
    assert_eq!((row.status, row.attempts), (RowStatus::Pending, 0), "no attempt counted, not parked");
    assert!(store.list_parked(10).await.unwrap().is_empty());

    // `run` does not claim again at once after a refusal: with a long idle_poll, the second
    // refusal is the last publish attempt before shutdown.
    let relay = Arc::new(Relay::new(
        Arc::new(store.clone()),
        Arc::new(Scripted::new(broker.clone(), vec![auth()])),
        config("r").with_idle_poll(Duration::from_secs(3600)),
    ));
    let stop = relay.shutdown_handle();
    let running = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await }
    });
    wait_until("one batch refused", || relay.totals().refused == 1).await;
    stop.trigger();
    let totals = within("the relay stops", running).await.unwrap().unwrap();
    assert_eq!((totals.claimed, totals.refused, totals.published), (1, 1, 0), "one claim, then the idle wait");
    assert!(broker.log(&dest()).is_empty());
    let row = &all_rows(&store).await.unwrap()[0];
    assert_eq!((row.status, row.attempts), (RowStatus::Pending, 0));
}

/// A decorator over [`MemoryBroker`] with a `publish_batch` of its own, offering events one
/// after another in slice order. It fails the next offer of chosen event ids, answers chosen ids
/// with `Skipped`, records the ids of every batch it was handed, and can hold each batch at a
/// gate. With `keep_going` it breaks the `Skipped` rule on purpose: after a failure it still
/// sends the later events of the key (a pipelining broker whose first write failed while the
/// next went through), so the relay's own per-key walk is what keeps the order.
#[derive(Default)]
struct Flaky {
    inner: MemoryBroker,
    fail: Mutex<std::collections::HashMap<String, Error>>,
    skip: Mutex<std::collections::HashSet<String>>,
    keep_going: bool,
    batches: Mutex<Vec<Vec<String>>>,
    gate: Option<Arc<Gate>>,
}

/// `started` is signalled when a batch arrives; the batch goes on once a permit of `open` is
/// available (one permit per batch).
struct Gate {
    started: Notify,
    open: tokio::sync::Semaphore,
}

impl Gate {
    fn new() -> Arc<Self> {
        Arc::new(Self { started: Notify::new(), open: tokio::sync::Semaphore::new(0) })
    }
}

impl Flaky {
    fn new(inner: MemoryBroker) -> Self {
        Self { inner, ..Self::default() }
    }

    fn fail_next(self, id: &str, error: Error) -> Self {
        self.fail.lock().unwrap().insert(id.to_owned(), error);
        self
    }

    fn skip_next(self, id: &str) -> Self {
        self.skip.lock().unwrap().insert(id.to_owned());
        self
    }

    fn batches(&self) -> Vec<Vec<String>> {
        self.batches.lock().unwrap().clone()
    }
}

#[async_trait]
impl Broker for Flaky {
    fn backend(&self) -> &'static str {
        "flaky"
    }
    async fn declare(&self, d: &Destination, g: &[ConsumerGroup]) -> outbox_core::Result<()> {
        self.inner.declare(d, g).await
    }
    async fn publish(&self, event: &Event) -> outbox_core::Result<()> {
        self.publish_batch(std::slice::from_ref(event)).await.remove(0)
    }
    async fn publish_batch(&self, events: &[Event]) -> Vec<outbox_core::Result<()>> {
        self.batches.lock().unwrap().push(events.iter().map(|e| e.id.to_string()).collect());
        if let Some(gate) = &self.gate {
            gate.started.notify_one();
            match tokio::time::timeout(LIMIT, gate.open.acquire()).await {
                Ok(permit) => permit.unwrap().forget(),
                Err(_) => {
                    return events
                        .iter()
                        .map(|_| Err(Error::transient(ErrorKind::Timeout, "flaky", "the gate was never opened")))
                        .collect();
                }
            }
        }
        let mut failed_keys = std::collections::HashSet::new();
        let mut out = Vec::new();
        for e in events {
            let id = e.id.to_string();
            if !self.keep_going && e.key.as_ref().is_some_and(|k| failed_keys.contains(k)) {
                out.push(Err(outbox_core::broker::skipped("flaky", "an earlier one")));
                continue;
            }
            let injected = self.fail.lock().unwrap().remove(&id);
            let r = if let Some(err) = injected {
                Err(err)
            } else if self.skip.lock().unwrap().remove(&id) {
                Err(outbox_core::broker::skipped("flaky", "another"))
            } else {
                self.inner.publish(e).await
            };
            if r.is_err()
                && let Some(k) = &e.key
            {
                failed_keys.insert(k.clone());
            }
            out.push(r);
        }
        out
    }
    async fn subscribe(&self, d: &Destination, g: &ConsumerGroup) -> outbox_core::Result<Box<dyn Subscription>> {
        self.inner.subscribe(d, g).await
    }
}

/// Ids in the broker's log, in order.
fn log_ids(broker: &MemoryBroker) -> Vec<String> {
    broker.log(&dest()).iter().map(|e| e.id.to_string()).collect()
}

/// For each key (by the first letter of the id), its ids in the order of their FIRST offer in the
/// broker's log.
fn first_offers_by_key(broker: &MemoryBroker) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut out: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for e in broker.log(&dest()) {
        let Some(k) = &e.key else { continue };
        let ids = out.entry(k.clone()).or_default();
        if !ids.contains(&e.id.to_string()) {
            ids.push(e.id.to_string());
        }
    }
    out
}

/// Pipelined: relay A publishes its second batch while the completion of its first is stalled.
/// Both leases expire, relay B re-publishes and completes both; A's overlapped completions
/// arrive late and are fenced, counted, and change nothing.
#[tokio::test]
async fn pipelined_batches_keep_fencing() {
    let (clock, store, broker) = setup().await;
    store.enqueue(&[event("e1"), event("e2")]).await.unwrap();
    let gate = Arc::new(Notify::new());
    let stalled = Arc::new(StallComplete::new(store.clone(), gate.clone()));
    let relay_a = Arc::new(Relay::new(
        stalled,
        Arc::new(broker.clone()),
        config("relay-a").with_batch_size(1).with_pipeline_depth(2),
    ));
    let a = tokio::spawn({
        let relay_a = relay_a.clone();
        async move { relay_a.drain().await.unwrap() }
    });
    // Overlap: e2 (batch 2) is published while e1's completion (batch 1) has not happened.
    wait_until("e1 and e2 published", || broker.log(&dest()).len() == 2).await;
    let rows = all_rows(&store).await.unwrap();
    assert!(rows.iter().all(|r| r.status == RowStatus::Leased && r.token == 1), "{rows:?}");

    clock.advance(LEASE * 2);
    let relay_b = Relay::new(Arc::new(store.clone()), Arc::new(broker.clone()), config("relay-b"));
    let rb = relay_b.drain().await.unwrap();
    assert_eq!((rb.claimed, rb.published, rb.fenced), (2, 2, 0));

    gate.notify_one();
    // Both batches' publishes have ended: their completions may be one call or two.
    wait_until("A's completion fenced", || relay_a.totals().fenced >= 1).await;
    gate.notify_one();
    let ra = within("relay A finishing", a).await.unwrap();
    assert_eq!((ra.claimed, ra.published, ra.fenced), (2, 0, 2), "{ra:?}");

    let rows = all_rows(&store).await.unwrap();
    for r in &rows {
        assert_eq!(r.status, RowStatus::Published);
        assert_eq!((r.token, r.published_token), (2, Some(2)), "published by B's token, not A's: {r:?}");
        assert_eq!(r.owner.as_deref(), Some("relay-b"));
    }
    assert_eq!(log_ids(&broker), ["e1", "e2", "e1", "e2"], "the duplicates stay visible");
}

/// Depth 1 is the serial relay: while a batch's completion is stalled nothing else is claimed.
#[tokio::test]
async fn depth_one_claims_only_after_the_outcomes_are_recorded() {
    let (_clock, store, broker) = setup().await;
    store.enqueue(&[event("e1"), event("e2")]).await.unwrap();
    let gate = Arc::new(Notify::new());
    let stalled = Arc::new(StallComplete::new(store.clone(), gate.clone()));
    let relay =
        Arc::new(Relay::new(stalled, Arc::new(broker.clone()), config("r").with_batch_size(1).with_pipeline_depth(1)));
    let task = tokio::spawn({
        let relay = relay.clone();
        async move { relay.drain().await.unwrap() }
    });
    wait_until("the first event published", || broker.log(&dest()).len() == 1).await;
    // Give a wrongly pipelined relay every chance to claim e2.
    for _ in 0..1000 {
        tokio::task::yield_now().await;
    }
    let rows = all_rows(&store).await.unwrap();
    assert_eq!((rows[0].status, rows[1].token), (RowStatus::Leased, 0), "e2 claimed before e1 completed: {rows:?}");
    assert_eq!(relay.totals().claimed, 1);

    gate.notify_one();
    wait_until("the second event published", || broker.log(&dest()).len() == 2).await;
    assert_eq!(all_rows(&store).await.unwrap()[0].status, RowStatus::Published);
    gate.notify_one();
    let r = within("the drain finishing", task).await.unwrap();
    assert_eq!((r.claimed, r.published, r.fenced, r.released), (2, 2, 0, 0));
    assert!(all_rows(&store).await.unwrap().iter().all(|r| r.status == RowStatus::Published));
    assert_eq!(log_ids(&broker), ["e1", "e2"]);
}

/// A failure in the middle of a batch: the failed row is retried, the later rows of its key are
/// released (Skipped by the broker) and published after it; other keys go on. The broker is
/// handed the whole batch in row-id order.
#[tokio::test]
async fn a_failed_row_holds_back_the_rest_of_its_key_within_a_batch() {
    let (_clock, store, broker) = setup().await;
    let events = vec![
        event("a1").with_key("a"),
        event("b1").with_key("b"),
        event("a2").with_key("a"),
        event("k1"),
        event("a3").with_key("a"),
        event("b2").with_key("b"),
    ];
    store.enqueue(&events).await.unwrap();
    let flaky = Arc::new(Flaky::new(broker.clone()).fail_next("a1", transient().unwrap()));
    let relay = Relay::new(Arc::new(store.clone()), flaky.clone(), config("r").with_backoff(Backoff::none()));

    let first = relay.run_once().await.unwrap();
    assert_eq!((first.claimed, first.published, first.retried, first.released), (6, 3, 1, 2), "{first:?}");
    let rows = all_rows(&store).await.unwrap();
    let by_id = |id: &str| rows.iter().find(|r| r.event.id.as_str() == id).unwrap().clone();
    assert_eq!((by_id("a1").status, by_id("a1").attempts), (RowStatus::Pending, 1));
    for id in ["a2", "a3"] {
        let r = by_id(id);
        assert_eq!((r.status, r.attempts, r.published_token), (RowStatus::Pending, 0, None), "{r:?}");
    }
    assert_eq!(log_ids(&broker), ["b1", "k1", "b2"]);

    let rest = relay.drain().await.unwrap();
    assert_eq!((rest.published, rest.retried, rest.released), (3, 0, 0), "{rest:?}");
    assert!(all_rows(&store).await.unwrap().iter().all(|r| r.status == RowStatus::Published));
    let firsts = first_offers_by_key(&broker);
    assert_eq!(firsts["a"], ["a1", "a2", "a3"]);
    assert_eq!(firsts["b"], ["b1", "b2"]);
    assert_eq!(
        flaky.batches(),
        [vec!["a1", "b1", "a2", "k1", "a3", "b2"], vec!["a1", "a2", "a3"]],
        "whole batches, in row-id order"
    );
}

/// A broker that keeps sending a key after one of its events failed: the relay still releases
/// every later row of the key, even the ones the broker accepted, and completes them only after
/// the failed row went through. The early copy is a visible duplicate, never a completion.
#[tokio::test]
async fn rows_accepted_after_their_keys_failure_are_released_not_completed() {
    let (_clock, store, broker) = setup().await;
    store.enqueue(&[event("a1").with_key("a"), event("a2").with_key("a"), event("b1").with_key("b")]).await.unwrap();
    let flaky = Flaky { keep_going: true, ..Flaky::new(broker.clone()) }.fail_next("a1", transient().unwrap());
    let relay = Relay::new(Arc::new(store.clone()), Arc::new(flaky), config("r").with_backoff(Backoff::none()));

    let first = relay.run_once().await.unwrap();
    assert_eq!((first.published, first.retried, first.released), (1, 1, 1), "{first:?}");
    assert_eq!(log_ids(&broker), ["a2", "b1"], "the broker took a2 although a1 failed");
    let a2 = all_rows(&store).await.unwrap().into_iter().find(|r| r.event.id.as_str() == "a2").unwrap();
    assert_eq!((a2.status, a2.published_token, a2.attempts), (RowStatus::Pending, None, 0), "{a2:?}");

    relay.drain().await.unwrap();
    let rows = all_rows(&store).await.unwrap();
    for r in &rows {
        assert_eq!(r.status, RowStatus::Published);
        assert_eq!(r.published_token, Some(r.token));
    }
    assert_eq!(log_ids(&broker), ["a2", "b1", "a1", "a2"]);
}

/// `Skipped` is not the row's fault: released, no attempt counted, no error recorded.
#[tokio::test]
async fn skipped_rows_count_no_attempt() {
    let (_clock, store, broker) = setup().await;
    store.enqueue(&[event("a1").with_key("a"), event("a2").with_key("a"), event("k1"), event("k2")]).await.unwrap();
    let flaky = Flaky::new(broker.clone()).skip_next("a1").skip_next("k1");
    let relay = Relay::new(Arc::new(store.clone()), Arc::new(flaky), config("r"));

    let first = relay.run_once().await.unwrap();
    assert_eq!(
        (first.claimed, first.published, first.released, first.retried, first.parked),
        (4, 1, 3, 0, 0),
        "{first:?}"
    );
    for r in all_rows(&store).await.unwrap().iter().filter(|r| r.event.id.as_str() != "k2") {
        assert_eq!((r.status, r.attempts, r.last_error.as_deref()), (RowStatus::Pending, 0, None), "{r:?}");
    }
    relay.drain().await.unwrap();
    for r in all_rows(&store).await.unwrap() {
        assert_eq!((r.status, r.attempts), (RowStatus::Published, 0), "{r:?}");
    }
    assert_eq!(first_offers_by_key(&broker)["a"], ["a1", "a2"]);
}

/// Shutdown with three batches at the broker at once (depth 3) and one claimed ahead: the three
/// finish and are completed, the one ahead is released, the unclaimed rows stay untouched, and
/// another relay then publishes the rest once.
#[tokio::test]
async fn shutdown_with_batches_in_flight_loses_nothing() {
    let (_clock, store, broker) = setup().await;
    let events: Vec<Event> = (1..=12).map(|i| event(&format!("e{i}"))).collect();
    store.enqueue(&events).await.unwrap();
    let gate = Gate::new();
    let flaky = Arc::new(Flaky { gate: Some(gate.clone()), ..Flaky::new(broker.clone()) });
    let relay = Arc::new(Relay::new(
        Arc::new(store.clone()),
        flaky.clone(),
        config("r").with_batch_size(2).with_pipeline_depth(3),
    ));
    let running = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await.unwrap() }
    });
    wait_until("three batches at the broker and eight rows claimed", || {
        flaky.batches().len() >= 3 && relay.totals().claimed >= 8
    })
    .await;
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert_eq!(relay.totals().claimed, 8, "three batches at the broker and one claimed ahead, no fifth claim");
    assert_eq!(flaky.batches().len(), 3, "no fourth batch at the broker at depth 3");
    relay.shutdown_handle().trigger();
    gate.open.add_permits(3);
    let totals = within("the relay stopping", running).await.unwrap();
    assert_eq!((totals.claimed, totals.published, totals.released, totals.fenced), (8, 6, 2, 0), "{totals:?}");
    assert_eq!(flaky.batches(), [vec!["e1", "e2"], vec!["e3", "e4"], vec!["e5", "e6"]]);

    let rows = all_rows(&store).await.unwrap();
    for r in &rows {
        let n: usize = r.event.id.as_str()[1..].parse().unwrap();
        let (status, token) = match n {
            1..=6 => (RowStatus::Published, 1),
            7..=8 => (RowStatus::Pending, 1),
            _ => (RowStatus::Pending, 0),
        };
        assert_eq!((r.status, r.token, r.attempts), (status, token, 0), "{r:?}");
        if status == RowStatus::Pending {
            assert_eq!(r.owner, None, "no lease left behind: {r:?}");
        }
    }
    let other = Relay::new(Arc::new(store.clone()), Arc::new(broker.clone()), config("r2"));
    assert_eq!(other.drain().await.unwrap().published, 6);
    let mut ids = log_ids(&broker);
    ids.sort_by_key(|id| id[1..].parse::<usize>().unwrap());
    assert_eq!(ids, (1..=12).map(|i| format!("e{i}")).collect::<Vec<_>>(), "each once");
}

/// A `metrics` recorder that keeps every counter and histogram, keyed `name{label=value,...}`.
#[derive(Default)]
struct Recorded {
    counters: Mutex<std::collections::BTreeMap<String, Arc<std::sync::atomic::AtomicU64>>>,
    histograms: Mutex<std::collections::BTreeMap<String, Arc<Observations>>>,
}

#[derive(Default)]
struct Observations(Mutex<Vec<f64>>);

impl metrics::HistogramFn for Observations {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

fn metric_key(key: &metrics::Key) -> String {
    let labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl metrics::Recorder for Recorded {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::from_arc(self.counters.lock().unwrap().entry(metric_key(key)).or_default().clone())
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::from_arc(self.histograms.lock().unwrap().entry(metric_key(key)).or_default().clone())
    }
}

impl Recorded {
    fn counter(&self, name: &str, owner: &str) -> u64 {
        self.counters
            .lock()
            .unwrap()
            .get(&format!("{name}{{owner={owner}}}"))
            .map_or(0, |c| c.load(std::sync::atomic::Ordering::SeqCst))
    }
    fn observations(&self, name: &str, owner: &str) -> Vec<f64> {
        self.histograms
            .lock()
            .unwrap()
            .get(&format!("{name}{{owner={owner}}}"))
            .map(|h| h.0.lock().unwrap().clone())
            .unwrap_or_default()
    }
}

/// The `outbox_relay_*` counters add up to `Relay::totals`; one publish latency per
/// `publish_batch` call, one claim latency per claim (an empty one too), one completion latency
/// per `complete_many` call, one batch latency per batch.
#[test]
fn metrics_add_up_to_the_totals() {
    let recorded = Recorded::default();
    metrics::with_local_recorder(&recorded, || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (_clock, store, broker) = setup().await;
            store
                .enqueue(&[event("a1").with_key("a"), event("a2").with_key("a"), event("k1"), event("k2")])
                .await
                .unwrap();
            let flaky = Arc::new(
                Flaky::new(broker.clone())
                    .fail_next("a1", Error::permanent(ErrorKind::TooLarge, "flaky", "message too large")),
            );
            let relay = Relay::new(Arc::new(store.clone()), flaky.clone(), config("metered"));
            let report = relay.drain().await.unwrap();
            let totals = relay.totals();
            assert_eq!(report, totals);
            assert_eq!(
                (totals.claimed, totals.published, totals.parked, totals.released, totals.retried),
                (4, 2, 1, 1, 0),
                "{totals:?}"
            );
            for (name, want) in [
                ("outbox_relay_claimed_total", totals.claimed),
                ("outbox_relay_published_total", totals.published),
                ("outbox_relay_fenced_total", totals.fenced),
                ("outbox_relay_retried_total", totals.retried),
                ("outbox_relay_parked_total", totals.parked),
                ("outbox_relay_released_total", totals.released),
                ("outbox_relay_refused_total", totals.refused),
            ] {
                assert_eq!(recorded.counter(name, "metered"), want, "{name}");
            }
            assert_eq!(recorded.observations("outbox_relay_publish_seconds", "metered").len(), flaky.batches().len());
            assert_eq!(recorded.observations("outbox_relay_batch_seconds", "metered").len(), 1);
            // Two claims: the batch of 4, then the empty one that ends the drain. One completion
            // call: k1 and k2 (a1 was parked, a2 released behind it).
            assert_eq!(recorded.observations("outbox_relay_claim_seconds", "metered").len(), 2);
            assert_eq!(recorded.observations("outbox_relay_complete_seconds", "metered").len(), 1);
            // Durable state agrees: the parked row holds its key back.
            let rows = all_rows(&store).await.unwrap();
            let status: Vec<_> = rows.iter().map(|r| (r.event.id.to_string(), r.status)).collect();
            assert_eq!(
                status,
                [
                    ("a1".to_owned(), RowStatus::Parked),
                    ("a2".to_owned(), RowStatus::Pending),
                    ("k1".to_owned(), RowStatus::Published),
                    ("k2".to_owned(), RowStatus::Published)
                ]
            );
        });
    });
}

/// Shutdown in the middle of a batch published by the default `publish_batch` (one key, one
/// publish at a time): the publish in flight finishes and is completed, the rest of the batch is
/// never sent and is released without an attempt.
#[tokio::test]
async fn shutdown_stops_a_batch_between_two_publishes() {
    let (_clock, store, broker) = setup().await;
    let events: Vec<Event> = (1..=3).map(|i| event(&format!("e{i}")).with_key("acct-1")).collect();
    store.enqueue(&events).await.unwrap();
    let gate = Arc::new((Notify::new(), Notify::new()));
    let scripted = Scripted { inner: broker.clone(), script: Mutex::default(), gate: Some(gate.clone()) };
    let relay = Arc::new(Relay::new(Arc::new(store.clone()), Arc::new(scripted), config("r")));
    let running = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await.unwrap() }
    });
    within("the first publish starting", gate.0.notified()).await;
    relay.shutdown_handle().trigger();
    gate.1.notify_one();
    let totals = within("the relay stopping after shutdown", running).await.unwrap();
    assert_eq!((totals.claimed, totals.published, totals.released, totals.retried), (3, 1, 2, 0), "{totals:?}");
    let rows = all_rows(&store).await.unwrap();
    assert_eq!(rows[0].status, RowStatus::Published);
    for r in &rows[1..] {
        assert_eq!((r.status, r.attempts, r.owner.as_deref()), (RowStatus::Pending, 0, None), "{r:?}");
    }
    assert_eq!(log_ids(&broker), ["e1"]);
}

/// A broker that, once, lets another relay take the batch being published: after the
/// `steal_after`-th publish the store's clock passes the lease and a claim by "thief" takes the
/// first `take` rows (the batch's own, their lease gone). The batch's publish goes on; its
/// completions are fenced.
struct Thief {
    inner: MemoryBroker,
    clock: ManualClock,
    store: MemoryOutbox,
    steal_after: usize,
    take: usize,
    publishes: std::sync::atomic::AtomicUsize,
    stolen: Mutex<Vec<i64>>,
}

#[async_trait]
impl Broker for Thief {
    fn backend(&self) -> &'static str {
        "thief"
    }
    async fn declare(&self, d: &Destination, g: &[ConsumerGroup]) -> outbox_core::Result<()> {
        self.inner.declare(d, g).await
    }
    async fn publish(&self, event: &Event) -> outbox_core::Result<()> {
        let n = self.publishes.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if n == self.steal_after {
            self.clock.advance(LEASE + Duration::from_millis(1));
            let rows = self.store.claim("thief", self.take, LEASE).await?;
            self.stolen.lock().unwrap().extend(rows.iter().map(|c| c.record.row_id));
        }
        self.inner.publish(event).await
    }
    async fn subscribe(&self, d: &Destination, g: &ConsumerGroup) -> outbox_core::Result<Box<dyn Subscription>> {
        self.inner.subscribe(d, g).await
    }
}

/// A batch that outlasts its lease is re-claimed by another relay and its completions are
/// fenced; claiming as many rows again would outlast the next lease too, and two relays would
/// take the batch from each other forever (seen in CI: a 200 ms lease, one key's 41 rows
/// published one at a time). So the next claim asks for half, and full batches that settle in
/// time grow it back by a tenth of `batch_size`. Judged by the claims' sizes, the rows and the
/// broker's log.
#[tokio::test]
async fn a_batch_that_outlasts_its_lease_halves_the_next_claim_and_batches_grow_back() {
    let (clock, store, broker) = setup().await;
    let events: Vec<Event> = (1..=50).map(|i| event(&format!("e{i:02}"))).collect();
    store.enqueue(&events).await.unwrap();
    let thief = Arc::new(Thief {
        inner: broker.clone(),
        clock: clock.clone(),
        store: store.clone(),
        steal_after: 5,
        take: 20,
        publishes: Default::default(),
        stolen: Mutex::default(),
    });
    let relay =
        Relay::new(Arc::new(store.clone()), thief.clone(), config("slow").with_batch_size(20).with_pipeline_depth(1));
    assert_eq!(relay.batch_limit(), 20);

    let first = relay.run_once().await.unwrap();
    assert_eq!((first.claimed, first.published, first.fenced), (20, 0, 20), "{first:?}");
    assert_eq!(*thief.stolen.lock().unwrap(), (1..=20).collect::<Vec<i64>>(), "the thief took the batch");
    assert_eq!(relay.batch_limit(), 10, "halved after the fenced batch");

    // The thief never completes; once its lease is gone the relay takes the rows back.
    clock.advance(LEASE + Duration::from_millis(1));
    let mut sizes = Vec::new();
    for _ in 0..20 {
        let r = relay.run_once().await.unwrap();
        if r.claimed == 0 {
            break;
        }
        assert_eq!((r.published, r.fenced), (r.claimed, 0), "{r:?}");
        sizes.push(r.claimed);
    }
    assert_eq!(sizes, [10, 12, 14, 14], "half, then +2 per full batch (a short last batch does not grow it)");
    assert_eq!(relay.batch_limit(), 16);

    let rows = all_rows(&store).await.unwrap();
    assert_eq!(rows.len(), 50);
    for r in &rows {
        assert_eq!((r.status, r.owner.as_deref()), (RowStatus::Published, Some("slow")), "{r:?}");
    }
    // The stolen batch was offered twice (once on the lost lease, once after); the rest once.
    let mut expected: Vec<String> = (1..=20).map(|i| format!("e{i:02}")).collect();
    expected.extend((1..=50).map(|i| format!("e{i:02}")));
    assert_eq!(log_ids(&broker), expected);
}

/// `OutboxStore::one_writer` with a broker that returns at once: on a store with one writer the
/// relay claims no batch ahead, since a place at the broker is always free (at most
/// `pipeline_depth` batches between claim and outcome, so a claim begins with at most one other
/// batch leased at depth 2); on any other store it claims ahead while completions lag (up to
/// 2 × depth + 1 batches). Either way every row is published once, in order.
#[tokio::test]
async fn a_store_with_one_writer_gets_no_batch_claimed_ahead() {
    for (one_writer, most) in [(true, 2), (false, 8)] {
        let (_clock, store, broker) = setup().await;
        let events: Vec<Event> = (1..=40).map(|i| event(&format!("e{i}"))).collect();
        store.enqueue(&events).await.unwrap();
        let writers = Arc::new(StallComplete {
            stall_complete: false,
            one_writer,
            // A claim takes time, as on a real store: a broker that returns at once has ended
            // a batch's publish before the next claim returns.
            claim_yields: 16,
            complete_yields: 64,
            ..StallComplete::new(store.clone(), Arc::new(Notify::new()))
        });
        let relay = Relay::new(
            writers.clone(),
            Arc::new(broker.clone()),
            config("r").with_batch_size(2).with_pipeline_depth(2),
        );
        let report = within("the relay draining 40 rows", relay.drain()).await.unwrap();
        assert_eq!((report.claimed, report.published), (40, 40), "one_writer {one_writer}: {report:?}");
        assert_eq!(
            writers.most_leased_at_claim.load(std::sync::atomic::Ordering::SeqCst),
            most,
            "rows leased out when a claim began, most (one_writer {one_writer}, depth 2, batches of 2)"
        );
        for r in all_rows(&store).await.unwrap() {
            assert_eq!((r.status, r.token, r.attempts), (RowStatus::Published, 1, 0), "{r:?}");
        }
        assert_eq!(log_ids(&broker), (1..=40).map(|i| format!("e{i}")).collect::<Vec<_>>());
    }
}

/// A broker whose publishes wait until the test opens the gate, counting the publishes begun,
/// and that prefers `prefers` batches at once.
struct Gated {
    inner: MemoryBroker,
    open: tokio::sync::watch::Receiver<bool>,
    begun: std::sync::atomic::AtomicUsize,
    prefers: Option<usize>,
}

#[async_trait]
impl Broker for Gated {
    fn backend(&self) -> &'static str {
        "gated"
    }
    fn preferred_pipeline_depth(&self) -> Option<usize> {
        self.prefers
    }
    async fn declare(&self, d: &Destination, g: &[ConsumerGroup]) -> outbox_core::Result<()> {
        self.inner.declare(d, g).await
    }
    async fn publish(&self, event: &Event) -> outbox_core::Result<()> {
        self.begun.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut open = self.open.clone();
        // Bounded: a gate never opened fails the publish instead of hanging the test.
        let opened = matches!(tokio::time::timeout(LIMIT, open.wait_for(|o| *o)).await, Ok(Ok(_)));
        if !opened {
            return Err(Error::transient(ErrorKind::Timeout, "gated", "the gate was never opened"));
        }
        self.inner.publish(event).await
    }
    async fn subscribe(&self, d: &Destination, g: &ConsumerGroup) -> outbox_core::Result<Box<dyn Subscription>> {
        self.inner.subscribe(d, g).await
    }
}

/// `OutboxStore::one_writer` with a broker that is busy: while every place at the broker is
/// publishing, the relay claims one batch ahead on a store with one writer too (depth 2, batches
/// of 2: the third claim begins with 4 rows leased, and no fourth claim begins before a publish
/// ends). Then every row is published once.
#[tokio::test]
async fn a_store_with_one_writer_gets_a_batch_claimed_ahead_while_the_broker_is_busy() {
    use std::sync::atomic::Ordering::SeqCst;
    let (_clock, store, broker) = setup().await;
    let events: Vec<Event> = (1..=20).map(|i| event(&format!("e{i:02}"))).collect();
    store.enqueue(&events).await.unwrap();
    let writer = Arc::new(StallComplete {
        stall_complete: false,
        one_writer: true,
        ..StallComplete::new(store.clone(), Arc::new(Notify::new()))
    });
    let (open, gate) = tokio::sync::watch::channel(false);
    let gated = Arc::new(Gated { inner: broker.clone(), open: gate, begun: Default::default(), prefers: None });
    let relay = Relay::new(writer.clone(), gated.clone(), config("r").with_batch_size(2).with_pipeline_depth(2));
    let drain = tokio::spawn(async move { relay.drain().await });

    // Both places publishing (a batch of 2 publishes its keys' events at once), then the claim
    // ahead: the third claim.
    wait_until("two batches at the broker and a third claimed", || {
        gated.begun.load(SeqCst) == 4 && writer.claims.load(SeqCst) == 3
    })
    .await;
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
    assert_eq!(writer.claims.load(SeqCst), 3, "one batch claimed ahead, not more");
    assert_eq!(writer.most_leased_at_claim.load(SeqCst), 4, "the third claim began with two batches leased");
    let rows = all_rows(&store).await.unwrap();
    let leased: Vec<&str> = rows.iter().filter(|r| r.token == 1).map(|r| r.event.id.as_str()).collect();
    assert_eq!(leased, ["e01", "e02", "e03", "e04", "e05", "e06"]);
    assert!(broker.log(&dest()).is_empty(), "nothing published while the gate is shut");

    open.send(true).unwrap();
    let report = within("the relay draining 20 rows", drain).await.unwrap().unwrap();
    assert_eq!((report.claimed, report.published), (20, 20), "{report:?}");
    for r in all_rows(&store).await.unwrap() {
        assert_eq!((r.status, r.token, r.published_token), (RowStatus::Published, 1, Some(1)), "{r:?}");
    }
    // Each once (rows without a key, published at once, may reach the log in any order).
    let mut published = log_ids(&broker);
    published.sort();
    assert_eq!(published, (1..=20).map(|i| format!("e{i:02}")).collect::<Vec<_>>());
}

/// `Broker::preferred_pipeline_depth`: a relay whose config sets no depth keeps as many batches
/// at the broker as the broker prefers (3), a depth set in the config wins (1 and 2), and a
/// broker without a preference gets `DEFAULT_PIPELINE_DEPTH` (2). Batches of one keyless row, the
/// gate shut: exactly that many publishes begin, no more; then every row is published once.
#[tokio::test]
async fn a_relay_without_a_depth_keeps_as_many_batches_at_the_broker_as_it_prefers() {
    use std::sync::atomic::Ordering::SeqCst;
    for (prefers, set, depth) in [(Some(3), None, 3), (Some(3), Some(1), 1), (Some(3), Some(2), 2), (None, None, 2)] {
        let case = format!("broker prefers {prefers:?}, config sets {set:?}");
        let (_clock, store, broker) = setup().await;
        let events: Vec<Event> = (1..=12).map(|i| event(&format!("e{i:02}"))).collect();
        store.enqueue(&events).await.unwrap();
        let (open, gate) = tokio::sync::watch::channel(false);
        let gated = Arc::new(Gated { inner: broker.clone(), open: gate, begun: Default::default(), prefers });
        let config = config("r").with_batch_size(1);
        let config = match set {
            Some(d) => config.with_pipeline_depth(d),
            None => config,
        };
        let relay = Relay::new(Arc::new(store.clone()), gated.clone(), config);
        assert_eq!(relay.pipeline_depth(), depth, "{case}");
        let drain = tokio::spawn(async move { relay.drain().await });
        wait_until(&format!("{depth} publishes begun ({case})"), || gated.begun.load(SeqCst) == depth).await;
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
        assert_eq!(gated.begun.load(SeqCst), depth, "no more batches at the broker than the depth ({case})");
        assert!(broker.log(&dest()).is_empty(), "nothing published while the gate is shut ({case})");
        open.send(true).unwrap();
        let report = within(&format!("the relay draining 12 rows ({case})"), drain).await.unwrap().unwrap();
        assert_eq!((report.claimed, report.published), (12, 12), "{case}: {report:?}");
        for r in all_rows(&store).await.unwrap() {
            assert_eq!((r.status, r.token, r.published_token), (RowStatus::Published, 1, Some(1)), "{case}: {r:?}");
        }
        let mut published = log_ids(&broker);
        published.sort();
        assert_eq!(published, (1..=12).map(|i| format!("e{i:02}")).collect::<Vec<_>>(), "{case}");
    }
}

/// A pipeline depth too large for the relay's permits is clamped, not a panic or a hang: every
/// row is published once.
#[tokio::test]
async fn a_huge_pipeline_depth_is_clamped() {
    let (_clock, store, broker) = setup().await;
    let events: Vec<Event> = (1..=5).map(|i| event(&format!("e{i}"))).collect();
    store.enqueue(&events).await.unwrap();
    let relay = Relay::new(
        Arc::new(store.clone()),
        Arc::new(broker.clone()),
        config("r").with_batch_size(2).with_pipeline_depth(usize::MAX),
    );
    let report = within("the relay draining 5 rows", relay.drain()).await.unwrap();
    assert_eq!((report.claimed, report.published), (5, 5), "{report:?}");
    for r in all_rows(&store).await.unwrap() {
        assert_eq!((r.status, r.token), (RowStatus::Published, 1), "{r:?}");
    }
    assert_eq!(log_ids(&broker), ["e1", "e2", "e3", "e4", "e5"]);
}

/// A relay whose future is dropped while a batch is at the broker takes that publish with it
/// (the relay runs each batch's publish on a task of its own, aborted with the relay's future):
/// nothing reaches the broker after the relay is gone, and the row stays leased until its lease
/// expires, as when the broker was called in place.
#[tokio::test]
async fn a_dropped_relay_takes_its_publish_in_flight_with_it() {
    use std::sync::atomic::Ordering::SeqCst;
    let (_clock, store, broker) = setup().await;
    store.enqueue(&[event("e1")]).await.unwrap();
    let (open, gate) = tokio::sync::watch::channel(false);
    let gated = Arc::new(Gated { inner: broker.clone(), open: gate, begun: Default::default(), prefers: None });
    let relay = Relay::new(Arc::new(store.clone()), gated.clone(), config("dropped"));
    let task = tokio::spawn(async move { relay.run_once().await });
    wait_until("the publish begun", || gated.begun.load(SeqCst) == 1).await;
    task.abort();
    assert!(within("the relay's task ends", task).await.unwrap_err().is_cancelled());
    open.send(true).unwrap();
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
    assert!(broker.log(&dest()).is_empty(), "a publish went on after its relay was dropped");
    let rows = all_rows(&store).await.unwrap();
    assert_eq!((rows[0].status, rows[0].token), (RowStatus::Leased, 1), "{rows:?}");
}

/// A relay at depth 2 (five batches between claim and outcome) over `n` rows in batches of
/// `batch`, whose first completion waits at the returned gate until every row has been
/// published and the publish stage has handed the decided batches on: each `complete_many`
/// waits for its own opening of the gate.
async fn published_behind_a_waiting_completion(
    n: usize,
    batch: usize,
) -> (MemoryOutbox, MemoryBroker, Arc<Notify>, Arc<StallComplete>, tokio::task::JoinHandle<BatchReport>) {
    let (_clock, store, broker) = setup().await;
    let events: Vec<Event> = (1..=n).map(|i| event(&format!("e{i}"))).collect();
    store.enqueue(&events).await.unwrap();
    let gate = Arc::new(Notify::new());
    let stalled = Arc::new(StallComplete::new(store.clone(), gate.clone()));
    let relay = Relay::new(
        stalled.clone(),
        Arc::new(broker.clone()),
        config("r").with_batch_size(batch).with_pipeline_depth(2),
    );
    let running = tokio::spawn(async move { relay.drain().await.unwrap() });
    wait_until("every batch published while the first completion waits", || log_ids(&broker).len() == n).await;
    // Let the publish stage hand the decided batches to the completion stage.
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert!(stalled.completions.lock().unwrap().is_empty(), "the first completion waits at the gate");
    (store, broker, gate, stalled, running)
}

/// Every row Published by the claim's token (1), and on the broker once.
async fn published_once_each(store: &MemoryOutbox, broker: &MemoryBroker, n: usize) {
    let rows = all_rows(store).await.unwrap();
    assert_eq!(rows.len(), n);
    for r in &rows {
        assert_eq!((r.status, r.token, r.published_token), (RowStatus::Published, 1, Some(1)), "{r:?}");
    }
    let mut ids = log_ids(broker);
    ids.sort_by_key(|id| id[1..].parse::<usize>().unwrap());
    assert_eq!(ids, (1..=n).map(|i| format!("e{i}")).collect::<Vec<_>>(), "each once");
}

/// Batches whose publishes ended while a completion ran are completed together, in one
/// `complete_many`: the first completion waits at a gate while the rest of the pipeline's five
/// batches are published; they are completed in one call after it.
#[tokio::test]
async fn batches_published_during_a_completion_are_completed_in_one_call() {
    let (store, broker, gate, stalled, running) = published_behind_a_waiting_completion(10, 2).await;
    gate.notify_one();
    wait_until("the first completion", || stalled.completions.lock().unwrap().len() == 1).await;
    gate.notify_one();
    let totals = within("the relay draining", running).await.unwrap();
    let calls = stalled.completions.lock().unwrap().clone();
    assert_eq!((calls.len(), calls.iter().sum::<usize>()), (2, 10), "two calls for five batches: {calls:?}");
    assert_eq!((totals.claimed, totals.published, totals.fenced), (10, 10, 0), "{totals:?}");
    published_once_each(&store, &broker, 10).await;
}

/// Completions settled together stay within 1,000 rows a call: batches of 400 (five in the
/// pipeline at depth 2) published while the first completion waits are completed two at a time
/// at most, never three (1,200 rows).
#[tokio::test]
async fn completions_settled_together_stay_within_a_thousand_rows() {
    let (store, broker, gate, stalled, running) = published_behind_a_waiting_completion(2000, 400).await;
    // Each call waits for its own opening of the gate: open it until the relay is done.
    let opener = tokio::spawn({
        let (gate, stalled) = (gate.clone(), stalled.clone());
        async move {
            let mut seen = 0;
            loop {
                gate.notify_one();
                wait_until("the next completion", || stalled.completions.lock().unwrap().len() > seen).await;
                seen += 1;
            }
        }
    });
    let totals = within("the relay draining", running).await.unwrap();
    opener.abort();
    let calls = stalled.completions.lock().unwrap().clone();
    assert_eq!(calls.iter().sum::<usize>(), 2000, "every row completed once: {calls:?}");
    assert!(calls.iter().all(|n| *n <= 1000), "a call of more than 1,000 rows: {calls:?}");
    assert!(calls.contains(&800), "two batches of 400 completed together: {calls:?}");
    assert_eq!((totals.claimed, totals.published, totals.fenced), (2000, 2000, 0), "{totals:?}");
    published_once_each(&store, &broker, 2000).await;
}

/// After a short claim the relay claims again once one batch in flight has settled, not once all
/// have (relay module docs, "After a short claim"): relays side by side cut each other's claims
/// short, and waiting for every batch each time emptied the pipeline. Depth 2, batches of 2, each
/// publish held at a gate: the second claim is short (keys a and b are in flight with the first
/// batch); once the first batch alone is let through and settled, the third claim takes a4 and
/// b5 while the short batch is still at the broker. Then every row is published once, in key
/// order.
#[tokio::test]
async fn after_a_short_claim_the_next_waits_for_one_batch_to_settle_not_all() {
    let (_clock, store, broker) = setup().await;
    let keyed = [("a1", "a"), ("b2", "b"), ("c3", "c"), ("a4", "a"), ("b5", "b")];
    store.enqueue(&keyed.map(|(id, key)| event(id).with_key(key))).await.unwrap();
    let gate = Gate::new();
    let flaky = Arc::new(Flaky { gate: Some(gate.clone()), ..Flaky::new(broker.clone()) });
    let relay =
        Relay::new(Arc::new(store.clone()), flaky.clone(), config("r").with_batch_size(2).with_pipeline_depth(2));
    let drain = tokio::spawn(async move { relay.drain().await });

    wait_until("the full batch and the short one at the broker", || flaky.batches().len() == 2).await;
    assert_eq!(
        flaky.batches(),
        [vec!["a1", "b2"], vec!["c3"]],
        "the second claim is short: a4 and b5 wait for a1 and b2"
    );
    // The first batch through (the gate's permits go in arrival order), the short one still held.
    gate.open.add_permits(1);
    wait_until("a third claim while the short batch is at the broker", || flaky.batches().len() == 3).await;
    assert_eq!(flaky.batches()[2], ["a4", "b5"]);
    let rows = all_rows(&store).await.unwrap();
    let status: Vec<(&str, RowStatus)> = rows.iter().map(|r| (r.event.id.as_str(), r.status)).collect();
    assert_eq!(
        status,
        [
            ("a1", RowStatus::Published),
            ("b2", RowStatus::Published),
            ("c3", RowStatus::Leased),
            ("a4", RowStatus::Leased),
            ("b5", RowStatus::Leased)
        ],
        "c3 still at the broker when a4 and b5 were claimed"
    );

    gate.open.add_permits(2);
    let report = within("the relay draining 5 rows", drain).await.unwrap().unwrap();
    assert_eq!((report.claimed, report.published, report.fenced), (5, 5, 0), "{report:?}");
    for r in all_rows(&store).await.unwrap() {
        assert_eq!((r.status, r.token, r.published_token), (RowStatus::Published, 1, Some(1)), "{r:?}");
    }
    let offers = first_offers_by_key(&broker);
    assert_eq!(offers["a"], ["a1", "a4"]);
    assert_eq!(offers["b"], ["b2", "b5"]);
    assert_eq!(offers["c"], ["c3"]);
}
