//! Several relays on one file: every row is published once, by its latest token.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::event;
use outbox_core::memory::MemoryBroker;
use outbox_core::store::all_rows;
use outbox_core::{Broker, Completion, OutboxAdmin, OutboxStore, Relay, RelayConfig, RowStatus};

const ROWS: usize = 2_000;
/// Seconds normally; anything past this is a hang (a relay or loop that never finishes).
const LIMIT: Duration = Duration::from_secs(120);

/// Await `task` for at most [`LIMIT`], failing with `what` instead of hanging.
async fn within<T>(what: &str, task: tokio::task::JoinHandle<T>) -> T {
    match tokio::time::timeout(LIMIT, task).await {
        Ok(joined) => joined.unwrap(),
        Err(_) => panic!("{what} did not finish within {LIMIT:?}"),
    }
}

async fn fill(store: &dyn OutboxStore) {
    let events: Vec<_> = (0..ROWS).map(|i| event(&format!("ev-{i:05}"), format!("{i}").as_bytes())).collect();
    for chunk in events.chunks(250) {
        store.enqueue(chunk).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_relays_with_expiring_leases_publish_every_row_once() {
    let db = common::open().await;
    fill(&db.store).await;
    let lease = Duration::from_secs(1);
    let claims: Arc<Mutex<Vec<(i64, u64)>>> = Arc::default();
    let published: Arc<Mutex<Vec<(i64, u64)>>> = Arc::default();
    let fenced: Arc<Mutex<u64>> = Arc::default();

    let mut tasks = Vec::new();
    for relay in 0..4 {
        let (store, clock) = (db.store.clone(), db.clock.clone());
        let (claims, published, fenced) = (claims.clone(), published.clone(), fenced.clone());
        tasks.push(tokio::spawn(async move {
            let owner = format!("relay-{relay}");
            let mut batch = 0u64;
            loop {
                let got = store.claim(&owner, 37, lease).await.unwrap();
                if got.is_empty() {
                    let s = store.stats().await.unwrap();
                    if s.pending == 0 && s.leased == 0 {
                        return;
                    }
                    tokio::task::yield_now().await;
                    continue;
                }
                batch += 1;
                claims.lock().unwrap().extend(got.iter().map(|c| (c.record.row_id, c.lease.token)));
                // Every third batch of each relay stalls past its lease before completing, so
                // other relays re-claim some of its rows and its completions are fenced.
                if (batch + relay).is_multiple_of(3) {
                    clock.advance(lease + Duration::from_millis(1));
                    tokio::task::yield_now().await;
                }
                let rows: Vec<_> = got.iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
                let out = store.complete_many(&rows).await.unwrap();
                for ((row, l), o) in rows.iter().zip(out) {
                    match o {
                        Completion::Published => published.lock().unwrap().push((*row, l.token)),
                        Completion::Fenced => *fenced.lock().unwrap() += 1,
                    }
                }
            }
        }));
    }
    for t in tasks {
        within("a relay loop draining the rows", t).await;
    }

    let claims = claims.lock().unwrap().clone();
    let published = published.lock().unwrap().clone();
    let mut seen = std::collections::BTreeSet::new();
    for c in &claims {
        assert!(seen.insert(*c), "two claims returned row {} with token {}", c.0, c.1);
    }
    let mut by_row: BTreeMap<i64, Vec<u64>> = BTreeMap::new();
    for (row, token) in &published {
        by_row.entry(*row).or_default().push(*token);
    }
    let rows = all_rows(&db.store).await.unwrap();
    assert_eq!(rows.len(), ROWS);
    for r in &rows {
        assert_eq!(r.status, RowStatus::Published, "row {}", r.row_id);
        assert_eq!(r.published_token, Some(r.token), "row {} published by a stale token", r.row_id);
        assert_eq!(by_row.get(&r.row_id), Some(&vec![r.token]), "row {}: exactly one accepted completion", r.row_id);
    }
    let fenced = *fenced.lock().unwrap();
    assert_eq!(claims.len() as u64, ROWS as u64 + fenced, "every extra claim ended in a fenced completion");
    eprintln!("claims: {}, fenced completions: {fenced}", claims.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_core_relays_drain_into_the_memory_broker() {
    let db = common::open().await;
    fill(&db.store).await;
    let broker = MemoryBroker::new();
    broker.declare(&common::dest(), &[]).await.unwrap();
    let store: Arc<dyn OutboxStore> = Arc::new(db.store.clone());
    let mut tasks = Vec::new();
    for i in 0..4 {
        let config = RelayConfig::new(format!("relay-{i}")).with_batch_size(50).with_seed(Some(i));
        let relay = Relay::new(store.clone(), Arc::new(broker.clone()), config);
        tasks.push(tokio::spawn(async move { relay.drain().await.unwrap() }));
    }
    let mut published = 0;
    for t in tasks {
        published += within("a relay draining the rows", t).await.published;
    }
    assert_eq!(published, ROWS as u64);
    let log = broker.log(&common::dest());
    let mut ids: Vec<String> = log.iter().map(|e| e.id.to_string()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), ROWS, "every event offered");
    assert_eq!(log.len(), ROWS, "no lease expired, so no duplicates");
    let s = db.store.stats().await.unwrap();
    assert_eq!((s.published, s.pending, s.leased), (ROWS as u64, 0, 0));
}
