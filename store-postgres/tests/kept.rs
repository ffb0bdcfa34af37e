//! The relay's claim and completion run on connections the store keeps outside the pool (see
//! the crate's "Connections kept for the relay"): they do not queue for the pool's connections,
//! a kept connection that died while idle costs the caller nothing, and closing the store closes
//! them.

mod common;

use std::time::{Duration, Instant};

use common::{TestDb, base_config, event};
use outbox_core::store::all_rows;
use outbox_core::{Completion, OutboxStore, RowStatus};
use outbox_store_postgres::sqlx::{self, Connection, PgConnection};

const LEASE: Duration = Duration::from_secs(60);

/// A connection of the test's own, outside the store (not named after its schema).
async fn outsider() -> PgConnection {
    let options = base_config().connect_options().unwrap().application_name("outbox-test-outsider");
    PgConnection::connect_with(&options).await.expect("connect")
}

/// Terminate every session of the store (they carry the schema as `application_name`) and wait,
/// at most 10 s, until none is left; returns how many were terminated.
async fn terminate_the_stores_sessions(db: &TestDb) -> i64 {
    let mut conn = outsider().await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1) t",
    )
    .bind(db.schema())
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while sessions(&mut conn, db).await > 0 {
        assert!(Instant::now() < deadline, "the store's sessions were still there 10 s after pg_terminate_backend");
        tokio::task::yield_now().await;
    }
    conn.close().await.unwrap();
    killed
}

async fn sessions(conn: &mut PgConnection, db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(db.schema())
        .fetch_one(conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relays_claims_and_completions_run_on_kept_connections_while_the_pool_is_taken() {
    let Some(db) =
        TestDb::open("kept_busy", None, |c| c.with_pool_size(2).with_connect_timeout(Duration::from_millis(500))).await
    else {
        return;
    };
    let events: Vec<_> = (0..40).map(|i| event(&format!("ev-{i:02}"), b"x")).collect();
    db.store.enqueue(&events).await.unwrap();
    // As a relay at pipeline depth 2 does: the next batch's claim beside the last one's
    // completion, so that two connections are kept.
    let mut last = db.store.claim("relay-kept", 10, LEASE).await.unwrap();
    let rows: Vec<_> = last.iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
    let (claimed, completed) = tokio::join!(db.store.claim("relay-kept", 10, LEASE), db.store.complete_many(&rows));
    assert!(completed.unwrap().iter().all(|c| *c == Completion::Published));
    last = claimed.unwrap();

    // The application takes every connection of the pool, as long transactions would.
    let held = [db.store.pool().acquire().await.unwrap(), db.store.pool().acquire().await.unwrap()];
    for round in 0..2 {
        let rows: Vec<_> = last.iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
        let (claimed, completed) = tokio::join!(db.store.claim("relay-kept", 10, LEASE), db.store.complete_many(&rows));
        let completed = completed.unwrap_or_else(|e| panic!("round {round}: the completion waited for the pool: {e}"));
        assert!(completed.iter().all(|c| *c == Completion::Published), "round {round}");
        last = claimed.unwrap_or_else(|e| panic!("round {round}: the claim waited for the pool: {e}"));
        assert_eq!(last.len(), 10, "round {round}");
    }
    drop(held);
    let rows: Vec<_> = last.iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
    db.store.complete_many(&rows).await.unwrap();
    let stored = all_rows(&db.store).await.unwrap();
    assert_eq!(stored.len(), 40);
    assert!(stored.iter().all(|r| r.status == RowStatus::Published && r.token == 1), "every row published once");
}

#[tokio::test]
async fn a_kept_connection_that_died_while_idle_costs_the_caller_nothing() {
    let Some(db) = TestDb::new("kept_lost").await else { return };
    let events: Vec<_> = (0..4).map(|i| event(&format!("ev-{i}"), b"x")).collect();
    db.store.enqueue(&events).await.unwrap();
    let first = db.store.claim("relay-kept", 2, LEASE).await.unwrap();
    assert_eq!(first.len(), 2);

    // The claim's connection is kept, idle for well under a second: it is not pinged first.
    assert!(terminate_the_stores_sessions(&db).await >= 1);
    let rows: Vec<_> = first.iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
    let out = db.store.complete_many(&rows).await.expect("the completion runs again on a pool connection");
    assert_eq!(out, [Completion::Published, Completion::Published]);

    assert!(terminate_the_stores_sessions(&db).await >= 1);
    let second = db.store.claim("relay-kept", 10, LEASE).await.expect("the claim runs again on a pool connection");
    let ids: Vec<_> = second.iter().map(|c| c.record.event.id.as_str().to_owned()).collect();
    assert_eq!(ids, ["ev-2", "ev-3"]);

    let stored = all_rows(&db.store).await.unwrap();
    let states: Vec<_> = stored.iter().map(|r| (r.status, r.token, r.owner.as_deref())).collect();
    assert_eq!(
        states,
        [
            (RowStatus::Published, 1, Some("relay-kept")),
            (RowStatus::Published, 1, Some("relay-kept")),
            (RowStatus::Leased, 1, Some("relay-kept")),
            (RowStatus::Leased, 1, Some("relay-kept")),
        ],
        "each statement took effect once: {stored:?}"
    );
}

#[tokio::test]
async fn closing_the_store_closes_its_kept_connections() {
    let Some(db) = TestDb::new("kept_close").await else { return };
    db.store.enqueue(&[event("ev-0", b"x")]).await.unwrap();
    let claimed = db.store.claim("relay-kept", 1, LEASE).await.unwrap();
    let rows: Vec<_> = claimed.iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
    assert_eq!(db.store.complete_many(&rows).await.unwrap(), [Completion::Published]);
    db.store.close().await;
    let mut conn = outsider().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = sessions(&mut conn, &db).await;
        if left == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{left} sessions of the store still open 10 s after close");
        tokio::task::yield_now().await;
    }
}
