//! Shared helpers: a fresh database file per test, a manual clock, event builders.
#![allow(dead_code)]

use std::sync::Arc;

use outbox_core::{Destination, Event, EventId, ManualClock};
use outbox_store_sqlite::{SqliteConfig, SqliteStore};

pub(crate) struct Db {
    pub(crate) store: SqliteStore,
    pub(crate) clock: ManualClock,
    pub(crate) dir: tempfile::TempDir,
}

impl Db {
    pub(crate) fn config(&self) -> SqliteConfig {
        self.store.config().clone()
    }
}

pub(crate) fn config_in(dir: &tempfile::TempDir) -> SqliteConfig {
    SqliteConfig::new(dir.path().join("outbox.db"))
}

pub(crate) async fn open() -> Db {
    open_with(|c| c).await
}

pub(crate) async fn open_with(tweak: impl FnOnce(SqliteConfig) -> SqliteConfig) -> Db {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::default();
    let store =
        SqliteStore::open_with_clock(tweak(config_in(&dir)), Arc::new(clock.clone())).await.expect("open store");
    Db { store, clock, dir }
}

pub(crate) fn id(s: &str) -> EventId {
    EventId::new(s).expect("event id")
}

pub(crate) fn dest() -> Destination {
    Destination::new("orders").expect("destination")
}

pub(crate) fn event(event_id: &str, payload: &[u8]) -> Event {
    Event::new(id(event_id), dest(), payload.to_vec())
}
