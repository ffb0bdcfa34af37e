//! The outbox store: leases, fencing tokens and the claim statement.
//!
//! Every transition is one statement whose `WHERE` clause is the fencing check, so the database
//! decides atomically whether a stale relay may act; the store never reads a row and then
//! decides in Rust. The claim takes `FOR UPDATE SKIP LOCKED` row locks so concurrent relays pass
//! each other instead of queueing, and walks the partial index of open rows, so its cost depends
//! on the backlog, not on how many published rows are kept. Key order is part of the same
//! statement (see `tables::claim_sql`): a row whose key has an earlier unpublished row outside
//! the claim is never taken, so no relay, retry or overlapped batch overtakes a key's head.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    Claimed, Completion, Destination, Error, ErrorKind, Event, EventId, Lease, OutboxAdmin, OutboxRecord, OutboxStats,
    OutboxStore, Outcome, ParkedHead, ParkedRow, Result, RowId, RowSnapshot, RowStatus, SharedClock, Timestamp, Wakeup,
};
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, Postgres, Row};

use crate::config::PgConfig;
use crate::error::{BACKEND, Phase, map, map_commit_error};
use crate::inbox::PgInbox;
use crate::kept::Kept;
use crate::notify::Notifier;
use crate::tables::{PgTables, SCHEMA_VERSION};
use outbox_core::event::decode_headers;

/// Longest duration passed to SQL, in ms (about 100 years): keeps `now + duration` far from
/// `bigint` overflow whatever the caller asks for.
const MAX_MS: i64 = 100 * 365 * 24 * 3600 * 1000;

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(MAX_MS).min(MAX_MS)
}

/// Largest plaintext of one TLS record.
///
/// sqlx 0.9.0 leaves Nagle's algorithm on (it stopped setting `TCP_NODELAY`), and over TLS it
/// hands each record to the socket with its own write. A request that needs two records then
/// goes out as two segments, and the second waits until the server acknowledges the first —
/// which the server delays by about 40 ms, since it is still waiting for the rest of the
/// request. Requests on the relay's hot path are kept within one record; a plain-TCP
/// connection writes a request at once and never had the problem.
const TLS_RECORD: usize = 16 * 1024;
/// Bytes of a completion request besides its rows: message framing, statement name, the
/// clock parameter, array headers (generously).
const REQUEST_OVERHEAD: usize = 1024;
/// Bytes per completed row: id and token as binary `bigint[]` elements (length + value each).
const BYTES_PER_ROW: usize = 2 * (4 + 8);

/// Rows of one completion statement for `owner`, so that the request fits one TLS record.
fn rows_per_statement(owner: &str) -> usize {
    (TLS_RECORD.saturating_sub(REQUEST_OVERHEAD + owner.len()) / BYTES_PER_ROW).max(1)
}

/// A row limit as PostgreSQL's `bigint`.
pub(crate) fn limit_param(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// PostgreSQL text cannot hold NUL; error texts come from brokers and handlers, so replace it.
pub(crate) fn sanitize(text: &str) -> String {
    text.replace('\0', "\u{fffd}")
}

pub(crate) fn corrupt(message: impl Into<String>) -> Error {
    Error::permanent(ErrorKind::Corrupt, BACKEND, message)
}

/// An [`OutboxStore`] on PostgreSQL. Cheap to clone: clones share the pool.
///
/// Build it with [`connect`](PgStore::connect), [`connect_with_clock`](PgStore::connect_with_clock)
/// or [`from_pool`](PgStore::from_pool), then call [`migrate`](PgStore::migrate) once, or check
/// with [`check_schema`](PgStore::check_schema) that a deploy step did; [`open`](PgStore::open)
/// is `connect` + `migrate`. Only `open` and `migrate` change the schema — the same three steps
/// `SqliteStore` has.
///
/// Its [`wakeup`](OutboxStore::wakeup) signal comes from PostgreSQL: every enqueue (through
/// the store or [`enqueue`](crate::enqueue) in the caller's transaction, from any process) sends
/// a `NOTIFY` on [`PgTables::notify_channel`] when its transaction commits, and the first relay
/// that asks for the signal starts one `LISTEN` connection per store (outside the pool), kept
/// until the store is [closed](PgStore::close) or its last clone dropped.
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    /// Connections of the relay's claim and completion (see `crate::kept`).
    kept: Arc<Kept>,
    tables: Arc<PgTables>,
    config: Arc<PgConfig>,
    notifier: Arc<Notifier>,
}

impl PgStore {
    /// Connect with the database clock.
    ///
    /// Opens one connection right away (so a wrong URL, password or unreachable server fails
    /// here, without waiting for the pool's retries), then a pool of up to
    /// [`pool_size`](PgConfig::pool_size) connections, each with the configured
    /// `statement_timeout` and `lock_timeout`.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for invalid settings (before any connection is tried);
    /// [`ErrorKind::Connection`] (transient) when the server cannot be reached within
    /// [`connect_timeout`](PgConfig::connect_timeout).
    pub async fn connect(config: PgConfig) -> Result<Self> {
        let tables = PgTables::new(&config)?;
        let options = config.connect_options()?;
        let settings = config.session_settings();
        let target = config.redacted_url();
        let timeout = config.connect_timeout();
        let probe = async {
            let mut conn = PgConnection::connect_with(&options).await?;
            settings.apply(&mut conn).await?;
            conn.close().await
        };
        match tokio::time::timeout(timeout, probe).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(map(e, Phase::InTransaction, &format!("connecting to {target}"))),
            Err(_) => {
                return Err(Error::transient(
                    ErrorKind::Connection,
                    BACKEND,
                    format!("connecting to {target} took longer than {timeout:?}"),
                ));
            }
        }
        let pool = config.pool_options().connect_lazy_with(options);
        let notifier = Arc::new(Notifier::new(&tables));
        let kept = Arc::new(Kept::new(&config));
        Ok(Self { pool, kept, tables: Arc::new(tables), config: Arc::new(config), notifier })
    }

    /// Connect and apply the migrations: [`connect`](PgStore::connect) followed by
    /// [`migrate`](PgStore::migrate) — the convenient default for an application that owns its
    /// schema, the same call as `SqliteStore::open`. Deployments that migrate in a separate step
    /// use `connect` and [`check_schema`](PgStore::check_schema) instead.
    ///
    /// # Errors
    /// As [`connect`](PgStore::connect) and [`migrate`](PgStore::migrate).
    pub async fn open(config: PgConfig) -> Result<Self> {
        let store = Self::connect(config).await?;
        store.migrate().await?;
        Ok(store)
    }

    /// [`open`](PgStore::open) with an injected clock.
    ///
    /// # Errors
    /// As [`open`](PgStore::open).
    pub async fn open_with_clock(config: PgConfig, clock: SharedClock) -> Result<Self> {
        let store = Self::connect_with_clock(config, clock).await?;
        store.migrate().await?;
        Ok(store)
    }

    /// Connect with an injected clock (tests expire leases by advancing a
    /// [`ManualClock`](outbox_core::ManualClock) instead of sleeping).
    ///
    /// # Errors
    /// As [`connect`](PgStore::connect).
    pub async fn connect_with_clock(config: PgConfig, clock: SharedClock) -> Result<Self> {
        Ok(Self::connect(config).await?.with_clock(clock))
    }

    /// Use an existing pool (for example the application's own). The pool's connections keep
    /// whatever session settings the pool gives them; build it with
    /// [`PgConfig::pool_options`] to get this crate's timeouts. The store detaches up to
    /// [`kept_connections`](PgConfig::kept_connections) of them (2 by default) for a relay's
    /// claim and completion (the crate's "Connections kept for the relay"), and the pool may
    /// open others in their place.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for an invalid schema or prefix.
    pub fn from_pool(pool: PgPool, config: PgConfig) -> Result<Self> {
        let tables = PgTables::new(&config)?;
        let notifier = Arc::new(Notifier::new(&tables));
        let kept = Arc::new(Kept::new(&config));
        Ok(Self { pool, kept, tables: Arc::new(tables), config: Arc::new(config), notifier })
    }

    /// The same store (same pool) deciding time by `clock` instead of the database clock.
    #[must_use]
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        let tables = (*self.tables).clone().with_clock(clock);
        self.tables = Arc::new(tables);
        self
    }

    /// The same store (same pool and clock) with the claim treating a parked head row as
    /// `parked_head` (see [`PgConfig::with_parked_head`]).
    #[must_use]
    pub fn with_parked_head(mut self, parked_head: ParkedHead) -> Self {
        self.tables = Arc::new((*self.tables).clone().with_parked_head(parked_head));
        self.config = Arc::new((*self.config).clone().with_parked_head(parked_head));
        self
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Table names, SQL and clock.
    pub fn tables(&self) -> &PgTables {
        &self.tables
    }

    /// The settings this store was built with.
    pub fn config(&self) -> &PgConfig {
        &self.config
    }

    /// The [`Inbox`](outbox_core::Inbox) on the same pool, tables and clock.
    pub fn inbox(&self) -> PgInbox {
        PgInbox::new(self.pool.clone(), self.tables.clone())
    }

    /// Close the pool: waits for checked-out connections to come back. Also closes the
    /// connections kept for the relay's statements and stops the wake-up listener; relays still
    /// running fall back to polling (and fail on the closed pool).
    pub async fn close(&self) {
        self.notifier.close().await;
        self.kept.close().await;
        self.pool.close().await;
    }

    /// Create the schema if it does not exist (a no-op for `public` and for existing schemas).
    ///
    /// # Errors
    /// The server's error, e.g. [`ErrorKind::Rejected`] without the `CREATE` privilege.
    pub async fn create_schema_if_missing(&self) -> Result<()> {
        let mut conn = self.acquire().await?;
        let mut tx = conn.begin().await.map_err(|e| map(e, Phase::InTransaction, "begin"))?;
        self.lock_and_create_schema(&mut tx).await?;
        tx.commit().await.map_err(map_commit_error)
    }

    /// Apply this crate's migrations up to [`SCHEMA_VERSION`]; returns the version now in place.
    ///
    /// Idempotent and safe to run from several processes at once: it runs in one transaction
    /// under an advisory lock per schema, creates the schema if missing, and records each applied
    /// version in `<prefix>schema_version`.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when the database is at a newer version than this crate knows;
    /// otherwise the server's error.
    pub async fn migrate(&self) -> Result<i32> {
        let mut conn = self.acquire().await?;
        let mut tx = conn.begin().await.map_err(|e| map(e, Phase::InTransaction, "begin"))?;
        match self.migrate_in(&mut tx).await {
            Ok(version) => {
                tx.commit().await.map_err(map_commit_error)?;
                Ok(version)
            }
            Err(e) => {
                // Roll back now rather than on drop: the schema lock must not outlive the call.
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    async fn migrate_in(&self, tx: &mut PgConnection) -> Result<i32> {
        let step = |what: &'static str| move |e| map(e, Phase::InTransaction, what);
        // Migrations are explicit operator actions: don't let the relay's short timeouts cut them.
        sqlx::query("SELECT set_config('statement_timeout', '0', true), set_config('lock_timeout', '60s', true)")
            .execute(&mut *tx)
            .await
            .map_err(step("migrate: session settings"))?;
        self.lock_and_create_schema(tx).await?;
        let sql = &self.tables.sql;
        sqlx::raw_sql(AssertSqlSafe(sql.version_table.clone()))
            .execute(&mut *tx)
            .await
            .map_err(step("migrate: version table"))?;
        let current: Option<i32> = sqlx::query_scalar(AssertSqlSafe(sql.version_read.clone()))
            .fetch_one(&mut *tx)
            .await
            .map_err(step("migrate: reading the version"))?;
        let current = current.unwrap_or(0);
        if current > SCHEMA_VERSION {
            return Err(corrupt(format!(
                "schema \"{}\" prefix \"{}\" is at version {current}, newer than the {SCHEMA_VERSION} this \
                 library knows; upgrade the library",
                self.tables.schema(),
                self.tables.prefix()
            )));
        }
        for (version, text) in &sql.migrations {
            if *version <= current {
                continue;
            }
            sqlx::raw_sql(AssertSqlSafe(text.clone()))
                .execute(&mut *tx)
                .await
                .map_err(step("migrate: applying a migration"))?;
            sqlx::query(AssertSqlSafe(sql.version_insert_row.clone()))
                .bind(version)
                .execute(&mut *tx)
                .await
                .map_err(step("migrate: recording the version"))?;
            tracing::info!(target: "outbox.postgres", schema = self.tables.schema(), prefix = self.tables.prefix(), version, "migration applied");
        }
        Ok(SCHEMA_VERSION.max(current))
    }

    /// The schema version in the database (`None` before the first [`migrate`](PgStore::migrate)).
    ///
    /// # Errors
    /// The server's error.
    pub async fn schema_version(&self) -> Result<Option<i32>> {
        let mut conn = self.acquire().await?;
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(self.tables.own("schema_version"))
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| map(e, Phase::InTransaction, "reading the schema version"))?;
        if !exists {
            return Ok(None);
        }
        sqlx::query_scalar(AssertSqlSafe(self.tables.sql.version_read.clone()))
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| map(e, Phase::InTransaction, "reading the schema version"))
    }

    /// Check that the tables are in place at the version this crate knows, without changing
    /// anything.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] when the tables are missing or older, naming the fix
    /// ([`migrate`](PgStore::migrate), or `outbox migrate --store URL`);
    /// [`ErrorKind::Corrupt`] when the database is at a newer version than this crate knows.
    pub async fn check_schema(&self) -> Result<()> {
        let want = SCHEMA_VERSION;
        let where_ = format!("schema \"{}\", table prefix \"{}\"", self.tables.schema(), self.tables.prefix());
        match self.schema_version().await? {
            Some(v) if v == want => Ok(()),
            Some(v) if v > want => Err(corrupt(format!(
                "{where_} is at version {v}, newer than the {want} this library knows; upgrade it"
            ))),
            found => Err(Error::config(
                BACKEND,
                format!(
                    "{where_} is at version {}, this library needs {want}: run PgStore::migrate (or `outbox \
                     migrate --store URL`) first",
                    found.map_or_else(|| "none (no tables)".to_string(), |v| v.to_string())
                ),
            )),
        }
    }

    /// Enqueue `events` on `conn` (typically `&mut *tx` of your own transaction) with this
    /// store's clock and payload limit: [`enqueue`](crate::enqueue)`(conn, self, events)`, the
    /// same method `SqliteStore` has.
    ///
    /// # Errors
    /// As [`enqueue`](crate::enqueue).
    pub async fn enqueue_in(&self, conn: &mut PgConnection, events: &[Event]) -> Result<Vec<RowId>> {
        crate::enqueue::enqueue(conn, self, events).await
    }

    /// [`enqueue_in`](PgStore::enqueue_in) for one event.
    ///
    /// # Errors
    /// As [`enqueue`](crate::enqueue).
    pub async fn enqueue_one_in(&self, conn: &mut PgConnection, event: &Event) -> Result<RowId> {
        crate::enqueue::enqueue_one(conn, self, event).await
    }

    async fn lock_and_create_schema(&self, conn: &mut PgConnection) -> Result<()> {
        let schema = self.tables.schema();
        let step = |what: &'static str| move |e| map(e, Phase::InTransaction, what);
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(format!("outbox-migrate:{schema}"))
            .execute(&mut *conn)
            .await
            .map_err(step("migrate: advisory lock"))?;
        let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(schema)
            .fetch_one(&mut *conn)
            .await
            .map_err(step("migrate: looking up the schema"))?;
        if !exists {
            // The schema name is a validated identifier (see PgConfig::validate).
            sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
                .execute(&mut *conn)
                .await
                .map_err(step("migrate: creating the schema"))?;
        }
        Ok(())
    }

    pub(crate) async fn acquire(&self) -> Result<PoolConnection<Postgres>> {
        self.pool.acquire().await.map_err(|e| map(e, Phase::InTransaction, "acquiring a connection"))
    }

    /// One completion statement for rows of one `owner`; returns `(id, token, owner)` of each
    /// row it published.
    async fn complete_statement<'o>(
        &self,
        conn: &mut PgConnection,
        phase: Phase,
        owner: &'o str,
        ids: &[i64],
        tokens: &[i64],
    ) -> Result<Vec<(i64, u64, &'o str)>> {
        let done = sqlx::query(AssertSqlSafe(self.tables.sql.complete_many.clone()))
            .bind(self.tables.now_param())
            .bind(ids)
            .bind(tokens)
            .bind(owner)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| map(e, phase, "complete_many"))?;
        done.iter().map(|r| Ok((get(r, "id")?, to_u64(get(r, "token")?, "token")?, owner))).collect()
    }

    /// The completion statements of [`complete_many`](OutboxStore::complete_many) on `conn`, in
    /// one transaction when there are several; how many rows each `(id, token, owner)` published.
    async fn complete_on<'o>(
        &self,
        conn: &mut PgConnection,
        statements: &[(&'o str, &[i64], &[i64])],
    ) -> Result<BTreeMap<(i64, u64, &'o str), usize>> {
        let mut published = BTreeMap::new();
        if let [(owner, ids, tokens)] = statements {
            for key in self.complete_statement(conn, Phase::AutocommitWrite, owner, ids, tokens).await? {
                *published.entry(key).or_default() += 1;
            }
        } else {
            let mut tx = conn.begin().await.map_err(|e| map(e, Phase::InTransaction, "begin"))?;
            for (owner, ids, tokens) in statements {
                for key in self.complete_statement(&mut tx, Phase::InTransaction, owner, ids, tokens).await? {
                    *published.entry(key).or_default() += 1;
                }
            }
            tx.commit().await.map_err(map_commit_error)?;
        }
        Ok(published)
    }

    /// Run one token-conditional update; `Applied` when it matched the row.
    async fn fenced_update(
        &self,
        sql: &Arc<str>,
        what: &str,
        row: RowId,
        lease: &Lease,
        extra: impl FnOnce(
            sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments>,
        ) -> sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<bool> {
        let Ok(token) = i64::try_from(lease.token) else { return Ok(false) };
        let mut conn = self.acquire().await?;
        let query = sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(self.tables.now_param())
            .bind(row)
            .bind(token)
            .bind(lease.owner.as_str().to_owned());
        let hit = extra(query).fetch_optional(&mut *conn).await.map_err(|e| map(e, Phase::AutocommitWrite, what))?;
        Ok(hit.is_some())
    }
}

impl AsRef<PgTables> for PgStore {
    fn as_ref(&self) -> &PgTables {
        &self.tables
    }
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore").field("config", &self.config).field("clock", &self.tables.clock()).finish()
    }
}

/// An outbox row as stored.
struct StoredRow {
    id: RowId,
    event: Event,
    attempts: u32,
    token: u64,
    owner: Option<String>,
    lease_expires_at: Option<i64>,
    available_at: i64,
    created_at: i64,
    published_token: Option<u64>,
    parked_at: Option<i64>,
    last_error: Option<String>,
}

fn get<'r, T>(row: &'r PgRow, column: &str) -> Result<T>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    row.try_get(column).map_err(|e| map(e, Phase::InTransaction, "decoding an outbox row"))
}

fn to_u64(value: i64, what: &str) -> Result<u64> {
    u64::try_from(value).map_err(|_| corrupt(format!("negative {what} {value} in an outbox row")))
}

impl StoredRow {
    fn decode(row: &PgRow) -> Result<Self> {
        let id: i64 = get(row, "id")?;
        let event_id: String = get(row, "event_id")?;
        let destination: String = get(row, "destination")?;
        let bad = |e: Error| corrupt(format!("outbox row {id}: {}", e.message()));
        let event = Event {
            id: EventId::new(event_id).map_err(bad)?,
            destination: Destination::new(destination).map_err(bad)?,
            key: get(row, "key")?,
            headers: decode_headers(&get::<Vec<u8>>(row, "headers")?, BACKEND)?,
            payload: get(row, "payload")?,
        };
        let attempts: i32 = get(row, "attempts")?;
        Ok(Self {
            id,
            event,
            attempts: u32::try_from(attempts).map_err(|_| corrupt(format!("outbox row {id}: attempts {attempts}")))?,
            token: to_u64(get(row, "token")?, "token")?,
            owner: get(row, "owner")?,
            lease_expires_at: get(row, "lease_expires_at")?,
            available_at: get(row, "available_at")?,
            created_at: get(row, "created_at")?,
            published_token: get::<Option<i64>>(row, "published_token")?
                .map(|t| to_u64(t, "published token"))
                .transpose()?,
            parked_at: get(row, "parked_at")?,
            last_error: get(row, "last_error")?,
        })
    }

    fn status(&self, now: i64) -> RowStatus {
        let expires = self.lease_expires_at.map(Timestamp::from_millis);
        RowStatus::of(self.published_token.is_some(), self.parked_at.is_some(), expires, Timestamp::from_millis(now))
    }

    fn record(&self) -> OutboxRecord {
        OutboxRecord {
            row_id: self.id,
            event: self.event.clone(),
            attempts: self.attempts,
            created_at: Timestamp(self.created_at),
        }
    }
}

fn applied(hit: bool) -> Outcome {
    if hit { Outcome::Applied } else { Outcome::Fenced }
}

#[async_trait]
impl OutboxStore for PgStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn enqueue(&self, events: &[Event]) -> Result<Vec<RowId>> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.acquire().await?;
        crate::enqueue::enqueue(&mut conn, &*self.tables, events).await
    }

    async fn claim(&self, owner: &str, limit: usize, lease: Duration) -> Result<Vec<Claimed>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let sql = self.tables.claim_statement(limit);
        let mut conn = self.kept.take(&self.pool).await?;
        let rows = loop {
            let rows = sqlx::query(AssertSqlSafe(sql.as_str()))
                .bind(self.tables.now_param())
                .bind(owner.to_owned())
                .bind(millis(lease))
                .fetch_all(conn.conn())
                .await
                .map_err(|e| map(e, Phase::AutocommitWrite, "claim"));
            match rows {
                Ok(rows) => break rows,
                Err(e) if conn.lost(&e) => conn = self.kept.pooled(&self.pool).await?,
                Err(e) => return Err(e),
            }
        };
        conn.keep();
        rows.iter()
            .map(|r| {
                let row = StoredRow::decode(r)?;
                let expires_at = row.lease_expires_at.ok_or_else(|| corrupt("claimed row without a lease"))?;
                Ok(Claimed {
                    record: row.record(),
                    lease: Lease { owner: owner.to_owned(), token: row.token, expires_at: Timestamp(expires_at) },
                })
            })
            .collect()
    }

    async fn complete(&self, row: RowId, lease: &Lease) -> Result<Completion> {
        let hit = self.fenced_update(&self.tables.sql.complete, "complete", row, lease, |q| q).await?;
        Ok(if hit { Completion::Published } else { Completion::Fenced })
    }

    /// One statement per owner and per 639 rows (with a 12-byte owner; fewer with a longer
    /// one), so that each request fits one TLS record (see the crate's "Requests and TLS");
    /// several statements run in one transaction.
    async fn complete_many(&self, rows: &[(RowId, Lease)]) -> Result<Vec<Completion>> {
        // A relay completes its own rows: normally one owner, so one group.
        let mut groups: BTreeMap<&str, (Vec<i64>, Vec<i64>)> = BTreeMap::new();
        for (row, lease) in rows {
            if let Ok(token) = i64::try_from(lease.token) {
                let (ids, tokens) = groups.entry(lease.owner.as_str()).or_default();
                ids.push(*row);
                tokens.push(token);
            }
        }
        let mut statements = Vec::new();
        for (owner, (ids, tokens)) in &groups {
            let n = rows_per_statement(owner);
            statements.extend(ids.chunks(n).zip(tokens.chunks(n)).map(|(i, t)| (*owner, i, t)));
        }
        if statements.is_empty() {
            return Ok(vec![Completion::Fenced; rows.len()]);
        }
        let mut conn = self.kept.take(&self.pool).await?;
        let mut published = loop {
            match self.complete_on(conn.conn(), &statements).await {
                Ok(published) => break published,
                Err(e) if conn.lost(&e) => conn = self.kept.pooled(&self.pool).await?,
                Err(e) => return Err(e),
            }
        };
        conn.keep();
        // One entry per input, in order; a row listed twice is published by the first entry only.
        Ok(rows
            .iter()
            .map(|(row, lease)| match published.get_mut(&(*row, lease.token, lease.owner.as_str())) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    Completion::Published
                }
                _ => Completion::Fenced,
            })
            .collect())
    }

    async fn fail(&self, row: RowId, lease: &Lease, retry_after: Duration, error: &str) -> Result<Outcome> {
        let error = sanitize(error);
        let retry_after = millis(retry_after);
        let hit = self
            .fenced_update(&self.tables.sql.fail, "fail", row, lease, move |q| q.bind(retry_after).bind(error))
            .await?;
        Ok(applied(hit))
    }

    async fn park(&self, row: RowId, lease: &Lease, reason: &str) -> Result<Outcome> {
        let reason = sanitize(reason);
        let hit = self.fenced_update(&self.tables.sql.park, "park", row, lease, move |q| q.bind(reason)).await?;
        Ok(applied(hit))
    }

    async fn extend(&self, row: RowId, lease: &Lease, by: Duration) -> Result<Outcome> {
        let by = millis(by);
        let hit = self.fenced_update(&self.tables.sql.extend, "extend", row, lease, move |q| q.bind(by)).await?;
        Ok(applied(hit))
    }

    async fn release(&self, row: RowId, lease: &Lease) -> Result<Outcome> {
        let hit = self.fenced_update(&self.tables.sql.release, "release", row, lease, |q| q).await?;
        Ok(applied(hit))
    }

    /// Starts the store's `LISTEN` task on the first call (connecting like the pool does);
    /// `None` after [`close`](PgStore::close) or outside a tokio runtime. See [`PgStore`].
    fn wakeup(&self) -> Option<Wakeup> {
        self.notifier.subscribe(&self.pool.connect_options(), self.config.connect_timeout())
    }
}

#[async_trait]
impl OutboxAdmin for PgStore {
    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedRow>> {
        let mut conn = self.acquire().await?;
        let rows = sqlx::query(AssertSqlSafe(self.tables.sql.list_parked.clone()))
            .bind(limit_param(limit))
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| map(e, Phase::InTransaction, "list_parked"))?;
        rows.iter()
            .map(|r| {
                let row = StoredRow::decode(r)?;
                let parked_at = row.parked_at.ok_or_else(|| corrupt("parked row without parked_at"))?;
                Ok(ParkedRow {
                    record: row.record(),
                    reason: row.last_error.clone().unwrap_or_default(),
                    parked_at: Timestamp(parked_at),
                })
            })
            .collect()
    }

    async fn requeue_parked(&self, rows: &[RowId]) -> Result<u64> {
        if rows.is_empty() {
            return Ok(0);
        }
        let mut conn = self.acquire().await?;
        let done = sqlx::query(AssertSqlSafe(self.tables.sql.requeue.clone()))
            .bind(self.tables.now_param())
            .bind(rows.to_vec())
            .execute(&mut *conn)
            .await
            .map_err(|e| map(e, Phase::AutocommitWrite, "requeue_parked"))?;
        Ok(done.rows_affected())
    }

    async fn purge_parked(&self, rows: &[RowId]) -> Result<u64> {
        if rows.is_empty() {
            return Ok(0);
        }
        let mut conn = self.acquire().await?;
        let done = sqlx::query(AssertSqlSafe(self.tables.sql.purge.clone()))
            .bind(rows.to_vec())
            .execute(&mut *conn)
            .await
            .map_err(|e| map(e, Phase::AutocommitWrite, "purge_parked"))?;
        Ok(done.rows_affected())
    }

    async fn stats(&self) -> Result<OutboxStats> {
        let mut conn = self.acquire().await?;
        let r = sqlx::query(AssertSqlSafe(self.tables.sql.stats.clone()))
            .bind(self.tables.now_param())
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| map(e, Phase::InTransaction, "stats"))?;
        let count = |c: &str| -> Result<u64> { to_u64(get(&r, c)?, "count") };
        let now: i64 = get(&r, "now")?;
        let oldest: Option<i64> = get(&r, "oldest")?;
        Ok(OutboxStats {
            pending: count("pending")?,
            leased: count("leased")?,
            parked: count("parked")?,
            published: count("published")?,
            oldest_pending_age: oldest.map(|o| Timestamp(now).since(Timestamp(o))),
        })
    }

    async fn inspect(&self, after: RowId, limit: usize) -> Result<Vec<RowSnapshot>> {
        let mut conn = self.acquire().await?;
        let rows = sqlx::query(AssertSqlSafe(self.tables.sql.inspect.clone()))
            .bind(self.tables.now_param())
            .bind(after)
            .bind(limit_param(limit))
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| map(e, Phase::InTransaction, "inspect"))?;
        rows.iter()
            .map(|r| {
                let now: i64 = get(r, "now")?;
                let row = StoredRow::decode(r)?;
                Ok(RowSnapshot {
                    row_id: row.id,
                    status: row.status(now),
                    attempts: row.attempts,
                    token: row.token,
                    owner: row.owner.clone(),
                    lease_expires_at: row.lease_expires_at.map(Timestamp),
                    published_token: row.published_token,
                    available_at: Timestamp(row.available_at),
                    created_at: Timestamp(row.created_at),
                    last_error: row.last_error.clone(),
                    event: row.event,
                })
            })
            .collect()
    }

    /// One `DELETE` of at most `limit` rows over the `events_published` index; see the
    /// crate's "Retention".
    async fn purge_published(&self, older_than: Duration, limit: usize) -> Result<u64> {
        crate::retention::purge_published(self, older_than, limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relays_completion_fits_one_tls_record() {
        // The batch-500 stall: 500 rows with a 12-byte owner must be one statement.
        assert_eq!(rows_per_statement("relay-bench1"), 639);
        assert!(rows_per_statement("relay-bench1") >= 500);
        let request = REQUEST_OVERHEAD + "relay-bench1".len() + 639 * BYTES_PER_ROW;
        assert!(request <= TLS_RECORD, "{request} bytes");
        assert_eq!(rows_per_statement(&"o".repeat(20_000)), 1);
    }
}
