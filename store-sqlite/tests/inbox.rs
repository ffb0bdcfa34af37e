//! The inbox: marker and effect in one transaction, read back from the file.

mod common;

use std::time::Duration;

use common::{event, id};
use outbox_core::{
    Clock, DeadLetter, DeadLetterReason, ErrorKind, Event, Fingerprint, Inbox, LedgerState, MarkOutcome, Timestamp,
    VersionOutcome,
};
use outbox_store_sqlite::SqliteStore;

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

#[tokio::test]
async fn dead_letters_commit_with_the_transaction() {
    let db = common::open().await;
    let letter = |event_id: &str, reason| DeadLetter {
        consumer: CONSUMER.into(),
        event_id: id(event_id),
        reason,
        error: format!("{event_id} failed"),
        payload: vec![0, 0xff, 1],
        at: Timestamp::default(),
    };
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
    let expected: Vec<DeadLetter> = [("x-1", DeadLetterReason::Conflict), ("x-2", DeadLetterReason::HandlerFailed)]
        .into_iter()
        .map(|(e, r)| DeadLetter { at: committed_at, ..letter(e, r) })
        .collect();
    assert_eq!(got, expected);
    assert!(db.store.dead_letters("other").await.unwrap().is_empty());
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
