//! The store side of a chaos run: the application's tables, the producers' transactions, the
//! insert that goes behind validation's back, and the durable state the checker reads.
//!
//! Only this module and the consumer's handler know which store is in use; everything else in
//! the runner is the same on PostgreSQL and SQLite.

use std::collections::BTreeMap;
use std::path::PathBuf;

use async_trait::async_trait;
use outbox::consumer::{EffectKind, Handler};
use outbox::core::event::encode_headers;
use outbox::postgres::sqlx::{self, AssertSqlSafe};
use outbox::postgres::{PgInbox, PgStore, PgTx, map_commit_error, map_error};
use outbox::sqlite::rusqlite::{TransactionBehavior, params, params_from_iter};
use outbox::sqlite::{SqliteStore, SqliteTx, sqlite_error};
use outbox::{AnyStore, Error, ErrorKind, Event, Result};

/// The consumer name every consumer process shares: the first half of every inbox marker.
pub(crate) const CONSUMER: &str = "chaos";

/// One outbox row as the checker sees it.
#[derive(Debug, Clone)]
pub(crate) struct RowTimes {
    /// Enqueue time, ms since the epoch (store clock).
    pub(crate) created_ms: i64,
    /// When it was published (ms), if it was.
    pub(crate) published_ms: Option<i64>,
    /// Whether it is parked, and why.
    pub(crate) parked: Option<String>,
    /// Whether the completing token is the latest one.
    pub(crate) stale_completion: bool,
}

/// Table sizes at one moment (long profile).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sizes {
    /// Outbox rows.
    pub(crate) outbox_rows: u64,
    /// Rows ever inserted: the row-id high-water mark (retention deletes rows, not this).
    pub(crate) inserted: u64,
    /// Of which published.
    pub(crate) published: u64,
    /// Inbox markers.
    pub(crate) markers: u64,
    /// Effect rows.
    pub(crate) effects: u64,
    /// Bytes on disk of outbox + inbox (PostgreSQL: relation sizes; SQLite: the files).
    pub(crate) bytes: u64,
}

/// The store a run uses.
#[derive(Clone)]
pub(crate) enum Site {
    /// A runner-owned PostgreSQL, reached through its fault proxy.
    Postgres(PgStore),
    /// A SQLite file in the run's directory.
    Sqlite(SqliteStore),
}

impl Site {
    /// Open the store `url` names.
    pub(crate) async fn open(url: &str) -> Result<Self> {
        match AnyStore::connect(url).await? {
            AnyStore::Postgres(s) => Ok(Self::Postgres(s)),
            AnyStore::Sqlite(s) => Ok(Self::Sqlite(s)),
            other => Err(Error::invalid_input(
                "chaos",
                format!("the chaos runner needs a SQL store, not {}", other.backend()),
            )),
        }
    }

    /// The library's tables and the application's: `chaos_orders` (the domain write, one per
    /// event) and `chaos_effects` (the consumer's effect, deliberately without a unique
    /// constraint so that a duplicate effect would show).
    pub(crate) async fn prepare(&self) -> Result<()> {
        match self {
            Self::Postgres(s) => {
                s.migrate().await?;
                let ddl = format!(
                    "CREATE TABLE IF NOT EXISTS {} (event_id text PRIMARY KEY, key text NOT NULL, producer int NOT NULL);
                     CREATE TABLE IF NOT EXISTS {} (seq bigserial PRIMARY KEY, consumer text NOT NULL, event_id text NOT NULL,
                                                    worker text NOT NULL, at_ms bigint NOT NULL);",
                    table(s, "chaos_orders")?,
                    table(s, "chaos_effects")?
                );
                sqlx::raw_sql(AssertSqlSafe(ddl)).execute(s.pool()).await.map_err(map_error)?;
                Ok(())
            }
            Self::Sqlite(s) => {
                s.with_connection(|c| {
                    c.execute_batch(
                        "CREATE TABLE IF NOT EXISTS chaos_orders (event_id TEXT PRIMARY KEY, key TEXT NOT NULL, producer INTEGER NOT NULL);
                         CREATE TABLE IF NOT EXISTS chaos_effects (seq INTEGER PRIMARY KEY, consumer TEXT NOT NULL, event_id TEXT NOT NULL,
                                                                   worker TEXT NOT NULL, at_ms INTEGER NOT NULL);",
                    )
                })
                .await
            }
        }
    }

    /// Commit one order per event and the events, in one transaction.
    pub(crate) async fn commit(&self, producer: u32, events: &[Event]) -> Result<()> {
        match self {
            Self::Postgres(s) => {
                let insert =
                    format!("INSERT INTO {} (event_id, key, producer) VALUES ($1, $2, $3)", table(s, "chaos_orders")?);
                let mut tx = s.pool().begin().await.map_err(map_error)?;
                for e in events {
                    sqlx::query(AssertSqlSafe(insert.clone()))
                        .bind(e.id.as_str())
                        .bind(e.key.as_deref().unwrap_or(""))
                        .bind(producer as i32)
                        .execute(&mut *tx)
                        .await
                        .map_err(map_error)?;
                }
                outbox::postgres::enqueue(&mut tx, s, events).await?;
                tx.commit().await.map_err(map_commit_error)
            }
            Self::Sqlite(s) => {
                let (store, events) = (s.clone(), events.to_vec());
                tokio::task::spawn_blocking(move || {
                    let mut conn = store.connect_raw()?;
                    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(sqlite_error)?;
                    for e in &events {
                        tx.execute(
                            "INSERT INTO chaos_orders (event_id, key, producer) VALUES (?1, ?2, ?3)",
                            params![e.id.as_str(), e.key.as_deref().unwrap_or(""), producer],
                        )
                        .map_err(sqlite_error)?;
                    }
                    store.enqueue_in(&tx, &events)?;
                    tx.commit().map_err(sqlite_error)
                })
                .await
                .map_err(join_error)?
            }
        }
    }

    /// How many of `ids` have a committed order: after a commit whose outcome is unknown, all of
    /// them (it committed) or none (it did not) — one transaction never leaves part.
    pub(crate) async fn committed(&self, ids: &[String]) -> Result<usize> {
        match self {
            Self::Postgres(s) => {
                let sql = format!("SELECT count(*) FROM {} WHERE event_id = ANY($1)", table(s, "chaos_orders")?);
                let n: i64 =
                    sqlx::query_scalar(AssertSqlSafe(sql)).bind(ids).fetch_one(s.pool()).await.map_err(map_error)?;
                Ok(n as usize)
            }
            Self::Sqlite(s) => {
                let ids = ids.to_vec();
                s.with_connection(move |c| {
                    let marks = vec!["?"; ids.len()].join(",");
                    let sql = format!("SELECT count(*) FROM chaos_orders WHERE event_id IN ({marks})");
                    c.query_row(&sql, params_from_iter(ids.iter()), |r| r.get::<_, i64>(0))
                })
                .await
                .map(|n| n as usize)
            }
        }
    }

    /// Insert `event` and its order with plain SQL, skipping the enqueue's validation: what a
    /// buggy or older writer could leave in the table. The relay must park it, not choke on it.
    pub(crate) async fn insert_unchecked(&self, event: &Event) -> Result<()> {
        let headers = encode_headers(&event.headers);
        let now = now_ms();
        match self {
            Self::Postgres(s) => {
                let mut tx = s.pool().begin().await.map_err(map_error)?;
                let order =
                    format!("INSERT INTO {} (event_id, key, producer) VALUES ($1, '', -1)", table(s, "chaos_orders")?);
                sqlx::query(AssertSqlSafe(order)).bind(event.id.as_str()).execute(&mut *tx).await.map_err(map_error)?;
                let row = format!(
                    "INSERT INTO {} (event_id, destination, key, headers, payload, available_at, created_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $6)",
                    s.tables().table("events")?
                );
                sqlx::query(AssertSqlSafe(row))
                    .bind(event.id.as_str())
                    .bind(event.destination.as_str())
                    .bind(event.key.as_deref())
                    .bind(headers)
                    .bind(&event.payload)
                    .bind(now)
                    .execute(&mut *tx)
                    .await
                    .map_err(map_error)?;
                tx.commit().await.map_err(map_commit_error)
            }
            Self::Sqlite(s) => {
                let e = event.clone();
                s.with_connection(move |c| {
                    c.execute_batch("BEGIN IMMEDIATE")?;
                    let r = (|| {
                        c.execute("INSERT INTO chaos_orders (event_id, key, producer) VALUES (?1, '', -1)", params![e.id.as_str()])?;
                        c.execute(
                            "INSERT INTO outbox_rows (event_id, destination, event_key, headers, payload, available_at, created_at)
                             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6)",
                            params![e.id.as_str(), e.destination.as_str(), e.key.as_deref(), headers, e.payload, now],
                        )?;
                        Ok(())
                    })();
                    match r {
                        Ok(()) => c.execute_batch("COMMIT"),
                        Err(e) => {
                            let _ = c.execute_batch("ROLLBACK");
                            Err(e)
                        }
                    }
                })
                .await
            }
        }
    }

    /// Every committed order's event id.
    pub(crate) async fn orders(&self) -> Result<Vec<String>> {
        match self {
            Self::Postgres(s) => {
                let sql = format!("SELECT event_id FROM {}", table(s, "chaos_orders")?);
                sqlx::query_scalar(AssertSqlSafe(sql)).fetch_all(s.pool()).await.map_err(map_error)
            }
            Self::Sqlite(s) => {
                s.with_connection(|c| {
                    let mut st = c.prepare("SELECT event_id FROM chaos_orders")?;
                    st.query_map([], |r| r.get(0))?.collect()
                })
                .await
            }
        }
    }

    /// Every outbox row: event id → times and state.
    pub(crate) async fn rows(&self) -> Result<BTreeMap<String, RowTimes>> {
        type Raw = (String, i64, Option<i64>, Option<i64>, Option<String>, i64, Option<i64>);
        let raw: Vec<Raw> = match self {
            Self::Postgres(s) => {
                let sql = format!(
                    "SELECT event_id, created_at, published_at, parked_at, last_error, token, published_token FROM {}",
                    s.tables().table("events")?
                );
                sqlx::query_as(AssertSqlSafe(sql)).fetch_all(s.pool()).await.map_err(map_error)?
            }
            Self::Sqlite(s) => {
                s.with_connection(|c| {
                    let mut st = c.prepare(
                        "SELECT event_id, created_at, published_at, parked_at, last_error, token, published_token FROM outbox_rows",
                    )?;
                    st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?)))?
                        .collect()
                })
                .await?
            }
        };
        Ok(raw
            .into_iter()
            .map(|(id, created, published, parked, error, token, published_token)| {
                let row = RowTimes {
                    created_ms: created,
                    published_ms: published,
                    parked: parked.map(|_| error.unwrap_or_default()),
                    stale_completion: published_token.is_some_and(|t| t != token),
                };
                (id, row)
            })
            .collect())
    }

    /// Effect rows per event id (of the one consumer).
    pub(crate) async fn effects(&self) -> Result<BTreeMap<String, u64>> {
        let raw: Vec<(String, i64)> = match self {
            Self::Postgres(s) => {
                let sql = format!("SELECT event_id, count(*) FROM {} GROUP BY event_id", table(s, "chaos_effects")?);
                sqlx::query_as(AssertSqlSafe(sql)).fetch_all(s.pool()).await.map_err(map_error)?
            }
            Self::Sqlite(s) => {
                s.with_connection(|c| {
                    let mut st = c.prepare("SELECT event_id, count(*) FROM chaos_effects GROUP BY event_id")?;
                    st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect()
                })
                .await?
            }
        };
        Ok(raw.into_iter().map(|(id, n)| (id, n as u64)).collect())
    }

    /// Distinct events with an effect (cheap; polled while draining).
    pub(crate) async fn effected(&self) -> Result<u64> {
        let n: i64 = match self {
            Self::Postgres(s) => {
                let sql = format!("SELECT count(DISTINCT event_id) FROM {}", table(s, "chaos_effects")?);
                sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(s.pool()).await.map_err(map_error)?
            }
            Self::Sqlite(s) => {
                s.with_connection(|c| {
                    c.query_row("SELECT count(DISTINCT event_id) FROM chaos_effects", [], |r| r.get(0))
                })
                .await?
            }
        };
        Ok(n as u64)
    }

    /// Table sizes now (long profile's windows).
    pub(crate) async fn sizes(&self) -> Result<Sizes> {
        match self {
            Self::Postgres(s) => {
                let (events, markers, effects, seq) = (
                    s.tables().table("events")?,
                    s.tables().table("inbox_markers")?,
                    table(s, "chaos_effects")?,
                    s.tables().table("events_id_seq")?,
                );
                // The sequence is not transactional: rolled-back enqueues count as inserted.
                let sql = format!(
                    "SELECT (SELECT count(*) FROM {events}), (SELECT count(*) FROM {events} WHERE published_at IS NOT NULL),
                            (SELECT count(*) FROM {markers}), (SELECT count(*) FROM {effects}),
                            pg_total_relation_size('{events}') + pg_total_relation_size('{markers}'),
                            (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {seq})",
                    events = events,
                    markers = markers,
                    effects = effects
                );
                let r: (i64, i64, i64, i64, i64, i64) =
                    sqlx::query_as(AssertSqlSafe(sql)).fetch_one(s.pool()).await.map_err(map_error)?;
                Ok(Sizes {
                    outbox_rows: r.0 as u64,
                    inserted: r.5 as u64,
                    published: r.1 as u64,
                    markers: r.2 as u64,
                    effects: r.3 as u64,
                    bytes: r.4 as u64,
                })
            }
            Self::Sqlite(s) => {
                let r: (i64, i64, i64, i64, i64) = s
                    .with_connection(|c| {
                        c.query_row(
                            "SELECT (SELECT count(*) FROM outbox_rows), (SELECT count(*) FROM outbox_rows WHERE published_at IS NOT NULL),
                                    (SELECT count(*) FROM outbox_inbox_markers), (SELECT count(*) FROM chaos_effects),
                                    (SELECT COALESCE(max(seq), 0) FROM sqlite_sequence WHERE name = 'outbox_rows')",
                            [],
                            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
                        )
                    })
                    .await?;
                let path: PathBuf = s.path().to_path_buf();
                let mut wal = path.clone().into_os_string();
                wal.push("-wal");
                let bytes =
                    [path, PathBuf::from(wal)].iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
                Ok(Sizes {
                    outbox_rows: r.0 as u64,
                    inserted: r.4 as u64,
                    published: r.1 as u64,
                    markers: r.2 as u64,
                    effects: r.3 as u64,
                    bytes,
                })
            }
        }
    }

    /// The inbox's operator side, for markers and dead letters.
    pub(crate) fn inbox_admin(&self) -> std::sync::Arc<dyn outbox::InboxAdmin> {
        match self {
            Self::Postgres(s) => std::sync::Arc::new(s.inbox()),
            Self::Sqlite(s) => std::sync::Arc::new(s.clone()),
        }
    }

    /// Close pooled connections (PostgreSQL), before its server goes away.
    pub(crate) async fn close(&self) {
        if let Self::Postgres(s) = self {
            s.close().await;
        }
    }
}

fn table(s: &PgStore, name: &str) -> Result<String> {
    s.tables().app_table(name)
}

/// Wall-clock milliseconds since the epoch (the same clock the stores use on this machine).
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn join_error(e: tokio::task::JoinError) -> Error {
    Error::permanent(ErrorKind::Rejected, "chaos", format!("a task failed: {e}"))
}

/// The consumer's effect: one row in `chaos_effects` per applied event, in the inbox's
/// transaction. Additive (a second row would be a duplicate effect), so the runtime guards it
/// with an inbox marker. The poison event fails every time.
pub(crate) struct Effect {
    /// `chaos_effects`, as the store's SQL needs it.
    pub(crate) table: String,
    /// This process's label, recorded with each effect.
    pub(crate) worker: String,
    /// The event id whose handler always fails.
    pub(crate) poison: String,
}

impl Effect {
    fn check(&self, event: &Event) -> Result<()> {
        if event.id.as_str() == self.poison {
            return Err(Error::permanent(
                ErrorKind::Handler,
                "chaos",
                format!("event {} is the poison event: its handler always fails", event.id),
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl Handler<SqliteStore> for Effect {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }

    async fn apply(&self, tx: &mut SqliteTx, event: &Event) -> Result<()> {
        self.check(event)?;
        let sql = format!("INSERT INTO {} (consumer, event_id, worker, at_ms) VALUES (?1, ?2, ?3, ?4)", self.table);
        let (id, worker) = (event.id.to_string(), self.worker.clone());
        tx.run(move |c| c.execute(&sql, params![CONSUMER, id, worker, now_ms()])).await?;
        Ok(())
    }
}

#[async_trait]
impl Handler<PgInbox> for Effect {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }

    async fn apply(&self, tx: &mut PgTx, event: &Event) -> Result<()> {
        self.check(event)?;
        let sql = format!("INSERT INTO {} (consumer, event_id, worker, at_ms) VALUES ($1, $2, $3, $4)", self.table);
        sqlx::query(AssertSqlSafe(sql))
            .bind(CONSUMER)
            .bind(event.id.as_str())
            .bind(&self.worker)
            .bind(now_ms())
            .execute(&mut **tx)
            .await
            .map_err(map_error)?;
        Ok(())
    }
}

/// `chaos_effects` as the worker's store names it.
pub(crate) fn effects_table(store: &AnyStore) -> Result<String> {
    match store {
        AnyStore::Postgres(s) => table(s, "chaos_effects"),
        _ => Ok("chaos_effects".to_string()),
    }
}
