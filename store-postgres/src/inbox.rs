//! The inbox on PostgreSQL: guards written in the handler's own transaction.
//!
//! A marker is `INSERT … ON CONFLICT DO NOTHING` on the `(consumer, event_id)` primary key. When
//! two deliveries of one event race, the second insert waits on the first transaction's
//! uncommitted key; once the first commits it sees a conflict, reads the stored fingerprint and
//! answers `Duplicate` (or `New` if the first rolled back). So concurrent duplicates serialize on
//! the key and at most one effect commits. Projection versions and the notification ledger lock
//! their row (`FOR UPDATE`) for the same reason.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::event::{decode_headers, encode_headers};
use outbox_core::{
    DeadLetter, DeadLetterReason, Destination, Error, ErrorKind, Event, EventId, Fingerprint, Inbox, InboxAdmin,
    LedgerState, MarkOutcome, Marker, Result, Timestamp, VersionOutcome,
};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Row, Transaction};

use crate::config::PgConfig;
use crate::error::{BACKEND, Phase, map, map_commit_error};
use crate::store::{corrupt, millis, sanitize};
use crate::tables::PgTables;

/// Attempts at a guard whose row vanished between two statements (a concurrent prune).
const GUARD_ATTEMPTS: usize = 3;

/// An open transaction of a [`PgInbox`]. The handler runs its effect on it:
///
/// ```no_run
/// use outbox_store_postgres::{PgTx, map_error, sqlx};
///
/// async fn credit(tx: &mut PgTx, account: i64, amount: i64) -> outbox_core::Result<()> {
///     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///         .bind(amount)
///         .bind(account)
///         .execute(&mut **tx)
///         .await
///         .map_err(map_error)?;
///     Ok(())
/// }
/// ```
///
/// Dropping it without [`Inbox::commit`] rolls everything back.
pub struct PgTx {
    tx: Transaction<'static, Postgres>,
}

impl PgTx {
    /// Wrap a transaction the caller opened (on any pool reaching the same database).
    pub fn from_transaction(tx: Transaction<'static, Postgres>) -> Self {
        Self { tx }
    }

    /// The connection, for the handler's own statements.
    pub fn as_conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// The underlying sqlx transaction.
    pub fn into_inner(self) -> Transaction<'static, Postgres> {
        self.tx
    }

    /// Roll back explicitly (dropping does the same, without waiting for the server).
    ///
    /// # Errors
    /// The server's error; the transaction is gone either way.
    pub async fn rollback(self) -> Result<()> {
        self.tx.rollback().await.map_err(|e| map(e, Phase::InTransaction, "rollback"))
    }
}

impl Deref for PgTx {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for PgTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

impl fmt::Debug for PgTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTx").finish_non_exhaustive()
    }
}

/// An [`Inbox`] on PostgreSQL: markers, projection versions, the notification ledger, dead
/// letters and failure counts in the tables [`PgStore::migrate`](crate::PgStore::migrate)
/// creates. Cheap to clone.
#[derive(Clone)]
pub struct PgInbox {
    pool: PgPool,
    tables: Arc<PgTables>,
}

impl PgInbox {
    pub(crate) fn new(pool: PgPool, tables: Arc<PgTables>) -> Self {
        Self { pool, tables }
    }

    /// An inbox on an existing pool (see [`PgStore::from_pool`](crate::PgStore::from_pool)).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for an invalid schema or prefix.
    pub fn from_pool(pool: PgPool, config: &PgConfig) -> Result<Self> {
        Ok(Self { pool, tables: Arc::new(PgTables::new(config)?) })
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Table names, SQL and clock.
    pub fn tables(&self) -> &PgTables {
        &self.tables
    }

    /// Committed failure count of `(consumer, event_id)` (0 when none).
    ///
    /// # Errors
    /// The server's error.
    pub async fn failures(&self, consumer: &str, event_id: &EventId) -> Result<u32> {
        let sql = format!(
            "SELECT COALESCE((SELECT failures FROM {} WHERE consumer = $1 AND event_id = $2), 0)",
            self.tables.own("inbox_failures")
        );
        let n: i32 = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(event_id.as_str())
            .fetch_one(&self.pool)
            .await
            .map_err(|e| map(e, Phase::InTransaction, "reading failures"))?;
        u32::try_from(n).map_err(|_| corrupt(format!("negative failure count {n}")))
    }

    /// Committed projection version of `(consumer, subject)`.
    ///
    /// # Errors
    /// The server's error.
    pub async fn version(&self, consumer: &str, subject: &str) -> Result<Option<u64>> {
        let sql =
            format!("SELECT version FROM {} WHERE consumer = $1 AND subject = $2", self.tables.own("inbox_versions"));
        let v: Option<i64> = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(subject)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| map(e, Phase::InTransaction, "reading a version"))?;
        v.map(|v| u64::try_from(v).map_err(|_| corrupt(format!("negative version {v}")))).transpose()
    }

    /// Committed ledger state of `(consumer, event_id)`.
    ///
    /// # Errors
    /// The server's error.
    pub async fn ledger(&self, consumer: &str, event_id: &EventId) -> Result<LedgerState> {
        let sql =
            format!("SELECT state FROM {} WHERE consumer = $1 AND event_id = $2", self.tables.own("inbox_ledger"));
        let s: Option<String> = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(event_id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| map(e, Phase::InTransaction, "reading the ledger"))?;
        s.map_or(Ok(LedgerState::Fresh), |s| parse_ledger(&s))
    }
}

impl fmt::Debug for PgInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgInbox").field("tables", &self.tables).finish_non_exhaustive()
    }
}

fn ledger_text(state: LedgerState) -> &'static str {
    match state {
        LedgerState::Fresh => "fresh",
        LedgerState::Attempted => "attempted",
        LedgerState::Done => "done",
    }
}

fn parse_ledger(s: &str) -> Result<LedgerState> {
    Ok(match s {
        "fresh" => LedgerState::Fresh,
        "attempted" => LedgerState::Attempted,
        "done" => LedgerState::Done,
        other => return Err(corrupt(format!("unknown ledger state {other:?}"))),
    })
}

fn fingerprint(bytes: &[u8]) -> Result<Fingerprint> {
    <[u8; 32]>::try_from(bytes)
        .map(Fingerprint)
        .map_err(|_| corrupt(format!("stored fingerprint is {} bytes, not 32", bytes.len())))
}

fn version_param(version: u64) -> Result<i64> {
    i64::try_from(version)
        .map_err(|_| Error::invalid_input(BACKEND, format!("version {version} is larger than PostgreSQL's bigint")))
}

fn get<'r, T>(row: &'r PgRow, column: &str) -> Result<T>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    row.try_get(column).map_err(|e| map(e, Phase::InTransaction, "decoding an inbox row"))
}

fn in_tx(what: &'static str) -> impl Fn(sqlx::Error) -> Error {
    move |e| map(e, Phase::InTransaction, what)
}

fn vanished(what: &str) -> Error {
    Error::transient(ErrorKind::Busy, BACKEND, format!("{what}: the row changed concurrently; retry the transaction"))
}

fn decode_dead_letter(consumer: &str, r: &PgRow) -> Result<DeadLetter> {
    let id: i64 = get(r, "id")?;
    let bad = |what: &str, e: Error| corrupt(format!("dead letter {id} of {consumer}: {what}: {}", e.message()));
    let event_id = EventId::new(get::<String>(r, "event_id")?).map_err(|e| bad("event id", e))?;
    let destination = Destination::new(get::<String>(r, "destination")?).map_err(|e| bad("destination", e))?;
    let headers = decode_headers(&get::<Vec<u8>>(r, "headers")?, BACKEND).map_err(|e| bad("headers", e))?;
    let reason: String = get(r, "reason")?;
    Ok(DeadLetter {
        id,
        consumer: consumer.to_owned(),
        event: Event { id: event_id, destination, key: get(r, "key")?, headers, payload: get(r, "payload")? },
        reason: DeadLetterReason::parse(&reason)
            .ok_or_else(|| corrupt(format!("dead letter {id} of {consumer}: unknown reason {reason:?}")))?,
        error: get(r, "error")?,
        at: Timestamp(get(r, "at")?),
    })
}

#[async_trait]
impl InboxAdmin for PgInbox {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn markers(&self, consumer: &str) -> Result<Vec<Marker>> {
        let rows = sqlx::query(AssertSqlSafe(self.tables.sql.markers.clone()))
            .bind(consumer)
            .fetch_all(&self.pool)
            .await
            .map_err(in_tx("markers"))?;
        rows.iter()
            .map(|r| {
                let event_id: String = get(r, "event_id")?;
                Ok(Marker {
                    consumer: consumer.to_owned(),
                    event_id: EventId::new(event_id).map_err(|e| corrupt(format!("stored marker: {}", e.message())))?,
                    fingerprint: fingerprint(&get::<Vec<u8>>(r, "fingerprint")?)?,
                    at: Timestamp(get(r, "at")?),
                })
            })
            .collect()
    }

    async fn dead_letters(&self, consumer: &str) -> Result<Vec<DeadLetter>> {
        let rows = sqlx::query(AssertSqlSafe(self.tables.sql.dead_letters.clone()))
            .bind(consumer)
            .fetch_all(&self.pool)
            .await
            .map_err(in_tx("dead_letters"))?;
        rows.iter().map(|r| decode_dead_letter(consumer, r)).collect()
    }

    async fn remove_dead_letters(&self, consumer: &str, ids: &[i64]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let mut conn = self.pool.acquire().await.map_err(|e| map(e, Phase::InTransaction, "acquiring a connection"))?;
        // One statement: the records and their failure counts go together or not at all.
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(self.tables.sql.remove_dead_letters.clone()))
            .bind(consumer)
            .bind(ids)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| map(e, Phase::AutocommitWrite, "remove_dead_letters"))?;
        u64::try_from(n).map_err(|_| corrupt(format!("negative count {n}")))
    }

    async fn prune_markers(&self, consumer: &str, older_than: Duration) -> Result<u64> {
        let mut conn = self.pool.acquire().await.map_err(|e| map(e, Phase::InTransaction, "acquiring a connection"))?;
        let done = sqlx::query(AssertSqlSafe(self.tables.sql.prune.clone()))
            .bind(self.tables.now_param())
            .bind(consumer)
            .bind(millis(older_than))
            .execute(&mut *conn)
            .await
            .map_err(|e| map(e, Phase::AutocommitWrite, "prune_markers"))?;
        Ok(done.rows_affected())
    }
}

#[async_trait]
impl Inbox for PgInbox {
    type Tx = PgTx;

    async fn begin(&self) -> Result<PgTx> {
        let tx = self.pool.begin().await.map_err(in_tx("begin"))?;
        Ok(PgTx { tx })
    }

    async fn commit(&self, tx: PgTx) -> Result<()> {
        tx.tx.commit().await.map_err(map_commit_error)
    }

    async fn mark(
        &self,
        tx: &mut PgTx,
        consumer: &str,
        event_id: &EventId,
        fingerprint_: &Fingerprint,
    ) -> Result<MarkOutcome> {
        let sql = &self.tables.sql;
        for _ in 0..GUARD_ATTEMPTS {
            let inserted: Option<bool> = sqlx::query_scalar(AssertSqlSafe(sql.mark_insert.clone()))
                .bind(self.tables.now_param())
                .bind(consumer)
                .bind(event_id.as_str())
                .bind(&fingerprint_.0[..])
                .fetch_optional(&mut *tx.tx)
                .await
                .map_err(in_tx("mark"))?;
            if inserted.is_some() {
                return Ok(MarkOutcome::New);
            }
            let stored: Option<Vec<u8>> = sqlx::query_scalar(AssertSqlSafe(sql.mark_select.clone()))
                .bind(consumer)
                .bind(event_id.as_str())
                .fetch_optional(&mut *tx.tx)
                .await
                .map_err(in_tx("mark"))?;
            if let Some(stored) = stored {
                let stored = fingerprint(&stored)?;
                return Ok(if stored == *fingerprint_ {
                    MarkOutcome::Duplicate
                } else {
                    MarkOutcome::Conflict { stored }
                });
            }
        }
        Err(vanished("mark"))
    }

    /// One round trip when the marker is new: the marker's insert and the `BEGIN` go in one
    /// simple query (see `PgTables::mark_then_begin`). When the marker exists the insert fails
    /// with a unique violation, which leaves the connection idle with nothing written, and the
    /// ordinary `begin` + `mark` tells a duplicate from a conflict (the server logs that
    /// violation as an error: one line per duplicate delivery).
    async fn begin_marked(
        &self,
        consumer: &str,
        event_id: &EventId,
        fingerprint_: &Fingerprint,
    ) -> Result<(PgTx, MarkOutcome)> {
        if let Some(statement) = self.tables.mark_then_begin(consumer, event_id.as_str(), fingerprint_) {
            match self.pool.begin_with(AssertSqlSafe(statement)).await {
                Ok(tx) => return Ok((PgTx { tx }, MarkOutcome::New)),
                Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {}
                Err(e) => return Err(map(e, Phase::InTransaction, "begin")),
            }
        }
        outbox_core::inbox::begin_then_mark(self, consumer, event_id, fingerprint_).await
    }

    async fn advance_version(
        &self,
        tx: &mut PgTx,
        consumer: &str,
        subject: &str,
        version: u64,
    ) -> Result<VersionOutcome> {
        let v = version_param(version)?;
        let sql = &self.tables.sql;
        for _ in 0..GUARD_ATTEMPTS {
            let inserted: Option<bool> = sqlx::query_scalar(AssertSqlSafe(sql.version_insert.clone()))
                .bind(consumer)
                .bind(subject)
                .bind(v)
                .fetch_optional(&mut *tx.tx)
                .await
                .map_err(in_tx("advance_version"))?;
            if inserted.is_some() {
                return Ok(VersionOutcome::Advanced { previous: None });
            }
            let current: Option<i64> = sqlx::query_scalar(AssertSqlSafe(sql.version_lock.clone()))
                .bind(consumer)
                .bind(subject)
                .fetch_optional(&mut *tx.tx)
                .await
                .map_err(in_tx("advance_version"))?;
            let Some(current) = current else { continue };
            let current = u64::try_from(current).map_err(|_| corrupt(format!("negative version {current}")))?;
            if current >= version {
                return Ok(VersionOutcome::Stale { current });
            }
            sqlx::query(AssertSqlSafe(sql.version_update.clone()))
                .bind(consumer)
                .bind(subject)
                .bind(v)
                .execute(&mut *tx.tx)
                .await
                .map_err(in_tx("advance_version"))?;
            return Ok(VersionOutcome::Advanced { previous: Some(current) });
        }
        Err(vanished("advance_version"))
    }

    async fn ledger_state(&self, tx: &mut PgTx, consumer: &str, event_id: &EventId) -> Result<LedgerState> {
        let sql = &self.tables.sql;
        // Materialize the entry so that the row lock below also holds for a fresh one: a
        // concurrent reader of the same entry waits until this transaction ends.
        sqlx::query(AssertSqlSafe(sql.ledger_fresh.clone()))
            .bind(consumer)
            .bind(event_id.as_str())
            .execute(&mut *tx.tx)
            .await
            .map_err(in_tx("ledger_state"))?;
        let state: Option<String> = sqlx::query_scalar(AssertSqlSafe(sql.ledger_lock.clone()))
            .bind(consumer)
            .bind(event_id.as_str())
            .fetch_optional(&mut *tx.tx)
            .await
            .map_err(in_tx("ledger_state"))?;
        state.map_or(Err(vanished("ledger_state")), |s| parse_ledger(&s))
    }

    async fn set_ledger_state(
        &self,
        tx: &mut PgTx,
        consumer: &str,
        event_id: &EventId,
        state: LedgerState,
    ) -> Result<()> {
        sqlx::query(AssertSqlSafe(self.tables.sql.ledger_set.clone()))
            .bind(consumer)
            .bind(event_id.as_str())
            .bind(ledger_text(state))
            .execute(&mut *tx.tx)
            .await
            .map_err(in_tx("set_ledger_state"))?;
        Ok(())
    }

    async fn dead_letter(&self, tx: &mut PgTx, record: &DeadLetter) -> Result<()> {
        sqlx::query(AssertSqlSafe(self.tables.sql.dead_letter.clone()))
            .bind(self.tables.now_param())
            .bind(record.consumer.as_str())
            .bind(record.event.id.as_str())
            .bind(record.event.destination.as_str())
            .bind(record.event.key.as_deref())
            .bind(encode_headers(&record.event.headers))
            .bind(record.reason.as_str())
            .bind(sanitize(&record.error))
            .bind(record.event.payload.as_slice())
            .execute(&mut *tx.tx)
            .await
            .map_err(in_tx("dead_letter"))?;
        Ok(())
    }

    async fn record_failure(&self, consumer: &str, event_id: &EventId) -> Result<u32> {
        let mut conn = self.pool.acquire().await.map_err(|e| map(e, Phase::InTransaction, "acquiring a connection"))?;
        let n: i32 = sqlx::query_scalar(AssertSqlSafe(self.tables.sql.record_failure.clone()))
            .bind(consumer)
            .bind(event_id.as_str())
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| map(e, Phase::AutocommitWrite, "record_failure"))?;
        u32::try_from(n).map_err(|_| corrupt(format!("negative failure count {n}")))
    }
}
