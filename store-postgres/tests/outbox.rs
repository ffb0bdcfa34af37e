//! The outbox store against a real PostgreSQL server, each test in a fresh schema.

mod common;

use std::time::Duration;

use common::{TestDb, arc_clock, event};
use outbox_core::store::all_rows;
use outbox_core::{Completion, ErrorKind, Event, ManualClock, OutboxAdmin, OutboxStore, Outcome, Retry, RowStatus};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe};
use outbox_store_postgres::{enqueue, enqueue_one};

const LEASE: Duration = Duration::from_secs(10);

#[tokio::test]
async fn enqueue_in_caller_transaction_commits_and_rolls_back_with_the_domain_row() {
    let Some(db) = TestDb::new("txn").await else { return };
    let orders = db.store.tables().app_table("orders").unwrap();
    db.exec(format!("CREATE TABLE {orders} (id text PRIMARY KEY)")).await;

    // Committed: both the domain row and the outbox rows.
    let mut tx = db.store.pool().begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {orders} (id) VALUES ('o-1')"))).execute(&mut *tx).await.unwrap();
    let one = enqueue_one(&mut tx, &db.store, &event("order-1", b"one")).await.unwrap();
    let batch =
        enqueue(&mut tx, db.store.tables(), &[event("order-2", b"two"), event("order-3", b"three")]).await.unwrap();
    assert_eq!(batch.len(), 2);
    assert!(one < batch[0] && batch[0] < batch[1], "ids follow input order: {one} {batch:?}");
    // Not visible outside the transaction yet.
    assert!(all_rows(&db.store).await.unwrap().is_empty());
    tx.commit().await.unwrap();

    // Rolled back: neither.
    let mut tx = db.store.pool().begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {orders} (id) VALUES ('o-2')"))).execute(&mut *tx).await.unwrap();
    enqueue_one(&mut tx, &db.store, &event("order-4", b"four")).await.unwrap();
    tx.rollback().await.unwrap();

    // Dropped without commit: neither.
    {
        let mut tx = db.store.pool().begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {orders} (id) VALUES ('o-3')")))
            .execute(&mut *tx)
            .await
            .unwrap();
        enqueue_one(&mut tx, &db.store, &event("order-5", b"five")).await.unwrap();
    }

    let rows = all_rows(&db.store).await.unwrap();
    let ids: Vec<&str> = rows.iter().map(|r| r.event.id.as_str()).collect();
    assert_eq!(ids, ["order-1", "order-2", "order-3"]);
    assert_eq!(rows[0].row_id, one);
    assert_eq!(db.count(format!("SELECT count(*) FROM {orders}")).await, 1);
    for r in &rows {
        assert_eq!((r.status, r.attempts, r.token, r.owner.as_deref()), (RowStatus::Pending, 0, 0, None));
    }
}

#[tokio::test]
async fn payload_and_headers_round_trip_byte_for_byte() {
    let Some(db) = TestDb::new("bytes").await else { return };
    let payload: Vec<u8> = (0..=255u8).chain([0, 0, 0xff, 0xfe, 0xc3, 0x28]).collect();
    let e = event("bytes-1", &payload)
        .with_key("customer-7")
        .with_header("nul", vec![0u8, 0, 1])
        .with_header("latin1", vec![0xe9, 0xff])
        .with_header("empty", Vec::new())
        .with_header("text", b"plain".to_vec());
    let plain = event("bytes-2", b"");
    db.store.enqueue(&[e.clone(), plain.clone()]).await.unwrap();

    let rows = all_rows(&db.store).await.unwrap();
    assert_eq!(rows[0].event, e);
    assert_eq!(rows[1].event, plain);
    let claimed = db.store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(claimed[0].record.event, e);
    assert_eq!(claimed[0].record.event.payload, payload);
    // And the column holds exactly the payload bytes.
    let stored: Vec<u8> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT payload FROM {} WHERE event_id = 'bytes-1'",
        db.store.tables().table("events").unwrap()
    )))
    .fetch_one(db.store.pool())
    .await
    .unwrap();
    assert_eq!(stored, payload);
}

#[tokio::test]
async fn duplicate_ids_are_conflicts_and_write_nothing() {
    let Some(db) = TestDb::new("dup").await else { return };
    db.store.enqueue(&[event("a", b"1")]).await.unwrap();

    let err = db.store.enqueue(&[event("b", b"2"), event("a", b"3")]).await.unwrap_err();
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Conflict, Retry::Permanent));
    assert!(err.message().contains("event id a "), "{err}");
    let err = db.store.enqueue(&[event("c", b"1"), event("c", b"2")]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert!(err.message().contains("c appears twice"), "{err}");

    // Inside a caller transaction the conflict leaves the transaction usable and empty of the batch.
    let mut tx = db.store.pool().begin().await.unwrap();
    let err = enqueue(&mut tx, &db.store, &[event("d", b""), event("a", b"")]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    enqueue_one(&mut tx, &db.store, &event("e", b"")).await.unwrap();
    tx.commit().await.unwrap();

    // A concurrent, not yet committed insert of the same id: the unique constraint decides.
    let mut first = db.store.pool().begin().await.unwrap();
    enqueue_one(&mut first, &db.store, &event("f", b"")).await.unwrap();
    let store = db.store.clone();
    let second = tokio::spawn(async move {
        let mut tx = store.pool().begin().await.unwrap();
        enqueue_one(&mut tx, &store, &event("f", b"")).await
    });
    common_wait_for_lock_waiter(&db).await;
    first.commit().await.unwrap();
    let err = second.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");

    let ids: Vec<String> = all_rows(&db.store).await.unwrap().into_iter().map(|r| r.event.id.to_string()).collect();
    assert_eq!(ids, ["a", "e", "f"]);
}

/// Wait (bounded) until some session of this test's schema waits on a lock.
async fn common_wait_for_lock_waiter(db: &TestDb) {
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
        assert!(tokio::time::Instant::now() < deadline, "no session started waiting on the lock");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn validation_happens_before_anything_is_written() {
    let Some(db) = TestDb::open("valid", None, |c| c.with_max_payload(8)).await else { return };
    let err = db.store.enqueue(&[event("ok", b"small"), event("big", &[0u8; 9])]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge);
    assert!(err.message().contains("big"), "{err}");
    let bad_key = event("k", b"").with_key("a\u{7}b");
    assert_eq!(db.store.enqueue(&[bad_key]).await.unwrap_err().kind(), ErrorKind::InvalidInput);
    // Headers have a limit of their own (64 KiB), whatever the payload limit.
    let huge = event("big-headers", b"").with_header("trace", vec![b'x'; 10 * 1024 * 1024]);
    let err = db.store.enqueue(&[event("ok2", b""), huge]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert!(err.is_permanent());
    assert!(err.message().contains("big-headers") && err.message().contains("65536"), "{err}");
    assert!(all_rows(&db.store).await.unwrap().is_empty());
}

#[tokio::test]
async fn stale_lease_is_fenced_and_the_new_one_publishes() {
    let clock = ManualClock::default();
    let Some(db) = TestDb::with_clock("fence", arc_clock(&clock)).await else { return };
    let t0 = clock.now_ms();
    db.store.enqueue(&[event("f-1", b"x")]).await.unwrap();

    let a = db.store.claim("relay-a", 10, LEASE).await.unwrap();
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].lease.token, 1);
    assert_eq!(a[0].lease.expires_at.as_millis(), t0 + 10_000);
    // A live lease is not claimable by anyone.
    assert!(db.store.claim("relay-b", 10, LEASE).await.unwrap().is_empty());
    let snap = &all_rows(&db.store).await.unwrap()[0];
    assert_eq!((snap.status, snap.owner.as_deref()), (RowStatus::Leased, Some("relay-a")));

    clock.advance(Duration::from_secs(11));
    let snap = &all_rows(&db.store).await.unwrap()[0];
    assert_eq!(snap.status, RowStatus::Pending, "expired lease reads as pending");
    let b = db.store.claim("relay-b", 10, LEASE).await.unwrap();
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].lease.token, 2);

    let row = a[0].record.row_id;
    assert_eq!(db.store.complete(row, &a[0].lease).await.unwrap(), Completion::Fenced);
    // Same token, other owner: also fenced.
    let forged = outbox_core::Lease { owner: "relay-a".into(), ..b[0].lease.clone() };
    assert_eq!(db.store.complete(row, &forged).await.unwrap(), Completion::Fenced);
    assert_eq!(db.store.complete(row, &b[0].lease).await.unwrap(), Completion::Published);
    assert_eq!(db.store.complete(row, &b[0].lease).await.unwrap(), Completion::Fenced, "already published");

    let snap = &all_rows(&db.store).await.unwrap()[0];
    assert_eq!(snap.status, RowStatus::Published);
    assert_eq!(snap.token, 2);
    assert_eq!(snap.published_token, Some(snap.token));
    assert_eq!(snap.owner.as_deref(), Some("relay-b"));
    assert!(db.store.claim("relay-c", 10, LEASE).await.unwrap().is_empty(), "published rows are never claimed");
}

#[tokio::test]
async fn expired_lease_not_reclaimed_may_still_complete_and_complete_many_reports_per_row() {
    let clock = ManualClock::default();
    let Some(db) = TestDb::with_clock("many", arc_clock(&clock)).await else { return };
    let events: Vec<Event> = (0..5).map(|i| event(&format!("m-{i}"), b"p")).collect();
    db.store.enqueue(&events).await.unwrap();
    let a = db.store.claim("a", 3, LEASE).await.unwrap();
    assert_eq!(a.iter().map(|c| c.record.event.id.as_str()).collect::<Vec<_>>(), ["m-0", "m-1", "m-2"]);
    clock.advance(LEASE * 2);
    // m-0 expired and is re-claimed by b together with m-1, m-2, m-3 (limit 4).
    let b = db.store.claim("b", 4, LEASE).await.unwrap();
    assert_eq!(b.len(), 4);
    assert!(b.windows(2).all(|w| w[0].record.row_id < w[1].record.row_id), "claims come in row order");

    let mut batch: Vec<_> = a.iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
    batch.push((b[3].record.row_id, b[3].lease.clone()));
    batch.push((b[3].record.row_id, b[3].lease.clone()));
    batch.push((999_999, b[0].lease.clone()));
    let out = db.store.complete_many(&batch).await.unwrap();
    assert_eq!(
        out,
        [
            Completion::Fenced,
            Completion::Fenced,
            Completion::Fenced,
            Completion::Published,
            Completion::Fenced,
            Completion::Fenced
        ]
    );
    // Expired but not re-claimed: m-4 claimed by c, expire, complete still works.
    let c = db.store.claim("c", 10, LEASE).await.unwrap();
    assert_eq!(c.len(), 1);
    clock.advance(LEASE * 2);
    assert_eq!(db.store.complete(c[0].record.row_id, &c[0].lease).await.unwrap(), Completion::Published);

    let rest: Vec<_> = b[..3].iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
    assert_eq!(db.store.complete_many(&rest).await.unwrap(), [Completion::Published; 3]);
    for r in all_rows(&db.store).await.unwrap() {
        assert_eq!(r.status, RowStatus::Published, "{}", r.event.id);
        assert_eq!(r.published_token, Some(r.token));
    }
}

#[tokio::test]
async fn fail_backs_off_and_counts_attempts() {
    let clock = ManualClock::default();
    let Some(db) = TestDb::with_clock("fail", arc_clock(&clock)).await else { return };
    db.store.enqueue(&[event("x", b"")]).await.unwrap();
    let c = db.store.claim("a", 1, LEASE).await.unwrap().remove(0);
    let row = c.record.row_id;
    let t = clock.now_ms();
    assert_eq!(
        db.store.fail(row, &c.lease, Duration::from_secs(30), "broker down\0!").await.unwrap(),
        Outcome::Applied
    );
    assert_eq!(db.store.fail(row, &c.lease, Duration::ZERO, "again").await.unwrap(), Outcome::Fenced);
    assert_eq!(db.store.complete(row, &c.lease).await.unwrap(), Completion::Fenced, "fail ends the lease");

    let snap = &all_rows(&db.store).await.unwrap()[0];
    assert_eq!(snap.attempts, 1);
    assert_eq!(snap.owner, None);
    assert_eq!(snap.lease_expires_at, None);
    assert_eq!(snap.available_at.as_millis(), t + 30_000);
    assert_eq!(snap.last_error.as_deref(), Some("broker down\u{fffd}!"));
    assert_eq!(snap.status, RowStatus::Pending);

    clock.advance(Duration::from_secs(29));
    assert!(db.store.claim("a", 1, LEASE).await.unwrap().is_empty(), "not before available_at");
    clock.advance(Duration::from_secs(1));
    let again = db.store.claim("a", 1, LEASE).await.unwrap().remove(0);
    assert_eq!((again.record.attempts, again.lease.token), (1, 2));
    assert_eq!(db.store.fail(row, &again.lease, Duration::ZERO, "third").await.unwrap(), Outcome::Applied);
    let third = db.store.claim("a", 1, LEASE).await.unwrap().remove(0);
    assert_eq!(third.record.attempts, 2);
}

#[tokio::test]
async fn park_list_requeue_purge() {
    let clock = ManualClock::default();
    let Some(db) = TestDb::with_clock("park", arc_clock(&clock)).await else { return };
    db.store.enqueue(&[event("p-1", b"1"), event("p-2", b"2"), event("p-3", b"3")]).await.unwrap();
    let claimed = db.store.claim("a", 3, LEASE).await.unwrap();
    let (r1, r2, r3) = (claimed[0].record.row_id, claimed[1].record.row_id, claimed[2].record.row_id);
    assert_eq!(db.store.fail(r1, &claimed[0].lease, Duration::ZERO, "first").await.unwrap(), Outcome::Applied);
    let parked_at = clock.now_ms();
    for c in &claimed[1..] {
        assert_eq!(db.store.park(c.record.row_id, &c.lease, "poison").await.unwrap(), Outcome::Applied);
        assert_eq!(db.store.park(c.record.row_id, &c.lease, "poison").await.unwrap(), Outcome::Fenced);
        assert_eq!(db.store.complete(c.record.row_id, &c.lease).await.unwrap(), Completion::Fenced);
    }
    clock.advance(LEASE * 10);
    let claimable = db.store.claim("b", 10, LEASE).await.unwrap();
    assert_eq!(claimable.iter().map(|c| c.record.row_id).collect::<Vec<_>>(), [r1], "parked rows are not claimed");

    let parked = db.store.list_parked(10).await.unwrap();
    assert_eq!(parked.iter().map(|p| p.record.row_id).collect::<Vec<_>>(), [r2, r3]);
    assert_eq!(parked[0].reason, "poison");
    assert_eq!(parked[0].parked_at.as_millis(), parked_at);
    assert_eq!(parked[0].record.event.payload, b"2");
    assert_eq!(db.store.list_parked(1).await.unwrap().len(), 1);
    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.parked, stats.leased), (2, 1));

    // Requeue ignores rows that are not parked.
    assert_eq!(db.store.requeue_parked(&[r1, r2, 12345]).await.unwrap(), 1);
    let snap = all_rows(&db.store).await.unwrap();
    let s2 = snap.iter().find(|r| r.row_id == r2).unwrap();
    assert_eq!((s2.status, s2.attempts), (RowStatus::Pending, 0));
    let again = db.store.claim("c", 10, LEASE).await.unwrap();
    assert_eq!(again.iter().map(|c| c.record.row_id).collect::<Vec<_>>(), [r2]);

    // Purge deletes only parked rows.
    assert_eq!(db.store.purge_parked(&[r1, r2, r3]).await.unwrap(), 1);
    let left: Vec<_> = all_rows(&db.store).await.unwrap().iter().map(|r| r.row_id).collect();
    assert_eq!(left, [r1, r2]);
    assert!(db.store.list_parked(10).await.unwrap().is_empty());
}

#[tokio::test]
async fn extend_and_release() {
    let clock = ManualClock::default();
    let Some(db) = TestDb::with_clock("extend", arc_clock(&clock)).await else { return };
    db.store.enqueue(&[event("e-1", b"")]).await.unwrap();
    let c = db.store.claim("a", 1, LEASE).await.unwrap().remove(0);
    let row = c.record.row_id;
    clock.advance(Duration::from_secs(8));
    assert_eq!(db.store.extend(row, &c.lease, Duration::from_secs(10)).await.unwrap(), Outcome::Applied);
    let snap = &all_rows(&db.store).await.unwrap()[0];
    assert_eq!(snap.lease_expires_at.unwrap().as_millis(), clock.now_ms() + 10_000);
    assert_eq!(snap.token, 1, "extend keeps the token");
    clock.advance(Duration::from_secs(9));
    assert!(db.store.claim("b", 1, LEASE).await.unwrap().is_empty(), "extended lease still live");

    let stale = outbox_core::Lease { token: 0, ..c.lease.clone() };
    assert_eq!(db.store.extend(row, &stale, LEASE).await.unwrap(), Outcome::Fenced);
    assert_eq!(db.store.release(row, &stale).await.unwrap(), Outcome::Fenced);

    assert_eq!(db.store.release(row, &c.lease).await.unwrap(), Outcome::Applied);
    let snap = &all_rows(&db.store).await.unwrap()[0];
    assert_eq!((snap.status, snap.attempts, snap.owner.as_deref()), (RowStatus::Pending, 0, None));
    assert_eq!(db.store.extend(row, &c.lease, LEASE).await.unwrap(), Outcome::Fenced, "released lease is gone");
    let b = db.store.claim("b", 1, LEASE).await.unwrap();
    assert_eq!(b.len(), 1, "released rows are claimable at once");
    assert_eq!(b[0].lease.token, 2);
}

#[tokio::test]
async fn stats_and_oldest_pending_age() {
    let clock = ManualClock::default();
    let Some(db) = TestDb::with_clock("stats", arc_clock(&clock)).await else { return };
    assert_eq!(db.store.stats().await.unwrap(), outbox_core::OutboxStats::default());
    db.store.enqueue(&[event("s-1", b"")]).await.unwrap();
    clock.advance(Duration::from_secs(5));
    db.store.enqueue(&[event("s-2", b""), event("s-3", b""), event("s-4", b"")]).await.unwrap();
    clock.advance(Duration::from_secs(2));

    let claimed = db.store.claim("a", 2, LEASE).await.unwrap();
    let done = db.store.complete(claimed[0].record.row_id, &claimed[0].lease).await.unwrap();
    assert_eq!(done, Completion::Published);
    let s = db.store.stats().await.unwrap();
    assert_eq!((s.pending, s.leased, s.parked, s.published), (2, 1, 0, 1));
    // s-1 is published; s-2 (enqueued 2 s ago) is leased; the oldest pending is s-3, also 2 s.
    assert_eq!(s.oldest_pending_age, Some(Duration::from_secs(2)));

    clock.advance(LEASE);
    let s = db.store.stats().await.unwrap();
    assert_eq!((s.pending, s.leased), (3, 0), "an expired lease counts as pending");
    assert_eq!(s.oldest_pending_age, Some(Duration::from_secs(12)));
}

#[tokio::test]
async fn database_clock_mode_claims_and_expires() {
    let Some(db) = TestDb::new("dbclock").await else { return };
    db.store.enqueue(&[event("d-1", b"")]).await.unwrap();
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let c = db.store.claim("a", 1, Duration::from_millis(300)).await.unwrap().remove(0);
    let expires = c.lease.expires_at.as_millis();
    // Server and client share this machine's clock; allow generous slack.
    assert!((expires - (before + 300)).abs() < 5_000, "expires_at {expires} vs local {before}");
    assert!(db.store.claim("b", 1, LEASE).await.unwrap().is_empty());
    let s = db.store.stats().await.unwrap();
    assert_eq!(s.leased, 1);
    // Wait for the database clock to pass the lease (a condition with a deadline).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let b = loop {
        let b = db.store.claim("b", 1, LEASE).await.unwrap();
        if !b.is_empty() {
            break b;
        }
        assert!(tokio::time::Instant::now() < deadline, "lease never expired on the database clock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(b[0].lease.token, 2);
    assert_eq!(db.store.complete(c.record.row_id, &c.lease).await.unwrap(), Completion::Fenced);
    assert_eq!(db.store.complete(b[0].record.row_id, &b[0].lease).await.unwrap(), Completion::Published);
    let snap = &all_rows(&db.store).await.unwrap()[0];
    assert_eq!(snap.published_token, Some(2));
}

#[tokio::test]
async fn concurrent_claims_never_share_a_row() {
    let Some(db) = TestDb::new("claims").await else { return };
    let events: Vec<Event> = (0..400).map(|i| event(&format!("c-{i:04}"), b"")).collect();
    db.store.enqueue(&events).await.unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let store = db.store.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                // Bounded: 400 rows in batches of 7 need at most 58 claims; a claim that took live
                // leases would go on forever, so it fails instead.
                for _ in 0..=58 {
                    let batch = store.claim(&format!("r{i}"), 7, Duration::from_secs(60)).await.unwrap();
                    if batch.is_empty() {
                        return got;
                    }
                    got.extend(batch.into_iter().map(|c| c.record.row_id));
                }
                panic!("r{i} was still claiming rows after 59 claims ({} rows for 400 enqueued)", got.len());
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort_unstable();
    let n = all.len();
    all.dedup();
    assert_eq!(all.len(), n, "a row was claimed twice under a live lease");
    assert_eq!(n, 400);
    assert!(all_rows(&db.store).await.unwrap().iter().all(|r| r.token == 1));
}

trait NowMs {
    fn now_ms(&self) -> i64;
}

impl NowMs for ManualClock {
    fn now_ms(&self) -> i64 {
        outbox_core::Clock::now(self).as_millis()
    }
}

/// The claim's last step (the per-key "gap"): a row that another session holds locked is skipped
/// by `FOR UPDATE SKIP LOCKED` without being leased, so the claim's snapshot sees it as free and
/// only that step keeps the later rows of its key from overtaking it. A concurrent claim that
/// has not yet committed holds such locks; here a transaction of the test holds them, so the
/// case is deterministic. Keys: `a` locked at its head, `b` locked in the middle, `c` free, and a
/// row without a key.
#[tokio::test]
async fn rows_behind_a_row_another_session_holds_locked_are_not_claimed() {
    let Some(db) = TestDb::new("gap").await else { return };
    let keyed = |id: &str, key: &str| event(id, b"").with_key(key);
    db.store
        .enqueue(&[
            keyed("a1", "a"),
            keyed("b1", "b"),
            keyed("a2", "a"),
            keyed("b2", "b"),
            keyed("c1", "c"),
            keyed("b3", "b"),
            event("n1", b""),
            keyed("c2", "c"),
        ])
        .await
        .unwrap();
    let events = db.store.tables().table("events").unwrap();
    let mut locker = db.store.pool().begin().await.unwrap();
    let locked: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT event_id FROM {events} WHERE event_id IN ('a1', 'b2') ORDER BY id FOR UPDATE"
    )))
    .fetch_all(&mut *locker)
    .await
    .unwrap();
    assert_eq!(locked, ["a1", "b2"]);

    let ids = |batch: &[outbox_core::Claimed]| -> Vec<String> {
        batch.iter().map(|c| c.record.event.id.to_string()).collect()
    };
    let first = db.store.claim("r1", 10, LEASE).await.unwrap();
    assert_eq!(ids(&first), ["b1", "c1", "n1", "c2"], "a2 and b3 wait behind the locked a1 and b2");
    let rows = all_rows(&db.store).await.unwrap();
    let state: Vec<(String, u64, Option<String>)> =
        rows.iter().map(|r| (r.event.id.to_string(), r.token, r.owner.clone())).collect();
    let leased = |id: &str| (id.to_string(), 1, Some("r1".to_string()));
    let untouched = |id: &str| (id.to_string(), 0, None);
    assert_eq!(
        state,
        [
            untouched("a1"),
            leased("b1"),
            untouched("a2"),
            untouched("b2"),
            leased("c1"),
            untouched("b3"),
            leased("n1"),
            leased("c2")
        ]
    );

    // The locks go away (a claim that rolled back): `a` is claimed from its head, `b` still waits
    // behind b1's live lease.
    locker.rollback().await.unwrap();
    let second = db.store.claim("r2", 10, LEASE).await.unwrap();
    assert_eq!(ids(&second), ["a1", "a2"]);
    let b1 = first.iter().find(|c| c.record.event.id.as_str() == "b1").unwrap();
    assert_eq!(db.store.complete(b1.record.row_id, &b1.lease).await.unwrap(), Completion::Published);
    let third = db.store.claim("r3", 10, LEASE).await.unwrap();
    assert_eq!(ids(&third), ["b2", "b3"]);
    let owners: Vec<(String, Option<String>, RowStatus)> = all_rows(&db.store)
        .await
        .unwrap()
        .iter()
        .map(|r| (r.event.id.to_string(), r.owner.clone(), r.status))
        .collect();
    let o = |id: &str, owner: &str, status| (id.to_string(), Some(owner.to_string()), status);
    assert_eq!(
        owners,
        [
            o("a1", "r2", RowStatus::Leased),
            o("b1", "r1", RowStatus::Published),
            o("a2", "r2", RowStatus::Leased),
            o("b2", "r3", RowStatus::Leased),
            o("c1", "r1", RowStatus::Leased),
            o("b3", "r3", RowStatus::Leased),
            o("n1", "r1", RowStatus::Leased),
            o("c2", "r1", RowStatus::Leased),
        ]
    );
}
