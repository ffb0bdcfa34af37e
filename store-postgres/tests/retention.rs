//! Retention on PostgreSQL (`OutboxAdmin::purge_published`): what is specific to this store, the
//! plan of the purge statement. What rows a purge deletes or keeps is the conformance suite's
//! `store_purge_published_keeps_open_rows`, run on this store by `tests/conformance.rs`.

mod common;

use std::time::Duration;

use common::TestDb;
use outbox_core::OutboxAdmin;
use outbox_store_postgres::sqlx::{self, AssertSqlSafe};

/// `EXPLAIN` of the exact purge statement over 100,000 published and 10,000 open rows: it must
/// walk the `events_published` index, never the whole table.
#[tokio::test]
async fn purge_plan_uses_the_published_index() {
    let Some(db) = TestDb::new("retention_explain").await else { return };
    let tables = db.store.tables();
    let events = tables.table("events").unwrap();
    db.exec(format!(
        "INSERT INTO {events} (event_id, destination, headers, payload, token, owner, available_at, created_at, \
             published_token, published_at)
         SELECT 'pub-' || g, 'orders', '\\x0100000000'::bytea, '\\x00'::bytea, 1, 'relay', 0, 0, 1, g
         FROM generate_series(1, 100000) g;
         INSERT INTO {events} (event_id, destination, headers, payload, available_at, created_at)
         SELECT 'pend-' || g, 'orders', '\\x0100000000'::bytea, '\\x00'::bytea, 0, 0
         FROM generate_series(1, 10000) g;
         ANALYZE {events};"
    ))
    .await;
    let plan: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!("EXPLAIN {}", tables.purge_published_sql())))
        .bind(None::<i64>)
        .bind(60_000_i64)
        .bind(1000_i64)
        .fetch_all(db.store.pool())
        .await
        .unwrap();
    let plan = plan.join("\n");
    println!("-- EXPLAIN of the purge statement\n{plan}");
    let index = format!("{}events_published", tables.prefix());
    assert!(plan.contains(&format!("Index Scan using {index}")), "the plan does not use {index}:\n{plan}");
    assert!(!plan.contains("Seq Scan"), "{plan}");

    // And it deletes what it says: 1000 of the oldest, then the rest in bounded steps.
    assert_eq!(db.store.purge_published(Duration::from_secs(60), 1000).await.unwrap(), 1000);
    let oldest_left = db.count(format!("SELECT min(published_at) FROM {events} WHERE published_at IS NOT NULL")).await;
    assert_eq!(oldest_left, 1001, "the 1000 oldest publications went first");
    assert_eq!(db.count(format!("SELECT count(*) FROM {events} WHERE published_at IS NULL")).await, 10_000);
}
