//! Retention on the reference backends, judged by the rows and markers left: the store's
//! `purge_published` contract, the `Cleanup` task's batches and settings, and marker pruning
//! only within a safe retention. Time is a `ManualClock`; the task's own pauses run on tokio's
//! paused clock.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::memory::{MemoryInbox, MemoryOutbox};
use outbox_core::store::all_rows;
use outbox_core::{
    Cleanup, CleanupConfig, Completion, Destination, ErrorKind, Event, EventId, Inbox, InboxAdmin, ManualClock,
    MarkOutcome, MarkerPruning, OutboxAdmin, OutboxStore, Outcome, RowStatus, Shutdown,
};

const MIN: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(86_400);

fn event(id: &str) -> Event {
    Event::new(EventId::new(id).unwrap(), Destination::new("orders").unwrap(), id.as_bytes().to_vec())
}

async fn left(store: &dyn OutboxAdmin) -> BTreeMap<String, RowStatus> {
    all_rows(store).await.unwrap().into_iter().map(|r| (r.event.id.as_str().to_string(), r.status)).collect()
}

/// `n` rows published 10 ms apart, then (the first time) one pending, one leased and one parked
/// row.
async fn fill(clock: &ManualClock, store: &MemoryOutbox, n: usize) {
    let events: Vec<_> = (0..n).map(|i| event(&format!("p{i:03}"))).collect();
    store.enqueue(&events).await.unwrap();
    for c in store.claim("relay", n + 1, HOUR).await.unwrap() {
        if c.record.event.id.as_str().starts_with("open-") {
            assert_eq!(store.release(c.record.row_id, &c.lease).await.unwrap(), Outcome::Applied);
            continue;
        }
        assert_eq!(store.complete(c.record.row_id, &c.lease).await.unwrap(), Completion::Published);
        clock.advance(Duration::from_millis(10));
    }
    if left(store).await.contains_key("open-pending") {
        return;
    }
    store.enqueue(&[event("open-pending"), event("open-leased"), event("open-parked")]).await.unwrap();
    let c = store.claim("relay", 3, DAY * 365).await.unwrap();
    assert_eq!(store.release(c[0].record.row_id, &c[0].lease).await.unwrap(), Outcome::Applied);
    assert_eq!(store.park(c[2].record.row_id, &c[2].lease, "poison").await.unwrap(), Outcome::Applied);
}

fn open_rows() -> BTreeMap<String, RowStatus> {
    [("open-leased", RowStatus::Leased), ("open-parked", RowStatus::Parked), ("open-pending", RowStatus::Pending)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

#[tokio::test]
async fn memory_purge_is_oldest_first_bounded_and_spares_open_rows() {
    let clock = ManualClock::default();
    let store = MemoryOutbox::new(Arc::new(clock.clone()));
    fill(&clock, &store, 5).await;
    // Published at t0, t0+10ms, ..., t0+40ms; now t0+50ms.
    assert_eq!(store.purge_published(Duration::from_millis(25), 2).await.unwrap(), 2);
    let rows = left(&store).await;
    assert!(!rows.contains_key("p000") && !rows.contains_key("p001") && rows.contains_key("p002"), "{rows:?}");
    // p002 was published at t0+20ms, exactly 30 ms ago: kept by "older than 30ms".
    assert_eq!(store.purge_published(Duration::from_millis(30), 10).await.unwrap(), 0);
    assert_eq!(store.purge_published(Duration::from_millis(25), 10).await.unwrap(), 1);
    clock.advance(HOUR * 24 * 30);
    assert_eq!(store.purge_published(MIN, 0).await.unwrap(), 0, "limit 0 deletes nothing");
    assert_eq!(store.purge_published(MIN, 10).await.unwrap(), 2);
    assert_eq!(left(&store).await, open_rows(), "open rows stay however old");
    // The id of a purged row can be enqueued again, as in the database stores.
    assert_eq!(store.enqueue(&[event("p000")]).await.unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn cleanup_round_deletes_in_batches_until_a_short_one() {
    let clock = ManualClock::default();
    let store = MemoryOutbox::new(Arc::new(clock.clone()));
    fill(&clock, &store, 25).await;
    clock.advance(HOUR);
    let cleanup = Cleanup::new(Arc::new(store.clone()), CleanupConfig::new(MIN).with_batch(10)).unwrap();
    let report = cleanup.run_once().await.unwrap();
    assert_eq!((report.published_deleted, report.batches, report.capped), (25, 3, 0));
    assert_eq!(left(&store).await, open_rows());
    let again = cleanup.run_once().await.unwrap();
    assert_eq!((again.published_deleted, again.batches), (0, 1));

    // A cap on batches ends a round early and says so.
    fill(&clock, &store, 30).await;
    clock.advance(HOUR);
    let capped =
        Cleanup::new(Arc::new(store.clone()), CleanupConfig::new(MIN).with_batch(10).with_max_batches(2)).unwrap();
    let r = capped.run_once().await.unwrap();
    assert_eq!((r.published_deleted, r.batches, r.capped), (20, 2, 1));
    assert_eq!(all_rows(&store).await.unwrap().iter().filter(|r| r.status == RowStatus::Published).count(), 10);
}

#[tokio::test(start_paused = true)]
async fn cleanup_runs_until_shutdown() {
    let clock = ManualClock::default();
    let store = MemoryOutbox::new(Arc::new(clock.clone()));
    fill(&clock, &store, 12).await;
    clock.advance(HOUR);
    let config = CleanupConfig::new(MIN).with_batch(5).with_interval(Duration::from_secs(30));
    let cleanup = Arc::new(Cleanup::new(Arc::new(store.clone()), config).unwrap());
    let shutdown = Shutdown::default();
    let task = tokio::spawn({
        let (cleanup, shutdown) = (cleanup.clone(), shutdown.clone());
        async move { cleanup.run(shutdown).await }
    });
    // Rounds repeat: rows published later are purged by a later round.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    while left(&store).await != open_rows() {
        assert!(tokio::time::Instant::now() < deadline, "first round never finished");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fill(&clock, &store, 3).await;
    clock.advance(HOUR);
    while left(&store).await != open_rows() {
        assert!(tokio::time::Instant::now() < deadline, "a later round never ran");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    shutdown.trigger();
    let total = tokio::time::timeout(Duration::from_secs(5), task).await.expect("stops on shutdown").unwrap().unwrap();
    assert_eq!(total.published_deleted, 15);
}

#[test]
fn zero_settings_are_config_errors_naming_the_setting() {
    let store: Arc<dyn OutboxAdmin> = Arc::new(MemoryOutbox::default());
    let err = Cleanup::new(store.clone(), CleanupConfig::new(Duration::ZERO)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("retention must be longer than zero"), "{err}");
    for (config, word) in [
        (CleanupConfig::new(DAY).with_batch(0), "batch"),
        (CleanupConfig::new(DAY).with_interval(Duration::ZERO), "interval"),
        (CleanupConfig::new(DAY).with_max_batches(0), "max_batches"),
    ] {
        let err = Cleanup::new(store.clone(), config).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains(word), "{err}");
    }
}

#[tokio::test(start_paused = true)]
async fn markers_are_pruned_only_within_a_safe_retention() {
    let clock = ManualClock::default();
    let inbox = MemoryInbox::new(Arc::new(clock.clone()));
    let admin: Arc<dyn InboxAdmin> = Arc::new(inbox.clone());
    let mark = |id: &'static str| {
        let inbox = inbox.clone();
        async move {
            let mut tx = inbox.begin().await.unwrap();
            let fp = event(id).fingerprint();
            assert_eq!(
                inbox.mark(&mut tx, "billing", &EventId::new(id).unwrap(), &fp).await.unwrap(),
                MarkOutcome::New
            );
            inbox.commit(tx).await.unwrap();
        }
    };

    // Unsafe: markers kept a day while the dead-letter queue keeps messages a week.
    let err = MarkerPruning::new(admin.clone(), "billing", DAY, DAY * 7 + HOUR).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("unsafe marker retention"), "{err}");
    assert_eq!(
        MarkerPruning::new(admin.clone(), "billing", Duration::ZERO, Duration::ZERO).unwrap_err().kind(),
        ErrorKind::Config
    );

    mark("old").await;
    clock.advance(DAY * 9);
    mark("young").await;
    clock.advance(HOUR);
    let pruning = MarkerPruning::new(admin.clone(), "billing", DAY * 8, DAY * 7 + HOUR).unwrap();
    let cleanup = Cleanup::new(Arc::new(MemoryOutbox::new(Arc::new(clock.clone()))), CleanupConfig::new(DAY))
        .unwrap()
        .with_markers(pruning);
    let r = cleanup.run_once().await.unwrap();
    assert_eq!(r.markers_deleted, 1);
    let kept: Vec<_> =
        admin.markers("billing").await.unwrap().into_iter().map(|m| m.event_id.as_str().to_string()).collect();
    assert_eq!(kept, ["young"]);
}
