//! Migrations, identifier validation and error mapping against a real PostgreSQL server.

mod common;

use std::time::{Duration, Instant};

use common::{TestDb, base_config, drop_schema, event, pg_available, unique_schema};
use outbox_core::{ErrorKind, Inbox, InboxAdmin, OutboxAdmin, OutboxStore, Retry};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe};
use outbox_store_postgres::{MAX_PREFIX_LEN, PgConfig, PgStore, SCHEMA_VERSION, is_unique_violation, map_error};

#[tokio::test]
async fn migrations_are_idempotent_and_refuse_a_newer_schema() {
    let Some(db) = TestDb::new("mig").await else { return };
    let tables = db.store.tables();
    assert_eq!(db.store.schema_version().await.unwrap(), Some(SCHEMA_VERSION));
    assert_eq!(db.store.migrate().await.unwrap(), SCHEMA_VERSION);
    assert_eq!(db.store.migrate().await.unwrap(), SCHEMA_VERSION);
    let versions = tables.table("schema_version").unwrap();
    assert_eq!(db.count(format!("SELECT count(*) FROM {versions}")).await, i64::from(SCHEMA_VERSION));

    // Every table and the partial index exist where the config says.
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 ORDER BY 1",
    )
    .bind(db.schema())
    .fetch_all(db.store.pool())
    .await
    .unwrap();
    for expected in [
        "outbox_events",
        "outbox_events_claimable",
        "outbox_inbox_markers",
        "outbox_inbox_versions",
        "outbox_inbox_ledger",
        "outbox_inbox_failures",
        "outbox_dead_letters",
        "outbox_schema_version",
    ] {
        assert!(names.iter().any(|n| n == expected), "{expected} missing from {names:?}");
    }
    let predicate: String =
        sqlx::query_scalar("SELECT pg_get_expr(indpred, indrelid) FROM pg_index WHERE indexrelid = to_regclass($1)")
            .bind(tables.table("events_claimable").unwrap())
            .fetch_one(db.store.pool())
            .await
            .unwrap();
    assert_eq!(predicate, "((published_at IS NULL) AND (parked_at IS NULL))");

    // A second store with another prefix in the same schema is independent.
    let other = PgStore::connect(db.config.clone().with_table_prefix("second_")).await.unwrap();
    other.migrate().await.unwrap();
    other.enqueue(&[event("x", b"")]).await.unwrap();
    assert_eq!(db.store.stats().await.unwrap().pending, 0);
    assert_eq!(other.stats().await.unwrap().pending, 1);

    // A database migrated by a newer library is refused, and nothing is changed.
    db.exec(format!("INSERT INTO {versions} (version) VALUES ({})", SCHEMA_VERSION + 1)).await;
    let err = db.store.migrate().await.unwrap_err();
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Corrupt, Retry::Permanent));
    assert!(err.message().contains("newer"), "{err}");
    assert_eq!(db.count(format!("SELECT count(*) FROM {versions}")).await, i64::from(SCHEMA_VERSION) + 1);
}

#[tokio::test]
async fn concurrent_migrations_of_a_new_schema_agree() {
    if !pg_available() {
        return;
    }
    let schema = unique_schema("migrace");
    let config = base_config().with_application_name(schema.clone()).with_schema(schema);
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let config = config.clone();
        tasks.push(tokio::spawn(async move { PgStore::connect(config).await.unwrap().migrate().await }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), SCHEMA_VERSION);
    }
    let store = PgStore::connect(config.clone()).await.unwrap();
    assert_eq!(store.schema_version().await.unwrap(), Some(SCHEMA_VERSION));
    drop_schema(config);
}

#[tokio::test]
async fn bad_identifiers_are_rejected_before_any_sql() {
    // An unreachable server: a Config error (not Connection) proves nothing was attempted.
    let unreachable = PgConfig::from_url("postgres://postgres@127.0.0.1:1/test").unwrap();
    let too_long = "p".repeat(MAX_PREFIX_LEN + 1);
    for bad in ["Bad-Name", "x; drop table", "", "1x", "a\"b"] {
        let err = PgStore::connect(unreachable.clone().with_schema(bad)).await.unwrap_err();
        assert_eq!((err.kind(), err.retry()), (ErrorKind::Config, Retry::Permanent), "schema {bad:?}: {err}");
        let err = PgStore::connect(unreachable.clone().with_table_prefix(bad)).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config, "prefix {bad:?}: {err}");
    }
    let err = PgStore::connect(unreachable.clone().with_table_prefix(too_long)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.message().contains("longer than the limit"), "{err}");
    let err = PgStore::connect(unreachable.clone().with_schema("s".repeat(64))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    let err = PgConfig::from_url("postgres://h/db?outbox_table_prefix=x;drop").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);

    if !pg_available() {
        return;
    }
    // With a real pool too: from_pool validates without touching the server.
    let pool = base_config().pool_options().connect_lazy_with(base_config().connect_options().unwrap());
    let err = PgStore::from_pool(pool, base_config().with_table_prefix("Bad-Name")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    // The longest allowed prefix works end to end (every derived name fits in 63 bytes).
    let longest = "p".repeat(MAX_PREFIX_LEN);
    let Some(db) = TestDb::open("longprefix", None, |c| c.with_table_prefix(&longest)).await else { return };
    db.store.enqueue(&[event("long", b"")]).await.unwrap();
    assert_eq!(db.store.claim("a", 1, Duration::from_secs(1)).await.unwrap().len(), 1);
}

#[tokio::test]
async fn unique_violation_maps_to_conflict() {
    let Some(db) = TestDb::new("uniq").await else { return };
    let table = db.store.tables().app_table("things").unwrap();
    db.exec(format!("CREATE TABLE {table} (id int PRIMARY KEY)")).await;
    let insert = || sqlx::query(AssertSqlSafe(format!("INSERT INTO {table} VALUES (1)")));
    insert().execute(db.store.pool()).await.unwrap();
    let raw = insert().execute(db.store.pool()).await.unwrap_err();
    assert!(is_unique_violation(&raw));
    let err = map_error(raw);
    assert_eq!((err.kind(), err.retry(), err.backend()), (ErrorKind::Conflict, Retry::Permanent, "postgres"));
    assert!(err.message().contains("23505"), "{err}");
}

#[tokio::test]
async fn unreachable_server_is_a_quick_transient_connection_error() {
    let config = PgConfig::from_url("postgres://postgres:secret@127.0.0.1:1/test").unwrap();
    let started = Instant::now();
    let err = PgStore::connect(config).await.unwrap_err();
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Connection, Retry::Transient), "{err}");
    assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
    assert!(!err.to_string().contains("secret"), "{err}");
}

#[tokio::test]
async fn statement_and_lock_timeouts_are_transient() {
    let Some(db) = TestDb::open("timeouts", None, |c| {
        c.with_statement_timeout(Duration::from_millis(200)).with_lock_timeout(Duration::from_millis(100))
    })
    .await
    else {
        return;
    };
    // Statement timeout (57014).
    let raw = sqlx::query("SELECT pg_sleep(2)").execute(db.store.pool()).await.unwrap_err();
    let err = map_error(raw);
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Timeout, Retry::Transient), "{err}");

    // Lock timeout (55P03): a row held by another transaction.
    db.store.enqueue(&[event("locked", b"")]).await.unwrap();
    let c = db.store.claim("a", 1, Duration::from_secs(60)).await.unwrap().remove(0);
    let mut holder = db.store.pool().begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!("SELECT 1 FROM {} FOR UPDATE", db.store.tables().table("events").unwrap())))
        .execute(&mut *holder)
        .await
        .unwrap();
    let err = db.store.complete(c.record.row_id, &c.lease).await.unwrap_err();
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Busy, Retry::Transient), "{err}");
    holder.rollback().await.unwrap();
    assert_eq!(db.store.complete(c.record.row_id, &c.lease).await.unwrap(), outbox_core::Completion::Published);
}

#[tokio::test]
async fn connection_lost_before_commit_is_outcome_unknown_and_nothing_is_durable() {
    let Some(db) = TestDb::new("commitlost").await else { return };
    let inbox = db.store.inbox();
    let e = event("lost-1", b"");
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(inbox.mark(&mut tx, "c", &e.id, &e.fingerprint()).await.unwrap(), outbox_core::MarkOutcome::New);
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *tx).await.unwrap();
    let killed: bool =
        sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(pid).fetch_one(db.store.pool()).await.unwrap();
    assert!(killed);
    let err = inbox.commit(tx).await.unwrap_err();
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Connection, Retry::OutcomeUnknown), "{err}");
    assert!(inbox.markers("c").await.unwrap().is_empty());
}

#[tokio::test]
async fn tls_connection_with_sslmode_require() {
    if !pg_available() {
        return;
    }
    let url = outbox_conformance_tests::pg_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    let config = PgConfig::from_url(&format!("{url}{sep}sslmode=require")).unwrap();
    let store = match PgStore::connect(config).await {
        Ok(store) => store,
        Err(e) => {
            eprintln!("SKIPPED: the server does not offer TLS ({e})");
            return;
        }
    };
    let encrypted: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(encrypted, "sslmode=require gave an unencrypted connection");
}
