//! This crate's half of the conformance suite, so the suite can judge PostgreSQL with any
//! broker: the crate's own run pairs it with the in-process broker, the store × broker matrix
//! and `outbox conformance --store postgres://… --broker …` with real ones.
//!
//! Every fixture migrates a fresh schema (cases run in parallel and re-run on a dirty server);
//! the harness remembers them and drops them all when it is dropped, after the run.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use outbox_conformance_tests::world::unique_tag;
use outbox_conformance_tests::{EffectRow, EffectTable, StoreFixture, StoreHarness};
use outbox_core::{EventId, ManualClock, ParkedHead, Result};
use sqlx::{AssertSqlSafe, Connection, PgPool, Row};

use crate::{PgConfig, PgInbox, PgStore, PgTx, map_error};

/// PostgreSQL outbox and inbox, one fresh schema per fixture.
pub struct PgStoreHarness {
    base: PgConfig,
    created: Mutex<Vec<PgConfig>>,
}

impl std::fmt::Debug for PgStoreHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStoreHarness").field("server", &self.base.redacted_url()).finish_non_exhaustive()
    }
}

impl PgStoreHarness {
    /// Fixtures on the server of `base` (its schema is replaced by a fresh one per fixture).
    pub fn new(base: PgConfig) -> Self {
        Self { base, created: Mutex::new(Vec::new()) }
    }

    fn created(&self) -> std::sync::MutexGuard<'_, Vec<PgConfig>> {
        self.created.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Drop every schema the fixtures created. The suite's runtimes are gone by then, but a
    /// connection they left open may still hold a transaction: end the sessions of each schema
    /// (they carry its name as `application_name`) first.
    async fn drop_schemas(configs: Vec<PgConfig>) -> std::result::Result<(), String> {
        let Some(first) = configs.first() else { return Ok(()) };
        let options =
            first.connect_options().map_err(|e| e.to_string())?.application_name("outbox-conformance-cleanup");
        let mut conn = sqlx::PgConnection::connect_with(&options).await.map_err(|e| format!("connect: {e}"))?;
        sqlx::query("SET lock_timeout = '10s'").execute(&mut conn).await.map_err(|e| e.to_string())?;
        for config in &configs {
            let schema = config.schema();
            let ended = sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = $1 AND pid <> pg_backend_pid()",
            )
            .bind(schema)
            .execute(&mut conn)
            .await;
            let dropped = match ended {
                Ok(_) => sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE")))
                    .execute(&mut conn)
                    .await
                    .map(|_| ()),
                Err(e) => Err(e),
            };
            if let Err(e) = dropped {
                eprintln!("could not drop the conformance schema {schema}: {e}");
            }
        }
        let _ = conn.close().await;
        Ok(())
    }
}

impl Drop for PgStoreHarness {
    fn drop(&mut self) {
        let configs = std::mem::take(&mut *self.created());
        if configs.is_empty() {
            return;
        }
        // Drop may run inside a runtime (which cannot block on another): clean up on a thread.
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("cannot build a runtime: {e}"))?;
            rt.block_on(Self::drop_schemas(configs))
        });
        match handle.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("could not drop the conformance schemas: {e}"),
            Err(_) => eprintln!("could not drop the conformance schemas: the cleanup thread panicked"),
        }
    }
}

/// `suite_effects` in the fixture's schema, written on the inbox transaction.
struct PgEffects {
    pool: PgPool,
    table: String,
}

#[async_trait]
impl EffectTable<PgInbox> for PgEffects {
    async fn insert(&self, tx: &mut PgTx, row: &EffectRow) -> Result<()> {
        let sql = format!("INSERT INTO {} (consumer, event_id, subject, value) VALUES ($1, $2, $3, $4)", self.table);
        sqlx::query(AssertSqlSafe(sql))
            .bind(&row.consumer)
            .bind(row.event_id.as_str())
            .bind(&row.subject)
            .bind(row.value)
            .execute(&mut **tx)
            .await
            .map_err(map_error)?;
        Ok(())
    }

    async fn rows(&self) -> Result<Vec<EffectRow>> {
        let sql = format!("SELECT consumer, event_id, subject, value FROM {} ORDER BY seq", self.table);
        let rows = sqlx::query(AssertSqlSafe(sql)).fetch_all(&self.pool).await.map_err(map_error)?;
        rows.iter()
            .map(|r| {
                Ok(EffectRow {
                    consumer: r.try_get(0).map_err(map_error)?,
                    event_id: EventId::new(r.try_get::<String, _>(1).map_err(map_error)?)?,
                    subject: r.try_get(2).map_err(map_error)?,
                    value: r.try_get(3).map_err(map_error)?,
                })
            })
            .collect()
    }
}

#[async_trait]
impl StoreHarness for PgStoreHarness {
    type Inbox = PgInbox;

    fn name(&self) -> String {
        "postgres store + postgres inbox".into()
    }

    fn exhaustive(&self) -> bool {
        // A schema and a migration per path: too slow for thousands of paths.
        false
    }

    fn sampled_iterations(&self) -> u32 {
        120
    }

    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<StoreFixture<PgInbox>> {
        self.fixture_with_parked_head(case, clock, ParkedHead::Block).await
    }

    fn configures_parked_head(&self) -> bool {
        true
    }

    async fn fixture_with_parked_head(
        &self,
        _case: &str,
        clock: ManualClock,
        parked_head: ParkedHead,
    ) -> Result<StoreFixture<PgInbox>> {
        let schema = format!("obt_suite_{}", unique_tag());
        let config = self
            .base
            .clone()
            .with_application_name(schema.clone())
            .with_schema(schema)
            .with_pool_size(4)
            .with_lock_timeout(Duration::from_secs(5))
            .with_parked_head(parked_head);
        self.created().push(config.clone());
        let store = PgStore::connect_with_clock(config, Arc::new(clock)).await?;
        store.migrate().await?;
        let table = store.tables().app_table("suite_effects")?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {table} (seq bigserial PRIMARY KEY, consumer text NOT NULL, event_id text NOT NULL,
                                   subject text NOT NULL, value bigint NOT NULL)"
        )))
        .execute(store.pool())
        .await
        .map_err(map_error)?;
        let effects = PgEffects { pool: store.pool().clone(), table };
        Ok(StoreFixture::new(Arc::new(store.clone()), store.inbox(), Arc::new(effects)))
    }
}
