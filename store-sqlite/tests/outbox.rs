//! The outbox state machine on a real SQLite file, read back from durable state.

mod common;

use std::time::Duration;

use common::{event, id};
use outbox_core::store::all_rows;
use outbox_core::{Clock, Completion, ErrorKind, Lease, OutboxAdmin, OutboxStore, Outcome, RowStatus};
use rusqlite::TransactionBehavior;

const LEASE: Duration = Duration::from_secs(10);

fn count(conn: &rusqlite::Connection, table: &str) -> i64 {
    conn.query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0)).unwrap()
}

#[tokio::test]
async fn enqueue_in_the_callers_transaction_commits_with_the_domain_row() {
    let db = common::open().await;
    let mut conn = db.store.connect_raw().unwrap();
    conn.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER NOT NULL)").unwrap();

    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
    tx.execute("INSERT INTO orders VALUES ('o-1', 42)", []).unwrap();
    let row = db.store.enqueue_one_in(&tx, &event("order-o-1", b"42")).unwrap();
    let more = outbox_store_sqlite::enqueue(&tx, &db.store, &[event("order-o-1-b", b"x"), event("order-o-1-c", b"y")])
        .unwrap();
    tx.commit().unwrap();

    assert_eq!(count(&conn, "orders"), 1);
    let rows = all_rows(&db.store).await.unwrap();
    assert_eq!(rows.iter().map(|r| r.row_id).collect::<Vec<_>>(), vec![row, more[0], more[1]]);
    assert_eq!(rows[0].event, event("order-o-1", b"42"));
    assert_eq!((rows[0].status, rows[0].attempts, rows[0].token), (RowStatus::Pending, 0, 0));
    // The method and the free function both stamp with the store's clock (a ManualClock here).
    assert!(rows.iter().all(|r| r.created_at == db.clock.now()), "{rows:?}");
}

#[tokio::test]
async fn enqueue_rolls_back_with_the_callers_transaction() {
    let db = common::open().await;
    let mut conn = db.store.connect_raw().unwrap();
    conn.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY)").unwrap();
    {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
        tx.execute("INSERT INTO orders VALUES ('o-1')", []).unwrap();
        outbox_store_sqlite::enqueue_one(&tx, &db.store, &event("order-o-1", b"42")).unwrap();
        // dropped: rolled back
    }
    assert_eq!(count(&conn, "orders"), 0);
    assert_eq!(count(&conn, "outbox_rows"), 0);
    assert!(all_rows(&db.store).await.unwrap().is_empty());
    assert_eq!(db.store.claim("r", 10, LEASE).await.unwrap().len(), 0);
}

#[tokio::test]
async fn a_rejected_batch_leaves_the_callers_transaction_usable() {
    let db = common::open().await;
    db.store.enqueue(&[event("taken", b"0")]).await.unwrap();
    let mut conn = db.store.connect_raw().unwrap();
    conn.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY)").unwrap();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
    tx.execute("INSERT INTO orders VALUES ('o-1')", []).unwrap();
    let err = db.store.enqueue_in(&tx, &[event("fresh", b"1"), event("taken", b"2")]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.message().contains("taken"), "{err}");
    tx.commit().unwrap();
    assert_eq!(count(&conn, "orders"), 1, "the caller's own write survives");
    let ids: Vec<String> = all_rows(&db.store).await.unwrap().into_iter().map(|r| r.event.id.to_string()).collect();
    assert_eq!(ids, vec!["taken"], "nothing of the rejected batch was written");
}

#[tokio::test]
async fn payload_and_headers_round_trip_byte_for_byte() {
    let db = common::open().await;
    let payload: Vec<u8> = vec![0, 1, 0, 0xff, 0xfe, 0x80, b'\n', 0, 0xc3, 0x28];
    let e = event("bin-1", &payload)
        .with_key("customer/7 ü")
        .with_header("nul", vec![0u8, 0, 0])
        .with_header("latin1", vec![0xe9, 0xff])
        .with_header("empty", Vec::new())
        .with_header("text", b"plain".to_vec());
    let plain = event("bin-2", b"");
    db.store.enqueue(&[e.clone(), plain.clone()]).await.unwrap();

    let claimed = db.store.claim("r", 10, LEASE).await.unwrap();
    assert_eq!(claimed.len(), 2);
    assert_eq!(claimed[0].record.event, e);
    assert_eq!(claimed[0].record.event.payload, payload);
    assert_eq!(claimed[1].record.event, plain);
    let rows = all_rows(&db.store).await.unwrap();
    assert_eq!(rows[0].event, e);
    assert_eq!(rows[0].event.fingerprint(), e.fingerprint());
}

#[tokio::test]
async fn stale_completion_is_fenced_and_the_latest_token_publishes() {
    let db = common::open().await;
    let [row] = db.store.enqueue(&[event("f2", b"x")]).await.unwrap()[..] else { panic!() };

    let a = db.store.claim("relay-a", 10, LEASE).await.unwrap();
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].lease.token, 1);
    assert_eq!(a[0].lease.expires_at, db.clock.now().plus(LEASE));
    assert!(db.store.claim("relay-b", 10, LEASE).await.unwrap().is_empty(), "a live lease is not claimable");

    db.clock.advance(LEASE + Duration::from_millis(1));
    let b = db.store.claim("relay-b", 10, LEASE).await.unwrap();
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].lease.token, 2);

    assert_eq!(db.store.complete(row, &a[0].lease).await.unwrap(), Completion::Fenced);
    let snap = &all_rows(&db.store).await.unwrap()[0];
    assert_eq!((snap.status, snap.published_token), (RowStatus::Leased, None), "a fenced completion changes nothing");

    assert_eq!(db.store.complete(row, &b[0].lease).await.unwrap(), Completion::Published);
    assert_eq!(db.store.complete(row, &b[0].lease).await.unwrap(), Completion::Fenced, "already published");
    let snap = &all_rows(&db.store).await.unwrap()[0];
    assert_eq!(snap.status, RowStatus::Published);
    assert_eq!(snap.token, 2);
    assert_eq!(snap.published_token, Some(snap.token));
    assert_eq!(snap.owner.as_deref(), Some("relay-b"));

    db.clock.advance(LEASE * 10);
    assert!(db.store.claim("relay-c", 10, LEASE).await.unwrap().is_empty(), "published rows are never claimed");
}

#[tokio::test]
async fn an_expired_lease_not_reclaimed_may_still_complete() {
    let db = common::open().await;
    db.store.enqueue(&[event("late", b"x")]).await.unwrap();
    let c = db.store.claim("r", 1, LEASE).await.unwrap().remove(0);
    db.clock.advance(LEASE * 3);
    assert_eq!(db.store.complete(c.record.row_id, &c.lease).await.unwrap(), Completion::Published);
    let wrong_owner = Lease { owner: "other".into(), ..c.lease.clone() };
    assert_eq!(db.store.complete(c.record.row_id, &wrong_owner).await.unwrap(), Completion::Fenced);
    assert_eq!(db.store.complete(9999, &c.lease).await.unwrap(), Completion::Fenced, "unknown row");
}

#[tokio::test]
async fn complete_many_reports_each_row_in_order() {
    let db = common::open().await;
    db.store.enqueue(&[event("m1", b"1"), event("m2", b"2"), event("m3", b"3")]).await.unwrap();
    let c = db.store.claim("r", 10, LEASE).await.unwrap();
    let stale = Lease { token: c[1].lease.token + 7, ..c[1].lease.clone() };
    let out = db
        .store
        .complete_many(&[
            (c[0].record.row_id, c[0].lease.clone()),
            (c[1].record.row_id, stale),
            (c[2].record.row_id, c[2].lease.clone()),
            (c[0].record.row_id, c[0].lease.clone()),
        ])
        .await
        .unwrap();
    assert_eq!(out, vec![Completion::Published, Completion::Fenced, Completion::Published, Completion::Fenced]);
    let status: Vec<RowStatus> = all_rows(&db.store).await.unwrap().iter().map(|r| r.status).collect();
    assert_eq!(status, vec![RowStatus::Published, RowStatus::Leased, RowStatus::Published]);
}

#[tokio::test]
async fn fail_counts_an_attempt_and_backs_off() {
    let db = common::open().await;
    db.store.enqueue(&[event("flaky", b"x")]).await.unwrap();
    let c = db.store.claim("r", 1, LEASE).await.unwrap().remove(0);
    let t0 = db.clock.now();
    let retry = Duration::from_secs(30);
    assert_eq!(db.store.fail(c.record.row_id, &c.lease, retry, "broker down").await.unwrap(), Outcome::Applied);
    assert_eq!(db.store.fail(c.record.row_id, &c.lease, retry, "again").await.unwrap(), Outcome::Fenced);

    let snap = all_rows(&db.store).await.unwrap().remove(0);
    assert_eq!(snap.status, RowStatus::Pending);
    assert_eq!(snap.attempts, 1);
    assert_eq!(snap.owner, None);
    assert_eq!(snap.lease_expires_at, None);
    assert_eq!(snap.available_at, t0.plus(retry));
    assert_eq!(snap.last_error.as_deref(), Some("broker down"));

    assert!(db.store.claim("r", 1, LEASE).await.unwrap().is_empty(), "not before the retry time");
    db.clock.advance(retry - Duration::from_millis(1));
    assert!(db.store.claim("r", 1, LEASE).await.unwrap().is_empty());
    db.clock.advance(Duration::from_millis(1));
    let again = db.store.claim("r", 1, LEASE).await.unwrap().remove(0);
    assert_eq!((again.record.attempts, again.lease.token), (1, 2));
}

#[tokio::test]
async fn park_list_requeue_and_purge() {
    let db = common::open().await;
    let ids = db.store.enqueue(&[event("p1", b"1"), event("p2", b"2"), event("p3", b"3")]).await.unwrap();
    let c = db.store.claim("r", 10, LEASE).await.unwrap();
    assert_eq!(db.store.fail(ids[0], &c[0].lease, Duration::ZERO, "first try").await.unwrap(), Outcome::Applied);
    let c0 = db.store.claim("r", 1, LEASE).await.unwrap().remove(0);
    let parked_at = db.clock.now();
    assert_eq!(db.store.park(ids[0], &c0.lease, "poison").await.unwrap(), Outcome::Applied);
    assert_eq!(db.store.park(ids[1], &c[1].lease, "too big").await.unwrap(), Outcome::Applied);
    assert_eq!(db.store.park(ids[1], &c[1].lease, "twice").await.unwrap(), Outcome::Fenced);
    assert_eq!(db.store.complete(ids[1], &c[1].lease).await.unwrap(), Completion::Fenced, "parked rows don't complete");

    let parked = db.store.list_parked(10).await.unwrap();
    assert_eq!(parked.iter().map(|p| p.record.row_id).collect::<Vec<_>>(), vec![ids[0], ids[1]]);
    assert_eq!(parked[0].reason, "poison");
    assert_eq!(parked[0].parked_at, parked_at);
    assert_eq!(parked[0].record.attempts, 1);
    assert_eq!(parked[0].record.event, event("p1", b"1"));
    assert_eq!(db.store.list_parked(1).await.unwrap().len(), 1);

    db.clock.advance(LEASE * 2);
    let claimable = db.store.claim("r", 10, LEASE).await.unwrap();
    assert_eq!(claimable.iter().map(|c| c.record.row_id).collect::<Vec<_>>(), vec![ids[2]], "parked rows are skipped");
    assert_eq!(db.store.stats().await.unwrap().parked, 2);

    assert_eq!(db.store.requeue_parked(&[ids[0], ids[2], 424_242]).await.unwrap(), 1);
    let snap = all_rows(&db.store).await.unwrap().remove(0);
    assert_eq!((snap.status, snap.attempts, snap.available_at), (RowStatus::Pending, 0, db.clock.now()));
    let back = db.store.claim("r", 10, LEASE).await.unwrap();
    assert_eq!(back.iter().map(|c| c.record.row_id).collect::<Vec<_>>(), vec![ids[0]]);

    assert_eq!(db.store.purge_parked(&[ids[0], ids[1], ids[2]]).await.unwrap(), 1, "only parked rows are purged");
    let left: Vec<_> = all_rows(&db.store).await.unwrap().iter().map(|r| r.row_id).collect();
    assert_eq!(left, vec![ids[0], ids[2]]);
    assert!(db.store.list_parked(10).await.unwrap().is_empty());
}

#[tokio::test]
async fn extend_and_release_are_token_conditional() {
    let db = common::open().await;
    let [row] = db.store.enqueue(&[event("e1", b"x")]).await.unwrap()[..] else { panic!() };
    let c = db.store.claim("r", 1, LEASE).await.unwrap().remove(0);

    assert_eq!(db.store.extend(row, &c.lease, Duration::from_secs(60)).await.unwrap(), Outcome::Applied);
    let snap = all_rows(&db.store).await.unwrap().remove(0);
    assert_eq!(snap.lease_expires_at, Some(db.clock.now().plus(Duration::from_secs(60))));
    assert_eq!(snap.token, 1, "extend keeps the token");
    db.clock.advance(Duration::from_secs(30));
    assert!(db.store.claim("other", 1, LEASE).await.unwrap().is_empty(), "extended lease still protects the row");

    let stale = Lease { token: 0, ..c.lease.clone() };
    let stranger = Lease { owner: "x".into(), ..c.lease.clone() };
    assert_eq!(db.store.extend(row, &stale, LEASE).await.unwrap(), Outcome::Fenced);
    assert_eq!(db.store.extend(row, &stranger, LEASE).await.unwrap(), Outcome::Fenced);
    assert_eq!(db.store.release(row, &stale).await.unwrap(), Outcome::Fenced);

    assert_eq!(db.store.release(row, &c.lease).await.unwrap(), Outcome::Applied);
    let snap = all_rows(&db.store).await.unwrap().remove(0);
    assert_eq!((snap.status, snap.attempts, snap.owner.clone()), (RowStatus::Pending, 0, None));
    assert_eq!(db.store.release(row, &c.lease).await.unwrap(), Outcome::Fenced, "owner cleared");
    assert_eq!(db.store.extend(row, &c.lease, LEASE).await.unwrap(), Outcome::Fenced);

    let again = db.store.claim("other", 1, LEASE).await.unwrap().remove(0);
    assert_eq!(again.lease.token, 2, "claimable at once after release");
}

#[tokio::test]
async fn stats_count_by_status_at_the_store_clock() {
    let db = common::open().await;
    assert_eq!(db.store.stats().await.unwrap(), outbox_core::OutboxStats::default());
    db.store.enqueue(&[event("s1", b"1"), event("s2", b"2")]).await.unwrap();
    db.clock.advance(Duration::from_secs(5));
    db.store.enqueue(&[event("s3", b"3"), event("s4", b"4")]).await.unwrap();
    let c = db.store.claim("r", 3, LEASE).await.unwrap();
    assert_eq!(db.store.complete(c[0].record.row_id, &c[0].lease).await.unwrap(), Completion::Published);
    assert_eq!(db.store.park(c[1].record.row_id, &c[1].lease, "bad").await.unwrap(), Outcome::Applied);
    db.clock.advance(Duration::from_secs(1));

    let s = db.store.stats().await.unwrap();
    assert_eq!((s.pending, s.leased, s.parked, s.published), (1, 1, 1, 1));
    assert_eq!(s.oldest_pending_age, Some(Duration::from_secs(1)), "s4 is the only pending row");

    db.clock.advance(LEASE);
    let s = db.store.stats().await.unwrap();
    assert_eq!((s.pending, s.leased), (2, 0), "an expired lease counts as pending");
    assert_eq!(s.oldest_pending_age, Some(Duration::from_secs(11)));
}

#[tokio::test]
async fn oversized_payload_is_too_large_and_nothing_is_written() {
    let db = common::open_with(|c| c.with_max_payload(16)).await;
    let err = db.store.enqueue(&[event("ok", &[1; 16]), event("big", &[0; 17])]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert!(err.is_permanent());
    assert!(err.message().contains("big"), "{err}");

    let mut conn = db.store.connect_raw().unwrap();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
    let err = db.store.enqueue_one_in(&tx, &event("big2", &[0; 17])).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge);
    // The free function takes the store, so it honours the configured limit too.
    let err = outbox_store_sqlite::enqueue_one(&tx, &db.store, &event("big3", &[0; 17])).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    // Headers have a limit of their own, whatever the payload limit: a 10 MB value is refused
    // by the store, by the free functions and at enqueue_in alike.
    let huge = event("big-headers", b"p").with_header("trace", vec![b'x'; 10 * 1024 * 1024]);
    for err in [
        db.store.enqueue_in(&tx, std::slice::from_ref(&huge)).unwrap_err(),
        outbox_store_sqlite::enqueue_one(&tx, &db.store, &huge).unwrap_err(),
    ] {
        assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
        assert!(err.is_permanent());
        assert!(err.message().contains("big-headers") && err.message().contains("65536"), "{err}");
    }
    tx.commit().unwrap();
    let err = db.store.enqueue(&[event("ok2", b"1"), huge]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert_eq!(count(&conn, "outbox_rows"), 0);
}

#[tokio::test]
async fn duplicate_event_id_is_a_conflict_and_nothing_is_written() {
    let db = common::open().await;
    db.store.enqueue(&[event("dup", b"1")]).await.unwrap();
    let err = db.store.enqueue(&[event("new-1", b"2"), event("dup", b"3")]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.is_permanent());
    assert!(err.message().contains("dup"), "{err}");
    let err = db.store.enqueue(&[event("twice", b"1"), event("twice", b"1")]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "a repeat inside one batch");
    let rows = all_rows(&db.store).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].event.id, id("dup"));
    assert_eq!(rows[0].event.payload, b"1");
}

#[tokio::test]
async fn claim_respects_limit_and_row_order() {
    let db = common::open().await;
    let ids = db.store.enqueue(&(0..7).map(|i| event(&format!("o{i}"), b"x")).collect::<Vec<_>>()).await.unwrap();
    assert!(db.store.claim("r", 0, LEASE).await.unwrap().is_empty());
    let first = db.store.claim("r", 3, LEASE).await.unwrap();
    let second = db.store.claim("r", 10, LEASE).await.unwrap();
    let got: Vec<_> = first.iter().chain(&second).map(|c| c.record.row_id).collect();
    assert_eq!(got, ids);
    let page = db.store.inspect(ids[2], 2).await.unwrap();
    assert_eq!(page.iter().map(|r| r.row_id).collect::<Vec<_>>(), vec![ids[3], ids[4]]);
}

#[tokio::test]
async fn the_claim_query_uses_the_claim_index() {
    let db = common::open().await;
    let conn = db.store.connect_raw().unwrap();
    let mut stmt = conn
        .prepare(
            "EXPLAIN QUERY PLAN SELECT row_id FROM outbox_rows
             WHERE published_token IS NULL AND parked_at IS NULL AND available_at <= ?1
               AND (lease_expires_at IS NULL OR lease_expires_at <= ?1)
             ORDER BY row_id LIMIT ?2",
        )
        .unwrap();
    let plan: Vec<String> = stmt.query_map((0, 10), |r| r.get(3)).unwrap().collect::<rusqlite::Result<_>>().unwrap();
    assert!(plan.iter().any(|p| p.contains("outbox_rows_claim")), "{plan:?}");
    assert!(!plan.iter().any(|p| p.contains("TEMP B-TREE")), "no sort needed: {plan:?}");
}

#[tokio::test]
async fn a_held_write_lock_is_a_transient_busy_error() {
    let db = common::open_with(|c| c.with_busy_timeout(Duration::from_millis(100))).await;
    db.store.enqueue(&[event("locked", b"x")]).await.unwrap();
    let mut other = db.store.connect_raw().unwrap();
    let holder = other.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();

    let err = db.store.claim("r", 10, LEASE).await.unwrap_err();
    assert_eq!((err.kind(), err.is_transient(), err.backend()), (ErrorKind::Busy, true, "sqlite"), "{err}");
    let err = outbox_core::Inbox::begin(&db.store).await.unwrap_err();
    assert_eq!((err.kind(), err.is_transient()), (ErrorKind::Busy, true), "{err}");
    assert_eq!(db.store.stats().await.unwrap().pending, 1, "readers are not blocked in WAL mode");

    drop(holder);
    assert_eq!(db.store.claim("r", 10, LEASE).await.unwrap().len(), 1);
}

/// The store's own writes take turns in the process before they take SQLite's lock (see the
/// pool's module docs). Concurrent enqueues, claims and completions of one store all succeed
/// and every row ends published exactly once. What the turns save (the busy handler's sleeps)
/// is a matter of speed, measured by `outbox bench --only P5`, not here.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writes_of_one_store_take_turns_and_publish_each_row_once() {
    const WRITERS: usize = 8;
    const ROUNDS: usize = 25;
    const PER_ENQUEUE: usize = 4;
    let total = WRITERS * ROUNDS * PER_ENQUEUE;
    let db = common::open_with(|c| c.with_busy_timeout(Duration::from_secs(10)).with_pool_size(4)).await;

    let enqueues = (0..WRITERS).map(|w| {
        let store = db.store.clone();
        tokio::spawn(async move {
            for r in 0..ROUNDS {
                let events: Vec<_> = (0..PER_ENQUEUE).map(|i| event(&format!("turns-{w}-{r}-{i}"), b"x")).collect();
                store.enqueue(&events).await.map_err(|e| format!("writer {w}, round {r}: {e}"))?;
            }
            Ok::<_, String>(())
        })
    });
    let relays = (0..2).map(|n| {
        let store = db.store.clone();
        tokio::spawn(async move {
            let owner = format!("relay-{n}");
            let mut published = 0usize;
            // Bounded: far more rounds than the rows need, even if this relay only finds empty
            // claims while the writers are still enqueueing.
            for _ in 0..20_000 {
                let claimed = store.claim(&owner, 7, LEASE).await.map_err(|e| format!("{owner} claim: {e}"))?;
                let rows: Vec<_> = claimed.iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
                let done = store.complete_many(&rows).await.map_err(|e| format!("{owner} complete: {e}"))?;
                published += done.iter().filter(|c| **c == Completion::Published).count();
                if store.stats().await.map_err(|e| e.to_string())?.published as usize == total {
                    break;
                }
            }
            Ok::<_, String>(published)
        })
    });
    let relays: Vec<_> = relays.collect();
    for e in enqueues {
        e.await.unwrap().unwrap();
    }
    let mut published = 0;
    for r in relays {
        published += r.await.unwrap().unwrap();
    }

    assert_eq!(published, total, "every row completed once, by one of the two relays");
    let rows = all_rows(&db.store).await.unwrap();
    assert_eq!(rows.len(), total);
    assert!(rows.iter().all(|r| r.status == RowStatus::Published), "every row published");
    assert!(
        rows.iter().all(|r| r.token == 1 && r.published_token == Some(1)),
        "every row claimed once and completed by that claim"
    );
}

/// While another connection holds the write lock, writes queued for their turn do not wait out
/// one busy timeout after another: each fails with a transient `Busy` after about one timeout
/// (its turn, then SQLite's lock: at most two), and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_queued_behind_a_held_lock_each_fail_busy_within_the_busy_timeout() {
    const TIMEOUT: Duration = Duration::from_millis(200);
    const WRITES: usize = 8;
    let db = common::open_with(|c| c.with_busy_timeout(TIMEOUT)).await;
    db.store.enqueue(&[event("held", b"x")]).await.unwrap();
    let mut other = db.store.connect_raw().unwrap();
    let holder = other.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();

    let started = std::time::Instant::now();
    let writes: Vec<_> = (0..WRITES)
        .map(|i| {
            let store = db.store.clone();
            tokio::spawn(async move {
                let t = std::time::Instant::now();
                let out = if i % 2 == 0 {
                    store.claim("r", 10, LEASE).await.map(drop)
                } else {
                    store.enqueue(&[event(&format!("queued-{i}"), b"y")]).await.map(drop)
                };
                (out, t.elapsed())
            })
        })
        .collect();
    let mut waits = Vec::new();
    for w in writes {
        let (out, waited) = w.await.unwrap();
        let err = out.expect_err("the lock is held elsewhere");
        assert_eq!((err.kind(), err.is_transient()), (ErrorKind::Busy, true), "{err}");
        waits.push(waited);
    }
    // One after another would take WRITES timeouts (1.6 s) for the last; the bound is two
    // timeouts each, with room for a slow machine.
    let longest = waits.iter().max().copied().unwrap_or_default();
    assert!(longest < TIMEOUT * 5, "a write waited {longest:?}, more than its turn and its lock allow: {waits:?}");
    assert!(started.elapsed() < TIMEOUT * WRITES as u32, "the writes waited one after another: {waits:?}");

    drop(holder);
    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.leased), (1, 0), "nothing was claimed or enqueued while the lock was held");
}
