//! The explicit schema story, the same as SQLite's: `connect` leaves the database alone,
//! `check_schema` says what is missing, `migrate` brings it up, `open` is `connect` + `migrate`,
//! and the store's methods enqueue in the caller's transaction with its payload limit.

mod common;

use common::{base_config, drop_schema, event, pg_available, unique_schema};
use outbox_core::store::all_rows;
use outbox_core::{ErrorKind, InboxAdmin};
use outbox_store_postgres::{PgStore, SCHEMA_VERSION, map_commit_error, map_error};

#[tokio::test]
async fn connect_check_migrate_open_and_enqueue_in() {
    if !pg_available() {
        return;
    }
    let schema = unique_schema("story");
    let config = base_config().with_schema(schema.clone()).with_application_name(schema.clone()).with_max_payload(16);
    let store = PgStore::connect(config.clone()).await.unwrap();
    let err = store.check_schema().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("migrate"), "{err}");
    assert_eq!(store.schema_version().await.unwrap(), None, "connect changes no schema");

    let opened = PgStore::open(config.clone()).await.unwrap();
    opened.check_schema().await.unwrap();
    store.check_schema().await.unwrap();
    assert_eq!(store.migrate().await.unwrap(), SCHEMA_VERSION, "idempotent after open");
    assert!(store.inbox().markers("billing").await.unwrap().is_empty());

    let mut tx = store.pool().begin().await.map_err(map_error).unwrap();
    let row = store.enqueue_one_in(&mut tx, &event("a", b"1")).await.unwrap();
    let err = store.enqueue_in(&mut tx, &[event("big", &[0; 17])]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "the store's max_payload: {err}");
    tx.commit().await.map_err(map_commit_error).unwrap();
    assert_eq!(all_rows(&store).await.unwrap().iter().map(|r| r.row_id).collect::<Vec<_>>(), vec![row]);

    opened.close().await;
    store.close().await;
    drop_schema(config);
}
