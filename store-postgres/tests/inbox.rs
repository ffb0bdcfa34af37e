//! The inbox against a real PostgreSQL server: guards and effects in one transaction.

mod common;

use std::time::Duration;

use common::{TestDb, arc_clock, event};
use outbox_core::{
    DeadLetter, DeadLetterReason, Event, EventId, Inbox, LedgerState, ManualClock, MarkOutcome, Timestamp,
    VersionOutcome,
};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe};
use outbox_store_postgres::{PgInbox, PgTx};

const CONSUMER: &str = "billing";

async fn credits_table(db: &TestDb) -> String {
    let credits = db.store.tables().app_table("credits").unwrap();
    db.exec(format!("CREATE TABLE {credits} (event_id text NOT NULL, amount bigint NOT NULL)")).await;
    credits
}

/// The handler: mark, and apply the effect only when new. Returns the outcome.
async fn handle(inbox: &PgInbox, tx: &mut PgTx, credits: &str, e: &Event) -> MarkOutcome {
    let outcome = inbox.mark(tx, CONSUMER, &e.id, &e.fingerprint()).await.unwrap();
    if outcome == MarkOutcome::New {
        let amount = i64::from(e.payload[0]);
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {credits} (event_id, amount) VALUES ($1, $2)")))
            .bind(e.id.as_str())
            .bind(amount)
            .execute(&mut **tx)
            .await
            .unwrap();
    }
    outcome
}

async fn balance(db: &TestDb, credits: &str) -> (i64, i64) {
    sqlx::query_as(AssertSqlSafe(format!("SELECT count(*), COALESCE(sum(amount), 0)::bigint FROM {credits}")))
        .fetch_one(db.store.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn new_duplicate_conflict_and_rollback_on_drop() {
    let Some(db) = TestDb::new("inbox").await else { return };
    let credits = credits_table(&db).await;
    let inbox = db.store.inbox();
    let a7 = event("a", &[7]);

    // Dropped before commit: neither marker nor effect.
    {
        let mut tx = inbox.begin().await.unwrap();
        assert_eq!(handle(&inbox, &mut tx, &credits, &a7).await, MarkOutcome::New);
    }
    assert_eq!(balance(&db, &credits).await, (0, 0));
    assert!(inbox.markers(CONSUMER).await.unwrap().is_empty());

    // F11: a:7, b:7, a:7, c:0 → balance 14, three markers.
    for e in [a7.clone(), event("b", &[7]), a7.clone(), event("c", &[0])] {
        let mut tx = inbox.begin().await.unwrap();
        let _ = handle(&inbox, &mut tx, &credits, &e).await;
        inbox.commit(tx).await.unwrap();
    }
    assert_eq!(balance(&db, &credits).await, (3, 14));
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(handle(&inbox, &mut tx, &credits, &a7).await, MarkOutcome::Duplicate);
    // Same id, different payload: conflict, stored fingerprint reported, nothing applied.
    let a8 = event("a", &[8]);
    assert_eq!(handle(&inbox, &mut tx, &credits, &a8).await, MarkOutcome::Conflict { stored: a7.fingerprint() });
    // Marking twice in one transaction: the second sees the first.
    let d = event("d", &[1]);
    assert_eq!(handle(&inbox, &mut tx, &credits, &d).await, MarkOutcome::New);
    assert_eq!(inbox.mark(&mut tx, CONSUMER, &d.id, &d.fingerprint()).await.unwrap(), MarkOutcome::Duplicate);
    // Another consumer has its own markers.
    assert_eq!(inbox.mark(&mut tx, "audit", &a7.id, &a7.fingerprint()).await.unwrap(), MarkOutcome::New);
    inbox.commit(tx).await.unwrap();

    assert_eq!(balance(&db, &credits).await, (4, 15));
    let markers = inbox.markers(CONSUMER).await.unwrap();
    let ids: Vec<&str> = markers.iter().map(|m| m.event_id.as_str()).collect();
    assert_eq!(ids, ["a", "b", "c", "d"]);
    assert_eq!(markers[0].fingerprint, a7.fingerprint());
    assert_eq!(inbox.markers("audit").await.unwrap().len(), 1);
}

#[tokio::test]
async fn concurrent_duplicates_serialize_on_the_key() {
    let Some(db) = TestDb::new("race").await else { return };
    let credits = credits_table(&db).await;
    let inbox = db.store.inbox();
    let e = event("race-1", &[5]);

    // Two deliveries of one event, each in its own task and transaction.
    let mut first = inbox.begin().await.unwrap();
    assert_eq!(handle(&inbox, &mut first, &credits, &e).await, MarkOutcome::New);
    let second = {
        let (inbox, credits, e) = (inbox.clone(), credits.clone(), e.clone());
        tokio::spawn(async move {
            let mut tx = inbox.begin().await.unwrap();
            let outcome = handle(&inbox, &mut tx, &credits, &e).await;
            inbox.commit(tx).await.unwrap();
            outcome
        })
    };
    wait_for_lock_waiter(&db).await;
    inbox.commit(first).await.unwrap();
    assert_eq!(second.await.unwrap(), MarkOutcome::Duplicate, "the second waited, then saw the marker");
    assert_eq!(balance(&db, &credits).await, (1, 5));

    // If the first rolls back, the waiting second applies the effect instead.
    let e2 = event("race-2", &[3]);
    let mut first = inbox.begin().await.unwrap();
    assert_eq!(handle(&inbox, &mut first, &credits, &e2).await, MarkOutcome::New);
    let second = {
        let (inbox, credits, e2) = (inbox.clone(), credits.clone(), e2.clone());
        tokio::spawn(async move {
            let mut tx = inbox.begin().await.unwrap();
            let outcome = handle(&inbox, &mut tx, &credits, &e2).await;
            inbox.commit(tx).await.unwrap();
            outcome
        })
    };
    wait_for_lock_waiter(&db).await;
    first.rollback().await.unwrap();
    assert_eq!(second.await.unwrap(), MarkOutcome::New);
    assert_eq!(balance(&db, &credits).await, (2, 8));

    // Many racers at once: exactly one effect.
    let e3 = event("race-3", &[1]);
    let racers: Vec<_> = (0..8)
        .map(|_| {
            let (inbox, credits, e3) = (inbox.clone(), credits.clone(), e3.clone());
            tokio::spawn(async move {
                let mut tx = inbox.begin().await.unwrap();
                let outcome = handle(&inbox, &mut tx, &credits, &e3).await;
                inbox.commit(tx).await.unwrap();
                outcome
            })
        })
        .collect();
    let mut new = 0;
    for r in racers {
        if r.await.unwrap() == MarkOutcome::New {
            new += 1;
        }
    }
    assert_eq!(new, 1);
    assert_eq!(balance(&db, &credits).await, (3, 9));
}

async fn wait_for_lock_waiter(db: &TestDb) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'",
        )
        .bind(db.schema())
        .fetch_one(db.store.pool())
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "the second delivery never waited on the key");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn projection_versions_never_move_backward() {
    let Some(db) = TestDb::new("version").await else { return };
    let inbox = db.store.inbox();
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.advance_version(&mut tx, CONSUMER, "acct-1", 3).await.unwrap(),
        VersionOutcome::Advanced { previous: None }
    );
    assert_eq!(
        inbox.advance_version(&mut tx, CONSUMER, "acct-1", 3).await.unwrap(),
        VersionOutcome::Stale { current: 3 }
    );
    inbox.commit(tx).await.unwrap();

    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.advance_version(&mut tx, CONSUMER, "acct-1", 2).await.unwrap(),
        VersionOutcome::Stale { current: 3 }
    );
    assert_eq!(
        inbox.advance_version(&mut tx, CONSUMER, "acct-1", 5).await.unwrap(),
        VersionOutcome::Advanced { previous: Some(3) }
    );
    drop(tx);
    assert_eq!(inbox.version(CONSUMER, "acct-1").await.unwrap(), Some(3), "rolled back");
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.advance_version(&mut tx, CONSUMER, "acct-1", 9).await.unwrap(),
        VersionOutcome::Advanced { previous: Some(3) }
    );
    inbox.commit(tx).await.unwrap();
    assert_eq!(inbox.version(CONSUMER, "acct-1").await.unwrap(), Some(9));
    assert_eq!(inbox.version(CONSUMER, "acct-2").await.unwrap(), None);
    let mut tx = inbox.begin().await.unwrap();
    assert!(inbox.advance_version(&mut tx, CONSUMER, "acct-1", u64::MAX).await.is_err());
}

#[tokio::test]
async fn ledger_dead_letters_failures_and_pruning() {
    let clock = ManualClock::default();
    let Some(db) = TestDb::with_clock("ledger", arc_clock(&clock)).await else { return };
    let inbox = db.store.inbox();
    let id = EventId::new("n-1").unwrap();

    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(inbox.ledger_state(&mut tx, CONSUMER, &id).await.unwrap(), LedgerState::Fresh);
    inbox.set_ledger_state(&mut tx, CONSUMER, &id, LedgerState::Attempted).await.unwrap();
    assert_eq!(inbox.ledger_state(&mut tx, CONSUMER, &id).await.unwrap(), LedgerState::Attempted);
    inbox.commit(tx).await.unwrap();
    let mut tx = inbox.begin().await.unwrap();
    inbox.set_ledger_state(&mut tx, CONSUMER, &id, LedgerState::Done).await.unwrap();
    drop(tx);
    assert_eq!(inbox.ledger(CONSUMER, &id).await.unwrap(), LedgerState::Attempted);
    assert_eq!(inbox.ledger(CONSUMER, &EventId::new("other").unwrap()).await.unwrap(), LedgerState::Fresh);

    // Dead letters are written in the transaction, stamped with the store clock.
    let record = DeadLetter {
        consumer: CONSUMER.into(),
        event_id: id.clone(),
        reason: DeadLetterReason::Conflict,
        error: "payload differs".into(),
        payload: vec![0, 159, 146, 150],
        at: Timestamp::default(),
    };
    let mut tx = inbox.begin().await.unwrap();
    inbox.dead_letter(&mut tx, &record).await.unwrap();
    drop(tx);
    assert!(inbox.dead_letters(CONSUMER).await.unwrap().is_empty());
    let mut tx = inbox.begin().await.unwrap();
    inbox.dead_letter(&mut tx, &record).await.unwrap();
    inbox.dead_letter(&mut tx, &DeadLetter { reason: DeadLetterReason::Uncertain, ..record.clone() }).await.unwrap();
    inbox.commit(tx).await.unwrap();
    let dead = inbox.dead_letters(CONSUMER).await.unwrap();
    assert_eq!(dead.len(), 2);
    assert_eq!(dead[0], DeadLetter { at: outbox_core::Clock::now(&clock), ..record.clone() });
    assert_eq!(dead[1].reason, DeadLetterReason::Uncertain);

    // Failure counts are durable and per key.
    assert_eq!(inbox.record_failure(CONSUMER, &id).await.unwrap(), 1);
    assert_eq!(inbox.record_failure(CONSUMER, &id).await.unwrap(), 2);
    assert_eq!(inbox.record_failure("audit", &id).await.unwrap(), 1);
    assert_eq!(inbox.failures(CONSUMER, &id).await.unwrap(), 2);

    // Pruning by age on the store clock.
    let mark = |name: &'static str| {
        let inbox = inbox.clone();
        async move {
            let e = event(name, b"x");
            let mut tx = inbox.begin().await.unwrap();
            assert_eq!(inbox.mark(&mut tx, CONSUMER, &e.id, &e.fingerprint()).await.unwrap(), MarkOutcome::New);
            inbox.commit(tx).await.unwrap();
        }
    };
    mark("old").await;
    clock.advance(Duration::from_secs(3600));
    assert_eq!(inbox.prune_markers(CONSUMER, Duration::from_secs(3600)).await.unwrap(), 0, "exactly 3600 s is kept");
    mark("young").await;
    clock.advance(Duration::from_secs(1));
    assert_eq!(inbox.prune_markers("audit", Duration::from_secs(60)).await.unwrap(), 0);
    assert_eq!(inbox.prune_markers(CONSUMER, Duration::from_secs(3600)).await.unwrap(), 1);
    let left: Vec<String> = inbox.markers(CONSUMER).await.unwrap().iter().map(|m| m.event_id.to_string()).collect();
    assert_eq!(left, ["young"]);
}
