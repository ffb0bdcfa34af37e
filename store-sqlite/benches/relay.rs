//! Enqueue and relay throughput of the SQLite store, against the in-memory reference store as
//! the baseline measured in the same run: `cargo bench -p outbox-store-sqlite`.
//!
//! The ratio to the baseline is what to watch; absolute numbers depend on the disk.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::memory::{MemoryBroker, MemoryOutbox};
use outbox_core::{Broker, Destination, Event, EventId, OutboxStore, Relay, RelayConfig};
use outbox_store_sqlite::{SqliteConfig, SqliteStore, Synchronous};

const EVENTS: usize = 10_000;
const BATCH: usize = 100;
const ROUNDS: usize = 3;

fn events(dest: &Destination) -> Vec<Event> {
    (0..EVENTS)
        .map(|i| {
            let id = EventId::new(format!("bench-{i:06}")).expect("valid id");
            Event::new(id, dest.clone(), format!("{{\"n\":{i}}}").into_bytes()).with_key(format!("k{}", i % 64))
        })
        .collect()
}

/// (enqueue time, drain time) for one fresh store.
async fn measure(store: Arc<dyn OutboxStore>) -> (Duration, Duration) {
    let dest = Destination::new("bench").expect("valid destination");
    let events = events(&dest);
    let t = Instant::now();
    for chunk in events.chunks(BATCH) {
        store.enqueue(chunk).await.expect("enqueue");
    }
    let enqueue = t.elapsed();
    let broker = MemoryBroker::new();
    broker.declare(&dest, &[]).await.expect("declare");
    let relay = Relay::new(store.clone(), Arc::new(broker.clone()), RelayConfig::new("bench"));
    let t = Instant::now();
    let report = relay.drain().await.expect("drain");
    let drain = t.elapsed();
    assert_eq!(report.published, EVENTS as u64, "every row published");
    assert_eq!(broker.log(&dest).len(), EVENTS, "every event on the broker");
    (enqueue, drain)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn rate(d: Duration) -> f64 {
    EVENTS as f64 / d.as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().expect("temporary directory");
    println!(
        "outbox-store-sqlite bench: {EVENTS} events, enqueue in batches of {BATCH}, one relay (batch {}, \
         pipeline depth {}) into the in-memory broker; median of {ROUNDS} rounds; files in {}",
        RelayConfig::default().batch_size,
        RelayConfig::default().pipeline_depth_for(&MemoryBroker::new()),
        dir.path().display()
    );
    let mut rows: Vec<(String, Duration, Duration)> = Vec::new();
    for name in ["memory (baseline)", "sqlite synchronous=full", "sqlite synchronous=normal"] {
        let (mut enq, mut drain) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let store: Arc<dyn OutboxStore> = match name {
                "memory (baseline)" => Arc::new(MemoryOutbox::default()),
                _ => {
                    let sync = if name.ends_with("full") { Synchronous::Full } else { Synchronous::Normal };
                    let path = dir.path().join(format!("{}-{round}.db", sync.as_str()));
                    Arc::new(SqliteStore::open(SqliteConfig::new(path).with_synchronous(sync)).await.expect("open"))
                }
            };
            let (e, d) = measure(store).await;
            enq.push(e);
            drain.push(d);
        }
        rows.push((name.to_string(), median(enq), median(drain)));
    }
    let (_, base_e, base_d) = rows[0].clone();
    println!("{:<28} {:>14} {:>12} {:>14} {:>12}", "store", "enqueue/s", "time ×base", "relay/s", "time ×base");
    for (name, e, d) in &rows {
        println!(
            "{name:<28} {:>14.0} {:>11.1}x {:>14.0} {:>11.1}x",
            rate(*e),
            e.as_secs_f64() / base_e.as_secs_f64(),
            rate(*d),
            d.as_secs_f64() / base_d.as_secs_f64()
        );
    }
}
