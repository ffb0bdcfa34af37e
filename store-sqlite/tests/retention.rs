//! Retention on SQLite (`OutboxAdmin::purge_published`): what is specific to this store, the
//! partial index the purge walks (its plan is checked in `src/retention.rs`). What rows a purge
//! deletes or keeps is the conformance suite's `store_purge_published_keeps_open_rows`, run on
//! this store by `tests/conformance.rs`.

mod common;

#[tokio::test]
async fn the_published_index_is_in_the_schema() {
    let db = common::open().await;
    let conn = db.store.connect_raw().unwrap();
    let sql: String = conn
        .query_row("SELECT sql FROM sqlite_master WHERE type = 'index' AND name = 'outbox_rows_published'", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert!(sql.contains("WHERE published_at IS NOT NULL"), "{sql}");
}
