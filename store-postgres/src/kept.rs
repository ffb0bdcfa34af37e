//! Connections kept for the relay's claim and completion, outside the pool.
//!
//! A connection taken from sqlx's pool costs two round trips besides its statement: the pool
//! pings it before handing it out (`test_before_acquire`), and pings it again, in a task of its
//! own, before taking it back. A relay claims and completes a batch every few milliseconds, on
//! a server that shares the machine's cores with it; the raw loop of `outbox bench` (one
//! connection, no pool) pays neither. So the claim and the completion run on a few connections
//! the store keeps itself: one that has just finished a statement is ready for the next, and is
//! pinged only when it has been idle for [`FRESH`] or more (a server restart, a proxy's idle
//! timeout).
//!
//! A connection is kept only after its statement succeeded. After an error, or when its caller
//! went away mid-statement, a kept connection is closed and a pool connection goes back to the
//! pool (which pings it), so none is reused in an unknown state. A kept connection is closed
//! after [`RETIRE`], as the pool retires its own. At most `kept_connections` are kept (2 by
//! default): beyond them the statements run on pool connections as before. A kept connection is
//! detached from the pool, which may then open another in its place, so a store has up to
//! `pool_size + kept_connections` connections. Measured in the crate's README ("Connections kept
//! for the relay").

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use outbox_core::{ErrorKind, Result};
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};

use crate::config::PgConfig;
use crate::error::{Phase, map};

/// A kept connection idle for this long is pinged before its next statement.
pub(crate) const FRESH: Duration = Duration::from_secs(1);

/// A kept connection this old is closed instead of kept again (sqlx's default `max_lifetime`
/// for pool connections), so that the server can free what a long session accumulates.
pub(crate) const RETIRE: Duration = Duration::from_secs(30 * 60);

#[derive(Debug)]
pub(crate) struct Kept {
    /// Idle kept connections; `None` once closed.
    idle: Mutex<Option<Vec<Idle>>>,
    /// How many may be kept ([`PgConfig::kept_connections`](crate::PgConfig::kept_connections)):
    /// a relay at pipeline depth 2 claims on one while it completes on another.
    max: usize,
    /// The longest wait for a ping's answer: the
    /// [`connect_timeout`](crate::PgConfig::connect_timeout), as for the pool's own wait for a
    /// connection. One that does not answer in time (a network that drops everything) is
    /// closed, not waited for.
    ping_timeout: Duration,
}

#[derive(Debug)]
struct Idle {
    conn: PgConnection,
    /// When it was kept first.
    since: Instant,
    /// When its last statement finished.
    used: Instant,
}

/// A connection for one statement; [`Taken::keep`] after the statement succeeded.
pub(crate) enum Taken<'a> {
    Kept(&'a Kept, PgConnection, Instant),
    Pooled(&'a Kept, PoolConnection<Postgres>),
}

impl Kept {
    pub(crate) fn new(config: &PgConfig) -> Self {
        Self {
            idle: Mutex::new(Some(Vec::new())),
            max: usize::try_from(config.kept_connections()).unwrap_or(usize::MAX),
            ping_timeout: config.connect_timeout(),
        }
    }

    /// A kept connection (pinged first if idle for [`FRESH`]; one that does not answer within
    /// the ping timeout is closed and the next tried), else one from the pool.
    pub(crate) async fn take<'a>(&'a self, pool: &PgPool) -> Result<Taken<'a>> {
        loop {
            let popped = self.lock().as_mut().and_then(Vec::pop);
            let Some(Idle { mut conn, since, used }) = popped else { break };
            if used.elapsed() < FRESH
                || matches!(tokio::time::timeout(self.ping_timeout, conn.ping()).await, Ok(Ok(())))
            {
                return Ok(Taken::Kept(self, conn, since));
            }
        }
        self.pooled(pool).await
    }

    /// A connection from the pool, for one more try after a kept connection was found lost
    /// (see [`Taken::lost`]).
    pub(crate) async fn pooled<'a>(&'a self, pool: &PgPool) -> Result<Taken<'a>> {
        let conn = pool.acquire().await.map_err(|e| map(e, Phase::InTransaction, "acquiring a connection"))?;
        Ok(Taken::Pooled(self, conn))
    }

    /// Close the kept connections; from now on none is kept.
    pub(crate) async fn close(&self) {
        let idle = self.lock().take().unwrap_or_default();
        for Idle { conn, .. } in idle {
            let _ = conn.close().await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<Idle>>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Taken<'_> {
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        match self {
            Taken::Kept(_, conn, _) => conn,
            Taken::Pooled(_, conn) => conn,
        }
    }

    /// Whether `error`, from a statement on this connection, says a kept connection was lost
    /// (it died while idle: a server restart, a terminated backend, a cut). Such a statement
    /// is tried once more on a pool connection, which the pool pings first: every statement
    /// kept connections run is one that may run again (a claim whose answer was lost leaves
    /// its rows leased until the lease expires, a completion is fenced by its token).
    pub(crate) fn lost(&self, error: &outbox_core::Error) -> bool {
        matches!(self, Taken::Kept(..)) && error.kind() == ErrorKind::Connection
    }

    /// The statement succeeded: keep the connection if there is room, else give it back (a
    /// pool connection) or close it (a kept one). Not called after an error: dropping a `Taken`
    /// closes a kept connection and gives a pool connection back to the pool.
    pub(crate) fn keep(self) {
        let (kept, conn, since) = match self {
            Taken::Kept(kept, conn, since) => (kept, Ok(conn), since),
            Taken::Pooled(kept, conn) => (kept, Err(conn), Instant::now()),
        };
        let mut idle = kept.lock();
        match idle.as_mut() {
            Some(idle) if idle.len() < kept.max && since.elapsed() < RETIRE => {
                let conn = conn.unwrap_or_else(PoolConnection::detach);
                idle.push(Idle { conn, since, used: Instant::now() });
            }
            // No room, retired or closed: a pool connection goes back to the pool, a kept one is
            // closed (dropping it closes its socket).
            _ => drop(conn),
        }
    }
}
