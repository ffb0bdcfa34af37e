//! `outbox cleanup` against a SQLite file: the rows and markers left in the file are what the
//! command said it deleted, open rows are never touched, and unsafe settings delete nothing.

// This test needs no running service: the helpers' re-export of `service` stays unused.
#[allow(unused_imports)]
mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use outbox::core::store::all_rows;
use outbox::core::{Completion, Inbox, InboxAdmin, ManualClock, OutboxAdmin, OutboxStore, Outcome, Timestamp};
use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::{Destination, Event, EventId, RowStatus};

const DAY: Duration = Duration::from_secs(86_400);
const HOUR: Duration = Duration::from_secs(3600);

fn now() -> Timestamp {
    Timestamp(i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap())
}

fn event(id: &str) -> Event {
    Event::new(EventId::new(id).unwrap(), Destination::new("orders").unwrap(), id.as_bytes().to_vec())
}

/// A file with 5 rows published 10 days ago, 2 published an hour ago, one parked and one
/// leased 10 days ago, one pending; and markers of `billing` from 10 days and 1 hour ago.
async fn seed(dir: &tempfile::TempDir) -> (String, SqliteStore) {
    let path = dir.path().join("outbox.db");
    let clock = ManualClock::new(now());
    clock.set(Timestamp(now().as_millis() - 10 * 86_400_000));
    let store = SqliteStore::open_with_clock(SqliteConfig::new(&path), Arc::new(clock.clone())).await.unwrap();
    let names = ["old-0", "old-1", "old-2", "old-3", "old-4", "parked", "leased", "young-0", "young-1", "pending"];
    store.enqueue(&names.map(event)).await.unwrap();
    let c = store.claim("relay", 7, 30 * DAY).await.unwrap();
    for c in &c[..5] {
        assert_eq!(store.complete(c.record.row_id, &c.lease).await.unwrap(), Completion::Published);
    }
    assert_eq!(store.park(c[5].record.row_id, &c[5].lease, "poison").await.unwrap(), Outcome::Applied);
    mark(&store, "m-old").await;
    clock.set(Timestamp(now().as_millis() - HOUR.as_millis() as i64));
    for c in store.claim("relay", 2, HOUR).await.unwrap() {
        assert_eq!(store.complete(c.record.row_id, &c.lease).await.unwrap(), Completion::Published);
    }
    mark(&store, "m-young").await;
    (format!("sqlite://{}", path.display()), store)
}

async fn mark(store: &SqliteStore, id: &str) {
    let mut tx = store.begin().await.unwrap();
    let outcome = store.mark(&mut tx, "billing", &EventId::new(id).unwrap(), &event(id).fingerprint()).await.unwrap();
    assert_eq!(outcome, outbox::core::MarkOutcome::New);
    store.commit(tx).await.unwrap();
}

async fn rows(store: &SqliteStore) -> BTreeMap<String, RowStatus> {
    all_rows(store as &dyn OutboxAdmin)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.event.id.as_str().to_string(), r.status))
        .collect()
}

async fn markers(store: &SqliteStore) -> Vec<String> {
    store.markers("billing").await.unwrap().into_iter().map(|m| m.event_id.as_str().to_string()).collect()
}

#[tokio::test]
async fn cleanup_deletes_old_published_rows_in_batches_and_spares_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (url, store) = seed(&dir).await;
    let before = rows(&store).await;
    assert_eq!(before.len(), 10);

    // Unsafe or zero settings: refused, nothing deleted.
    let zero = run(&["cleanup", "--store", &url, "--published-older-than", "0s"], Duration::from_secs(60));
    assert_eq!(zero.status.code(), Some(1), "{:?}", text(&zero));
    assert!(text(&zero).1.contains("longer than zero"), "{:?}", text(&zero));
    let unsafe_markers = run(
        &[
            "cleanup",
            "--store",
            &url,
            "--published-older-than",
            "7d",
            "--markers",
            "billing",
            "--markers-older-than",
            "1d",
            "--max-redelivery",
            "1h",
            "--dead-letter-retention",
            "7d",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(unsafe_markers.status.code(), Some(1), "{:?}", text(&unsafe_markers));
    assert!(text(&unsafe_markers).1.contains("unsafe marker retention"), "{:?}", text(&unsafe_markers));
    let missing = run(
        &["cleanup", "--store", &url, "--published-older-than", "7d", "--markers", "billing"],
        Duration::from_secs(60),
    );
    assert_eq!(missing.status.code(), Some(2), "--markers without its horizon is a usage error");
    assert_eq!(rows(&store).await, before);
    assert_eq!(markers(&store).await, ["m-old", "m-young"]);

    // Published rows older than 7 days, two per transaction: 5 rows in 3 batches.
    let out = ok(&["cleanup", "--store", &url, "--published-older-than", "7d", "--batch", "2", "--pause", "1ms"]);
    assert!(out.contains("deleted 5 published row(s) older than 7d in 3 batch(es)"), "{out}");
    let after = rows(&store).await;
    let expected: BTreeMap<String, RowStatus> = [
        ("leased", RowStatus::Leased),
        ("parked", RowStatus::Parked),
        ("pending", RowStatus::Pending),
        ("young-0", RowStatus::Published),
        ("young-1", RowStatus::Published),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(after, expected);
    assert_eq!(markers(&store).await, ["m-old", "m-young"], "markers are pruned only when asked");

    // Markers, with a safe retention: 8 days against 1 hour + 7 days.
    let out = ok(&[
        "cleanup",
        "--store",
        &url,
        "--published-older-than",
        "7d",
        "--markers",
        "billing",
        "--markers-older-than",
        "8d",
        "--max-redelivery",
        "1h",
        "--dead-letter-retention",
        "7d",
    ]);
    assert!(out.contains("deleted 0 published row(s)"), "{out}");
    assert!(out.contains("deleted 1 marker(s) of consumer billing older than 8d"), "{out}");
    assert_eq!(markers(&store).await, ["m-young"]);
    assert_eq!(rows(&store).await, expected);
}
