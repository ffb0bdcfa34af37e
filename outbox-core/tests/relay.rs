//! The relay and the reference store, judged by durable state: row status, tokens and the
//! broker's log.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::memory::{MemoryBroker, MemoryOutbox};
use outbox_core::store::all_rows;
use outbox_core::{
    Backoff, Broker, Clock, Completion, ConsumerGroup, Destination, Error, ErrorKind, Event, EventId, ManualClock,
    OutboxAdmin, OutboxStore, Relay, RelayConfig, Retry, RowStatus, Subscription,
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
    let stalled = Arc::new(StallComplete { inner: store.clone(), gate: gate.clone() });
    let relay_a = Relay::new(stalled, Arc::new(broker.clone()), config("relay-a"));
    let relay_b = Relay::new(Arc::new(store.clone()), Arc::new(broker.clone()), config("relay-b"));

    let a = tokio::spawn(async move { relay_a.run_once().await.unwrap() });
    // Wait (with a deadline) until A has published both events.
    wait_until(|| broker.log(&dest()).len() == 2).await;
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

struct StallComplete {
    inner: MemoryOutbox,
    gate: Arc<Notify>,
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
        self.inner.claim(owner, limit, lease).await
    }
    async fn complete(&self, row: i64, lease: &outbox_core::Lease) -> outbox_core::Result<Completion> {
        self.inner.complete(row, lease).await
    }
    async fn complete_many(&self, rows: &[(i64, outbox_core::Lease)]) -> outbox_core::Result<Vec<Completion>> {
        if tokio::time::timeout(LIMIT, self.gate.notified()).await.is_err() {
            return Err(Error::transient(ErrorKind::Timeout, "stall", "the gate was never opened"));
        }
        self.inner.complete_many(rows).await
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

async fn wait_until(mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "condition not reached within {LIMIT:?}");
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

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_and_releases_the_rest() {
    let (_clock, store, broker) = setup().await;
    // One key: publishes are sequential, so the first is in flight while the others wait.
    let events: Vec<Event> = (1..=3).map(|i| event(&format!("e{i}")).with_key("acct-1")).collect();
    store.enqueue(&events).await.unwrap();
    let gate = Arc::new((Notify::new(), Notify::new()));
    let scripted = Scripted { inner: broker.clone(), script: Mutex::default(), gate: Some(gate.clone()) };
    let relay = Arc::new(Relay::new(Arc::new(store.clone()), Arc::new(scripted), config("r")));
    let shutdown = relay.shutdown_handle();
    let running = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await.unwrap() }
    });
    within("the first publish starting", gate.0.notified()).await;
    shutdown.trigger();
    gate.1.notify_one(); // let it finish
    let totals = within("the relay stopping after shutdown", running).await.unwrap();
    assert_eq!((totals.claimed, totals.published, totals.released), (3, 1, 2));

    let rows = all_rows(&store).await.unwrap();
    assert_eq!(rows[0].status, RowStatus::Published);
    for r in &rows[1..] {
        assert_eq!(r.status, RowStatus::Pending, "released rows are claimable at once");
        assert_eq!(r.attempts, 0, "a release is not a failed attempt");
        assert_eq!(r.owner, None);
    }
    assert_eq!(broker.log(&dest()).len(), 1);
    // Another relay picks the released rows up immediately, in key order.
    let other = Relay::new(Arc::new(store.clone()), Arc::new(broker.clone()), config("r2"));
    assert_eq!(other.run_once().await.unwrap().published, 2);
    let ids: Vec<_> = broker.log(&dest()).iter().map(|e| e.id.to_string()).collect();
    assert_eq!(ids, ["e1", "e2", "e3"]);
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
        config("r").with_concurrency(1).with_backoff(Backoff::none()),
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
    wait_until(|| relay.totals().refused == 1).await;
    stop.trigger();
    let totals = within("the relay stops", running).await.unwrap().unwrap();
    assert_eq!((totals.claimed, totals.refused, totals.published), (1, 1, 0), "one claim, then the idle wait");
    assert!(broker.log(&dest()).is_empty());
    let row = &all_rows(&store).await.unwrap()[0];
    assert_eq!((row.status, row.attempts), (RowStatus::Pending, 0));
}
