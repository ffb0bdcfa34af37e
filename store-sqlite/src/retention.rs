//! Retention of published rows: a published row is history, and history kept forever makes the
//! file grow without bound.
//!
//! One purge is one `BEGIN IMMEDIATE` transaction with one `DELETE` that walks the partial
//! index `outbox_rows_published` (schema version 3) from the oldest publication, so it reads
//! only the rows it deletes and holds the single write lock of the file only for as long as
//! that takes — a relay's claim waits at most that long. "Now" comes from the store's clock,
//! like every other decision of this crate.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::Result;

use crate::error::ResultExt;
use crate::store::{SqliteStore, to_sql_limit};

const PURGE: &str = "DELETE FROM outbox_rows WHERE row_id IN (
    SELECT row_id FROM outbox_rows
    WHERE published_at IS NOT NULL AND published_at < ?1
    ORDER BY published_at
    LIMIT ?2
)";

/// [`OutboxAdmin::purge_published`](outbox_core::OutboxAdmin::purge_published) for `store`.
pub(crate) async fn purge_published(store: &SqliteStore, older_than: Duration, limit: usize) -> Result<u64> {
    if limit == 0 {
        return Ok(0);
    }
    let limit = to_sql_limit(limit);
    let age = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
    let clock = Arc::clone(store.clock());
    store
        .pool()
        .write("purge published rows", move |tx| {
            // Read after the write lock is taken, like every other decision of this store.
            let cutoff = clock.now().as_millis().saturating_sub(age);
            let n = tx
                .prepare_cached(PURGE)
                .ctx("purge published rows")?
                .execute((cutoff, limit))
                .ctx("purge published rows")?;
            Ok(n as u64)
        })
        .await
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_purge_uses_the_published_index() {
        let conn = rusqlite::Connection::open_in_memory().unwrap();
        conn.execute_batch(
            "CREATE TABLE outbox_rows (row_id INTEGER PRIMARY KEY, published_at INTEGER, parked_at INTEGER);
             CREATE INDEX outbox_rows_published ON outbox_rows (published_at) WHERE published_at IS NOT NULL;",
        )
        .unwrap();
        let plan: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {}", super::PURGE))
            .unwrap()
            .query_map((0, 10), |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(plan.iter().any(|p| p.contains("outbox_rows_published")), "{plan:?}");
        assert!(!plan.iter().any(|p| p.starts_with("SCAN outbox_rows")), "{plan:?}");
    }
}
