//! A running relay wakes up on an enqueue instead of waiting for its poll.
//!
//! The relays here poll once an hour, so only the store's wake-up signal can get an event to
//! the broker within the test's deadline. Each test judges by durable state: the broker's log
//! and the row read back as published.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::memory::{MemoryBroker, MemoryOutbox};
use outbox_core::store::all_rows;
use outbox_core::{
    Broker, Claimed, Completion, ConsumerGroup, Destination, Event, EventId, Lease, OutboxAdmin, OutboxStats,
    OutboxStore, Outcome, ParkedRow, Relay, RelayConfig, Result, RowId, RowSnapshot, RowStatus, Subscription, Wakeup,
};

const DEADLINE: Duration = Duration::from_secs(10);
const HOUR: Duration = Duration::from_secs(3600);

fn dest() -> Destination {
    Destination::new("orders").unwrap()
}

fn event(id: &str) -> Event {
    Event::new(EventId::new(id).unwrap(), dest(), id.as_bytes().to_vec())
}

/// A store that counts claims, to show that an idle relay does not spin.
struct Counting {
    inner: MemoryOutbox,
    claims: AtomicU64,
}

#[async_trait]
impl OutboxStore for Counting {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    async fn enqueue(&self, events: &[Event]) -> Result<Vec<RowId>> {
        self.inner.enqueue(events).await
    }
    async fn claim(&self, owner: &str, limit: usize, lease: Duration) -> Result<Vec<Claimed>> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(owner, limit, lease).await
    }
    async fn complete(&self, row: RowId, lease: &Lease) -> Result<Completion> {
        self.inner.complete(row, lease).await
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
}

#[async_trait]
impl OutboxAdmin for Counting {
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

/// Wait (bounded) for the next delivery on `sub` and return its event id.
async fn next_id(sub: &mut Box<dyn Subscription>, what: &str) -> String {
    let delivery = sub
        .next(DEADLINE)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{what}: nothing reached the broker within {DEADLINE:?} (relay polls hourly)"));
    let id = delivery.event.id.as_str().to_owned();
    delivery.ack().await.unwrap();
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_publishes_an_enqueue_at_once() {
    let store = Arc::new(Counting { inner: MemoryOutbox::default(), claims: AtomicU64::new(0) });
    let broker = MemoryBroker::new();
    let group = ConsumerGroup::new("check").unwrap();
    let mut sub = broker.subscribe(&dest(), &group).await.unwrap();
    let config = RelayConfig::new("relay-wakeup").with_idle_poll(HOUR).with_seed(Some(1));
    let relay = Arc::new(Relay::new(store.clone(), Arc::new(broker.clone()), config));
    let task = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await }
    });

    const N: usize = 20;
    for i in 0..N {
        let id = format!("e{i}");
        store.enqueue(&[event(&id)]).await.unwrap();
        assert_eq!(next_id(&mut sub, &id).await, id);
    }

    relay.shutdown_handle().trigger();
    let totals = tokio::time::timeout(DEADLINE, task).await.expect("relay did not stop").unwrap().unwrap();
    assert_eq!(totals.published, N as u64, "{totals:?}");
    let rows = all_rows(&store.inner).await.unwrap();
    assert_eq!(rows.len(), N);
    for r in &rows {
        assert_eq!(r.status, RowStatus::Published, "{r:?}");
    }
    let log: Vec<_> = broker.log(&dest()).iter().map(|e| e.id.as_str().to_owned()).collect();
    assert_eq!(log, (0..N).map(|i| format!("e{i}")).collect::<Vec<_>>());
    // Per enqueue: at most the claim that found it, the empty claim after the batch and one
    // claim for a signal that raced the batch; plus the first claim. A spinning relay claims
    // thousands of times.
    let claims = store.claims.load(Ordering::SeqCst);
    assert!(claims <= 3 * N as u64 + 1, "{claims} claims for {N} enqueues: the idle relay is spinning");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_relay_of_the_process_is_woken() {
    let store = Arc::new(MemoryOutbox::default());
    let broker = MemoryBroker::new();
    broker.declare(&dest(), &[]).await.unwrap();
    let mut relays = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..3 {
        let config = RelayConfig::new(format!("relay-{i}")).with_idle_poll(HOUR).with_seed(Some(i));
        let relay = Arc::new(Relay::new(store.clone(), Arc::new(broker.clone()), config));
        tasks.push(tokio::spawn({
            let relay = relay.clone();
            async move { relay.run().await }
        }));
        relays.push(relay);
    }
    let group = ConsumerGroup::new("check").unwrap();
    let mut sub = broker.subscribe(&dest(), &group).await.unwrap();
    store.enqueue(&[event("a"), event("b")]).await.unwrap();
    let mut got = vec![next_id(&mut sub, "a or b").await, next_id(&mut sub, "a or b").await];
    got.sort();
    assert_eq!(got, ["a", "b"]);
    for r in &relays {
        r.shutdown_handle().trigger();
    }
    let mut published = 0;
    for t in tasks {
        published += tokio::time::timeout(DEADLINE, t).await.expect("relay did not stop").unwrap().unwrap().published;
    }
    assert_eq!(published, 2);
    assert!(all_rows(store.as_ref()).await.unwrap().iter().all(|r| r.status == RowStatus::Published));
}
