//! The conformance harness for SQLite: shared by this crate's `conformance` test and by the
//! `outbox conformance` command, which includes this file.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_conformance_tests::reference::memory_capabilities;
use outbox_conformance_tests::world::unique_tag;
use outbox_conformance_tests::{Capabilities, EffectRow, EffectTable, Fixture, Harness};
use outbox_core::memory::MemoryBroker;
use outbox_core::{Destination, EventId, ManualClock, Result};
use outbox_store_sqlite::rusqlite::params;
use outbox_store_sqlite::{SqliteConfig, SqliteStore, SqliteTx, Synchronous};

/// SQLite outbox and inbox (two files per fixture: the producer's and the consumer's
/// database) with the in-process reference broker.
pub(crate) struct SqliteHarness {
    dir: tempfile::TempDir,
}

impl SqliteHarness {
    /// Files go to a fresh temporary directory (in RAM where `/dev/shm` exists).
    pub(crate) fn new() -> Self {
        // A RAM-backed directory where there is one: the suite opens thousands of files.
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() };
        Self { dir: dir.expect("temporary directory") }
    }

    fn file(&self, case: &str, tag: &str, role: &str) -> PathBuf {
        self.dir.path().join(format!("{case}-{tag}-{role}.db"))
    }
}

/// The effect table `suite_effects` in the consumer's database.
struct SqliteEffects(SqliteStore);

#[async_trait]
impl EffectTable<SqliteStore> for SqliteEffects {
    async fn insert(&self, tx: &mut SqliteTx, row: &EffectRow) -> Result<()> {
        let r = row.clone();
        tx.run(move |c| {
            c.execute(
                "INSERT INTO suite_effects (consumer, event_id, subject, value) VALUES (?1, ?2, ?3, ?4)",
                params![r.consumer, r.event_id.as_str(), r.subject, r.value],
            )
        })
        .await?;
        Ok(())
    }

    async fn rows(&self) -> Result<Vec<EffectRow>> {
        let raw: Vec<(String, String, String, i64)> = self
            .0
            .with_connection(|c| {
                let mut s = c.prepare("SELECT consumer, event_id, subject, value FROM suite_effects ORDER BY seq")?;
                let rows = s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
                rows.collect()
            })
            .await?;
        raw.into_iter()
            .map(|(consumer, id, subject, value)| {
                Ok(EffectRow { consumer, event_id: EventId::new(id)?, subject, value })
            })
            .collect()
    }
}

#[async_trait]
impl Harness for SqliteHarness {
    type Inbox = SqliteStore;

    fn name(&self) -> String {
        "sqlite store + sqlite inbox + memory broker".into()
    }

    fn capabilities(&self) -> Capabilities {
        // The in-process broker: every broker case applies. Fixtures are files in RAM, cheap
        // enough for the exhaustive exploration within the reference bounds.
        Capabilities { delivery_wait: Duration::ZERO, ..memory_capabilities() }
    }

    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<Fixture<SqliteStore>> {
        let tag = unique_tag();
        let config = |role| SqliteConfig::new(self.file(case, &tag, role)).with_synchronous(Synchronous::Normal);
        let outbox = SqliteStore::open_with_clock(config("outbox"), Arc::new(clock.clone())).await?;
        let inbox = SqliteStore::open_with_clock(config("inbox"), Arc::new(clock)).await?;
        inbox
            .with_connection(|c| {
                c.execute_batch(
                    "CREATE TABLE IF NOT EXISTS suite_effects (
                        seq INTEGER PRIMARY KEY AUTOINCREMENT,
                        consumer TEXT NOT NULL, event_id TEXT NOT NULL, subject TEXT NOT NULL, value INTEGER NOT NULL)",
                )
            })
            .await?;
        Ok(Fixture::new(
            Arc::new(outbox),
            Arc::new(MemoryBroker::new()),
            inbox.clone(),
            Arc::new(SqliteEffects(inbox)),
            Destination::new("suite")?,
        ))
    }
}
