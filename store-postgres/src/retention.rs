//! Retention of published rows: a published row is history, and history kept forever makes the
//! table, its indexes and every vacuum grow without bound.
//!
//! One purge is one statement (so one short transaction) that walks the partial index
//! `<prefix>events_published` (schema version 3) from the oldest publication: it reads only
//! the rows it deletes, never the open ones, and holds their row locks only for that statement.
//! `FOR UPDATE SKIP LOCKED` lets two cleanups run at once without waiting for each other.
//! Published rows are never updated again (every transition requires `published_at IS NULL`),
//! so a relay never waits for a purge either.

use std::time::Duration;

use sqlx::AssertSqlSafe;

use outbox_core::Result;

use crate::error::{Phase, map};
use crate::store::{PgStore, millis};

/// The purge statement for the events table `events` (qualified and quoted), with `now` the
/// store-clock expression over `$1`. The batch's ids go back as an array, so the `DELETE` finds
/// them by primary key (a join with the selection may be planned as a scan of the whole
/// table). Parameters: `$1` now in ms (`NULL`: database clock),
/// `$2` age in ms, `$3` limit.
pub(crate) fn purge_published_sql(events: &str, now: &str) -> String {
    format!(
        "DELETE FROM {events}
WHERE id = ANY(ARRAY(
    SELECT id FROM {events}
    WHERE published_at IS NOT NULL AND published_at < {now} - $2
    ORDER BY published_at
    LIMIT $3
    FOR UPDATE SKIP LOCKED
))
  AND published_at IS NOT NULL"
    )
}

/// [`OutboxAdmin::purge_published`](outbox_core::OutboxAdmin::purge_published) for `store`.
pub(crate) async fn purge_published(store: &PgStore, older_than: Duration, limit: usize) -> Result<u64> {
    if limit == 0 {
        return Ok(0);
    }
    let tables = store.tables();
    let mut conn = store.acquire().await?;
    let done = sqlx::query(AssertSqlSafe(tables.sql.purge_published.clone()))
        .bind(tables.now_param())
        .bind(millis(older_than))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(&mut *conn)
        .await
        .map_err(|e| map(e, Phase::AutocommitWrite, "purge_published"))?;
    Ok(done.rows_affected())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_purge_touches_only_published_rows_and_is_bounded() {
        let sql = super::purge_published_sql("\"s\".\"events\"", "$1");
        assert!(sql.contains("published_at IS NOT NULL AND published_at < $1 - $2"), "{sql}");
        assert!(sql.contains("LIMIT $3"), "{sql}");
        assert!(sql.contains("ORDER BY published_at"), "{sql}");
    }
}
