//! This crate's half of the conformance suite, so the suite can judge SQLite with any broker:
//! the crate's own run pairs it with the in-process broker, the store × broker matrix and
//! `outbox conformance --store sqlite --broker …` with real ones.
//!
//! Every fixture gets two fresh files (the producer's database and the consumer's), so cases
//! run in parallel and nothing leaks between them. The suite opens thousands of files, so they
//! go to a RAM-backed directory where there is one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use outbox_conformance_tests::world::unique_tag;
use outbox_conformance_tests::{EffectRow, EffectTable, StoreFixture, StoreHarness};
use outbox_core::{Error, ErrorKind, EventId, ManualClock, ParkedHead, Result};
use rusqlite::params;

use crate::{SqliteConfig, SqliteStore, SqliteTx, Synchronous};

/// SQLite outbox and inbox, two files per fixture under one directory.
#[derive(Debug)]
pub struct SqliteStoreHarness {
    dir: Dir,
}

#[derive(Debug)]
enum Dir {
    /// Deleted with the harness.
    Temp(tempfile::TempDir),
    /// Given by the caller; kept.
    Given(PathBuf),
}

impl SqliteStoreHarness {
    /// Files in a fresh temporary directory (under `/dev/shm` where it exists), deleted with the
    /// harness.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] when no temporary directory can be created.
    pub fn temporary() -> Result<Self> {
        let shm = Path::new("/dev/shm");
        let dir = if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() };
        let dir = dir.map_err(|e| {
            Error::permanent(ErrorKind::Config, "sqlite", format!("cannot create a temporary directory: {e}"))
        })?;
        Ok(Self { dir: Dir::Temp(dir) })
    }

    /// Files in `dir` (created if missing, kept afterwards).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] when the directory cannot be created.
    pub fn in_dir(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| {
            Error::permanent(ErrorKind::Config, "sqlite", format!("cannot create {}: {e}", dir.display()))
        })?;
        Ok(Self { dir: Dir::Given(dir) })
    }

    /// The directory the fixtures' files go to.
    pub fn dir(&self) -> &Path {
        match &self.dir {
            Dir::Temp(d) => d.path(),
            Dir::Given(p) => p,
        }
    }

    fn file(&self, case: &str, tag: &str, role: &str) -> PathBuf {
        self.dir().join(format!("{case}-{tag}-{role}.db"))
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
impl StoreHarness for SqliteStoreHarness {
    type Inbox = SqliteStore;

    fn name(&self) -> String {
        "sqlite store + sqlite inbox".into()
    }

    fn exhaustive(&self) -> bool {
        // Files in RAM: cheap enough for the exhaustive exploration within the reference bounds.
        true
    }

    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<StoreFixture<SqliteStore>> {
        self.fixture_with_parked_head(case, clock, ParkedHead::Block).await
    }

    fn configures_parked_head(&self) -> bool {
        true
    }

    async fn fixture_with_parked_head(
        &self,
        case: &str,
        clock: ManualClock,
        parked_head: ParkedHead,
    ) -> Result<StoreFixture<SqliteStore>> {
        let tag = unique_tag();
        let config = |role| {
            SqliteConfig::new(self.file(case, &tag, role))
                .with_synchronous(Synchronous::Normal)
                .with_parked_head(parked_head)
        };
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
        Ok(StoreFixture::new(Arc::new(outbox), inbox.clone(), Arc::new(SqliteEffects(inbox))))
    }
}
