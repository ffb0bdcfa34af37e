//! Errors from SQLite name the backend and the operation and keep rusqlite's error as their
//! source. (SQLite has no credentials, so there is no authentication failure to classify.)

use std::error::Error as _;

use outbox_core::ErrorKind;
use outbox_store_sqlite::{SqliteConfig, SqliteStore};

#[tokio::test]
async fn a_file_that_is_not_a_database_is_a_named_permanent_error_with_its_source() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("not-a-database.db");
    std::fs::write(&path, vec![0x5a_u8; 8192]).expect("write the file");
    let err = SqliteStore::open(SqliteConfig::new(&path)).await.expect_err("not a database");
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err} / {err:?}");
    assert!(err.is_permanent(), "{err}");
    assert_eq!(err.backend(), "sqlite");
    assert!(err.operation().is_some(), "the operation is named: {err:?}");
    assert!(err.to_string().starts_with(&format!("sqlite: {} failed: ", err.operation().unwrap_or_default())), "{err}");
    assert!(err.source().is_some(), "rusqlite's error is kept: {err:?}");
}
