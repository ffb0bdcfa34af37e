//! The whole conformance suite against the real PostgreSQL server: outbox store and inbox in a
//! fresh schema per fixture (dropped when the run ends), with the in-process reference broker.
//! Permutations are sampled by seed (`OUTBOX_TEST_SEED` replays a run).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_conformance_tests::reference::memory_capabilities;
use outbox_conformance_tests::{Capabilities, EffectRow, EffectTable, Fixture, Harness};
use outbox_core::memory::MemoryBroker;
use outbox_core::{Destination, EventId, ManualClock, Result};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe, PgPool, Row};
use outbox_store_postgres::{PgConfig, PgInbox, PgStore, PgTx, map_error};

/// Harness over PostgreSQL; remembers every schema it created and drops them at the end.
struct PgHarness {
    created: Mutex<Vec<PgConfig>>,
}

impl Drop for PgHarness {
    fn drop(&mut self) {
        let created = std::mem::take(&mut *self.created.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        for config in created {
            common::drop_schema(config);
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
impl Harness for PgHarness {
    type Inbox = PgInbox;

    fn name(&self) -> String {
        "postgres store + postgres inbox + memory broker".into()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { exhaustive: false, sampled_iterations: 120, ..memory_capabilities() }
    }

    async fn fixture(&self, _case: &str, clock: ManualClock) -> Result<Fixture<PgInbox>> {
        let schema = common::unique_schema("suite");
        let config = common::base_config()
            .with_application_name(schema.clone())
            .with_schema(schema)
            .with_pool_size(4)
            .with_lock_timeout(Duration::from_secs(5));
        self.created.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(config.clone());
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
        Ok(Fixture::new(
            Arc::new(store.clone()),
            Arc::new(MemoryBroker::new()),
            store.inbox(),
            Arc::new(effects),
            Destination::new("suite")?,
        ))
    }
}

fn main() -> std::process::ExitCode {
    if !common::pg_available() {
        return std::process::ExitCode::SUCCESS;
    }
    outbox_conformance_tests::main(PgHarness { created: Mutex::default() })
}
