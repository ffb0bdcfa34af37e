use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::{BACKEND, lock};
use crate::clock::{SharedClock, SystemClock, Timestamp};
use crate::error::{Error, ErrorKind, Result};
use crate::event::{EventId, Fingerprint};
use crate::inbox::{DeadLetter, Inbox, InboxAdmin, LedgerState, MarkOutcome, Marker, VersionOutcome};

type Key = (String, EventId);

#[derive(Debug, Default, Clone)]
struct State {
    markers: BTreeMap<Key, Marker>,
    versions: BTreeMap<(String, String), u64>,
    ledger: BTreeMap<Key, LedgerState>,
    dead: Vec<DeadLetter>,
    /// The id of the last dead letter written (ids start at 1, like a database sequence).
    last_dead_id: i64,
    failures: BTreeMap<Key, u32>,
    tables: BTreeMap<String, Vec<Vec<u8>>>,
}

/// An open transaction on a [`MemoryInbox`]: writes are staged here and applied atomically on
/// commit, after checking that nothing it read changed meanwhile (optimistic concurrency, which
/// makes a concurrent duplicate marker fail at commit like a unique-key violation).
#[derive(Debug, Default)]
pub struct MemoryTx {
    markers: Vec<Marker>,
    /// (key, version read, new version)
    versions: Vec<((String, String), Option<u64>, u64)>,
    /// (key, state read, new state)
    ledger: Vec<(Key, LedgerState, LedgerState)>,
    dead: Vec<DeadLetter>,
    rows: Vec<(String, Vec<u8>)>,
}

impl MemoryTx {
    /// Append a row to an application table in this transaction: the in-memory stand-in for the
    /// business effect's SQL.
    pub fn insert(&mut self, table: &str, row: Vec<u8>) {
        self.rows.push((table.to_string(), row));
    }
}

/// The reference [`Inbox`]: markers, projection versions, the notification ledger, dead letters
/// and application tables, committed all-or-nothing.
#[derive(Debug, Clone)]
pub struct MemoryInbox {
    state: Arc<Mutex<State>>,
    clock: SharedClock,
}

impl Default for MemoryInbox {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock))
    }
}

impl MemoryInbox {
    /// An empty inbox on `clock`.
    pub fn new(clock: SharedClock) -> Self {
        Self { state: Arc::default(), clock }
    }

    /// Committed rows of an application table, in insertion order.
    pub fn table(&self, table: &str) -> Vec<Vec<u8>> {
        lock(&self.state).tables.get(table).cloned().unwrap_or_default()
    }

    /// Committed projection version of `(consumer, subject)`.
    pub fn version(&self, consumer: &str, subject: &str) -> Option<u64> {
        lock(&self.state).versions.get(&(consumer.to_string(), subject.to_string())).copied()
    }

    /// Committed ledger state.
    pub fn ledger(&self, consumer: &str, event_id: &EventId) -> LedgerState {
        lock(&self.state).ledger.get(&(consumer.to_string(), event_id.clone())).copied().unwrap_or(LedgerState::Fresh)
    }
}

fn write_conflict(what: String) -> Error {
    Error::transient(ErrorKind::Busy, BACKEND, format!("concurrent write conflict on {what}; transaction rolled back"))
}

#[async_trait]
impl InboxAdmin for MemoryInbox {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn markers(&self, consumer: &str) -> Result<Vec<Marker>> {
        Ok(lock(&self.state).markers.values().filter(|m| m.consumer == consumer).cloned().collect())
    }

    async fn dead_letters(&self, consumer: &str) -> Result<Vec<DeadLetter>> {
        Ok(lock(&self.state).dead.iter().filter(|d| d.consumer == consumer).cloned().collect())
    }

    async fn remove_dead_letters(&self, consumer: &str, ids: &[i64]) -> Result<u64> {
        let mut st = lock(&self.state);
        let mut removed = Vec::new();
        st.dead.retain(|d| {
            let gone = d.consumer == consumer && ids.contains(&d.id);
            if gone {
                removed.push(d.event.id.clone());
            }
            !gone
        });
        for event_id in &removed {
            st.failures.remove(&(consumer.to_string(), event_id.clone()));
        }
        Ok(removed.len() as u64)
    }

    async fn prune_markers(&self, consumer: &str, older_than: Duration) -> Result<u64> {
        let now = self.clock.now();
        let mut st = lock(&self.state);
        let before = st.markers.len();
        st.markers.retain(|_, m| !(m.consumer == consumer && now.since(m.at) > older_than));
        Ok((before - st.markers.len()) as u64)
    }
}

#[async_trait]
impl Inbox for MemoryInbox {
    type Tx = MemoryTx;

    async fn begin(&self) -> Result<MemoryTx> {
        Ok(MemoryTx::default())
    }

    async fn commit(&self, tx: MemoryTx) -> Result<()> {
        let now = self.clock.now();
        let mut st = lock(&self.state);
        for m in &tx.markers {
            if st.markers.contains_key(&(m.consumer.clone(), m.event_id.clone())) {
                return Err(write_conflict(format!("marker ({}, {})", m.consumer, m.event_id)));
            }
        }
        for (key, read, _) in &tx.versions {
            if st.versions.get(key).copied() != *read {
                return Err(write_conflict(format!("projection ({}, {})", key.0, key.1)));
            }
        }
        for (key, read, _) in &tx.ledger {
            if st.ledger.get(key).copied().unwrap_or(LedgerState::Fresh) != *read {
                return Err(write_conflict(format!("ledger ({}, {})", key.0, key.1)));
            }
        }
        for mut m in tx.markers {
            m.at = now;
            st.markers.insert((m.consumer.clone(), m.event_id.clone()), m);
        }
        for (key, _, v) in tx.versions {
            st.versions.insert(key, v);
        }
        for (key, _, s) in tx.ledger {
            st.ledger.insert(key, s);
        }
        for mut d in tx.dead {
            st.last_dead_id += 1;
            d.id = st.last_dead_id;
            d.at = now;
            st.dead.push(d);
        }
        for (table, row) in tx.rows {
            st.tables.entry(table).or_default().push(row);
        }
        Ok(())
    }

    async fn mark(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        event_id: &EventId,
        fingerprint: &Fingerprint,
    ) -> Result<MarkOutcome> {
        let existing = tx
            .markers
            .iter()
            .find(|m| m.consumer == consumer && &m.event_id == event_id)
            .map(|m| m.fingerprint)
            .or_else(|| {
                lock(&self.state).markers.get(&(consumer.to_string(), event_id.clone())).map(|m| m.fingerprint)
            });
        Ok(match existing {
            Some(f) if f == *fingerprint => MarkOutcome::Duplicate,
            Some(stored) => MarkOutcome::Conflict { stored },
            None => {
                tx.markers.push(Marker {
                    consumer: consumer.to_string(),
                    event_id: event_id.clone(),
                    fingerprint: *fingerprint,
                    at: Timestamp::default(),
                });
                MarkOutcome::New
            }
        })
    }

    async fn advance_version(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        subject: &str,
        version: u64,
    ) -> Result<VersionOutcome> {
        let key = (consumer.to_string(), subject.to_string());
        let staged = tx.versions.iter().rev().find(|(k, _, _)| *k == key).map(|(_, _, v)| *v);
        let committed = lock(&self.state).versions.get(&key).copied();
        let current = staged.or(committed);
        match current {
            Some(c) if c >= version => Ok(VersionOutcome::Stale { current: c }),
            previous => {
                tx.versions.push((key, committed, version));
                Ok(VersionOutcome::Advanced { previous })
            }
        }
    }

    async fn ledger_state(&self, tx: &mut MemoryTx, consumer: &str, event_id: &EventId) -> Result<LedgerState> {
        let key = (consumer.to_string(), event_id.clone());
        if let Some((_, _, s)) = tx.ledger.iter().rev().find(|(k, _, _)| *k == key) {
            return Ok(*s);
        }
        Ok(lock(&self.state).ledger.get(&key).copied().unwrap_or(LedgerState::Fresh))
    }

    async fn set_ledger_state(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        event_id: &EventId,
        state: LedgerState,
    ) -> Result<()> {
        let key = (consumer.to_string(), event_id.clone());
        let read = lock(&self.state).ledger.get(&key).copied().unwrap_or(LedgerState::Fresh);
        tx.ledger.push((key, read, state));
        Ok(())
    }

    async fn dead_letter(&self, tx: &mut MemoryTx, record: &DeadLetter) -> Result<()> {
        tx.dead.push(record.clone());
        Ok(())
    }

    async fn record_failure(&self, consumer: &str, event_id: &EventId) -> Result<u32> {
        let mut st = lock(&self.state);
        let n = st.failures.entry((consumer.to_string(), event_id.clone())).or_insert(0);
        *n += 1;
        Ok(*n)
    }
}
