//! Throughput on this machine (ignored by default; run in release):
//! `cargo test --release -p outbox-store-sqlite --test measure -- --ignored --nocapture`

mod common;

use std::sync::Arc;
use std::time::Instant;

use outbox_core::memory::MemoryBroker;
use outbox_core::{Broker, OutboxStore, Relay, RelayConfig};
use outbox_store_sqlite::{SqliteConfig, SqliteStore, Synchronous};

const EVENTS: usize = 10_000;
const BATCH: usize = 100;

async fn run(synchronous: Synchronous) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = SqliteConfig::new(dir.path().join("measure.db")).with_synchronous(synchronous);
    let store = SqliteStore::open(config).await.unwrap();
    let events: Vec<_> =
        (0..EVENTS).map(|i| common::event(&format!("m-{i:06}"), format!("{{\"n\":{i}}}").as_bytes())).collect();

    let t = Instant::now();
    for chunk in events.chunks(BATCH) {
        store.enqueue(chunk).await.unwrap();
    }
    let enqueue = t.elapsed();

    let broker = MemoryBroker::new();
    broker.declare(&common::dest(), &[]).await.unwrap();
    let relay = Relay::new(Arc::new(store.clone()), Arc::new(broker.clone()), RelayConfig::new("measure"));
    let t = Instant::now();
    let report = relay.drain().await.unwrap();
    let drain = t.elapsed();

    assert_eq!(report.published, EVENTS as u64);
    assert_eq!(broker.log(&common::dest()).len(), EVENTS);
    assert_eq!(store.stats().await.unwrap().published, EVENTS as u64);
    eprintln!(
        "synchronous={synchronous}: enqueue {EVENTS} in batches of {BATCH}: {enqueue:?} ({:.0}/s); \
         one relay drain (batch {}): {drain:?} ({:.0}/s)",
        EVENTS as f64 / enqueue.as_secs_f64(),
        relay.config().batch_size,
        EVENTS as f64 / drain.as_secs_f64(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run in release with --ignored --nocapture"]
async fn enqueue_and_drain_10k() {
    run(Synchronous::Full).await;
    run(Synchronous::Normal).await;
}
