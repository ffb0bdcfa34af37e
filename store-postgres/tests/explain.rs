//! `EXPLAIN` of the exact claim statement over a large backlog: the plan must walk the partial
//! index of open rows, so published rows cost nothing. Loads 110,000 rows (about a second);
//! `--nocapture` prints the plan.

mod common;

use common::TestDb;
use outbox_store_postgres::sqlx::{self, AssertSqlSafe};

#[tokio::test]
async fn claim_plan_uses_the_partial_index() {
    let Some(db) = TestDb::new("explain").await else { return };
    let tables = db.store.tables();
    let events = tables.table("events").unwrap();
    // 100,000 published rows, then 10,000 pending ones, with the store's own headers encoding
    // (format byte 1, zero headers).
    db.exec(format!(
        "INSERT INTO {events} (event_id, destination, headers, payload, token, owner, available_at, created_at, \
             published_token, published_at)
         SELECT 'pub-' || g, 'orders', '\\x0100000000'::bytea, convert_to('payload ' || g, 'UTF8'), 1, 'relay', 0, 0, 1, 0
         FROM generate_series(1, 100000) g;
         INSERT INTO {events} (event_id, destination, headers, payload, available_at, created_at)
         SELECT 'pend-' || g, 'orders', '\\x0100000000'::bytea, convert_to('payload ' || g, 'UTF8'), 0, 0
         FROM generate_series(1, 10000) g;
         ANALYZE {events};"
    ))
    .await;

    let explain = |analyze: bool| {
        let prefix = if analyze { "EXPLAIN (ANALYZE, BUFFERS, TIMING OFF)" } else { "EXPLAIN" };
        sqlx::query_scalar::<_, String>(AssertSqlSafe(format!("{prefix} {}", tables.claim_sql(100))))
            .bind(None::<i64>)
            .bind("relay-explain")
            .bind(30_000_i64)
    };
    let plan = explain(false).fetch_all(db.store.pool()).await.unwrap().join("\n");
    println!("-- EXPLAIN of the claim statement (100,000 published + 10,000 pending rows)\n{plan}");
    let index = format!("{}events_claimable", tables.prefix());
    assert!(plan.contains(&format!("Index Scan using {index}")), "the plan does not use {index}:\n{plan}");

    // The same statement executed (in a transaction rolled back afterwards): actual row counts.
    let mut tx = db.store.pool().begin().await.unwrap();
    let analyzed = explain(true).fetch_all(&mut *tx).await.unwrap().join("\n");
    tx.rollback().await.unwrap();
    println!("-- EXPLAIN (ANALYZE, BUFFERS) of the same statement, rolled back\n{analyzed}");
    assert!(analyzed.contains(&index));

    // The generic plan (what a prepared statement may switch to, with the clock unknown).
    let mut conn = db.store.pool().acquire().await.unwrap();
    db_exec(&mut conn, format!("PREPARE claim_generic(bigint, text, bigint) AS {}", tables.claim_sql(100))).await;
    db_exec(&mut conn, "SET plan_cache_mode = force_generic_plan".into()).await;
    let generic: Vec<String> =
        sqlx::query_scalar(AssertSqlSafe("EXPLAIN EXECUTE claim_generic(1767225600000, 'relay', 30000)"))
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    let generic = generic.join("\n");
    db_exec(&mut conn, "DEALLOCATE claim_generic; RESET plan_cache_mode".into()).await;
    println!("-- generic plan of the same statement\n{generic}");
    assert!(generic.contains(&format!("Index Scan using {index}")), "generic plan:\n{generic}");
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of the store's claim of `limit` rows (database clock), executed
/// in a transaction that is rolled back: the plan with actual row counts, nothing claimed.
async fn analyze_claim(db: &TestDb, limit: usize) -> String {
    let sql = format!("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) {}", db.store.tables().claim_sql(limit));
    let mut tx = db.store.pool().begin().await.unwrap();
    let analyzed: Vec<String> = sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(None::<i64>)
        .bind("relay-explain")
        .bind(30_000_i64)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    analyzed.join("\n")
}

async fn db_exec(conn: &mut sqlx::PgConnection, sql: String) {
    sqlx::raw_sql(AssertSqlSafe(sql)).execute(conn).await.unwrap();
}

/// The claim with key order, over a realistic keyed backlog (ANALYZEd): 100,000 published rows of
/// 5,000 keys, 10,000 pending rows of 2,000 keys, 500 rows without a key, and some keys blocked
/// (a row backing off, a leased row, a parked row). Every probe of the key order must be an index
/// scan: no `Seq Scan` anywhere in the plan, the custom one or the generic one.
#[tokio::test]
async fn keyed_claim_plan_uses_indexes_only() {
    let Some(db) = TestDb::new("explain_keys").await else { return };
    let tables = db.store.tables();
    let events = tables.table("events").unwrap();
    db.exec(format!(
        "INSERT INTO {events} (event_id, destination, key, headers, payload, token, owner, available_at, created_at, \
             published_token, published_at)
         SELECT 'pub-' || g, 'orders', 'k' || (g % 5000), '\\x0100000000'::bytea, convert_to('payload ' || g, 'UTF8'),
                1, 'relay', 0, 0, 1, 0
         FROM generate_series(1, 100000) g;
         INSERT INTO {events} (event_id, destination, key, headers, payload, available_at, created_at)
         SELECT 'pend-' || g, 'orders', CASE WHEN g % 20 = 0 THEN NULL ELSE 'k' || (g % 2000) END, '\\x0100000000'::bytea,
                convert_to('payload ' || g, 'UTF8'), 0, 0
         FROM generate_series(1, 10000) g;
         UPDATE {events} SET available_at = 9000000000000 WHERE event_id IN ('pend-1', 'pend-2');
         UPDATE {events} SET owner = 'other', token = 1, lease_expires_at = 9000000000000 WHERE event_id = 'pend-3';
         UPDATE {events} SET parked_at = 0 WHERE event_id = 'pend-4';
         ANALYZE {events};"
    ))
    .await;
    let claim = |limit: usize| {
        sqlx::query_scalar::<_, String>(AssertSqlSafe(format!("EXPLAIN {}", tables.claim_sql(limit))))
            .bind(None::<i64>)
            .bind("relay-explain")
            .bind(30_000_i64)
    };
    let claimable = format!("{}events_claimable", tables.prefix());
    let key_open = format!("{}events_key_open", tables.prefix());
    let key_held = format!("{}events_key_held", tables.prefix());
    for limit in [100, 500] {
        let plan = claim(limit).fetch_all(db.store.pool()).await.unwrap().join("\n");
        println!("-- EXPLAIN of the keyed claim, limit {limit}\n{plan}");
        assert!(!plan.contains("Seq Scan"), "a sequential scan in the claim plan:\n{plan}");
        assert!(plan.contains(&format!("Index Scan using {claimable}")), "{claimable} not used:\n{plan}");
        assert!(plan.contains(&key_open), "{key_open} not used:\n{plan}");
        assert!(plan.contains(&key_held), "{key_held} not used:\n{plan}");
    }

    // Executed and rolled back: the blocked keys' later rows are not taken.
    let analyzed = analyze_claim(&db, 500).await;
    println!("-- EXPLAIN (ANALYZE, BUFFERS) of the keyed claim, rolled back\n{analyzed}");
    assert!(!analyzed.contains("Seq Scan"), "{analyzed}");

    // The generic plan, as a prepared statement may use it.
    let mut conn = db.store.pool().acquire().await.unwrap();
    db_exec(&mut conn, format!("PREPARE claim_keys(bigint, text, bigint) AS {}", tables.claim_sql(500))).await;
    db_exec(&mut conn, "SET plan_cache_mode = force_generic_plan".into()).await;
    let generic: Vec<String> =
        sqlx::query_scalar(AssertSqlSafe("EXPLAIN EXECUTE claim_keys(1767225600000, 'relay', 30000)"))
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    db_exec(&mut conn, "DEALLOCATE claim_keys; RESET plan_cache_mode".into()).await;
    let generic = generic.join("\n");
    println!("-- generic plan of the keyed claim\n{generic}");
    assert!(!generic.contains("Seq Scan"), "generic plan:\n{generic}");
    assert!(generic.contains(&key_open), "generic plan:\n{generic}");
    assert!(generic.contains(&key_held), "generic plan:\n{generic}");
}

/// A deep pipeline over few keys: once every key's head is in flight, the rest of the backlog
/// waits behind them, and a claim must find that out without probing an index per row. 20,000
/// pending rows of 50 keys; a claim of 50 leases every key's head; the next claim takes nothing,
/// and its plan reads each index with one scan: no probe per row or per held key (each row is
/// dropped on a hash lookup and a comparison with the highest first holding row).
#[tokio::test]
async fn claim_behind_every_head_in_flight_probes_no_index_per_row() {
    let Some(db) = TestDb::new("explain_heads").await else { return };
    let tables = db.store.tables();
    let events = tables.table("events").unwrap();
    db.exec(format!(
        "INSERT INTO {events} (event_id, destination, key, headers, payload, available_at, created_at)
         SELECT 'pend-' || g, 'orders', 'k' || (g % 50), '\\x0100000000'::bytea, convert_to('payload ' || g, 'UTF8'), 0, 0
         FROM generate_series(1, 20000) g;
         ANALYZE {events};"
    ))
    .await;
    let lease = std::time::Duration::from_secs(60);
    let first = outbox_core::OutboxStore::claim(&db.store, "relay-a", 50, lease).await.unwrap();
    let keys: std::collections::BTreeSet<_> = first.iter().filter_map(|c| c.record.event.key.clone()).collect();
    assert_eq!((first.len(), keys.len()), (50, 50), "the first claim should take one head per key");
    let second = outbox_core::OutboxStore::claim(&db.store, "relay-b", 100, lease).await.unwrap();
    let taken: Vec<_> = second.iter().map(|c| (c.record.row_id, c.record.event.key.clone())).collect();
    assert!(taken.is_empty(), "a claim took rows behind their keys' leased heads: {taken:?}");
    // Read back: the 50 leased rows are the heads (the oldest row of each key), nothing else.
    let leased = db
        .count(format!(
            "SELECT count(*) FROM {events} t WHERE t.owner IS NOT NULL AND t.owner = 'relay-a'
               AND t.id = (SELECT min(id) FROM {events} h WHERE h.key = t.key)"
        ))
        .await;
    let any = db.count(format!("SELECT count(*) FROM {events} WHERE owner IS NOT NULL")).await;
    assert_eq!((leased, any), (50, 50), "leased heads, leased rows");

    let analyzed = analyze_claim(&db, 100).await;
    println!("-- EXPLAIN (ANALYZE, BUFFERS) of a claim behind every head in flight, rolled back\n{analyzed}");
    // Each index is read by one scan: the held keys once, the walk once. A probe per row (or per
    // held key) would show as an index scan with thousands (or fifty) loops.
    let scans: Vec<&str> = analyzed.lines().filter(|l| l.contains("Index") && l.contains("loops=")).collect();
    assert!(scans.len() >= 2, "no index scans in the plan:\n{analyzed}");
    for scan in &scans {
        assert!(scan.contains("loops=1)"), "an index scan runs more than once: {scan}\n{analyzed}");
    }
    assert!(!analyzed.contains("Seq Scan"), "{analyzed}");
}

/// The store's claim is planned once per connection and limit, not at every call: its text holds
/// no parameter the plan depends on (the limit is written in, the clock is an init plan), so
/// PostgreSQL keeps the generic plan after its five custom ones. Read from the connection's own
/// `pg_prepared_statements` (a pool of one connection and none kept for the relay, so the claims
/// and the read share it).
#[tokio::test]
async fn claim_switches_to_its_generic_plan() {
    let Some(db) = TestDb::open("explain_generic", None, |c| c.with_pool_size(1).with_kept_connections(0)).await else {
        return;
    };
    let tables = db.store.tables();
    let events = tables.table("events").unwrap();
    db.exec(format!(
        "INSERT INTO {events} (event_id, destination, key, headers, payload, available_at, created_at)
         SELECT 'pend-' || g, 'orders', CASE WHEN g % 10 = 0 THEN NULL ELSE 'k' || (g % 500) END,
                '\\x0100000000'::bytea, convert_to('payload ' || g, 'UTF8'), 0, 0
         FROM generate_series(1, 5000) g;
         ANALYZE {events};"
    ))
    .await;
    let lease = std::time::Duration::from_secs(60);
    let mut claimed = 0;
    for limit in [40, 20] {
        for _ in 0..12 {
            let batch = outbox_core::OutboxStore::claim(&db.store, "relay-plan", limit, lease).await.unwrap();
            assert!(!batch.is_empty() && batch.len() <= limit, "a claim of {limit} took {}", batch.len());
            claimed += batch.len();
        }
    }
    assert_leased_once(&db, claimed).await;

    let counts: Vec<(bool, bool, i64, i64)> = prepared_claims(&db)
        .await
        .iter()
        .map(|(_, sql, generic, custom)| (sql.contains("LIMIT 20\n"), sql.contains("LIMIT 40\n"), *generic, *custom))
        .collect();
    println!("-- prepared claims (limit 20?, limit 40?, generic plans, custom plans): {counts:?}");
    assert_eq!(counts.len(), 2, "one prepared claim per limit: {counts:?}");
    for (_, _, generic, custom) in &counts {
        assert!(*custom <= 5 && *generic >= 7, "12 claims, {generic} generic plans and {custom} custom: {counts:?}");
    }
    assert!(counts.iter().any(|c| c.0) && counts.iter().any(|c| c.1), "{counts:?}");
}

/// A relay that starts on an empty outbox makes PostgreSQL build the claim's generic plan from
/// an empty table (its idle claims are the first five calls), and a generic plan is kept until
/// the table is analyzed again or a plan cache reset (any backend's schema DDL, say) makes
/// PostgreSQL plan again. Whichever plan the prepared claim runs after a burst of rows that no
/// `ANALYZE` has seen must still walk the indexes: no part of it may be a sequential scan.
#[tokio::test]
async fn claim_generic_plan_made_on_an_empty_table_still_walks_the_indexes() {
    let Some(db) = TestDb::open("explain_empty", None, |c| c.with_pool_size(1).with_kept_connections(0)).await else {
        return;
    };
    let tables = db.store.tables();
    let events = tables.table("events").unwrap();
    let lease = std::time::Duration::from_secs(60);
    for _ in 0..8 {
        let batch = outbox_core::OutboxStore::claim(&db.store, "relay-plan", 100, lease).await.unwrap();
        assert!(batch.is_empty(), "an empty outbox gave {} rows", batch.len());
    }
    // The burst, not analyzed: 100,000 published rows and 10,000 pending ones over 1,000 keys.
    db.exec(format!(
        "INSERT INTO {events} (event_id, destination, key, headers, payload, token, owner, available_at, created_at,
             published_token, published_at)
         SELECT 'pub-' || g, 'orders', 'k' || (g % 1000), '\\x0100000000'::bytea, convert_to('payload ' || g, 'UTF8'),
                1, 'relay', 0, 0, 1, 0
         FROM generate_series(1, 100000) g;
         INSERT INTO {events} (event_id, destination, key, headers, payload, available_at, created_at)
         SELECT 'pend-' || g, 'orders', 'k' || (g % 1000), '\\x0100000000'::bytea, convert_to('payload ' || g, 'UTF8'), 0, 0
         FROM generate_series(1, 10000) g;"
    ))
    .await;
    let mut claimed = 0;
    for _ in 0..3 {
        let batch = outbox_core::OutboxStore::claim(&db.store, "relay-plan", 100, lease).await.unwrap();
        assert_eq!(batch.len(), 100, "a claim of 100 over 10,000 pending rows of 1,000 keys");
        claimed += batch.len();
    }
    assert_leased_once(&db, claimed).await;

    // The plan the connection keeps for the claim of 100.
    let prepared = prepared_claims(&db).await;
    assert_eq!(prepared.len(), 1, "{prepared:?}");
    // Alone, 6 of the 11 claims ran the generic plan made on the empty table. Beside the other
    // tests, whose schemas reset every backend's plan cache, the claims after the burst were
    // planned again (custom), so the count is not asserted.
    let (name, _, generic, _) = &prepared[0];
    println!("-- 11 claims, {generic} on a generic plan");
    let plan: Vec<String> =
        sqlx::query_scalar(AssertSqlSafe(format!("EXPLAIN EXECUTE {name}(NULL, 'relay-explain', 30000)")))
            .fetch_all(db.store.pool())
            .await
            .unwrap();
    let plan = plan.join("\n");
    println!("-- the prepared claim's plan after a burst of 110,000 rows, not analyzed\n{plan}");
    let index = format!("{}events_claimable", tables.prefix());
    assert!(plan.contains(&format!("Index Scan using {index}")), "{plan}");
    assert!(!plan.contains("Seq Scan"), "{plan}");
}

/// The claims the store prepared on its one connection (the tests above use a pool of one):
/// name, statement, generic plans, custom plans; by statement.
async fn prepared_claims(db: &TestDb) -> Vec<(String, String, i64, i64)> {
    sqlx::query_as(
        "SELECT name, statement, generic_plans, custom_plans FROM pg_prepared_statements
         WHERE statement LIKE '%FOR UPDATE SKIP LOCKED%' AND statement NOT LIKE '%pg_prepared_statements%'
         ORDER BY statement",
    )
    .fetch_all(db.store.pool())
    .await
    .unwrap()
}

/// Every row the claims returned is leased once, to the claimer, read back from the table.
async fn assert_leased_once(db: &TestDb, claimed: usize) {
    let events = db.store.tables().table("events").unwrap();
    let leased = db.count(format!("SELECT count(*) FROM {events} WHERE owner = 'relay-plan' AND token = 1")).await;
    assert_eq!(leased, i64::try_from(claimed).unwrap(), "rows leased once each, as the claims returned them");
}
