//! The outbox table and its state machine, in SQL.
//!
//! Every transition is one conditional `UPDATE` inside a `BEGIN IMMEDIATE` transaction: SQLite
//! has a single writer per file, so taking the write lock up front is what makes two relays'
//! claims serialize instead of both reading the same pending row. "Now" is read from the
//! store's clock after the lock is taken and passed to SQL as a parameter; SQLite's own clock is
//! never used, so an injected clock decides every expiry.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    Claimed, Completion, Destination, Error, ErrorKind, Event, EventId, Lease, OutboxAdmin, OutboxRecord, OutboxStats,
    OutboxStore, Outcome, ParkedHead, ParkedRow, Result, RowId, RowSnapshot, RowStatus, SharedClock, SystemClock,
    Timestamp, Wakeup, WakeupSender,
};
use rusqlite::types::Value;
use rusqlite::{Connection, Transaction};

use crate::config::SqliteConfig;
use crate::enqueue::insert_events;
use crate::error::{BACKEND, ResultExt, corrupt};
use crate::pool::Pool;
use crate::schema;
use outbox_core::event::decode_headers;

/// The columns [`RawRow::read`] expects, in order.
macro_rules! row_columns {
    () => {
        "row_id, event_id, destination, event_key, headers, payload, attempts, token, owner, lease_expires_at, \
         available_at, created_at, published_token, parked_at, last_error"
    };
}

/// The fencing check, on parameters `?1` row id, `?2` token, `?3` owner.
macro_rules! holds_lease {
    () => {
        "row_id = ?1 AND token = ?2 AND owner = ?3 AND published_token IS NULL AND parked_at IS NULL"
    };
}

/// Outbox store and inbox on one SQLite file.
///
/// A cheaply cloneable handle: clones share the connection pool. It implements
/// [`OutboxStore`] and [`Inbox`](outbox_core::Inbox) (with [`SqliteTx`](crate::SqliteTx) as
/// the transaction), so one value serves relays and consumers.
///
/// # Waking relays
///
/// Its [`wakeup`](OutboxStore::wakeup) signal is in-process and shared by clones: relays
/// running on this handle (or a clone) wake up when rows are enqueued through it.
/// - [`enqueue`](OutboxStore::enqueue) signals after its commit.
/// - [`enqueue`](crate::enqueue) / [`enqueue_one`](crate::enqueue_one) in the caller's
///   transaction (and the same methods [`enqueue_in`](SqliteStore::enqueue_in) /
///   [`enqueue_one_in`](SqliteStore::enqueue_one_in)) signal as soon as the rows are written,
///   before the caller's commit. That is early, not
///   wrong: SQLite has one writer, the caller's transaction holds the write lock from its first
///   write until it ends, and a woken relay's claim (`BEGIN IMMEDIATE`) waits for that lock, so
///   it sees the rows right after the commit, or finds nothing after a rollback and waits
///   again. A caller that keeps its transaction open longer than the busy timeout after
///   enqueueing makes that claim fail with a transient `Busy` error; the relay logs it and
///   retries after its poll interval.
/// - Writes from another store handle or process signal nobody: relays find those rows at their
///   next poll.
///
/// # Schema
///
/// [`open`](SqliteStore::open) migrates the file (the embedded default);
/// [`connect`](SqliteStore::connect) leaves it alone, and [`migrate`](SqliteStore::migrate) /
/// [`check_schema`](SqliteStore::check_schema) do the rest explicitly — the same three steps
/// `PgStore` has.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: Arc<Pool>,
    clock: SharedClock,
    parked_head: ParkedHead,
    wakeup: WakeupSender,
}

/// The inbox of a [`SqliteStore`]: the store itself (see [`SqliteStore::inbox`]). The name
/// matches `outbox_store_postgres::PgInbox`, so a handler's port is implemented for
/// `SqliteInbox` and `PgInbox`.
pub type SqliteInbox = SqliteStore;

impl SqliteStore {
    /// Open (creating if needed) the database of `config`, apply pending migrations, and use the
    /// system clock: [`connect`](SqliteStore::connect) followed by
    /// [`migrate`](SqliteStore::migrate), the convenient default for an embedded database.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for invalid settings; [`ErrorKind::Corrupt`] for a file that is not
    /// a database or whose schema is newer than this code; other SQLite errors, converted.
    pub async fn open(config: SqliteConfig) -> Result<Self> {
        Self::open_with_clock(config, Arc::new(SystemClock)).await
    }

    /// [`open`](SqliteStore::open) with an injected clock: every lease, retry time and
    /// timestamp is read from `clock` (tests use a `ManualClock` to expire leases without
    /// sleeping).
    ///
    /// # Errors
    /// As [`open`](SqliteStore::open).
    pub async fn open_with_clock(config: SqliteConfig, clock: SharedClock) -> Result<Self> {
        let store = Self::connect_with_clock(config, clock).await?;
        store.migrate().await?;
        Ok(store)
    }

    /// Open (creating if needed) the database of `config` **without** touching its schema, with
    /// the system clock — the same step as `PgStore::connect`. Run
    /// [`migrate`](SqliteStore::migrate) (for example from a deploy step) or check with
    /// [`check_schema`](SqliteStore::check_schema) before use.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for invalid settings; [`ErrorKind::Corrupt`] for a file that is not
    /// a database; other SQLite errors, converted.
    pub async fn connect(config: SqliteConfig) -> Result<Self> {
        Self::connect_with_clock(config, Arc::new(SystemClock)).await
    }

    /// [`connect`](SqliteStore::connect) with an injected clock.
    ///
    /// # Errors
    /// As [`connect`](SqliteStore::connect).
    pub async fn connect_with_clock(config: SqliteConfig, clock: SharedClock) -> Result<Self> {
        config.validate()?;
        let (config, conn) = blocking(move || {
            let conn = config.open_store_connection()?;
            Ok((config, conn))
        })
        .await?;
        tracing::debug!(target: "outbox.sqlite", path = %config.path.display(), "opened");
        let parked_head = config.parked_head;
        Ok(Self { pool: Pool::new(config, conn), clock, parked_head, wakeup: WakeupSender::new() })
    }

    /// Apply this crate's migrations up to [`SCHEMA_VERSION`](crate::SCHEMA_VERSION); returns the
    /// version now in place.
    ///
    /// Idempotent and safe from several processes at once: each migration runs in the
    /// `BEGIN IMMEDIATE` transaction that records its version. [`open`](SqliteStore::open)
    /// calls it; call it yourself after [`connect`](SqliteStore::connect).
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when the file's schema is newer than this code; other SQLite
    /// errors, converted.
    pub async fn migrate(&self) -> Result<i64> {
        let clock = Arc::clone(&self.clock);
        self.pool.run(move |conn| schema::migrate(conn, clock.now())).await?;
        Ok(schema::SCHEMA_VERSION)
    }

    /// Check that the schema is at the version this code knows, without changing it.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] when the tables are missing or older, naming the fix
    /// ([`migrate`](SqliteStore::migrate), or `outbox migrate --store URL`);
    /// [`ErrorKind::Corrupt`] when the file's schema is newer than this code.
    pub async fn check_schema(&self) -> Result<()> {
        let found = self.schema_version().await?;
        let want = schema::SCHEMA_VERSION;
        let path = self.path().display().to_string();
        if found == want {
            Ok(())
        } else if found > want {
            Err(Error::permanent(
                ErrorKind::Corrupt,
                BACKEND,
                format!(
                    "{path} is at outbox schema version {found}, newer than the {want} this code knows; upgrade it"
                ),
            ))
        } else {
            let found = if found == 0 { "none (no tables)".to_string() } else { found.to_string() };
            Err(Error::config(
                BACKEND,
                format!(
                    "{path} is at outbox schema version {found}, this code needs {want}: run \
                     SqliteStore::migrate (or `outbox migrate --store URL`) first"
                ),
            ))
        }
    }

    /// The inbox on the same database and clock, for a consumer: the store itself, since one
    /// SQLite file holds both sides. The same call as `PgStore::inbox`, so code that picks a store
    /// reads the same on both.
    pub fn inbox(&self) -> SqliteInbox {
        self.clone()
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.pool.config().path
    }

    /// The settings the store was opened with.
    pub fn config(&self) -> &SqliteConfig {
        self.pool.config()
    }

    /// The same store (same pool, clock and wake-up signal) with the claim treating a parked head
    /// row as `parked_head` instead of the configured
    /// [`parked_head`](SqliteConfig::parked_head).
    #[must_use]
    pub fn with_parked_head(mut self, parked_head: ParkedHead) -> Self {
        self.parked_head = parked_head;
        self
    }

    /// What the claim does with a parked head row.
    pub fn parked_head(&self) -> ParkedHead {
        self.parked_head
    }

    /// The clock the store reads "now" from.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// A new connection to the same file with the same settings, outside the pool, for the
    /// caller's own transactions (domain write + [`enqueue_in`](SqliteStore::enqueue_in)).
    /// Blocking, like every `rusqlite` call.
    ///
    /// # Errors
    /// As [`SqliteConfig::open_connection`].
    pub fn connect_raw(&self) -> Result<Connection> {
        self.pool.config().open_connection()
    }

    /// Enqueue `events` in the caller's transaction `tx` with this store's clock and payload
    /// limit, and wake this store's relays. Blocking. The same as the free function
    /// [`enqueue`](crate::enqueue)`(tx, self, events)`.
    ///
    /// The wake-up is sent when the rows are written, before `tx` commits; relays then wait for
    /// the commit (see [Waking relays](SqliteStore#waking-relays)).
    ///
    /// # Errors
    /// As [`enqueue`](crate::enqueue).
    pub fn enqueue_in(&self, tx: &Transaction<'_>, events: &[Event]) -> Result<Vec<RowId>> {
        // The caller's trace travels with the events (free without `opentelemetry`).
        let events: &[Event] = &outbox_core::telemetry::with_trace_context(events);
        let ids = insert_events(tx, events, self.clock.now(), self.pool.config().max_payload)?;
        if !ids.is_empty() {
            self.wakeup.notify();
        }
        Ok(ids)
    }

    /// [`enqueue_in`](SqliteStore::enqueue_in) for one event.
    ///
    /// # Errors
    /// As [`enqueue`](crate::enqueue).
    pub fn enqueue_one_in(&self, tx: &Transaction<'_>, event: &Event) -> Result<RowId> {
        self.enqueue_in(tx, std::slice::from_ref(event))?
            .into_iter()
            .next()
            .ok_or_else(|| Error::permanent(ErrorKind::Rejected, BACKEND, "enqueue returned no row id"))
    }

    /// The schema version recorded in the file (0 before the first migration).
    ///
    /// # Errors
    /// SQLite errors, converted.
    pub async fn schema_version(&self) -> Result<i64> {
        self.pool
            .run(|conn| {
                let what = "read the schema version";
                let exists: bool = conn
                    .query_row(
                        "SELECT EXISTS (SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'outbox_schema_version')",
                        [],
                        |r| r.get(0),
                    )
                    .ctx(what)?;
                if !exists {
                    return Ok(0);
                }
                conn.query_row("SELECT COALESCE(MAX(version), 0) FROM outbox_schema_version", [], |r| r.get(0)).ctx(what)
            })
            .await
    }

    /// Run `f` on a pooled connection, outside any transaction (each statement commits on its
    /// own), on the blocking pool: for reading application tables back or creating them from
    /// async code. For writes that must commit with an inbox marker use
    /// [`SqliteTx::run`](crate::SqliteTx::run) instead.
    ///
    /// A transaction `f` leaves open is rolled back (the connection is closed, not reused).
    ///
    /// # Errors
    /// The SQLite error of `f`, converted as by [`sqlite_error`](crate::sqlite_error).
    pub async fn with_connection<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        self.pool.run(move |conn| f(conn).map_err(crate::error::sqlite_error)).await
    }

    pub(crate) fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// A token-conditional `UPDATE` (`sql` uses `?1..?3` for the lease, `?4..` for `extra(now)`).
    async fn conditional<F>(
        &self,
        what: &'static str,
        sql: &'static str,
        row: RowId,
        lease: &Lease,
        extra: F,
    ) -> Result<Outcome>
    where
        F: FnOnce(Timestamp) -> Vec<Value> + Send + 'static,
    {
        let Ok(token) = i64::try_from(lease.token) else { return Ok(Outcome::Fenced) };
        let owner = lease.owner.clone();
        let clock = Arc::clone(&self.clock);
        self.pool
            .write(what, move |tx| {
                let mut params = vec![Value::Integer(row), Value::Integer(token), Value::Text(owner)];
                params.extend(extra(clock.now()));
                let n = tx.prepare_cached(sql).ctx(what)?.execute(rusqlite::params_from_iter(params)).ctx(what)?;
                Ok(if n == 1 { Outcome::Applied } else { Outcome::Fenced })
            })
            .await
    }
}

/// Run blocking work on tokio's blocking pool, re-raising its panic.
pub(crate) async fn blocking<T, F>(f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(out) => out,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(_) => Err(Error::permanent(ErrorKind::Closed, BACKEND, "blocking task was cancelled")),
        },
    }
}

pub(crate) fn to_sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// A row as SQLite returns it.
struct RawRow {
    row_id: i64,
    event_id: String,
    destination: String,
    key: Option<String>,
    headers: Vec<u8>,
    payload: Vec<u8>,
    attempts: i64,
    token: i64,
    owner: Option<String>,
    lease_expires_at: Option<i64>,
    available_at: i64,
    created_at: i64,
    published_token: Option<i64>,
    parked_at: Option<i64>,
    last_error: Option<String>,
}

impl RawRow {
    fn read(r: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            row_id: r.get(0)?,
            event_id: r.get(1)?,
            destination: r.get(2)?,
            key: r.get(3)?,
            headers: r.get(4)?,
            payload: r.get(5)?,
            attempts: r.get(6)?,
            token: r.get(7)?,
            owner: r.get(8)?,
            lease_expires_at: r.get(9)?,
            available_at: r.get(10)?,
            created_at: r.get(11)?,
            published_token: r.get(12)?,
            parked_at: r.get(13)?,
            last_error: r.get(14)?,
        })
    }

    fn decode(self) -> Result<StoredRow> {
        let row = self.row_id;
        let bad =
            |what: &str, e: Error| corrupt(format!("outbox row {row}: stored {what} is invalid: {}", e.message()));
        let id = EventId::new(self.event_id).map_err(|e| bad("event id", e))?;
        let destination = Destination::new(self.destination).map_err(|e| bad("destination", e))?;
        let headers = decode_headers(&self.headers, BACKEND).map_err(|e| bad("headers", e))?;
        let unsigned = |what: &str, v: i64| {
            u64::try_from(v).map_err(|_| corrupt(format!("outbox row {row}: {what} {v} is negative")))
        };
        Ok(StoredRow {
            row_id: row,
            event: Event { id, destination, key: self.key, headers, payload: self.payload },
            attempts: u32::try_from(self.attempts)
                .map_err(|_| corrupt(format!("outbox row {row}: attempts {} out of range", self.attempts)))?,
            token: unsigned("token", self.token)?,
            owner: self.owner,
            lease_expires_at: self.lease_expires_at.map(Timestamp),
            available_at: Timestamp(self.available_at),
            created_at: Timestamp(self.created_at),
            published_token: self.published_token.map(|t| unsigned("published token", t)).transpose()?,
            parked_at: self.parked_at.map(Timestamp),
            last_error: self.last_error,
        })
    }
}

/// A decoded row.
struct StoredRow {
    row_id: RowId,
    event: Event,
    attempts: u32,
    token: u64,
    owner: Option<String>,
    lease_expires_at: Option<Timestamp>,
    available_at: Timestamp,
    created_at: Timestamp,
    published_token: Option<u64>,
    parked_at: Option<Timestamp>,
    last_error: Option<String>,
}

impl StoredRow {
    /// Same rule as the reference model.
    fn status(&self, now: Timestamp) -> RowStatus {
        RowStatus::of(self.published_token.is_some(), self.parked_at.is_some(), self.lease_expires_at, now)
    }

    fn into_record(self) -> OutboxRecord {
        OutboxRecord { row_id: self.row_id, event: self.event, attempts: self.attempts, created_at: self.created_at }
    }

    fn into_snapshot(self, now: Timestamp) -> RowSnapshot {
        RowSnapshot {
            status: self.status(now),
            row_id: self.row_id,
            attempts: self.attempts,
            token: self.token,
            owner: self.owner,
            lease_expires_at: self.lease_expires_at,
            published_token: self.published_token,
            available_at: self.available_at,
            created_at: self.created_at,
            last_error: self.last_error,
            event: self.event,
        }
    }
}

/// The two statements of [`claimable_ids`] for one [`ParkedHead`]: `$blocks` is what makes a
/// row of a key's chain block it besides backing off or a live lease, `$chain` what leaves a row
/// out of the chain. The probes' table has no alias, so both apply to it as they are. `event_key
/// IS NOT NULL` lets the partial index `outbox_rows_key_open` serve every probe.
macro_rules! key_order_sql {
    ($blocks:literal, $chain:literal) => {
        (
            concat!(
                "SELECT o.row_id, o.event_key FROM outbox_rows o
     WHERE o.published_token IS NULL AND o.parked_at IS NULL
       AND o.available_at <= ?1 AND (o.lease_expires_at IS NULL OR o.lease_expires_at <= ?1)
       AND (o.event_key IS NULL OR COALESCE((SELECT ",
                $blocks,
                "available_at > ?1 OR COALESCE(lease_expires_at > ?1, 0)
                     FROM outbox_rows
                     WHERE event_key = o.event_key AND event_key IS NOT NULL AND published_token IS NULL",
                $chain,
                "
                     ORDER BY row_id LIMIT 1), 0) = 0)
     ORDER BY o.row_id LIMIT ?2"
            ),
            concat!(
                "SELECT k.event_key, (SELECT row_id FROM outbox_rows
         WHERE event_key = k.event_key AND event_key IS NOT NULL AND published_token IS NULL",
                $chain,
                "
           AND row_id NOT IN (SELECT value FROM json_each(?1))
         ORDER BY row_id LIMIT 1)
     FROM (SELECT DISTINCT event_key FROM outbox_rows
           WHERE row_id IN (SELECT value FROM json_each(?1)) AND event_key IS NOT NULL) k"
            ),
        )
    };
}
/// The claim's last statement: lease the rows [`claimable_ids`] picked (`?3`, a JSON array) to
/// `?1` until `?2`, and return them.
const CLAIM_UPDATE_SQL: &str = concat!(
    "UPDATE outbox_rows SET token = token + 1, owner = ?1, lease_expires_at = ?2
     WHERE row_id IN (SELECT value FROM json_each(?3))
     RETURNING ",
    row_columns!()
);

/// The statements of a claim, exactly as [`SqliteStore`] runs them in one `BEGIN IMMEDIATE`
/// transaction, for benchmarks that do the same work by hand. Only with the `testkit` feature,
/// not part of the stable API.
#[cfg(any(test, feature = "testkit"))]
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ClaimSql {
    /// Open, due, unleased rows whose key's head is not blocked, in row order: `?1` now in ms,
    /// `?2` limit; returns `row_id, event_key`.
    pub candidates: &'static str,
    /// For each key of `?1` (a JSON array of candidate ids): the key's first unpublished row
    /// that is not a candidate, or `NULL`; returns `event_key, row_id`. A candidate after its
    /// key's gap is not claimed.
    pub gaps: &'static str,
    /// Lease the picked rows: `?1` owner, `?2` lease expiry in ms, `?3` the ids as a JSON array;
    /// returns every column of each row.
    pub update: &'static str,
}

#[cfg(any(test, feature = "testkit"))]
impl SqliteStore {
    /// The claim's statements under this store's [`ParkedHead`].
    pub fn claim_sql(&self) -> ClaimSql {
        let (candidates, gaps) = key_order_sql(self.parked_head);
        ClaimSql { candidates, gaps, update: CLAIM_UPDATE_SQL }
    }
}

/// The candidates statement and the gap statement of [`claimable_ids`] under `parked_head`.
fn key_order_sql(parked_head: ParkedHead) -> (&'static str, &'static str) {
    match parked_head {
        ParkedHead::Block => key_order_sql!("parked_at IS NOT NULL OR ", ""),
        ParkedHead::Skip => key_order_sql!("", " AND parked_at IS NULL"),
    }
}

/// The rows a claim at `now` takes, at most `limit`, in row order, under key order (see
/// [`OutboxStore::claim`]). Runs inside the claim's `BEGIN IMMEDIATE` transaction, so nothing
/// changes between its two statements:
///
/// 1. candidates: open rows in row order that are due and unleased and whose key's head (oldest
///    unpublished row) is not blocked — one probe of `outbox_rows_key_open` per keyed row, which
///    keeps a key stuck behind its head out of the batch, so it cannot crowd out other keys;
/// 2. gaps, one statement for every key of the candidates: the key's first unpublished row that
///    is not a candidate. A candidate after its key's gap is dropped: a row blocked in the middle
///    of a key (its head claimable, a later row backing off or leased) stops the key there.
///
/// Step 2 alone decides key order; step 1 only keeps blocked keys from filling the batch (a key
/// blocked in its middle can fill one batch at most, as its head is then claimed and in flight).
/// Under [`ParkedHead::Skip`] parked rows are left out of a key's chain; under `Block` they block.
fn claimable_ids(tx: &Transaction<'_>, parked_head: ParkedHead, now: Timestamp, limit: i64) -> Result<Vec<i64>> {
    let what = "claim";
    let (candidates_sql, gaps_sql) = key_order_sql(parked_head);
    let candidates: Vec<(i64, Option<String>)> = tx
        .prepare_cached(candidates_sql)
        .ctx(what)?
        .query_map((now.0, limit), |r| Ok((r.get(0)?, r.get(1)?)))
        .ctx(what)?
        .collect::<rusqlite::Result<_>>()
        .ctx(what)?;
    if candidates.iter().all(|(_, key)| key.is_none()) {
        // No key in the batch: nothing to check, no second statement.
        return Ok(candidates.into_iter().map(|(id, _)| id).collect());
    }
    let ids: Vec<i64> = candidates.iter().map(|(id, _)| *id).collect();
    let gaps: std::collections::HashMap<String, i64> = tx
        .prepare_cached(gaps_sql)
        .ctx(what)?
        .query_map([json_array(&ids)], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?)))
        .ctx(what)?
        .filter_map(|r| r.map(|(key, gap)| gap.map(|gap| (key, gap))).transpose())
        .collect::<rusqlite::Result<_>>()
        .ctx(what)?;
    Ok(candidates
        .into_iter()
        .filter(|(id, key)| key.as_ref().and_then(|k| gaps.get(k)).is_none_or(|gap| id < gap))
        .map(|(id, _)| id)
        .collect())
}

/// `ids` as a JSON array, the one parameter `json_each` expands into the claim's `IN` list.
fn json_array(ids: &[i64]) -> String {
    use std::fmt::Write as _;
    let mut json = String::with_capacity(2 + ids.len() * 8);
    json.push('[');
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            json.push(',');
        }
        let _ = write!(json, "{id}");
    }
    json.push(']');
    json
}

fn query_rows(conn: &Connection, what: &str, sql: &str, params: impl rusqlite::Params) -> Result<Vec<StoredRow>> {
    let mut stmt = conn.prepare_cached(sql).ctx(what)?;
    let raw = stmt.query_map(params, RawRow::read).ctx(what)?.collect::<rusqlite::Result<Vec<_>>>().ctx(what)?;
    raw.into_iter().map(RawRow::decode).collect()
}

#[async_trait]
impl OutboxStore for SqliteStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn enqueue(&self, events: &[Event]) -> Result<Vec<RowId>> {
        let max_payload = self.pool.config().max_payload;
        for e in events {
            e.validate(max_payload)?;
        }
        if events.is_empty() {
            return Ok(Vec::new());
        }
        // Injected here, on the caller's span, not on the pool's thread.
        let events = outbox_core::telemetry::with_trace_context(events).into_owned();
        let clock = Arc::clone(&self.clock);
        let ids = self.pool.write("enqueue", move |tx| insert_events(tx, &events, clock.now(), max_payload)).await?;
        // Committed: a woken relay's claim sees the rows.
        self.wakeup.notify();
        Ok(ids)
    }

    async fn claim(&self, owner: &str, limit: usize, lease: Duration) -> Result<Vec<Claimed>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let owner = owner.to_string();
        let clock = Arc::clone(&self.clock);
        let limit = to_sql_limit(limit);
        let parked_head = self.parked_head;
        self.pool
            .write("claim", move |tx| {
                let now = clock.now();
                let expires_at = now.plus(lease);
                let ids = claimable_ids(tx, parked_head, now, limit)?;
                if ids.is_empty() {
                    return Ok(Vec::new());
                }
                let ids = json_array(&ids);
                let mut rows = query_rows(tx, "claim", CLAIM_UPDATE_SQL, (&owner, expires_at.0, ids))?;
                rows.sort_by_key(|r| r.row_id);
                Ok(rows
                    .into_iter()
                    .map(|r| Claimed {
                        lease: Lease { owner: owner.clone(), token: r.token, expires_at },
                        record: r.into_record(),
                    })
                    .collect())
            })
            .await
    }

    async fn complete(&self, row: RowId, lease: &Lease) -> Result<Completion> {
        let out = self.complete_many(&[(row, lease.clone())]).await?;
        Ok(out.into_iter().next().unwrap_or(Completion::Fenced))
    }

    async fn complete_many(&self, rows: &[(RowId, Lease)]) -> Result<Vec<Completion>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let rows = rows.to_vec();
        let clock = Arc::clone(&self.clock);
        self.pool
            .write("complete", move |tx| {
                let now = clock.now();
                let mut stmt = tx
                    .prepare_cached(concat!(
                        "UPDATE outbox_rows SET published_token = token, published_at = ?4, lease_expires_at = NULL
                             WHERE ",
                        holds_lease!()
                    ))
                    .ctx("complete")?;
                let mut out = Vec::with_capacity(rows.len());
                for (row, lease) in &rows {
                    let n = match i64::try_from(lease.token) {
                        Ok(token) => stmt.execute((row, token, &lease.owner, now.0)).ctx("complete")?,
                        Err(_) => 0,
                    };
                    out.push(if n == 1 { Completion::Published } else { Completion::Fenced });
                }
                Ok(out)
            })
            .await
    }

    async fn fail(&self, row: RowId, lease: &Lease, retry_after: Duration, error: &str) -> Result<Outcome> {
        let error = error.to_string();
        self.conditional(
            "fail",
            concat!(
                "UPDATE outbox_rows SET attempts = attempts + 1, owner = NULL, lease_expires_at = NULL,
                     available_at = ?4, last_error = ?5
                 WHERE ",
                holds_lease!()
            ),
            row,
            lease,
            move |now| vec![Value::Integer(now.plus(retry_after).0), Value::Text(error)],
        )
        .await
    }

    async fn park(&self, row: RowId, lease: &Lease, reason: &str) -> Result<Outcome> {
        let reason = reason.to_string();
        self.conditional(
            "park",
            concat!(
                "UPDATE outbox_rows SET owner = NULL, lease_expires_at = NULL, parked_at = ?4, last_error = ?5
                 WHERE ",
                holds_lease!()
            ),
            row,
            lease,
            move |now| vec![Value::Integer(now.0), Value::Text(reason)],
        )
        .await
    }

    async fn extend(&self, row: RowId, lease: &Lease, by: Duration) -> Result<Outcome> {
        self.conditional(
            "extend",
            concat!("UPDATE outbox_rows SET lease_expires_at = ?4 WHERE ", holds_lease!()),
            row,
            lease,
            move |now| vec![Value::Integer(now.plus(by).0)],
        )
        .await
    }

    async fn release(&self, row: RowId, lease: &Lease) -> Result<Outcome> {
        self.conditional(
            "release",
            concat!(
                "UPDATE outbox_rows SET owner = NULL, lease_expires_at = NULL, available_at = ?4 WHERE ",
                holds_lease!()
            ),
            row,
            lease,
            move |now| vec![Value::Integer(now.0)],
        )
        .await
    }

    /// In-process, shared by clones; see [Waking relays](SqliteStore#waking-relays).
    fn wakeup(&self) -> Option<Wakeup> {
        Some(self.wakeup.subscribe())
    }

    /// Yes: SQLite has one writer per database file, and this store's writes take turns in the
    /// process; a relay then claims a batch ahead of its places at the broker only while every
    /// place is publishing (else at most `pipeline_depth` batches are between claim and recorded
    /// outcome).
    fn one_writer(&self) -> bool {
        true
    }
}

#[async_trait]
impl OutboxAdmin for SqliteStore {
    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedRow>> {
        let limit = to_sql_limit(limit);
        self.pool
            .run(move |conn| {
                let rows = query_rows(
                    conn,
                    "list parked rows",
                    concat!(
                        "SELECT ",
                        row_columns!(),
                        " FROM outbox_rows WHERE parked_at IS NOT NULL ORDER BY row_id LIMIT ?1"
                    ),
                    [limit],
                )?;
                Ok(rows
                    .into_iter()
                    .filter_map(|r| {
                        let parked_at = r.parked_at?;
                        let reason = r.last_error.clone().unwrap_or_default();
                        Some(ParkedRow { record: r.into_record(), reason, parked_at })
                    })
                    .collect())
            })
            .await
    }

    async fn requeue_parked(&self, rows: &[RowId]) -> Result<u64> {
        if rows.is_empty() {
            return Ok(0);
        }
        let rows = rows.to_vec();
        let clock = Arc::clone(&self.clock);
        self.pool
            .write("requeue parked rows", move |tx| {
                let now = clock.now();
                let mut stmt = tx
                    .prepare_cached(
                        "UPDATE outbox_rows SET parked_at = NULL, attempts = 0, available_at = ?2
                             WHERE row_id = ?1 AND parked_at IS NOT NULL AND published_token IS NULL",
                    )
                    .ctx("requeue parked rows")?;
                let mut n = 0u64;
                for row in &rows {
                    n += stmt.execute((row, now.0)).ctx("requeue parked rows")? as u64;
                }
                Ok(n)
            })
            .await
    }

    async fn purge_parked(&self, rows: &[RowId]) -> Result<u64> {
        if rows.is_empty() {
            return Ok(0);
        }
        let rows = rows.to_vec();
        self.pool
            .write("purge parked rows", move |tx| {
                let mut stmt = tx
                    .prepare_cached("DELETE FROM outbox_rows WHERE row_id = ?1 AND parked_at IS NOT NULL")
                    .ctx("purge parked rows")?;
                let mut n = 0u64;
                for row in &rows {
                    n += stmt.execute([row]).ctx("purge parked rows")? as u64;
                }
                Ok(n)
            })
            .await
    }

    async fn stats(&self) -> Result<OutboxStats> {
        let clock = Arc::clone(&self.clock);
        self.pool
            .run(move |conn| {
                let now = clock.now();
                let (published, parked, leased, pending, oldest): (i64, i64, i64, i64, Option<i64>) = conn
                    .prepare_cached(
                        "SELECT
                             COALESCE(SUM(published_token IS NOT NULL), 0),
                             COALESCE(SUM(published_token IS NULL AND parked_at IS NOT NULL), 0),
                             COALESCE(SUM(published_token IS NULL AND parked_at IS NULL
                                          AND lease_expires_at IS NOT NULL AND lease_expires_at > ?1), 0),
                             COALESCE(SUM(published_token IS NULL AND parked_at IS NULL
                                          AND (lease_expires_at IS NULL OR lease_expires_at <= ?1)), 0),
                             MIN(CASE WHEN published_token IS NULL AND parked_at IS NULL
                                           AND (lease_expires_at IS NULL OR lease_expires_at <= ?1)
                                      THEN created_at END)
                         FROM outbox_rows",
                    )
                    .ctx("stats")?
                    .query_row([now.0], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
                    .ctx("stats")?;
                let count = |v: i64| u64::try_from(v).unwrap_or(0);
                Ok(OutboxStats {
                    pending: count(pending),
                    leased: count(leased),
                    parked: count(parked),
                    published: count(published),
                    oldest_pending_age: oldest.map(|o| now.since(Timestamp(o))),
                })
            })
            .await
    }

    async fn inspect(&self, after: RowId, limit: usize) -> Result<Vec<RowSnapshot>> {
        let limit = to_sql_limit(limit);
        let clock = Arc::clone(&self.clock);
        self.pool
            .run(move |conn| {
                let now = clock.now();
                let rows = query_rows(
                    conn,
                    "inspect",
                    concat!("SELECT ", row_columns!(), " FROM outbox_rows WHERE row_id > ?1 ORDER BY row_id LIMIT ?2"),
                    (after, limit),
                )?;
                Ok(rows.into_iter().map(|r| r.into_snapshot(now)).collect())
            })
            .await
    }

    /// One `BEGIN IMMEDIATE` transaction deleting at most `limit` rows over the
    /// `outbox_rows_published` index; see the crate's "Retention".
    async fn purge_published(&self, older_than: Duration, limit: usize) -> Result<u64> {
        crate::retention::purge_published(self, older_than, limit).await
    }
}

#[cfg(test)]
mod tests {
    use outbox_core::{ParkedHead, Timestamp};

    /// Every probe of the key order is a search of `outbox_rows_key_open`, under both
    /// [`ParkedHead`] settings: no statement of the claim walks a key's rows or the table.
    #[test]
    fn the_key_order_probes_search_the_key_index() {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        crate::schema::migrate(&mut conn, Timestamp(0)).unwrap();
        for parked_head in [ParkedHead::Block, ParkedHead::Skip] {
            let (candidates, gaps) = super::key_order_sql(parked_head);
            let explain = |sql: &str, params: &[&dyn rusqlite::ToSql]| -> Vec<String> {
                conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                    .unwrap()
                    .query_map(params, |r| r.get::<_, String>(3))
                    .unwrap()
                    .collect::<Result<_, _>>()
                    .unwrap()
            };
            let plans = [(explain(candidates, &[&0, &10]), 1), (explain(gaps, &[&"[1,2]"]), 1)];
            for (plan, probes) in plans {
                let searches = plan
                    .iter()
                    .filter(|p| p.starts_with("SEARCH outbox_rows USING") && p.contains("outbox_rows_key_open"))
                    .count();
                assert_eq!(searches, probes, "{parked_head:?}: {plan:#?}");
                assert!(
                    !plan.iter().any(|p| p.starts_with("SCAN outbox_rows ") || p.as_str() == "SCAN outbox_rows"),
                    "{parked_head:?}: {plan:#?}"
                );
            }
        }
    }

    /// `PRAGMA temp_store` of a connection (0 default, 2 memory).
    fn temp_store(conn: &rusqlite::Connection) -> outbox_core::Result<i64> {
        use crate::error::ResultExt;
        conn.query_row("PRAGMA temp_store", [], |r| r.get(0)).ctx("read temp_store")
    }

    /// The store's own connections keep temporary storage in memory (see
    /// `SqliteConfig::open_store_connection`: otherwise each write's savepoint journal went to a
    /// file created and deleted per batch): the connection its writes take turns on, and a
    /// pooled one. A caller's own connection keeps SQLite's default.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_stores_connections_keep_temporary_storage_in_memory_and_a_callers_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::SqliteStore::open(crate::SqliteConfig::new(dir.path().join("t.db"))).await.unwrap();
        let writer = store.pool.write("test", |tx| temp_store(tx)).await.unwrap();
        let pooled = store.pool.run(|conn| temp_store(conn)).await.unwrap();
        assert_eq!((writer, pooled), (2, 2), "temp_store of the writer's and of a pooled connection (2: memory)");
        assert_eq!(temp_store(&store.connect_raw().unwrap()).unwrap(), 0, "a caller's connection keeps the default");
    }
}
