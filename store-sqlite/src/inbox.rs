//! The consumer side: marker and business effect in one SQLite transaction.
//!
//! A [`SqliteTx`] owns one pooled connection with an open `BEGIN IMMEDIATE` transaction. Taking
//! the write lock at `begin` is what serializes two deliveries of one event: the second
//! transaction starts only after the first committed or rolled back, so its `mark` sees the
//! first marker and reports a duplicate instead of both applying the effect. The handler runs
//! its effect on the same connection through [`SqliteTx::run`], so marker and effect commit or
//! vanish together.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::event::{decode_headers, encode_headers};
use outbox_core::{
    DeadLetter, DeadLetterReason, Destination, Error, ErrorKind, Event, EventId, Fingerprint, Inbox, InboxAdmin,
    LedgerState, MarkOutcome, Marker, Result, SharedClock, Timestamp, VersionOutcome,
};
use rusqlite::{Connection, OptionalExtension};

use crate::error::{BACKEND, ResultExt, corrupt, map_commit, sqlite_error};
use crate::pool::Checkout;
use crate::store::SqliteStore;

/// An open inbox transaction on a [`SqliteStore`]: one pooled connection inside
/// `BEGIN IMMEDIATE`.
///
/// Run the business effect on it with [`run`](SqliteTx::run); commit with
/// [`Inbox::commit`]. Dropping it without committing rolls everything back (on the blocking
/// pool) and returns the connection. While it is open it holds the file's write lock, so keep it
/// short: other writers (relays, other consumers) wait up to the busy timeout.
pub struct SqliteTx {
    checkout: Option<Checkout>,
    /// Markers written in this transaction: their `at` becomes the commit time.
    new_markers: Vec<(String, String)>,
    /// Dead letters written in this transaction: their `at` becomes the commit time.
    new_dead_letters: Vec<i64>,
}

impl fmt::Debug for SqliteTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTx")
            .field("open", &self.checkout.is_some())
            .field("new_markers", &self.new_markers.len())
            .finish_non_exhaustive()
    }
}

fn closed() -> Error {
    Error::permanent(ErrorKind::Closed, BACKEND, "the transaction is no longer open; it was rolled back")
}

impl SqliteTx {
    /// Run `f` on this transaction's connection, on the blocking pool. Its writes commit with the
    /// inbox marker, or not at all.
    ///
    /// `f` must not end the transaction itself (`COMMIT`, `ROLLBACK`); if it does, the call
    /// fails with [`ErrorKind::Rejected`] and the transaction is unusable. Use a `SAVEPOINT`
    /// for partial rollback.
    ///
    /// # Errors
    /// The SQLite error of `f`, converted as by [`sqlite_error`](crate::sqlite_error); a panic
    /// in `f` is re-raised in the caller and rolls the transaction back.
    pub async fn run<T, F>(&mut self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        self.run_with(move |conn| f(conn).map_err(sqlite_error)).await
    }

    /// [`run`](SqliteTx::run) for code that reports its own errors (use
    /// [`sqlite_error`](crate::sqlite_error) to convert `rusqlite` errors inside it).
    ///
    /// # Errors
    /// What `f` returns.
    pub async fn run_with<T, F>(&mut self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T> + Send + 'static,
    {
        let checkout = self.checkout.as_mut().ok_or_else(closed)?;
        checkout
            .run_existing(move |conn| {
                if conn.is_autocommit() {
                    return Err(closed());
                }
                let out = f(conn);
                if conn.is_autocommit() {
                    // SQLite rolled back on an error (I/O, full disk), or `f` ended the
                    // transaction; either way nothing later may run outside it.
                    out?;
                    return Err(Error::permanent(
                        ErrorKind::Rejected,
                        BACKEND,
                        "the code run on the transaction ended it (COMMIT or ROLLBACK); use a SAVEPOINT instead",
                    ));
                }
                out
            })
            .await
    }

    /// Roll back now and wait for it (dropping the transaction does the same in the
    /// background).
    ///
    /// # Errors
    /// None in practice: a failed `ROLLBACK` closes the connection, which rolls back too.
    pub async fn rollback(mut self) -> Result<()> {
        if let Some(mut checkout) = self.checkout.take() {
            checkout
                .run_existing(|conn| {
                    if !conn.is_autocommit() {
                        conn.execute_batch("ROLLBACK").ctx("rollback")?;
                    }
                    Ok(())
                })
                .await?;
        }
        Ok(())
    }
}

impl Drop for SqliteTx {
    fn drop(&mut self) {
        let Some(mut checkout) = self.checkout.take() else { return };
        match tokio::runtime::Handle::try_current() {
            // The checkout is released (and the connection returned) once the rollback is done.
            // If the runtime is shutting down and never runs this, dropping the checkout closes
            // the connection, which rolls back as well.
            Ok(handle) => drop(handle.spawn_blocking(move || checkout.rollback_blocking())),
            Err(_) => checkout.rollback_blocking(),
        }
    }
}

fn to_i64(what: &str, v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::invalid_input(BACKEND, format!("{what} {v} is larger than SQLite can store")))
}

fn fingerprint(consumer: &str, event_id: &str, bytes: Vec<u8>) -> Result<Fingerprint> {
    let arr: [u8; 32] = bytes
        .try_into()
        .map_err(|_| corrupt(format!("inbox marker ({consumer}, {event_id}): stored fingerprint is not 32 bytes")))?;
    Ok(Fingerprint(arr))
}

/// A dead letter as SQLite returns it.
struct RawDeadLetter {
    id: i64,
    event_id: String,
    destination: String,
    key: Option<String>,
    headers: Vec<u8>,
    reason: String,
    error: String,
    payload: Vec<u8>,
    at: i64,
}

impl RawDeadLetter {
    fn decode(self, consumer: &str) -> Result<DeadLetter> {
        let (c, id) = (consumer, self.id);
        let bad = |what: &str, e: Error| corrupt(format!("dead letter {id} of {c}: {what}: {}", e.message()));
        let event_id = EventId::new(self.event_id).map_err(|e| bad("event id", e))?;
        let destination = Destination::new(self.destination).map_err(|e| bad("destination", e))?;
        let headers = decode_headers(&self.headers, BACKEND).map_err(|e| bad("headers", e))?;
        let reason = DeadLetterReason::parse(&self.reason)
            .ok_or_else(|| corrupt(format!("dead letter {id} of {c}: unknown reason {:?}", self.reason)))?;
        Ok(DeadLetter {
            id,
            consumer: consumer.to_string(),
            event: Event { id: event_id, destination, key: self.key, headers, payload: self.payload },
            reason,
            error: self.error,
            at: Timestamp(self.at),
        })
    }
}

#[async_trait]
impl InboxAdmin for SqliteStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn markers(&self, consumer: &str) -> Result<Vec<Marker>> {
        let c = consumer.to_string();
        let what = "read inbox markers";
        self.pool()
            .run(move |conn| {
                let mut stmt = conn
                    .prepare_cached(
                        "SELECT event_id, fingerprint, at FROM outbox_inbox_markers WHERE consumer = ?1 ORDER BY event_id",
                    )
                    .ctx(what)?;
                let raw = stmt
                    .query_map([&c], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?, r.get::<_, i64>(2)?)))
                    .ctx(what)?
                    .collect::<rusqlite::Result<Vec<_>>>()
                    .ctx(what)?;
                raw.into_iter()
                    .map(|(id, fp, at)| {
                        let fingerprint = fingerprint(&c, &id, fp)?;
                        let event_id = EventId::new(id.clone())
                            .map_err(|e| corrupt(format!("inbox marker ({c}, {id}): {}", e.message())))?;
                        Ok(Marker { consumer: c.clone(), event_id, fingerprint, at: Timestamp(at) })
                    })
                    .collect()
            })
            .await
    }

    async fn dead_letters(&self, consumer: &str) -> Result<Vec<DeadLetter>> {
        let c = consumer.to_string();
        let what = "read dead letters";
        self.pool()
            .run(move |conn| {
                let mut stmt = conn
                    .prepare_cached(
                        "SELECT id, event_id, destination, event_key, headers, reason, error, payload, at
                         FROM outbox_inbox_dead_letters WHERE consumer = ?1 ORDER BY id",
                    )
                    .ctx(what)?;
                let raw = stmt
                    .query_map([&c], |r| {
                        Ok(RawDeadLetter {
                            id: r.get(0)?,
                            event_id: r.get(1)?,
                            destination: r.get(2)?,
                            key: r.get(3)?,
                            headers: r.get(4)?,
                            reason: r.get(5)?,
                            error: r.get(6)?,
                            payload: r.get(7)?,
                            at: r.get(8)?,
                        })
                    })
                    .ctx(what)?
                    .collect::<rusqlite::Result<Vec<_>>>()
                    .ctx(what)?;
                raw.into_iter().map(|d| d.decode(&c)).collect()
            })
            .await
    }

    async fn remove_dead_letters(&self, consumer: &str, ids: &[i64]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let (c, ids) = (consumer.to_string(), ids.to_vec());
        let what = "remove dead letters";
        self.pool()
            .write(what, move |tx| {
                let mut delete = tx
                    .prepare_cached(
                        "DELETE FROM outbox_inbox_dead_letters WHERE consumer = ?1 AND id = ?2 RETURNING event_id",
                    )
                    .ctx(what)?;
                let mut removed = Vec::new();
                for id in &ids {
                    if let Some(event_id) =
                        delete.query_row((&c, id), |r| r.get::<_, String>(0)).optional().ctx(what)?
                    {
                        removed.push(event_id);
                    }
                }
                let mut clear = tx
                    .prepare_cached("DELETE FROM outbox_inbox_failures WHERE consumer = ?1 AND event_id = ?2")
                    .ctx(what)?;
                for event_id in &removed {
                    clear.execute((&c, event_id)).ctx(what)?;
                }
                Ok(removed.len() as u64)
            })
            .await
    }

    async fn prune_markers(&self, consumer: &str, older_than: Duration) -> Result<u64> {
        let c = consumer.to_string();
        let older = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let clock: SharedClock = Arc::clone(self.clock());
        let what = "prune inbox markers";
        self.pool()
            .write(what, move |tx| {
                // Same rule as the reference: delete when `now - at > older_than`.
                let cutoff = clock.now().0.saturating_sub(older);
                let n = tx
                    .prepare_cached("DELETE FROM outbox_inbox_markers WHERE consumer = ?1 AND at < ?2")
                    .ctx(what)?
                    .execute((&c, cutoff))
                    .ctx(what)?;
                Ok(n as u64)
            })
            .await
    }
}

#[async_trait]
impl Inbox for SqliteStore {
    type Tx = SqliteTx;

    async fn begin(&self) -> Result<SqliteTx> {
        let mut checkout = self.pool().checkout().await?;
        checkout.run(|conn| conn.execute_batch("BEGIN IMMEDIATE").ctx("begin")).await?;
        Ok(SqliteTx { checkout: Some(checkout), new_markers: Vec::new(), new_dead_letters: Vec::new() })
    }

    async fn commit(&self, mut tx: SqliteTx) -> Result<()> {
        let mut checkout = tx.checkout.take().ok_or_else(closed)?;
        let markers = std::mem::take(&mut tx.new_markers);
        let dead = std::mem::take(&mut tx.new_dead_letters);
        let clock = Arc::clone(self.clock());
        checkout
            .run_existing(move |conn| {
                if conn.is_autocommit() {
                    return Err(closed());
                }
                let stamp = || -> Result<()> {
                    let now = clock.now();
                    let mut m = conn
                        .prepare_cached("UPDATE outbox_inbox_markers SET at = ?3 WHERE consumer = ?1 AND event_id = ?2")
                        .ctx("commit")?;
                    for (consumer, event_id) in &markers {
                        m.execute((consumer, event_id, now.0)).ctx("commit")?;
                    }
                    let mut d = conn
                        .prepare_cached("UPDATE outbox_inbox_dead_letters SET at = ?2 WHERE id = ?1")
                        .ctx("commit")?;
                    for id in &dead {
                        d.execute((id, now.0)).ctx("commit")?;
                    }
                    Ok(())
                };
                let done = stamp().and_then(|()| conn.execute_batch("COMMIT").map_err(|e| map_commit("inbox", e)));
                if done.is_err() && !conn.is_autocommit() {
                    let _ = conn.execute_batch("ROLLBACK");
                }
                done
            })
            .await
    }

    async fn mark(
        &self,
        tx: &mut SqliteTx,
        consumer: &str,
        event_id: &EventId,
        fingerprint: &Fingerprint,
    ) -> Result<MarkOutcome> {
        let (c, id, fp) = (consumer.to_string(), event_id.as_str().to_string(), *fingerprint);
        let clock = Arc::clone(self.clock());
        let what = "mark";
        let outcome = tx
            .run_with(move |conn| {
                let inserted = conn
                    .prepare_cached(
                        "INSERT INTO outbox_inbox_markers (consumer, event_id, fingerprint, at) VALUES (?1, ?2, ?3, ?4)
                         ON CONFLICT (consumer, event_id) DO NOTHING",
                    )
                    .ctx(what)?
                    .execute((&c, &id, fp.0.as_slice(), clock.now().0))
                    .ctx(what)?;
                if inserted == 1 {
                    return Ok(MarkOutcome::New);
                }
                let stored: Vec<u8> = conn
                    .prepare_cached(
                        "SELECT fingerprint FROM outbox_inbox_markers WHERE consumer = ?1 AND event_id = ?2",
                    )
                    .ctx(what)?
                    .query_row((&c, &id), |r| r.get(0))
                    .ctx(what)?;
                let stored = self::fingerprint(&c, &id, stored)?;
                Ok(if stored == fp { MarkOutcome::Duplicate } else { MarkOutcome::Conflict { stored } })
            })
            .await?;
        if outcome == MarkOutcome::New {
            tx.new_markers.push((consumer.to_string(), event_id.as_str().to_string()));
        }
        Ok(outcome)
    }

    async fn advance_version(
        &self,
        tx: &mut SqliteTx,
        consumer: &str,
        subject: &str,
        version: u64,
    ) -> Result<VersionOutcome> {
        let new = to_i64("projection version", version)?;
        let (c, s) = (consumer.to_string(), subject.to_string());
        let clock = Arc::clone(self.clock());
        let what = "advance the projection version";
        tx.run_with(move |conn| {
            let current: Option<i64> = conn
                .prepare_cached("SELECT version FROM outbox_inbox_versions WHERE consumer = ?1 AND subject = ?2")
                .ctx(what)?
                .query_row((&c, &s), |r| r.get(0))
                .optional()
                .ctx(what)?;
            let current = current
                .map(|v| {
                    u64::try_from(v).map_err(|_| corrupt(format!("projection ({c}, {s}): version {v} is negative")))
                })
                .transpose()?;
            if let Some(current) = current
                && current >= version
            {
                return Ok(VersionOutcome::Stale { current });
            }
            conn.prepare_cached(
                "INSERT INTO outbox_inbox_versions (consumer, subject, version, at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (consumer, subject) DO UPDATE SET version = excluded.version, at = excluded.at",
            )
            .ctx(what)?
            .execute((&c, &s, new, clock.now().0))
            .ctx(what)?;
            Ok(VersionOutcome::Advanced { previous: current })
        })
        .await
    }

    async fn ledger_state(&self, tx: &mut SqliteTx, consumer: &str, event_id: &EventId) -> Result<LedgerState> {
        let (c, id) = (consumer.to_string(), event_id.as_str().to_string());
        let what = "read the notification ledger";
        tx.run_with(move |conn| {
            let state: Option<String> = conn
                .prepare_cached("SELECT state FROM outbox_inbox_ledger WHERE consumer = ?1 AND event_id = ?2")
                .ctx(what)?
                .query_row((&c, &id), |r| r.get(0))
                .optional()
                .ctx(what)?;
            match state.as_deref() {
                None => Ok(LedgerState::Fresh),
                Some("attempted") => Ok(LedgerState::Attempted),
                Some("done") => Ok(LedgerState::Done),
                Some(other) => Err(corrupt(format!("ledger ({c}, {id}): unknown state {other:?}"))),
            }
        })
        .await
    }

    async fn set_ledger_state(
        &self,
        tx: &mut SqliteTx,
        consumer: &str,
        event_id: &EventId,
        state: LedgerState,
    ) -> Result<()> {
        let (c, id) = (consumer.to_string(), event_id.as_str().to_string());
        let clock = Arc::clone(self.clock());
        let what = "write the notification ledger";
        tx.run_with(move |conn| {
            let text = match state {
                LedgerState::Fresh => {
                    conn.prepare_cached("DELETE FROM outbox_inbox_ledger WHERE consumer = ?1 AND event_id = ?2")
                        .ctx(what)?
                        .execute((&c, &id))
                        .ctx(what)?;
                    return Ok(());
                }
                LedgerState::Attempted => "attempted",
                LedgerState::Done => "done",
            };
            conn.prepare_cached(
                "INSERT INTO outbox_inbox_ledger (consumer, event_id, state, at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (consumer, event_id) DO UPDATE SET state = excluded.state, at = excluded.at",
            )
            .ctx(what)?
            .execute((&c, &id, text, clock.now().0))
            .ctx(what)?;
            Ok(())
        })
        .await
    }

    async fn dead_letter(&self, tx: &mut SqliteTx, record: &DeadLetter) -> Result<()> {
        let r = record.clone();
        let clock = Arc::clone(self.clock());
        let what = "write a dead letter";
        let id = tx
            .run_with(move |conn| {
                conn.prepare_cached(
                    "INSERT INTO outbox_inbox_dead_letters
                         (consumer, event_id, destination, event_key, headers, reason, error, payload, at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                )
                .ctx(what)?
                .execute((
                    &r.consumer,
                    r.event.id.as_str(),
                    r.event.destination.as_str(),
                    r.event.key.as_deref(),
                    encode_headers(&r.event.headers),
                    r.reason.as_str(),
                    &r.error,
                    &r.event.payload,
                    clock.now().0,
                ))
                .ctx(what)?;
                Ok(conn.last_insert_rowid())
            })
            .await?;
        tx.new_dead_letters.push(id);
        Ok(())
    }

    async fn record_failure(&self, consumer: &str, event_id: &EventId) -> Result<u32> {
        let (c, id) = (consumer.to_string(), event_id.as_str().to_string());
        let clock = Arc::clone(self.clock());
        let what = "record a handler failure";
        self.pool()
            .write(what, move |tx| {
                let n: i64 = tx
                    .prepare_cached(
                        "INSERT INTO outbox_inbox_failures (consumer, event_id, count, at) VALUES (?1, ?2, 1, ?3)
                             ON CONFLICT (consumer, event_id) DO UPDATE SET count = count + 1, at = excluded.at
                             RETURNING count",
                    )
                    .ctx(what)?
                    .query_row((&c, &id, clock.now().0), |r| r.get(0))
                    .ctx(what)?;
                u32::try_from(n).map_err(|_| corrupt(format!("failure count ({c}, {id}) is {n}")))
            })
            .await
    }
}
