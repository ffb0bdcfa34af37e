//! The inbox against a real PostgreSQL server: guards and effects in one transaction.

mod common;

use std::time::Duration;

use common::{TestDb, arc_clock, base_config, event, pg_available, unique_schema};
use outbox_core::inbox::UNKNOWN_DESTINATION;
use outbox_core::{
    Clock, DeadLetter, DeadLetterReason, Event, EventId, Headers, Inbox, InboxAdmin, LedgerState, ManualClock,
    MarkOutcome, Timestamp, VersionOutcome,
};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe};
use outbox_store_postgres::{PgInbox, PgStore, PgTx, SCHEMA_VERSION};

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

/// The effect alone (the marker comes from `begin_marked`).
async fn credit(tx: &mut PgTx, credits: &str, e: &Event) {
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {credits} (event_id, amount) VALUES ($1, $2)")))
        .bind(e.id.as_str())
        .bind(i64::from(e.payload[0]))
        .execute(&mut **tx)
        .await
        .unwrap();
}

/// Prepared statements on the pool's one connection that insert an inbox marker: the
/// parameterized `mark` prepares one; `begin_marked`'s one-step path sends a simple query and
/// prepares nothing.
async fn prepared_mark_inserts(db: &TestDb) -> i64 {
    db.count("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'INSERT INTO %inbox_markers%'".into())
        .await
}

/// `begin_marked` opens the transaction with the marker in it (one simple query: insert, then
/// `BEGIN`); a marker already there makes that insert fail, which must leave the connection
/// idle and clean, and the ordinary path then tells a duplicate from a conflict. On a pool of
/// one connection, so every step after a refused insert runs on the connection it happened on.
/// Names and ids carry `'` and `\`, which the one-step path writes as constants.
#[tokio::test]
async fn begin_marked_writes_the_marker_in_the_transaction_it_opens() {
    let clock = ManualClock::new(Timestamp::from_millis(1_750_000_000_123));
    let Some(db) = TestDb::open("begin_marked", Some(arc_clock(&clock)), |c| c.with_pool_size(1)).await else {
        return;
    };
    let credits = credits_table(&db).await;
    let inbox = db.store.inbox();
    let consumer = r"o'brien\billing";
    let (e1, e2) = (event(r"it's\1", &[7]), event(r"it's\2", &[5]));

    // New, dropped: neither marker nor effect.
    {
        let (mut tx, outcome) = inbox.begin_marked(consumer, &e1.id, &e1.fingerprint()).await.unwrap();
        assert_eq!(outcome, MarkOutcome::New);
        credit(&mut tx, &credits, &e1).await;
    }
    assert_eq!(balance(&db, &credits).await, (0, 0));
    assert!(inbox.markers(consumer).await.unwrap().is_empty());

    // New, committed: marker (store clock, exact names) and effect together.
    let (mut tx, outcome) = inbox.begin_marked(consumer, &e1.id, &e1.fingerprint()).await.unwrap();
    assert_eq!(outcome, MarkOutcome::New);
    credit(&mut tx, &credits, &e1).await;
    inbox.commit(tx).await.unwrap();
    assert_eq!(
        prepared_mark_inserts(&db).await,
        0,
        "the new markers went in one simple query, not the prepared insert"
    );
    let markers = inbox.markers(consumer).await.unwrap();
    assert_eq!(markers.len(), 1, "{markers:?}");
    assert_eq!((markers[0].event_id.as_str(), markers[0].consumer.as_str()), (e1.id.as_str(), consumer));
    assert_eq!((markers[0].fingerprint, markers[0].at), (e1.fingerprint(), clock.now()));

    // Duplicate and conflict: the refused insert left the one connection usable.
    let (tx, outcome) = inbox.begin_marked(consumer, &e1.id, &e1.fingerprint()).await.unwrap();
    assert_eq!(outcome, MarkOutcome::Duplicate);
    inbox.commit(tx).await.unwrap();
    assert_eq!(prepared_mark_inserts(&db).await, 1, "a duplicate goes through the ordinary mark");
    let other = event(r"it's\1", &[8]);
    let (tx, outcome) = inbox.begin_marked(consumer, &other.id, &other.fingerprint()).await.unwrap();
    assert_eq!(outcome, MarkOutcome::Conflict { stored: e1.fingerprint() });
    drop(tx);

    // And the next new event takes the one-step path again, on the same connection.
    clock.advance(Duration::from_secs(1));
    let (mut tx, outcome) = inbox.begin_marked(consumer, &e2.id, &e2.fingerprint()).await.unwrap();
    assert_eq!(outcome, MarkOutcome::New);
    credit(&mut tx, &credits, &e2).await;
    inbox.commit(tx).await.unwrap();
    assert_eq!(balance(&db, &credits).await, (2, 12));
    let markers = inbox.markers(consumer).await.unwrap();
    let got: Vec<(&str, Timestamp)> = markers.iter().map(|m| (m.event_id.as_str(), m.at)).collect();
    assert_eq!(got, [(e1.id.as_str(), Timestamp::from_millis(1_750_000_000_123)), (e2.id.as_str(), clock.now())]);
    assert!(inbox.markers("o'brien").await.unwrap().is_empty(), "the consumer name is stored whole");
}

/// Without an injected clock, `begin_marked`'s one-step path stamps the marker with the
/// database clock in milliseconds, as the parameterized `mark` does.
#[tokio::test]
async fn begin_marked_stamps_the_database_clock() {
    let Some(db) = TestDb::new("begin_marked_db_clock").await else { return };
    let inbox = db.store.inbox();
    let db_now_ms = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint".to_string();
    let e = event("stamped", &[1]);
    let before = db.count(db_now_ms.clone()).await;
    let (tx, outcome) = inbox.begin_marked(CONSUMER, &e.id, &e.fingerprint()).await.unwrap();
    assert_eq!(outcome, MarkOutcome::New);
    inbox.commit(tx).await.unwrap();
    let after = db.count(db_now_ms).await;
    let markers = inbox.markers(CONSUMER).await.unwrap();
    assert_eq!(markers.len(), 1, "{markers:?}");
    let at = markers[0].at.as_millis();
    assert!((before..=after).contains(&at), "marker at {at}, database clock {before}..={after} ms");
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

    // Dead letters are written in the transaction, stamped with the store clock, and keep the
    // whole event.
    let record = letter("n-1", DeadLetterReason::Conflict);
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
    assert!(dead[0].id > 0 && dead[1].id > dead[0].id, "store-assigned ids in write order: {dead:?}");
    assert_eq!(dead[0], DeadLetter { id: dead[0].id, at: outbox_core::Clock::now(&clock), ..record.clone() });
    assert_eq!(dead[1].reason, DeadLetterReason::Uncertain);
    assert_eq!(dead[1].event, record.event, "destination, key, headers and payload byte-for-byte");

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

/// A dead letter whose event has a key, binary header values and a binary payload.
fn letter(event_id: &str, reason: DeadLetterReason) -> DeadLetter {
    let e = event(event_id, &[0, 159, 146, 150, 0, 0xff])
        .with_key(format!("key of {event_id} ünï"))
        .with_header("bin", vec![0u8, 0xff, 0])
        .with_header("empty", Vec::new());
    DeadLetter::new(CONSUMER, e, reason, format!("{event_id} failed"))
}

#[tokio::test]
async fn removing_dead_letters_takes_only_the_consumers_ids_and_resets_their_failure_counts() {
    let Some(db) = TestDb::new("rmdead").await else { return };
    let inbox = db.store.inbox();
    let mut tx = inbox.begin().await.unwrap();
    for e in ["r-1", "r-2", "r-3"] {
        inbox.dead_letter(&mut tx, &letter(e, DeadLetterReason::HandlerFailed)).await.unwrap();
    }
    let other = DeadLetter { consumer: "other".into(), ..letter("r-1", DeadLetterReason::HandlerFailed) };
    inbox.dead_letter(&mut tx, &other).await.unwrap();
    inbox.commit(tx).await.unwrap();
    let eid = |e: &str| EventId::new(e).unwrap();
    for e in ["r-1", "r-2", "r-3"] {
        inbox.record_failure(CONSUMER, &eid(e)).await.unwrap();
    }
    inbox.record_failure("other", &eid("r-1")).await.unwrap();
    let ours = inbox.dead_letters(CONSUMER).await.unwrap();
    let theirs = inbox.dead_letters("other").await.unwrap();
    assert_eq!((ours.len(), theirs.len()), (3, 1));

    assert_eq!(inbox.remove_dead_letters(CONSUMER, &[]).await.unwrap(), 0);
    let asked = [ours[0].id, ours[2].id, theirs[0].id, theirs[0].id + 100];
    assert_eq!(inbox.remove_dead_letters(CONSUMER, &asked).await.unwrap(), 2);
    assert_eq!(inbox.dead_letters(CONSUMER).await.unwrap(), [ours[1].clone()]);
    assert_eq!(inbox.dead_letters("other").await.unwrap(), theirs);
    assert_eq!(inbox.remove_dead_letters(CONSUMER, &asked).await.unwrap(), 0, "already gone");

    let counts = (
        inbox.failures(CONSUMER, &eid("r-1")).await.unwrap(),
        inbox.failures(CONSUMER, &eid("r-2")).await.unwrap(),
        inbox.failures(CONSUMER, &eid("r-3")).await.unwrap(),
    );
    assert_eq!(counts, (0, 1, 0));
    assert_eq!(inbox.failures("other", &eid("r-1")).await.unwrap(), 1, "the other consumer's count stays");
    assert_eq!(inbox.record_failure(CONSUMER, &eid("r-1")).await.unwrap(), 1, "counts from 1 again");
}

#[tokio::test]
async fn a_version_1_schema_migrates_and_keeps_its_dead_letters() {
    if !pg_available() {
        return;
    }
    // Written at version 2; later versions (3 retention, 4 key order) add indexes only.
    const { assert!(SCHEMA_VERSION >= 2) };
    let schema = unique_schema("migv1");
    let config = base_config().with_application_name(schema.clone()).with_schema(schema);
    // Not migrated; the guard drops the schema at the end, also on panic.
    let db = TestDb { store: PgStore::connect(config.clone()).await.unwrap(), config: config.clone() };
    let store = &db.store;
    assert_eq!(store.schema_version().await.unwrap(), None);

    // The schema as version 1 left it, with a dead letter and its failure count in it.
    let tables = store.tables();
    let (version, v1) = tables.migration_sql().next().unwrap();
    assert_eq!(version, 1);
    let versions = tables.table("schema_version").unwrap();
    let dead = tables.table("dead_letters").unwrap();
    let failures = tables.table("inbox_failures").unwrap();
    let setup = format!(
        "CREATE SCHEMA \"{}\";
{v1}
CREATE TABLE {versions} (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now());
INSERT INTO {versions} (version) VALUES (1);
INSERT INTO {dead} (consumer, event_id, reason, error, payload, at)
    VALUES ('billing', 'old-1', 'handler_failed', 'handler failed 5 times', '\\x00ff0a00', 1234);
INSERT INTO {failures} (consumer, event_id, failures) VALUES ('billing', 'old-1', 5);",
        config.schema()
    );
    sqlx::raw_sql(AssertSqlSafe(setup)).execute(store.pool()).await.unwrap();
    assert_eq!(store.schema_version().await.unwrap(), Some(1));

    assert_eq!(store.migrate().await.unwrap(), SCHEMA_VERSION);
    assert_eq!(store.schema_version().await.unwrap(), Some(SCHEMA_VERSION));
    let applied: Vec<i32> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT version FROM {versions} ORDER BY 1")))
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(applied, (1..=SCHEMA_VERSION).collect::<Vec<_>>());

    // The old record reads back: what version 1 kept, byte-for-byte, and the documented
    // defaults for what it did not.
    let inbox = store.inbox();
    let old = inbox.dead_letters(CONSUMER).await.unwrap();
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

    // The defaults were only for existing rows: a write must supply the columns.
    let no_default: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns
         WHERE table_schema = $1 AND table_name = 'outbox_dead_letters'
           AND column_name IN ('destination', 'key', 'headers') AND column_default IS NULL",
    )
    .bind(config.schema())
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(no_default, 3);

    // New records keep everything; removing the old one clears its failure count.
    let mut tx = inbox.begin().await.unwrap();
    inbox.dead_letter(&mut tx, &letter("new-1", DeadLetterReason::Conflict)).await.unwrap();
    inbox.commit(tx).await.unwrap();
    let all = inbox.dead_letters(CONSUMER).await.unwrap();
    assert_eq!(all.len(), 2);
    assert!(all[1].id > d.id);
    assert_eq!(all[1].event, letter("new-1", DeadLetterReason::Conflict).event);
    assert_eq!(inbox.failures(CONSUMER, &EventId::new("old-1").unwrap()).await.unwrap(), 5);
    assert_eq!(inbox.remove_dead_letters(CONSUMER, &[d.id]).await.unwrap(), 1);
    assert_eq!(inbox.failures(CONSUMER, &EventId::new("old-1").unwrap()).await.unwrap(), 0);

    // Migrating again applies nothing.
    assert_eq!(store.migrate().await.unwrap(), SCHEMA_VERSION);
    assert_eq!(inbox.dead_letters(CONSUMER).await.unwrap(), [all[1].clone()]);
}
