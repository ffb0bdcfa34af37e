//! Versioned schema, applied when a store opens the file.
//!
//! Each migration runs once, in the same `BEGIN IMMEDIATE` transaction that records its version
//! in `outbox_schema_version`, so two processes opening one new file cannot both apply it, and a
//! crash half-way leaves the previous version intact. A file whose version is newer than this
//! code knows is refused: old code writing a newer layout is how durable state gets damaged.

use outbox_core::{ErrorKind, Result, Timestamp};
use rusqlite::{Connection, TransactionBehavior};

use crate::error::{BACKEND, ResultExt, map_commit};

/// The schema version this code creates and understands.
///
/// - 1: outbox rows and the inbox tables.
/// - 2: consumer dead letters keep the whole event (destination, key, headers).
/// - 3: an index on `published_at` of published rows, for retention (`purge_published`).
/// - 4: an index on `(event_key, row_id)` of unpublished keyed rows, for the claim's key order.
pub const SCHEMA_VERSION: i64 = 4;

const V1: &str = r"
CREATE TABLE outbox_rows (
    row_id           INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id         TEXT    NOT NULL UNIQUE,
    destination      TEXT    NOT NULL,
    event_key        TEXT,
    headers          BLOB    NOT NULL,
    payload          BLOB    NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    token            INTEGER NOT NULL DEFAULT 0,
    owner            TEXT,
    lease_expires_at INTEGER,
    available_at     INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    published_token  INTEGER,
    published_at     INTEGER,
    parked_at        INTEGER,
    last_error       TEXT
) STRICT;

-- Serves claim: open rows in row-id order, with the columns the due/lease filter reads.
CREATE INDEX outbox_rows_claim ON outbox_rows (row_id, available_at, lease_expires_at)
    WHERE published_token IS NULL AND parked_at IS NULL;

-- Serves list_parked.
CREATE INDEX outbox_rows_parked ON outbox_rows (row_id) WHERE parked_at IS NOT NULL;

CREATE TABLE outbox_inbox_markers (
    consumer    TEXT    NOT NULL,
    event_id    TEXT    NOT NULL,
    fingerprint BLOB    NOT NULL,
    at          INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
) STRICT, WITHOUT ROWID;

CREATE INDEX outbox_inbox_markers_at ON outbox_inbox_markers (consumer, at);

CREATE TABLE outbox_inbox_versions (
    consumer TEXT    NOT NULL,
    subject  TEXT    NOT NULL,
    version  INTEGER NOT NULL,
    at       INTEGER NOT NULL,
    PRIMARY KEY (consumer, subject)
) STRICT, WITHOUT ROWID;

CREATE TABLE outbox_inbox_ledger (
    consumer TEXT    NOT NULL,
    event_id TEXT    NOT NULL,
    state    TEXT    NOT NULL CHECK (state IN ('attempted', 'done')),
    at       INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
) STRICT, WITHOUT ROWID;

CREATE TABLE outbox_inbox_dead_letters (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer TEXT    NOT NULL,
    event_id TEXT    NOT NULL,
    reason   TEXT    NOT NULL,
    error    TEXT    NOT NULL,
    payload  BLOB    NOT NULL,
    at       INTEGER NOT NULL
) STRICT;

CREATE INDEX outbox_inbox_dead_letters_consumer ON outbox_inbox_dead_letters (consumer, id);

CREATE TABLE outbox_inbox_failures (
    consumer TEXT    NOT NULL,
    event_id TEXT    NOT NULL,
    count    INTEGER NOT NULL,
    at       INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
) STRICT, WITHOUT ROWID;
";

/// Consumer dead letters keep the whole delivered event, so that a replay is faithful. Version 1
/// kept only the event id and payload: its records get destination
/// [`UNKNOWN_DESTINATION`](outbox_core::inbox::UNKNOWN_DESTINATION) (a replay tool asks the
/// operator where to send them), no key, and no headers (`x'0100000000'` is
/// [`encode_headers`](outbox_core::event::encode_headers) of none). The defaults only fill
/// existing rows; every write supplies all three.
const V2: &str = r"
ALTER TABLE outbox_inbox_dead_letters ADD COLUMN destination TEXT NOT NULL DEFAULT '_outbox.unknown-destination';
ALTER TABLE outbox_inbox_dead_letters ADD COLUMN event_key TEXT;
ALTER TABLE outbox_inbox_dead_letters ADD COLUMN headers BLOB NOT NULL DEFAULT x'0100000000';
";

/// Serves retention: published rows, oldest publication first, without reading the open ones.
const V3: &str = r"
CREATE INDEX outbox_rows_published ON outbox_rows (published_at) WHERE published_at IS NOT NULL;
";

/// Serves the claim's key order: a key's unpublished rows (parked ones too, which block their key
/// under `ParkedHead::Block`) in row order; rows without a key never enter it.
const V4: &str = r"
CREATE INDEX outbox_rows_key_open ON outbox_rows (event_key, row_id)
    WHERE published_token IS NULL AND event_key IS NOT NULL;
";

/// `(version, SQL)`, ascending; the last version is [`SCHEMA_VERSION`].
const MIGRATIONS: &[(i64, &str)] = &[(1, V1), (2, V2), (3, V3), (4, V4)];

/// Bring the file to [`SCHEMA_VERSION`]; returns the version found before.
pub(crate) fn migrate(conn: &mut Connection, now: Timestamp) -> Result<i64> {
    let what = "migrate the schema";
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).ctx(what)?;
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS outbox_schema_version (
            version    INTEGER PRIMARY KEY,
            applied_at INTEGER NOT NULL
        ) STRICT;",
    )
    .ctx(what)?;
    let found: i64 =
        tx.query_row("SELECT COALESCE(MAX(version), 0) FROM outbox_schema_version", [], |r| r.get(0)).ctx(what)?;
    if found > SCHEMA_VERSION {
        return Err(outbox_core::Error::permanent(
            ErrorKind::Corrupt,
            BACKEND,
            format!(
                "the database has outbox schema version {found}, newer than version {SCHEMA_VERSION} that this \
                 code knows; refusing to use it (upgrade outbox-store-sqlite)"
            ),
        ));
    }
    for &(version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > found) {
        tx.execute_batch(sql).ctx(&format!("apply schema version {version}"))?;
        tx.execute("INSERT INTO outbox_schema_version (version, applied_at) VALUES (?1, ?2)", (version, now.0))
            .ctx(what)?;
        tracing::info!(target: "outbox.sqlite", version, "applied schema migration");
    }
    tx.commit().map_err(|e| map_commit(what, e))?;
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_ascending_and_end_at_the_current_one() {
        assert!(MIGRATIONS.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(MIGRATIONS.last().map(|m| m.0), Some(SCHEMA_VERSION));
    }

    #[test]
    fn v2_defaults_are_the_unknown_destination_and_no_headers() {
        // Frozen text; these are what the literals must stay equal to.
        assert!(V2.contains(&format!("'{}'", outbox_core::inbox::UNKNOWN_DESTINATION)));
        let none = outbox_core::event::encode_headers(&outbox_core::Headers::new());
        let hex: String = none.iter().map(|b| format!("{b:02x}")).collect();
        assert!(V2.contains(&format!("x'{hex}'")), "{hex}");
        assert!(outbox_core::Destination::new(outbox_core::inbox::UNKNOWN_DESTINATION).is_ok());
    }
}
