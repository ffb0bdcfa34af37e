//! Retention on PostgreSQL (`OutboxAdmin::purge_published`), judged by the rows left in the table:
//! only published rows older than the retention go, oldest publication first, `limit` at a
//! time; pending, leased and parked rows stay whatever their age. Time is a `ManualClock`.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::TestDb;
use outbox_core::store::all_rows;
use outbox_core::{Completion, ManualClock, OutboxAdmin, OutboxStore, Outcome, RowStatus};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe};

const MIN: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);

/// Event id → status of every row left.
async fn left(store: &dyn OutboxAdmin) -> BTreeMap<String, RowStatus> {
    all_rows(store).await.unwrap().into_iter().map(|r| (r.event.id.as_str().to_string(), r.status)).collect()
}

fn expect(rows: &[(&str, RowStatus)]) -> BTreeMap<String, RowStatus> {
    rows.iter().map(|(id, s)| ((*id).to_string(), *s)).collect()
}

#[tokio::test]
async fn purge_deletes_old_published_rows_oldest_first_in_batches_and_nothing_else() {
    let clock = ManualClock::default();
    let Some(db) = TestDb::with_clock("retention", common::arc_clock(&clock)).await else { return };
    let (store, clock) = (&db.store, &clock);
    let events: Vec<_> = (0..8).map(|i| common::event(&format!("e{i}"), b"x")).collect();
    store.enqueue(&events).await.unwrap();

    // e0..e2 published at t0+1m, t0+2m and t0 — publication order is not row order.
    let c = store.claim("relay", 3, HOUR).await.unwrap();
    assert_eq!(store.complete(c[2].record.row_id, &c[2].lease).await.unwrap(), Completion::Published);
    clock.advance(MIN);
    assert_eq!(store.complete(c[0].record.row_id, &c[0].lease).await.unwrap(), Completion::Published);
    clock.advance(MIN);
    assert_eq!(store.complete(c[1].record.row_id, &c[1].lease).await.unwrap(), Completion::Published);
    // e3 failed (pending again), e4 parked, e5 leased for an hour: all old, none published.
    let c = store.claim("relay", 3, HOUR).await.unwrap();
    assert_eq!(store.fail(c[0].record.row_id, &c[0].lease, Duration::ZERO, "down").await.unwrap(), Outcome::Applied);
    assert_eq!(store.park(c[1].record.row_id, &c[1].lease, "poison").await.unwrap(), Outcome::Applied);
    // e6 published young, at t0+10m; e7 never claimed.
    clock.advance(8 * MIN);
    let young: Vec<_> = store.claim("relay", 2, HOUR).await.unwrap();
    let e6 = young.iter().find(|c| c.record.event.id.as_str() == "e6").unwrap();
    assert_eq!(store.complete(e6.record.row_id, &e6.lease).await.unwrap(), Completion::Published);
    for c in young.iter().filter(|c| c.record.event.id.as_str() != "e6") {
        assert_eq!(store.release(c.record.row_id, &c.lease).await.unwrap(), Outcome::Applied);
    }
    use RowStatus::{Leased, Parked, Pending, Published};
    let all = [
        ("e0", Published),
        ("e1", Published),
        ("e2", Published),
        ("e3", Pending),
        ("e4", Parked),
        ("e5", Leased),
        ("e6", Published),
        ("e7", Pending),
    ];
    assert_eq!(left(store).await, expect(&all));

    // Now t0+10m. Older than 8m means published before t0+2m: e2 (t0) and e0 (t0+1m); e1, at
    // exactly t0+2m, is kept.
    assert_eq!(store.purge_published(8 * MIN, 0).await.unwrap(), 0, "limit 0 deletes nothing");
    assert_eq!(store.purge_published(8 * MIN, 1).await.unwrap(), 1);
    assert!(!left(store).await.contains_key("e2"), "the oldest publication goes first, whatever its row id");
    assert!(left(store).await.contains_key("e0"));
    assert_eq!(store.purge_published(8 * MIN, 10).await.unwrap(), 1, "e0 only; e1 is exactly 8m old");
    assert_eq!(store.purge_published(8 * MIN, 10).await.unwrap(), 0);
    assert_eq!(store.purge_published(5 * MIN, 10).await.unwrap(), 1, "e1");
    assert_eq!(store.purge_published(5 * MIN, 10).await.unwrap(), 0, "e6 is young");
    assert_eq!(left(store).await, expect(&all[3..]));

    // An hour later e5's lease has expired and e6 is old: only e6 goes; the open rows stay.
    clock.advance(HOUR);
    assert_eq!(store.purge_published(5 * MIN, 10).await.unwrap(), 1);
    assert_eq!(left(store).await, expect(&[("e3", Pending), ("e4", Parked), ("e5", Pending), ("e7", Pending)]));
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.published, stats.pending, stats.parked), (0, 3, 1));

    // A purged row's event id is free again, as the unique index says.
    assert_eq!(store.enqueue(&[common::event("e6", b"again")]).await.unwrap().len(), 1);
}

#[tokio::test]
async fn purge_goes_in_batches_of_limit() {
    let clock = ManualClock::default();
    let Some(db) = TestDb::with_clock("retention", common::arc_clock(&clock)).await else { return };
    let (store, clock) = (&db.store, &clock);
    let events: Vec<_> = (0..25).map(|i| common::event(&format!("b{i:02}"), b"x")).collect();
    store.enqueue(&events).await.unwrap();
    for c in store.claim("relay", 25, HOUR).await.unwrap() {
        assert_eq!(store.complete(c.record.row_id, &c.lease).await.unwrap(), Completion::Published);
        clock.advance(Duration::from_millis(10));
    }
    clock.advance(MIN);
    let mut batches = Vec::new();
    loop {
        let n = store.purge_published(MIN, 10).await.unwrap();
        batches.push(n);
        if n < 10 {
            break;
        }
        assert!(batches.len() < 10, "purge never finished: {batches:?}");
    }
    // Published at t0 .. t0+240ms; now is t0+60.25s, so every row is more than a minute old.
    assert_eq!(batches, [10, 10, 5]);
    assert!(left(store).await.is_empty());
}

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
