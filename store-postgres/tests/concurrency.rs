//! Several relays against one table on the real server, leases on the database clock.
//!
//! Judged only by durable state: every row published by its latest token, and the broker log
//! holding every event at least once. Duplicates are counted and printed, never hidden.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::{TestDb, dest, event};
use outbox_core::memory::MemoryBroker;
use outbox_core::store::all_rows;
use outbox_core::{
    Backoff, BatchReport, Broker, ConsumerGroup, Destination, Event, OutboxAdmin, OutboxStore, Relay, RelayConfig,
    RowStatus, Subscription,
};

const LEASE: Duration = Duration::from_millis(200);

struct Outcome {
    elapsed: Duration,
    duplicates: usize,
    totals: BatchReport,
}

async fn run_relays(db: &TestDb, broker: Arc<dyn Broker>, log: &MemoryBroker, rows: usize, relays: usize) -> Outcome {
    let events: Vec<Event> =
        (0..rows).map(|i| event(&format!("evt-{i:06}"), format!("payload {i}").as_bytes())).collect();
    for chunk in events.chunks(1000) {
        db.store.enqueue(chunk).await.unwrap();
    }

    let started = Instant::now();
    let mut handles = Vec::new();
    let mut stops = Vec::new();
    for i in 0..relays {
        let config = RelayConfig::default()
            .with_owner(format!("relay-{i}"))
            .with_batch_size(100)
            .with_lease(LEASE)
            .with_idle_poll(Duration::from_millis(10))
            .with_backoff(Backoff::none())
            .with_seed(Some(i as u64));
        let store: Arc<dyn OutboxStore> = Arc::new(db.store.clone());
        let relay = Relay::new(store, broker.clone(), config);
        stops.push(relay.shutdown_handle());
        handles.push(tokio::spawn(async move { relay.run().await }));
    }
    // Wait for the durable condition, with a deadline.
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let stats = db.store.stats().await.unwrap();
        if stats.published == rows as u64 {
            break;
        }
        assert!(Instant::now() < deadline, "not everything was published in time: {stats:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    for s in &stops {
        s.trigger();
    }
    let mut totals = BatchReport::default();
    for h in handles {
        let t = h.await.unwrap().unwrap();
        totals.claimed += t.claimed;
        totals.published += t.published;
        totals.fenced += t.fenced;
        totals.retried += t.retried;
        totals.released += t.released;
        totals.parked += t.parked;
    }

    // Durable state of the store: every row published by its latest token.
    let stored = all_rows(&db.store).await.unwrap();
    assert_eq!(stored.len(), rows);
    for r in &stored {
        assert_eq!(r.status, RowStatus::Published, "{}", r.event.id);
        assert_eq!(r.published_token, Some(r.token), "row {} completed by a stale token", r.row_id);
    }
    // Durable state of the broker: every event at least once, nothing that was never enqueued,
    // every copy byte-for-byte the enqueued event.
    let expected: BTreeMap<&str, &Event> = events.iter().map(|e| (e.id.as_str(), e)).collect();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for e in log.log(&dest()) {
        assert_eq!(expected.get(e.id.as_str()), Some(&&e), "ghost or altered message {}", e.id);
        *seen.entry(e.id.to_string()).or_default() += 1;
    }
    assert_eq!(seen.len(), rows, "some events were never offered");
    let duplicates = seen.values().map(|n| n - 1).sum();
    Outcome { elapsed, duplicates, totals }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_relays_publish_ten_thousand_rows() {
    let Some(db) = TestDb::open("relays", None, |c| c.with_pool_size(12)).await else { return };
    let broker = MemoryBroker::new();
    broker.declare(&dest(), &[]).await.unwrap();
    let out = run_relays(&db, Arc::new(broker.clone()), &broker, 10_000, 4).await;
    println!(
        "4 relays, 10000 rows, lease {LEASE:?}: all published in {:?}; duplicates offered: {}; \
         fenced completions: {}; claims: {}",
        out.elapsed, out.duplicates, out.totals.fenced, out.totals.claimed
    );
    assert_eq!(out.totals.published, 10_000, "each row is completed exactly once");
}

/// A broker that stalls some publishes past the lease: another relay re-claims those rows and
/// publishes them again, and the stalled relay's completion must be fenced.
struct SlowBroker {
    inner: MemoryBroker,
    stalled: Mutex<BTreeSet<String>>,
    stalls: AtomicU64,
}

#[async_trait]
impl Broker for SlowBroker {
    fn backend(&self) -> &'static str {
        "slow-memory"
    }
    async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> outbox_core::Result<()> {
        self.inner.declare(destination, groups).await
    }
    async fn publish(&self, event: &Event) -> outbox_core::Result<()> {
        self.inner.publish(event).await?;
        // The first publish of every 250th event stalls after the broker accepted it: the relay
        // has sent but not yet recorded completion when its lease runs out.
        let chosen = event.id.as_str().ends_with("250")
            || event.id.as_str().ends_with("500")
            || event.id.as_str().ends_with("750")
            || event.id.as_str().ends_with("000");
        let first = chosen && self.stalled.lock().unwrap().insert(event.id.to_string());
        if first {
            self.stalls.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(LEASE * 2).await;
        }
        Ok(())
    }
    async fn subscribe(
        &self,
        destination: &Destination,
        group: &ConsumerGroup,
    ) -> outbox_core::Result<Box<dyn Subscription>> {
        self.inner.subscribe(destination, group).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalled_relays_are_fenced_and_duplicates_are_counted() {
    let Some(db) = TestDb::open("stalled", None, |c| c.with_pool_size(12)).await else { return };
    let log = MemoryBroker::new();
    log.declare(&dest(), &[]).await.unwrap();
    let broker = Arc::new(SlowBroker { inner: log.clone(), stalled: Mutex::default(), stalls: AtomicU64::new(0) });
    let out = run_relays(&db, broker.clone(), &log, 2_000, 4).await;
    println!(
        "4 relays, 2000 rows, {} publishes stalled past the lease: all published in {:?}; duplicates offered: {}; \
         fenced completions: {}",
        broker.stalls.load(Ordering::Relaxed),
        out.elapsed,
        out.duplicates,
        out.totals.fenced
    );
    assert!(out.duplicates > 0, "the stalls should have caused re-offers");
    assert!(out.totals.fenced > 0, "stale completions must have been fenced");
    assert_eq!(out.totals.published, 2_000, "each row is completed exactly once");
}
