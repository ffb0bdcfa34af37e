//! Shared test setup: one fresh schema per test, dropped when the test ends (also on panic).
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use outbox_conformance_tests::{pg_url, service_addr};
use outbox_core::{Destination, Event, EventId, SharedClock};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe, Connection};
use outbox_store_postgres::{PgConfig, PgStore};

/// `host:port` of the server the tests use (from `OUTBOX_PG_URL`, else the local server).
pub fn server_addr() -> String {
    service_addr(&pg_url())
}

/// `false` (after a loud skip message) when PostgreSQL is not reachable outside CI.
pub fn pg_available() -> bool {
    outbox_conformance_tests::require_service("PostgreSQL", "postgres", &server_addr())
}

/// A schema name no other test, run or process uses.
pub fn unique_schema(tag: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("obt_{tag}_{}_{}_{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed), nanos % 1_000_000)
}

pub fn base_config() -> PgConfig {
    PgConfig::from_url(&pg_url()).expect("test URL is valid")
}

/// A migrated store in a fresh schema; the schema is dropped on drop.
pub struct TestDb {
    pub store: PgStore,
    pub config: PgConfig,
}

impl TestDb {
    pub async fn new(tag: &str) -> Option<Self> {
        Self::open(tag, None, |c| c).await
    }

    pub async fn with_clock(tag: &str, clock: SharedClock) -> Option<Self> {
        Self::open(tag, Some(clock), |c| c).await
    }

    pub async fn open(
        tag: &str,
        clock: Option<SharedClock>,
        adjust: impl FnOnce(PgConfig) -> PgConfig,
    ) -> Option<Self> {
        if !pg_available() {
            return None;
        }
        let schema = unique_schema(tag);
        let config = adjust(base_config().with_application_name(schema.clone()).with_schema(schema));
        let store = match clock {
            Some(clock) => PgStore::connect_with_clock(config.clone(), clock).await,
            None => PgStore::connect(config.clone()).await,
        }
        .expect("connect");
        store.migrate().await.expect("migrate");
        Some(Self { store, config })
    }

    pub fn schema(&self) -> &str {
        self.config.schema()
    }

    /// Run one SQL text (DDL or a statement without parameters) on the pool.
    pub async fn exec(&self, sql: String) {
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(self.store.pool()).await.expect("test SQL");
    }

    pub async fn count(&self, sql: String) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(self.store.pool()).await.expect("count query")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        drop_schema(self.config.clone());
    }
}

/// Drop a test schema from a thread of its own (Drop cannot await).
///
/// The test's runtime is blocked while this runs, so a transaction the test dropped may still be
/// open on a pooled connection (sqlx rolls back on the runtime); end the test's own sessions,
/// which carry the schema name as `application_name`, before dropping.
pub fn drop_schema(config: PgConfig) {
    let schema = config.schema().to_string();
    let handle = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let options = config.connect_options().expect("options").application_name("outbox-test-cleanup");
            let mut conn = sqlx::PgConnection::connect_with(&options).await.expect("connect for cleanup");
            sqlx::query("SET lock_timeout = '10s'").execute(&mut conn).await.expect("set lock_timeout");
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = $1 AND pid <> pg_backend_pid()",
            )
            .bind(&schema)
            .execute(&mut conn)
            .await
            .expect("end the test's sessions");
            sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE")))
                .execute(&mut conn)
                .await
                .expect("drop schema");
            let _ = conn.close().await;
        });
    });
    if handle.join().is_err() {
        eprintln!("could not drop test schema");
    }
}

pub fn dest() -> Destination {
    Destination::new("orders").unwrap()
}

pub fn event(id: &str, payload: &[u8]) -> Event {
    Event::new(EventId::new(id).unwrap(), dest(), payload.to_vec())
}

pub fn arc_clock(clock: &outbox_core::ManualClock) -> SharedClock {
    Arc::new(clock.clone())
}
