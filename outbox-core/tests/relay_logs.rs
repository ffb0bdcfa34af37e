//! The relay's log lines, read back through a `fmt` subscriber. A file of its own: a test
//! binary runs its tests on parallel threads, and a callsite first reached on another thread
//! while this test's scoped subscriber is being installed can keep the interest it was given
//! without it (seen once: a `debug` line missing), so no other test may run beside this one.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::memory::{MemoryBroker, MemoryOutbox};
use outbox_core::store::all_rows;
use outbox_core::{Broker, Destination, Event, EventId, ManualClock, OutboxStore, Relay, RelayConfig, RowStatus};

const LIMIT: Duration = Duration::from_secs(10);

fn dest() -> Destination {
    Destination::new("orders").unwrap()
}

/// A log sink for one test: every line the `fmt` layer writes while the guard is held.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn lines(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap()).lines().map(str::to_owned).collect()
    }
}

/// Drain `events` rows in batches of 10 with the relay's log at `level`; the log's lines.
async fn drain_logged(level: tracing::Level, events: usize) -> Vec<String> {
    let store = MemoryOutbox::new(Arc::new(ManualClock::default()));
    let broker = MemoryBroker::new();
    broker.declare(&dest(), &[]).await.unwrap();
    let batch: Vec<Event> =
        (0..events).map(|i| Event::new(EventId::new(format!("log-{i:03}")).unwrap(), dest(), vec![i as u8])).collect();
    store.enqueue(&batch).await.unwrap();
    let sink = Captured::default();
    let writer = sink.clone();
    let subscriber =
        tracing_subscriber::fmt().with_max_level(level).with_ansi(false).with_writer(move || writer.clone()).finish();
    let store = Arc::new(store);
    let config = RelayConfig::new("logger").with_batch_size(10).with_lease(Duration::from_secs(60));
    let relay = Relay::new(store.clone(), Arc::new(broker.clone()), config);
    let report = {
        let _guard = tracing::subscriber::set_default(subscriber);
        tokio::time::timeout(LIMIT, relay.drain()).await.expect("the drain ends within 10s").unwrap()
    };
    assert_eq!(report.published, events as u64, "{report:?}");
    // Durable state: every row published once, every event on the broker once.
    let rows = all_rows(&*store).await.unwrap();
    assert_eq!(rows.iter().filter(|r| r.status == RowStatus::Published).count(), events, "{rows:?}");
    assert_eq!(broker.log(&dest()).len(), events, "every event on the broker once");
    sink.lines()
}

/// A relay at work writes one summary line at `info` (at most every `LOG_SUMMARY_EVERY`, and
/// when the work runs out), not a line per batch; each batch is at `debug`.
#[tokio::test]
async fn a_relay_logs_a_summary_at_info_and_each_batch_at_debug() {
    let info = drain_logged(tracing::Level::INFO, 30).await;
    assert!(!info.iter().any(|l| l.contains("batch done")), "a batch line at info: {info:#?}");
    let relayed: Vec<&String> = info.iter().filter(|l| l.contains("relayed")).collect();
    assert_eq!(relayed.len(), 1, "one summary for a drain shorter than the interval: {info:#?}");
    for field in ["batches=3", "claimed=30", "published=30", "fenced=0", "owner=logger"] {
        assert!(relayed[0].contains(field), "{field} in {}", relayed[0]);
    }
    let debug = drain_logged(tracing::Level::DEBUG, 30).await;
    let batches: Vec<&String> = debug.iter().filter(|l| l.contains("batch done")).collect();
    assert_eq!(batches.len(), 3, "a line per batch at debug: {debug:#?}");
    assert!(batches.iter().all(|l| l.contains(" DEBUG ") && l.contains("published=10")), "{batches:#?}");
}
