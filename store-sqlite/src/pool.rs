//! A few connections, used from async code without blocking the runtime.
//!
//! `rusqlite` is synchronous and a write may wait for another connection's lock for the whole
//! busy timeout, so every call runs on tokio's blocking pool, owning its connection while it
//! runs. A semaphore bounds how many connections exist; they are opened lazily and reused.
//!
//! SQLite has one writer at a time, and a writer that finds the lock taken sleeps in the busy
//! handler (1, 2, 5, 10 ms and longer) well past the moment the lock is free again: a relay
//! claiming its next batch while it completes the last one lost about 40% of its throughput to
//! those sleeps. So the store's own short write transactions ([`Pool::write`]) take turns in
//! the process first, and the lock passes from one to the next at once. Writers in other
//! processes, and transactions the application holds open, still meet the busy handler.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use outbox_core::{Error, ErrorKind, Result};
use rusqlite::{Connection, Transaction};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::SqliteConfig;
use crate::error::BACKEND;
use crate::store::write_tx;

pub(crate) struct Pool {
    config: SqliteConfig,
    idle: Mutex<Vec<Connection>>,
    permits: Arc<Semaphore>,
    /// One turn: held by the short write transaction of this pool that may take SQLite's lock.
    writer: tokio::sync::Mutex<()>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("path", &self.config.path)
            .field("size", &self.config.pool_size)
            .field("available", &self.permits.available_permits())
            .finish()
    }
}

impl Pool {
    pub(crate) fn new(config: SqliteConfig, first: Connection) -> Arc<Self> {
        let permits = Arc::new(Semaphore::new(config.pool_size));
        Arc::new(Self { config, idle: Mutex::new(vec![first]), permits, writer: tokio::sync::Mutex::const_new(()) })
    }

    pub(crate) fn config(&self) -> &SqliteConfig {
        &self.config
    }

    /// Wait for a free slot; the connection itself is taken (or opened) on the blocking thread.
    pub(crate) async fn checkout(self: &Arc<Self>) -> Result<Checkout> {
        let permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .map_err(|_| Error::permanent(ErrorKind::Closed, BACKEND, "connection pool is closed"))?;
        let conn = self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
        Ok(Checkout { conn, pool: Arc::clone(self), _permit: permit })
    }

    /// Run `f` on a pooled connection on the blocking pool.
    pub(crate) async fn run<T, F>(self: &Arc<Self>, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        self.checkout().await?.run(f).await
    }

    /// Run `f` in a `BEGIN IMMEDIATE` transaction on a pooled connection, when no other write of
    /// this pool is running (see the module docs); rolled back if `f` or the commit fails. Waits
    /// at most the busy timeout for its turn, then at most the busy timeout for SQLite's lock;
    /// either wait running out is a transient [`ErrorKind::Busy`].
    pub(crate) async fn write<T, F>(self: &Arc<Self>, what: &'static str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Transaction<'_>) -> Result<T> + Send + 'static,
    {
        // Waiting for the turn counts as waiting for the lock: at most the busy timeout, then the
        // same transient `Busy` as SQLite's own wait gives, instead of queuing behind every write
        // that is itself waiting out a lock held elsewhere.
        let timeout = self.config.busy_timeout;
        let _turn = tokio::time::timeout(timeout, self.writer.lock()).await.map_err(|_| {
            Error::transient(
                ErrorKind::Busy,
                BACKEND,
                format!(
                    "{what}: other writes of this store held the write lock for the whole busy timeout ({timeout:?})"
                ),
            )
        })?;
        self.run(move |conn| write_tx(conn, what, f)).await
    }
}

/// One slot of the pool: a permit and, between calls, its connection. Dropping it gives the
/// connection back, unless a transaction was left open on it (then the connection is closed,
/// which rolls the transaction back).
pub(crate) struct Checkout {
    conn: Option<Connection>,
    pool: Arc<Pool>,
    _permit: OwnedSemaphorePermit,
}

impl fmt::Debug for Checkout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkout").field("connected", &self.conn.is_some()).finish_non_exhaustive()
    }
}

impl Checkout {
    /// Run `f` on this slot's connection (opening it if needed) on the blocking pool.
    ///
    /// If the future is dropped while `f` runs, the connection is closed when `f` returns (which
    /// rolls back an open transaction); a later `run` opens a fresh one, `run_existing` fails.
    pub(crate) async fn run<T, F>(&mut self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        let conn = self.conn.take();
        let config = self.pool.config.clone();
        let task = tokio::task::spawn_blocking(move || {
            let mut conn = match conn {
                Some(c) => c,
                None => match config.open_connection() {
                    Ok(c) => c,
                    Err(e) => return (None, Err(e)),
                },
            };
            let out = f(&mut conn);
            (Some(conn), out)
        });
        match task.await {
            Ok((conn, out)) => {
                self.conn = conn;
                out
            }
            Err(e) => match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(_) => Err(Error::permanent(ErrorKind::Closed, BACKEND, "blocking task was cancelled")),
            },
        }
    }

    /// Run `f` on the connection this checkout already holds; fails if it has none (a
    /// transaction's connection is never replaced by a fresh one).
    pub(crate) async fn run_existing<T, F>(&mut self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        if self.conn.is_none() {
            return Err(Error::permanent(
                ErrorKind::Closed,
                BACKEND,
                "the transaction's connection was lost (an earlier call on it was cancelled or panicked); \
                 it has been rolled back",
            ));
        }
        self.run(f).await
    }

    /// Roll back whatever is open on the connection. Blocking.
    pub(crate) fn rollback_blocking(&mut self) {
        if let Some(conn) = &self.conn
            && !conn.is_autocommit()
            && conn.execute_batch("ROLLBACK").is_err()
        {
            // Closing the connection rolls back for sure.
            self.conn = None;
        }
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take()
            && conn.is_autocommit()
        {
            self.pool.idle.lock().unwrap_or_else(PoisonError::into_inner).push(conn);
        }
    }
}
