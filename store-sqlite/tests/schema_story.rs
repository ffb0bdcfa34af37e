//! The explicit schema story, the same as PostgreSQL's: `connect` leaves the file alone,
//! `check_schema` says what is missing, `migrate` brings it up (idempotently), `open` is
//! `connect` + `migrate`.

mod common;

use outbox_core::{ErrorKind, InboxAdmin, OutboxStore};
use outbox_store_sqlite::{SCHEMA_VERSION, SqliteInbox, SqliteStore};

#[tokio::test]
async fn connect_does_not_migrate_and_check_schema_names_the_fix() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::connect(common::config_in(&dir)).await.unwrap();
    assert_eq!(store.schema_version().await.unwrap(), 0, "connect changes no schema");
    let err = store.check_schema().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("migrate") && err.to_string().contains("sqlite"), "{err}");
    // Using the unmigrated store fails with an error, it does not create tables on the side.
    assert!(store.enqueue(&[common::event("a", b"1")]).await.is_err());

    assert_eq!(store.migrate().await.unwrap(), SCHEMA_VERSION);
    assert_eq!(store.migrate().await.unwrap(), SCHEMA_VERSION, "idempotent");
    store.check_schema().await.unwrap();
    assert_eq!(store.schema_version().await.unwrap(), SCHEMA_VERSION);
    store.enqueue(&[common::event("a", b"1")]).await.unwrap();

    // The inbox is reached the same way as on PostgreSQL: `store.inbox()`.
    let inbox: SqliteInbox = store.inbox();
    assert_eq!(inbox.markers("billing").await.unwrap(), vec![]);
}

#[tokio::test]
async fn check_schema_refuses_a_newer_file() {
    let db = common::open().await;
    db.store.check_schema().await.unwrap();
    db.store
        .connect_raw()
        .unwrap()
        .execute("INSERT INTO outbox_schema_version (version, applied_at) VALUES (?1, 0)", [SCHEMA_VERSION + 1])
        .unwrap();
    let err = db.store.check_schema().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    let err = db.store.migrate().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
}
