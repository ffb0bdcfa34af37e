//! Migrations, pragmas and refusal of files this code must not touch.

mod common;

use std::sync::Arc;

use outbox_core::store::all_rows;
use outbox_core::{ErrorKind, ManualClock, OutboxStore};
use outbox_store_sqlite::{SCHEMA_VERSION, SqliteStore, Synchronous};

fn versions(conn: &rusqlite::Connection) -> Vec<(i64, i64)> {
    let mut stmt = conn.prepare("SELECT version, applied_at FROM outbox_schema_version ORDER BY version").unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().collect::<rusqlite::Result<_>>().unwrap()
}

#[tokio::test]
async fn fresh_database_gets_the_current_schema_in_wal_mode() {
    let db = common::open().await;
    assert_eq!(db.store.schema_version().await.unwrap(), SCHEMA_VERSION);
    let conn = db.store.connect_raw().unwrap();
    let applied: Vec<i64> = versions(&conn).into_iter().map(|(v, _)| v).collect();
    assert_eq!(applied, (1..=SCHEMA_VERSION).collect::<Vec<_>>(), "every version, once");
    let mut stmt = conn.prepare("SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name").unwrap();
    let tables: Vec<String> = stmt.query_map([], |r| r.get(0)).unwrap().collect::<rusqlite::Result<_>>().unwrap();
    for t in [
        "outbox_rows",
        "outbox_schema_version",
        "outbox_inbox_markers",
        "outbox_inbox_versions",
        "outbox_inbox_ledger",
        "outbox_inbox_dead_letters",
        "outbox_inbox_failures",
    ] {
        assert!(tables.iter().any(|n| n == t), "missing table {t} in {tables:?}");
    }
    let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
    assert_eq!(mode, "wal");
    let sync: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
    assert_eq!(sync, 2, "FULL by default");
    let busy: i64 = conn.query_row("PRAGMA busy_timeout", [], |r| r.get(0)).unwrap();
    assert_eq!(busy, 5000);
}

#[tokio::test]
async fn normal_synchronous_is_applied_when_asked() {
    let db = common::open_with(|c| c.with_synchronous(Synchronous::Normal)).await;
    let sync: i64 = db.store.connect_raw().unwrap().query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
    assert_eq!(sync, 1);
}

#[tokio::test]
async fn reopening_is_a_no_op_and_keeps_rows() {
    let db = common::open().await;
    db.store.enqueue(&[common::event("a", b"1")]).await.unwrap();
    let before = versions(&db.store.connect_raw().unwrap());
    db.clock.advance(std::time::Duration::from_secs(60));
    for _ in 0..2 {
        let again = SqliteStore::open_with_clock(db.config(), Arc::new(db.clock.clone())).await.unwrap();
        assert_eq!(again.schema_version().await.unwrap(), SCHEMA_VERSION);
        assert_eq!(versions(&again.connect_raw().unwrap()), before, "no migration re-applied");
        assert_eq!(all_rows(&again).await.unwrap().len(), 1);
    }
}

#[tokio::test]
async fn newer_schema_is_refused_naming_both_versions() {
    let db = common::open().await;
    let newer = SCHEMA_VERSION + 1;
    db.store
        .connect_raw()
        .unwrap()
        .execute("INSERT INTO outbox_schema_version (version, applied_at) VALUES (?1, 0)", [newer])
        .unwrap();
    let err = SqliteStore::open_with_clock(db.config(), Arc::new(ManualClock::default())).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.is_permanent());
    assert_eq!(err.backend(), "sqlite");
    assert!(err.message().contains(&format!("version {newer}")), "{err}");
    assert!(err.message().contains(&format!("version {SCHEMA_VERSION}")), "{err}");
}

#[tokio::test]
async fn a_file_that_is_not_a_database_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::config_in(&dir);
    std::fs::write(&config.path, vec![0x5a; 8192]).unwrap();
    let err = SqliteStore::open(config).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.is_permanent());
}

#[tokio::test]
async fn a_missing_directory_is_a_connection_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = outbox_store_sqlite::SqliteConfig::new(dir.path().join("no/such/dir/outbox.db"));
    let err = SqliteStore::open(config).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
}
