//! The inbox: marker and effect in one transaction, read back from the file.

mod common;

use std::time::Duration;

use common::{event, id};
use outbox_core::inbox::UNKNOWN_DESTINATION;
use outbox_core::{
    Clock, DeadLetter, DeadLetterReason, ErrorKind, Event, Fingerprint, Headers, Inbox, InboxAdmin, LedgerState,
    ManualClock, MarkOutcome, Timestamp, VersionOutcome,
};
use outbox_store_sqlite::{SCHEMA_VERSION, SqliteStore};

const CONSUMER: &str = "billing";

fn create_effect_table(store: &SqliteStore) {
    store
        .connect_raw()
        .unwrap()
        .execute_batch("CREATE TABLE credits (event_id TEXT NOT NULL, account TEXT NOT NULL, amount INTEGER NOT NULL)")
        .unwrap();
}

/// Committed effect rows and marker rows for `event_id`, read with a separate connection.
fn durable(store: &SqliteStore, event_id: &str) -> (i64, i64) {
    let conn = store.connect_raw().unwrap();
    let effects = conn.query_row("SELECT COUNT(*) FROM credits WHERE event_id = ?1", [event_id], |r| r.get(0)).unwrap();
    let markers = conn
        .query_row(
            "SELECT COUNT(*) FROM outbox_inbox_markers WHERE consumer = ?1 AND event_id = ?2",
            [CONSUMER, event_id],
            |r| r.get(0),
        )
        .unwrap();
    (effects, markers)
}

/// The consumer's handling of one delivery: mark, apply the credit if new, commit.
async fn handle(store: &SqliteStore, e: &Event, account: &str, amount: i64) -> outbox_core::Result<MarkOutcome> {
    let mut tx = store.begin().await?;
    let outcome = store.mark(&mut tx, CONSUMER, &e.id, &e.fingerprint()).await?;
    if outcome == MarkOutcome::New {
        let (id, account) = (e.id.to_string(), account.to_string());
        tx.run(move |c| c.execute("INSERT INTO credits VALUES (?1, ?2, ?3)", (id, account, amount))).await?;
    }
    store.commit(tx).await?;
    Ok(outcome)
}

#[tokio::test]
async fn new_duplicate_and_conflict() {
    let db = common::open().await;
    create_effect_table(&db.store);
    let e = event("credit-1", b"7");

    assert_eq!(handle(&db.store, &e, "a", 7).await.unwrap(), MarkOutcome::New);
    assert_eq!(durable(&db.store, "credit-1"), (1, 1));

    assert_eq!(handle(&db.store, &e, "a", 7).await.unwrap(), MarkOutcome::Duplicate);
    assert_eq!(durable(&db.store, "credit-1"), (1, 1));

    let changed = event("credit-1", b"8");
    let mut tx = db.store.begin().await.unwrap();
    let outcome = db.store.mark(&mut tx, CONSUMER, &changed.id, &changed.fingerprint()).await.unwrap();
    assert_eq!(outcome, MarkOutcome::Conflict { stored: e.fingerprint() });
    db.store.commit(tx).await.unwrap();
    assert_eq!(durable(&db.store, "credit-1"), (1, 1));

    // Another consumer is independent.
    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.mark(&mut tx, "audit", &e.id, &e.fingerprint()).await.unwrap(), MarkOutcome::New);
    db.store.commit(tx).await.unwrap();

    let markers = db.store.markers(CONSUMER).await.unwrap();
    assert_eq!(markers.len(), 1);
    assert_eq!((markers[0].event_id.clone(), markers[0].fingerprint), (id("credit-1"), e.fingerprint()));
    assert_eq!(db.store.markers("audit").await.unwrap().len(), 1);
}

#[tokio::test]
async fn dropping_the_transaction_rolls_back_marker_and_effect() {
    let db = common::open().await;
    create_effect_table(&db.store);
    let e = event("credit-2", b"5");
    {
        let mut tx = db.store.begin().await.unwrap();
        assert_eq!(db.store.mark(&mut tx, CONSUMER, &e.id, &e.fingerprint()).await.unwrap(), MarkOutcome::New);
        tx.run(|c| c.execute("INSERT INTO credits VALUES ('credit-2', 'a', 5)", [])).await.unwrap();
        // crash before commit: dropped
    }
    assert_eq!(durable(&db.store, "credit-2"), (0, 0));
    assert!(db.store.markers(CONSUMER).await.unwrap().is_empty());

    // Explicit rollback does the same.
    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.mark(&mut tx, CONSUMER, &e.id, &e.fingerprint()).await.unwrap(), MarkOutcome::New);
    tx.rollback().await.unwrap();
    assert_eq!(durable(&db.store, "credit-2"), (0, 0));

    // Redelivery applies once.
    assert_eq!(handle(&db.store, &e, "a", 5).await.unwrap(), MarkOutcome::New);
    assert_eq!(handle(&db.store, &e, "a", 5).await.unwrap(), MarkOutcome::Duplicate);
    assert_eq!(durable(&db.store, "credit-2"), (1, 1));
}

#[tokio::test]
async fn a_failing_effect_is_reported_and_nothing_commits() {
    let db = common::open().await;
    create_effect_table(&db.store);
    let e = event("credit-3", b"1");
    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.mark(&mut tx, CONSUMER, &e.id, &e.fingerprint()).await.unwrap(), MarkOutcome::New);
    let err = tx.run(|c| c.execute("INSERT INTO no_such_table VALUES (1)", [])).await.unwrap_err();
    assert_eq!(err.backend(), "sqlite");
    assert!(err.is_permanent(), "{err}");
    drop(tx);
    assert_eq!(durable(&db.store, "credit-3"), (0, 0));
}

#[tokio::test]
async fn an_effect_that_ends_the_transaction_is_rejected() {
    let db = common::open().await;
    let e = event("credit-4", b"1");
    let mut tx = db.store.begin().await.unwrap();
    let err = tx.run(|c| c.execute_batch("ROLLBACK")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rejected, "{err}");
    let err = db.store.mark(&mut tx, CONSUMER, &e.id, &e.fingerprint()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "nothing runs outside the transaction: {err}");
    assert!(db.store.commit(tx).await.is_err());
    assert!(db.store.markers(CONSUMER).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_apply_one_effect() {
    let db = common::open().await;
    create_effect_table(&db.store);
    let events: Vec<Event> = (0..25).map(|i| event(&format!("dup-{i}"), b"3")).collect();
    let mut tasks = Vec::new();
    for e in &events {
        for _ in 0..3 {
            let (store, e) = (db.store.clone(), e.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    match handle(&store, &e, "acct", 3).await {
                        Ok(outcome) => return outcome,
                        Err(err) if err.is_transient() => continue,
                        Err(err) => panic!("{err}"),
                    }
                }
            }));
        }
    }
    let mut new = 0;
    for t in tasks {
        if t.await.unwrap() == MarkOutcome::New {
            new += 1;
        }
    }
    assert_eq!(new, events.len(), "exactly one delivery per event was new");
    for e in &events {
        assert_eq!(durable(&db.store, e.id.as_str()), (1, 1), "{}", e.id);
    }
}

#[tokio::test]
async fn equal_amounts_in_different_events_are_different_events() {
    // F11: a:7, b:7, a:7, c:0 → balance 14, three markers.
    let db = common::open().await;
    create_effect_table(&db.store);
    let (a, b, c) = (event("a", b"7"), event("b", b"7"), event("c", b"0"));
    let mut outcomes = Vec::new();
    for (e, amount) in [(&a, 7), (&b, 7), (&a, 7), (&c, 0)] {
        outcomes.push(handle(&db.store, e, "acct", amount).await.unwrap());
    }
    assert_eq!(outcomes, [MarkOutcome::New, MarkOutcome::New, MarkOutcome::Duplicate, MarkOutcome::New]);
    let conn = db.store.connect_raw().unwrap();
    let balance: i64 = conn.query_row("SELECT COALESCE(SUM(amount), 0) FROM credits", [], |r| r.get(0)).unwrap();
    assert_eq!(balance, 14);
    assert_eq!(db.store.markers(CONSUMER).await.unwrap().len(), 3);
}

#[tokio::test]
async fn marker_time_is_the_commit_time_and_prune_keeps_young_markers() {
    let db = common::open().await;
    let t0 = db.clock.now();
    let (e1, e2) = (event("old", b"1"), event("young", b"2"));
    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.mark(&mut tx, CONSUMER, &e1.id, &e1.fingerprint()).await.unwrap(), MarkOutcome::New);
    db.clock.advance(Duration::from_secs(1));
    db.store.commit(tx).await.unwrap();
    let t1 = t0.plus(Duration::from_secs(1));
    assert_eq!(db.store.markers(CONSUMER).await.unwrap()[0].at, t1);

    db.clock.advance(Duration::from_secs(10));
    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.mark(&mut tx, CONSUMER, &e2.id, &e2.fingerprint()).await.unwrap(), MarkOutcome::New);
    db.store.commit(tx).await.unwrap();

    // now = t1 + 10s: "old" is exactly 10s old, not more.
    assert_eq!(db.store.prune_markers(CONSUMER, Duration::from_secs(10)).await.unwrap(), 0);
    db.clock.advance(Duration::from_millis(1));
    assert_eq!(db.store.prune_markers("someone-else", Duration::from_secs(10)).await.unwrap(), 0);
    assert_eq!(db.store.prune_markers(CONSUMER, Duration::from_secs(10)).await.unwrap(), 1);
    let left = db.store.markers(CONSUMER).await.unwrap();
    assert_eq!(left.iter().map(|m| m.event_id.to_string()).collect::<Vec<_>>(), vec!["young"]);
}

#[tokio::test]
async fn projection_versions_never_move_backward() {
    let db = common::open().await;
    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(
        db.store.advance_version(&mut tx, CONSUMER, "acct-1", 1).await.unwrap(),
        VersionOutcome::Advanced { previous: None }
    );
    assert_eq!(
        db.store.advance_version(&mut tx, CONSUMER, "acct-1", 3).await.unwrap(),
        VersionOutcome::Advanced { previous: Some(1) }
    );
    db.store.commit(tx).await.unwrap();

    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(
        db.store.advance_version(&mut tx, CONSUMER, "acct-1", 2).await.unwrap(),
        VersionOutcome::Stale { current: 3 }
    );
    assert_eq!(
        db.store.advance_version(&mut tx, CONSUMER, "acct-1", 3).await.unwrap(),
        VersionOutcome::Stale { current: 3 }
    );
    assert_eq!(
        db.store.advance_version(&mut tx, CONSUMER, "acct-1", 9).await.unwrap(),
        VersionOutcome::Advanced { previous: Some(3) }
    );
    drop(tx);

    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(
        db.store.advance_version(&mut tx, CONSUMER, "acct-1", 4).await.unwrap(),
        VersionOutcome::Advanced { previous: Some(3) },
        "the dropped transaction's version 9 never committed"
    );
    let err = db.store.advance_version(&mut tx, CONSUMER, "acct-1", u64::MAX).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    db.store.commit(tx).await.unwrap();
    let stored: i64 = db
        .store
        .connect_raw()
        .unwrap()
        .query_row(
            "SELECT version FROM outbox_inbox_versions WHERE consumer = ?1 AND subject = 'acct-1'",
            [CONSUMER],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(stored, 4);
}

#[tokio::test]
async fn notification_ledger_round_trips() {
    let db = common::open().await;
    let e = id("mail-1");
    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.ledger_state(&mut tx, CONSUMER, &e).await.unwrap(), LedgerState::Fresh);
    db.store.set_ledger_state(&mut tx, CONSUMER, &e, LedgerState::Attempted).await.unwrap();
    assert_eq!(db.store.ledger_state(&mut tx, CONSUMER, &e).await.unwrap(), LedgerState::Attempted);
    db.store.commit(tx).await.unwrap();

    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.ledger_state(&mut tx, CONSUMER, &e).await.unwrap(), LedgerState::Attempted);
    db.store.set_ledger_state(&mut tx, CONSUMER, &e, LedgerState::Done).await.unwrap();
    drop(tx);

    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.ledger_state(&mut tx, CONSUMER, &e).await.unwrap(), LedgerState::Attempted, "rolled back");
    db.store.set_ledger_state(&mut tx, CONSUMER, &e, LedgerState::Done).await.unwrap();
    db.store.commit(tx).await.unwrap();

    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.ledger_state(&mut tx, CONSUMER, &e).await.unwrap(), LedgerState::Done);
    assert_eq!(db.store.ledger_state(&mut tx, "other", &e).await.unwrap(), LedgerState::Fresh);
    db.store.set_ledger_state(&mut tx, CONSUMER, &e, LedgerState::Fresh).await.unwrap();
    db.store.commit(tx).await.unwrap();
    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.ledger_state(&mut tx, CONSUMER, &e).await.unwrap(), LedgerState::Fresh);
}

/// A dead letter whose event has a key, binary header values and a binary payload.
fn letter(event_id: &str, reason: DeadLetterReason) -> DeadLetter {
    let e = event(event_id, &[0, 0xff, 1, b'\n', 0])
        .with_key(format!("key of {event_id} ünï"))
        .with_header("bin", vec![0u8, 0xff, 0])
        .with_header("empty", Vec::new());
    DeadLetter::new(CONSUMER, e, reason, format!("{event_id} failed"))
}

#[tokio::test]
async fn dead_letters_commit_with_the_transaction_and_keep_the_whole_event() {
    let db = common::open().await;
    let mut tx = db.store.begin().await.unwrap();
    db.store.dead_letter(&mut tx, &letter("x-1", DeadLetterReason::Conflict)).await.unwrap();
    db.store.dead_letter(&mut tx, &letter("x-2", DeadLetterReason::HandlerFailed)).await.unwrap();
    db.clock.advance(Duration::from_secs(2));
    db.store.commit(tx).await.unwrap();
    let committed_at = db.clock.now();

    let mut tx = db.store.begin().await.unwrap();
    db.store.dead_letter(&mut tx, &letter("x-3", DeadLetterReason::Uncertain)).await.unwrap();
    drop(tx);

    let got = db.store.dead_letters(CONSUMER).await.unwrap();
    assert_eq!(got.len(), 2);
    assert!(got[0].id > 0 && got[1].id > got[0].id, "store-assigned ids in write order: {got:?}");
    let expected: Vec<DeadLetter> = [("x-1", DeadLetterReason::Conflict), ("x-2", DeadLetterReason::HandlerFailed)]
        .into_iter()
        .zip(&got)
        .map(|((e, r), g)| DeadLetter { id: g.id, at: committed_at, ..letter(e, r) })
        .collect();
    assert_eq!(got, expected, "event (destination, key, headers, payload) byte-for-byte");
    assert!(db.store.dead_letters("other").await.unwrap().is_empty());

    // The columns themselves, read with a separate connection.
    let conn = db.store.connect_raw().unwrap();
    let (destination, key, headers): (String, Option<String>, Vec<u8>) = conn
        .query_row(
            "SELECT destination, event_key, headers FROM outbox_inbox_dead_letters WHERE id = ?1",
            [got[0].id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(destination, "orders");
    assert_eq!(key.as_deref(), Some("key of x-1 ünï"));
    assert_eq!(outbox_core::event::decode_headers(&headers, "test").unwrap(), expected[0].event.headers);
}

#[tokio::test]
async fn removing_dead_letters_takes_only_the_consumers_ids_and_resets_their_failure_counts() {
    let db = common::open().await;
    let mut tx = db.store.begin().await.unwrap();
    for e in ["r-1", "r-2", "r-3"] {
        db.store.dead_letter(&mut tx, &letter(e, DeadLetterReason::HandlerFailed)).await.unwrap();
    }
    let other = DeadLetter { consumer: "other".into(), ..letter("r-1", DeadLetterReason::HandlerFailed) };
    db.store.dead_letter(&mut tx, &other).await.unwrap();
    db.store.commit(tx).await.unwrap();
    for e in ["r-1", "r-2", "r-3"] {
        db.store.record_failure(CONSUMER, &id(e)).await.unwrap();
    }
    db.store.record_failure("other", &id("r-1")).await.unwrap();
    let ours = db.store.dead_letters(CONSUMER).await.unwrap();
    let theirs = db.store.dead_letters("other").await.unwrap();

    assert_eq!(db.store.remove_dead_letters(CONSUMER, &[]).await.unwrap(), 0);
    let asked = [ours[0].id, ours[2].id, theirs[0].id, theirs[0].id + 100];
    assert_eq!(db.store.remove_dead_letters(CONSUMER, &asked).await.unwrap(), 2);
    assert_eq!(db.store.dead_letters(CONSUMER).await.unwrap(), [ours[1].clone()]);
    assert_eq!(db.store.dead_letters("other").await.unwrap(), theirs);

    let count = |consumer: &str, e: &str| -> i64 {
        db.store
            .connect_raw()
            .unwrap()
            .query_row(
                "SELECT COALESCE((SELECT count FROM outbox_inbox_failures WHERE consumer = ?1 AND event_id = ?2), 0)",
                [consumer, e],
                |r| r.get(0),
            )
            .unwrap()
    };
    assert_eq!((count(CONSUMER, "r-1"), count(CONSUMER, "r-2"), count(CONSUMER, "r-3")), (0, 1, 0));
    assert_eq!(count("other", "r-1"), 1, "the other consumer's count stays");
    assert_eq!(db.store.record_failure(CONSUMER, &id("r-1")).await.unwrap(), 1, "counts from 1 again");
}

/// The schema exactly as version 1 of this crate created it (frozen: the migration from it is
/// what is under test).
const SCHEMA_V1: &str = r"
CREATE TABLE outbox_schema_version (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL) STRICT;
CREATE TABLE outbox_rows (
    row_id INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL UNIQUE, destination TEXT NOT NULL,
    event_key TEXT, headers BLOB NOT NULL, payload BLOB NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    token INTEGER NOT NULL DEFAULT 0, owner TEXT, lease_expires_at INTEGER, available_at INTEGER NOT NULL,
    created_at INTEGER NOT NULL, published_token INTEGER, published_at INTEGER, parked_at INTEGER, last_error TEXT
) STRICT;
CREATE INDEX outbox_rows_claim ON outbox_rows (row_id, available_at, lease_expires_at)
    WHERE published_token IS NULL AND parked_at IS NULL;
CREATE INDEX outbox_rows_parked ON outbox_rows (row_id) WHERE parked_at IS NOT NULL;
CREATE TABLE outbox_inbox_markers (
    consumer TEXT NOT NULL, event_id TEXT NOT NULL, fingerprint BLOB NOT NULL, at INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
) STRICT, WITHOUT ROWID;
CREATE INDEX outbox_inbox_markers_at ON outbox_inbox_markers (consumer, at);
CREATE TABLE outbox_inbox_versions (
    consumer TEXT NOT NULL, subject TEXT NOT NULL, version INTEGER NOT NULL, at INTEGER NOT NULL,
    PRIMARY KEY (consumer, subject)
) STRICT, WITHOUT ROWID;
CREATE TABLE outbox_inbox_ledger (
    consumer TEXT NOT NULL, event_id TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('attempted', 'done')), at INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
) STRICT, WITHOUT ROWID;
CREATE TABLE outbox_inbox_dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT, consumer TEXT NOT NULL, event_id TEXT NOT NULL, reason TEXT NOT NULL,
    error TEXT NOT NULL, payload BLOB NOT NULL, at INTEGER NOT NULL
) STRICT;
CREATE INDEX outbox_inbox_dead_letters_consumer ON outbox_inbox_dead_letters (consumer, id);
CREATE TABLE outbox_inbox_failures (
    consumer TEXT NOT NULL, event_id TEXT NOT NULL, count INTEGER NOT NULL, at INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
) STRICT, WITHOUT ROWID;
INSERT INTO outbox_schema_version (version, applied_at) VALUES (1, 0);
INSERT INTO outbox_inbox_dead_letters (consumer, event_id, reason, error, payload, at)
    VALUES ('billing', 'old-1', 'handler_failed', 'handler failed 5 times', x'00ff0a00', 1234);
INSERT INTO outbox_inbox_failures (consumer, event_id, count, at) VALUES ('billing', 'old-1', 5, 1234);
";

#[tokio::test]
async fn a_version_1_file_migrates_and_keeps_its_dead_letters() {
    // Written at version 2; later versions (3 retention, 4 key order) add indexes only.
    const { assert!(SCHEMA_VERSION >= 2) };
    let dir = tempfile::tempdir().unwrap();
    let config = common::config_in(&dir);
    {
        let conn = outbox_store_sqlite::rusqlite::Connection::open(&config.path).unwrap();
        conn.execute_batch(SCHEMA_V1).unwrap();
    }
    let clock = ManualClock::default();
    let store = SqliteStore::open_with_clock(config.clone(), std::sync::Arc::new(clock.clone())).await.unwrap();
    assert_eq!(store.schema_version().await.unwrap(), SCHEMA_VERSION);
    let versions: Vec<i64> = {
        let conn = store.connect_raw().unwrap();
        let mut stmt = conn.prepare("SELECT version FROM outbox_schema_version ORDER BY version").unwrap();
        stmt.query_map([], |r| r.get(0)).unwrap().collect::<Result<_, _>>().unwrap()
    };
    assert_eq!(versions, (1..=SCHEMA_VERSION).collect::<Vec<_>>());

    // The old record reads back: what version 1 kept, byte-for-byte, and the documented
    // defaults for what it did not.
    let old = store.dead_letters(CONSUMER).await.unwrap();
    assert_eq!(old.len(), 1);
    let d = &old[0];
    assert_eq!(
        (d.event.id.as_str(), d.reason, d.error.as_str()),
        ("old-1", DeadLetterReason::HandlerFailed, "handler failed 5 times")
    );
    assert_eq!(d.event.payload, [0x00, 0xff, 0x0a, 0x00]);
    assert_eq!(d.at, Timestamp(1234));
    assert_eq!(d.event.destination.as_str(), UNKNOWN_DESTINATION);
    assert!(!d.destination_known());
    assert_eq!((d.event.key.as_ref(), &d.event.headers), (None, &Headers::new()));

    // New records keep everything; removing the old one clears its failure count.
    let mut tx = store.begin().await.unwrap();
    store.dead_letter(&mut tx, &letter("new-1", DeadLetterReason::Conflict)).await.unwrap();
    store.commit(tx).await.unwrap();
    let all = store.dead_letters(CONSUMER).await.unwrap();
    assert_eq!(all.len(), 2);
    assert!(all[1].id > d.id);
    assert_eq!(all[1].event, letter("new-1", DeadLetterReason::Conflict).event);
    assert!(all[1].destination_known());
    assert_eq!(store.remove_dead_letters(CONSUMER, &[d.id]).await.unwrap(), 1);
    assert_eq!(store.record_failure(CONSUMER, &id("old-1")).await.unwrap(), 1);

    // Reopening applies nothing again.
    drop(store);
    let again = SqliteStore::open(config).await.unwrap();
    assert_eq!(again.schema_version().await.unwrap(), SCHEMA_VERSION);
    assert_eq!(again.dead_letters(CONSUMER).await.unwrap(), [all[1].clone()]);
}

#[tokio::test]
async fn failure_counts_are_durable_per_key() {
    let db = common::open().await;
    let (a, b) = (id("f-a"), id("f-b"));
    assert_eq!(db.store.record_failure(CONSUMER, &a).await.unwrap(), 1);
    assert_eq!(db.store.record_failure(CONSUMER, &a).await.unwrap(), 2);
    assert_eq!(db.store.record_failure(CONSUMER, &b).await.unwrap(), 1);
    assert_eq!(db.store.record_failure("other", &a).await.unwrap(), 1);
    let reopened = SqliteStore::open(db.config()).await.unwrap();
    assert_eq!(reopened.record_failure(CONSUMER, &a).await.unwrap(), 3);
}

#[tokio::test]
async fn a_stored_fingerprint_is_compared_byte_for_byte() {
    let db = common::open().await;
    let e = id("fp");
    let fp = Fingerprint([7; 32]);
    let mut tx = db.store.begin().await.unwrap();
    assert_eq!(db.store.mark(&mut tx, CONSUMER, &e, &fp).await.unwrap(), MarkOutcome::New);
    assert_eq!(db.store.mark(&mut tx, CONSUMER, &e, &fp).await.unwrap(), MarkOutcome::Duplicate, "same tx");
    let mut other = fp;
    other.0[31] = 8;
    assert_eq!(db.store.mark(&mut tx, CONSUMER, &e, &other).await.unwrap(), MarkOutcome::Conflict { stored: fp });
    db.store.commit(tx).await.unwrap();
}

#[tokio::test]
async fn with_connection_reads_committed_state_and_never_leaks_a_transaction() {
    let db = common::open_with(|c| c.with_pool_size(1)).await;
    db.store
        .with_connection(|c| c.execute_batch("CREATE TABLE credits (event_id TEXT, account TEXT, amount INTEGER)"))
        .await
        .unwrap();
    assert_eq!(handle(&db.store, &event("w-1", b"4"), "acct", 4).await.unwrap(), MarkOutcome::New);
    // A transaction left open by the closure is rolled back, and the pool keeps working.
    db.store
        .with_connection(|c| c.execute_batch("BEGIN; INSERT INTO credits VALUES ('ghost', 'acct', 100);"))
        .await
        .unwrap();
    let sum: i64 = db
        .store
        .with_connection(|c| c.query_row("SELECT COALESCE(SUM(amount), 0) FROM credits", [], |r| r.get(0)))
        .await
        .unwrap();
    assert_eq!(sum, 4);
    assert_eq!(handle(&db.store, &event("w-2", b"1"), "acct", 1).await.unwrap(), MarkOutcome::New);
    assert_eq!(durable(&db.store, "ghost"), (0, 0));
}
