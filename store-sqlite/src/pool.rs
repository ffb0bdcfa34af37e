//! A few connections, used from async code without blocking the runtime.
//!
//! `rusqlite` is synchronous and a write may wait for another connection's lock for the whole
//! busy timeout, so every call runs on tokio's blocking pool, owning its connection while it
//! runs. A semaphore bounds how many connections exist (besides the one the store's own writes
//! run on, "One connection for the turn" below); they are opened lazily and reused.
//!
//! SQLite has one writer at a time, and a writer that finds the lock taken sleeps in the busy
//! handler (1, 2, 5, 10 ms and longer) well past the moment the lock is free again: a relay
//! claiming its next batch while it completes the last one lost about 40% of its throughput to
//! those sleeps. So the store's own short write transactions ([`Pool::write`]) take turns in
//! the process first, and the lock passes from one to the next at once. Writers in other
//! processes, and transactions the application holds open, still meet the busy handler.
//!
//! # Group commit
//!
//! With `synchronous=full` every commit waits for the disk (an fsync, a third of a millisecond
//! or more), and producers enqueueing at once all wait for the turn, one commit after another.
//! So the write that gets the turn runs every write queued at that
//! moment in one transaction, each in a savepoint of its own, and commits once: a write that
//! fails is rolled back to its savepoint and gets its own error, the others commit. A group of
//! one takes no savepoint (it fails with its transaction): SQLite keeps the original of every
//! page a savepoint changes, in a temporary file past 64 KiB, and a relay's claim or completion,
//! which usually queues alone behind the other, changes more than that. No write's
//! caller hears of its result before the commit that makes it durable (or, if that commit fails,
//! gets the commit's error). The writes of one group run in the order they were queued, one
//! after another on one connection, so the group is what running them one by one would give.
//! A write that finds the turn free and nothing queued runs at once, without the queue (through
//! it, one producer alone was about a quarter slower).
//!
//! Measured with one store on a fresh file, each task enqueueing one 256-byte event at a time
//! (4,000 in all), alternating with the pool before (one transaction per write), three runs
//! each: 16 tasks 18.8k, 27.4k, 25.5k events/s in about 255 transactions against 3.6k, 3.8k,
//! 4.6k; 4 tasks 8.9k, 9.7k, 10.4k against 3.5k, 3.5k, 4.3k; one task 3.7k, 3.0k, 3.5k against
//! 3.5k, 3.6k, 3.3k.
//!
//! Writes queued while a transaction's writes run are taken into it too, each in a savepoint,
//! before it commits (once: those queued during them wait for the next turn). A relay's claim
//! and its last batch's completion seldom wait at once (1,023 to 1,028 transactions for 1,028
//! writes in `outbox bench --only P5`), but one is nearly always issued while the other runs:
//! taken along, the pair commits once instead of twice, so each batch waits for one fsync, not
//! two. `outbox bench --only P5 --seed 7`, seven pairs alternating with the pool before (ratio to
//! the same run's raw rusqlite loop, which commits claim and completion apart): 0.88, 0.90, 0.98,
//! 0.97, 0.91, 0.89, 0.99 against 0.78, 0.87, 0.85, 0.92, 0.69, 0.85, 0.87. A first write that
//! fails takes nothing along (it fails with its transaction), and what it would have taken
//! waits for the next turn.
//!
//! # One connection for the turn
//!
//! Each connection keeps its own cache of the file's pages, and a write on another connection
//! makes it stale: the next transaction reads again what the other one changed. When the turn's
//! writes took whichever pooled connection was free, a relay's claim and completion alternated
//! between two connections (the last write's connection goes back to the pool only after its
//! caller has its result, so the next write, already holding the turn, takes another), and
//! each found its cache stale. So the turn owns one connection of its own, outside the pool's
//! `pool_size`: every write of the turn runs on it, and it is handed on with the turn. Measured
//! in `outbox bench --only P5 --seed 7` (pipeline depth 2), time inside the statements per call:
//! claim 0.88–1.03 ms and completion 0.40–0.47 ms against 1.16–1.39 ms and 0.59–0.71 ms.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use outbox_core::{Error, ErrorKind, Result};
use rusqlite::{Connection, Transaction, TransactionBehavior};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

use crate::config::SqliteConfig;
use crate::error::{BACKEND, map, map_commit};

pub(crate) struct Pool {
    config: SqliteConfig,
    idle: Mutex<Vec<Connection>>,
    permits: Arc<Semaphore>,
    /// One turn, and the connection the turn's writes run on: held by the group of this pool's
    /// short write transactions that may take SQLite's lock until its transaction has ended
    /// (module docs, "One connection for the turn"). `None` until the first write opens it,
    /// and again after a write panicked on it.
    writer: Arc<tokio::sync::Mutex<Option<Connection>>>,
    /// Writes waiting for a turn, in the order they came (module docs, "Group commit").
    queue: Mutex<VecDeque<Queued>>,
    next_write: AtomicU64,
    /// Write transactions begun by [`Pool::write`] (groups, not writes).
    transactions: AtomicU64,
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
        Arc::new(Self {
            config,
            idle: Mutex::new(vec![first]),
            permits,
            writer: Arc::new(tokio::sync::Mutex::const_new(None)),
            queue: Mutex::new(VecDeque::new()),
            next_write: AtomicU64::new(0),
            transactions: AtomicU64::new(0),
        })
    }

    pub(crate) fn config(&self) -> &SqliteConfig {
        &self.config
    }

    /// Write transactions [`Pool::write`] has begun: fewer than its calls when writes waiting at
    /// once were committed together.
    #[cfg(test)]
    pub(crate) fn write_transactions(&self) -> u64 {
        self.transactions.load(Ordering::Relaxed)
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

    /// Run `f` in a `BEGIN IMMEDIATE` transaction on the turn's connection, when no other write
    /// of this pool is running (see the module docs), together with the other writes waiting then
    /// or queued while it runs ("Group commit"); rolled back (to its savepoint) if `f` fails, and
    /// returns only once the transaction has committed or failed. Waits at most the busy timeout
    /// for its turn, then at most the busy timeout for SQLite's lock; either wait running out is
    /// a transient [`ErrorKind::Busy`].
    pub(crate) async fn write<T, F>(self: &Arc<Self>, what: &'static str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Transaction<'_>) -> Result<T> + Send + 'static,
    {
        // Alone: a free turn and nothing queued, so nothing to commit with.
        if let Ok(turn) = Arc::clone(&self.writer).try_lock_owned()
            && self.queue().is_empty()
        {
            self.transactions.fetch_add(1, Ordering::Relaxed);
            let pool = Arc::clone(self);
            return self.on_writer(turn, move |conn| write_alone(conn?, &pool, what, f)).await;
        }
        let (reply, mut result) = oneshot::channel();
        let id = self.next_write.fetch_add(1, Ordering::Relaxed);
        self.queue().push_back(Queued { id, what, write: Box::new(Write { f, reply }) });
        // A caller that goes away before its write is taken into a group takes it back.
        let queued = Unqueue { pool: self, id };

        // Waiting for the turn counts as waiting for the lock: at most the busy timeout, then the
        // same transient `Busy` as SQLite's own wait gives, instead of queuing behind every write
        // that is itself waiting out a lock held elsewhere. Another write's group may take this
        // one along meanwhile: then its result comes without a turn.
        let timeout = self.config.busy_timeout;
        let turn = tokio::select! {
            biased;
            out = &mut result => return delivered(out),
            turn = tokio::time::timeout(timeout, Arc::clone(&self.writer).lock_owned()) => turn,
        };
        let Ok(turn) = turn else {
            if queued.take_back() {
                return Err(Error::transient(
                    ErrorKind::Busy,
                    BACKEND,
                    format!(
                        "{what}: other writes of this store held the write lock for the whole busy timeout ({timeout:?})"
                    ),
                ));
            }
            // Taken into a group that is running: its result is on the way.
            return delivered(result.await);
        };
        // With the turn, no group is running: this write is either done or still queued.
        if let Ok(out) = result.try_recv() {
            return out;
        }
        let group: Vec<Queued> = self.queue().drain(..).collect();
        self.transactions.fetch_add(1, Ordering::Relaxed);
        // The turn ends with the transaction, on the blocking thread, even if this caller goes
        // away meanwhile; the others' results are delivered from there too.
        let pool = Arc::clone(self);
        self.on_writer(turn, move |conn| {
            match conn {
                Ok(conn) => commit_group(conn, &pool, group),
                // No connection to run on: every write of the group gets why.
                Err(e) => group.into_iter().for_each(|q| q.write.refuse(e.clone())),
            }
            Ok(())
        })
        .await?;
        delivered(result.await)
    }

    /// Run `f` on the turn's connection (opening it first if there is none; `f` gets the error
    /// if that fails) on the blocking pool. The connection goes back to the turn, and the turn
    /// is released, on the blocking thread when `f` returns, even if the caller went away
    /// meanwhile; a connection `f` panicked on is closed (rolling back what it held open), and
    /// the next write opens another.
    async fn on_writer<T, F>(&self, mut turn: tokio::sync::OwnedMutexGuard<Option<Connection>>, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(Result<&mut Connection>) -> Result<T> + Send + 'static,
    {
        let config = self.config.clone();
        let task = tokio::task::spawn_blocking(move || {
            let mut conn = match turn.take() {
                Some(c) => Ok(c),
                None => config.open_store_connection(),
            };
            let out = f(conn.as_mut().map_err(|e| e.clone()));
            *turn = conn.ok();
            out
        });
        match task.await {
            Ok(out) => out,
            Err(e) => not_joined(e),
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Queued>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The writes queued now, taken into the running transaction (module docs, "Group commit").
    fn take_queued(&self) -> Vec<Queued> {
        self.queue().drain(..).collect()
    }
}

/// A blocking task that did not return: its panic goes on in the caller; a cancelled one (the
/// runtime shutting down) is a permanent `Closed`.
fn not_joined<T>(e: tokio::task::JoinError) -> Result<T> {
    match e.try_into_panic() {
        Ok(panic) => std::panic::resume_unwind(panic),
        Err(_) => Err(Error::permanent(ErrorKind::Closed, BACKEND, "blocking task was cancelled")),
    }
}

/// Run `f` in a `BEGIN IMMEDIATE` transaction, then the writes queued while it ran (each in a
/// savepoint), and commit once; rolled back if `f` fails (nothing is taken along then), and
/// `f`'s result is the commit's error if the commit fails.
fn write_alone<T>(
    conn: &mut Connection,
    pool: &Pool,
    what: &str,
    f: impl FnOnce(&Transaction<'_>) -> Result<T>,
) -> Result<T> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| map(what, e))?;
    let out = f(&tx)?;
    match take_along_and_commit(tx, what, Vec::new(), pool.take_queued()) {
        None => Ok(out),
        Some(e) => Err(e),
    }
}

/// A write's result, or why it has none: its group's thread panicked (inside another write) or
/// was cancelled before the write ran.
fn delivered<T>(out: std::result::Result<Result<T>, oneshot::error::RecvError>) -> Result<T> {
    out.unwrap_or_else(|_| {
        Err(Error::permanent(
            ErrorKind::Closed,
            BACKEND,
            "the write was abandoned with the transaction it was queued into (a write in it panicked)",
        ))
    })
}

/// A write waiting for a turn.
struct Queued {
    id: u64,
    what: &'static str,
    write: Box<dyn Pending>,
}

/// Takes a write out of the queue if its caller leaves before the write was taken into a group.
struct Unqueue<'a> {
    pool: &'a Pool,
    id: u64,
}

impl Unqueue<'_> {
    /// Whether the write was still queued (and now is not).
    fn take_back(&self) -> bool {
        let mut queue = self.pool.queue();
        let Some(at) = queue.iter().position(|q| q.id == self.id) else { return false };
        queue.remove(at);
        true
    }
}

impl Drop for Unqueue<'_> {
    fn drop(&mut self) {
        self.take_back();
    }
}

/// One write of a group, its result type erased.
trait Pending: Send {
    /// Run the write's statements; the write's result waits for the group's commit.
    fn run(self: Box<Self>, tx: &Transaction<'_>) -> Ran;
    /// The write does not run: tell its caller why.
    fn refuse(self: Box<Self>, error: Error);
}

struct Write<T, F> {
    f: F,
    reply: oneshot::Sender<Result<T>>,
}

/// A write that ran in the group's transaction, waiting for its commit.
struct Ran {
    ok: bool,
    /// Hands the write's result to its caller: `None` once the group committed, else the error
    /// that ended the group (a write that failed itself gets its own error either way).
    deliver: Box<dyn FnOnce(Option<Error>) + Send>,
}

impl<T, F> Pending for Write<T, F>
where
    T: Send + 'static,
    F: FnOnce(&Transaction<'_>) -> Result<T> + Send + 'static,
{
    fn run(self: Box<Self>, tx: &Transaction<'_>) -> Ran {
        let Write { f, reply } = *self;
        let out = f(tx);
        Ran {
            ok: out.is_ok(),
            deliver: Box::new(move |ended| {
                let out = match (out, ended) {
                    (Ok(_), Some(e)) => Err(e),
                    (out, _) => out,
                };
                // The caller may have gone away; its write is done either way.
                let _ = reply.send(out);
            }),
        }
    }

    fn refuse(self: Box<Self>, error: Error) {
        let _ = self.reply.send(Err(error));
    }
}

/// Run `group` in one `BEGIN IMMEDIATE` transaction, then the writes queued while it ran, and
/// commit it once (module docs, "Group commit"); every write's caller gets its result.
fn commit_group(conn: &mut Connection, pool: &Pool, mut group: Vec<Queued>) {
    let what = match group.as_slice() {
        [] => return,
        [one] => one.what.to_string(),
        [first, rest @ ..] => format!("{} (one transaction with {} other writes)", first.what, rest.len()),
    };
    let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(e) => {
            let e = map(&what, e);
            group.into_iter().for_each(|q| q.write.refuse(e.clone()));
            return;
        }
    };
    // A group of one needs no savepoint: its write fails with its transaction, as a write
    // alone does. A savepoint keeps the original of every page the write changes, past 64 KiB
    // in a temporary file that SQLite creates and deletes: a relay's claim or completion of 100
    // rows changes that many pages of the key indexes, and queues behind the other (a group of
    // one) about every batch.
    if group.len() == 1
        && let Some(q) = group.pop()
    {
        let r = q.write.run(&tx);
        if !r.ok {
            drop(tx);
            (r.deliver)(None);
            return;
        }
        take_along_and_commit(tx, &what, vec![r], pool.take_queued());
        return;
    }
    let mut ran = Vec::with_capacity(group.len());
    if let Err(e) = run_in_savepoints(&tx, &what, &mut ran, group) {
        end_broken(tx, ran, e);
        return;
    }
    take_along_and_commit(tx, &what, ran, pool.take_queued());
}

/// Run `along` (writes queued while the transaction's first writes ran) in savepoints of `tx`
/// and commit; every write of `ran` and `along` gets its result. Returns the error that ended the
/// transaction, if one did.
fn take_along_and_commit(tx: Transaction<'_>, what: &str, mut ran: Vec<Ran>, along: Vec<Queued>) -> Option<Error> {
    // A write taken along hears of a failed commit or savepoint under the first write's name:
    // say that it was taken along, and how many were.
    let what = match along.len() {
        0 => std::borrow::Cow::Borrowed(what),
        n => std::borrow::Cow::Owned(format!("{what}, with {n} write(s) taken along")),
    };
    if let Err(e) = run_in_savepoints(&tx, &what, &mut ran, along) {
        return Some(end_broken(tx, ran, e));
    }
    let ended = tx.commit().err().map(|e| map_commit(&what, e));
    ran.into_iter().for_each(|r| (r.deliver)(ended.clone()));
    ended
}

/// Run `writes` in `tx`, each in a savepoint of its own (a write that fails is rolled back to
/// it), pushing each to `ran`. A savepoint that could not be set or undone breaks the
/// transaction: the writes not run yet are refused, and the error is returned.
fn run_in_savepoints(tx: &Transaction<'_>, what: &str, ran: &mut Vec<Ran>, writes: Vec<Queued>) -> Result<()> {
    let mut waiting = writes.into_iter();
    let mut broken = None;
    for q in waiting.by_ref() {
        if let Err(e) = tx.execute_batch("SAVEPOINT outbox_write") {
            broken = Some((map(q.what, e), Some(q)));
            break;
        }
        let r = q.write.run(tx);
        let end = if r.ok { "RELEASE outbox_write" } else { "ROLLBACK TO outbox_write; RELEASE outbox_write" };
        let ended = tx.execute_batch(end);
        ran.push(r);
        if let Err(e) = ended {
            broken = Some((map(q.what, e), None));
            break;
        }
    }
    let Some((e, unstarted)) = broken else { return Ok(()) };
    let e = Error::new(
        e.kind(),
        e.retry(),
        BACKEND,
        format!("{what}: rolled back with every write of its transaction: {e}"),
    );
    unstarted.into_iter().chain(waiting).for_each(|q| q.write.refuse(e.clone()));
    Err(e)
}

/// A savepoint could not be set or undone: nothing of the transaction is kept, and every write
/// that ran in it gets `e`. Returns `e`.
fn end_broken(tx: Transaction<'_>, ran: Vec<Ran>, e: Error) -> Error {
    drop(tx);
    ran.into_iter().for_each(|r| (r.deliver)(Some(e.clone())));
    e
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
                None => match config.open_store_connection() {
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
            Err(e) => not_joined(e),
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::error::ResultExt;

    /// One write of a test, its result ignored.
    type TestWrite = Box<dyn FnOnce(&Transaction<'_>) -> Result<()> + Send>;

    /// A pool on a fresh file with table `t` (unique names) holding the name `taken`, and
    /// `child` whose deferred foreign key fails only at commit.
    async fn pool(dir: &tempfile::TempDir) -> Arc<Pool> {
        let config = SqliteConfig::new(dir.path().join("pool.db")).with_pool_size(2);
        let pool = Pool::new(config.clone(), config.open_connection().unwrap());
        pool.run(|c| {
            c.execute_batch(
                "CREATE TABLE t (name TEXT PRIMARY KEY);
                 INSERT INTO t VALUES ('taken');
                 CREATE TABLE child (parent TEXT REFERENCES t (name) DEFERRABLE INITIALLY DEFERRED);",
            )
            .ctx("create")
        })
        .await
        .unwrap();
        pool
    }

    /// Names in `t`, read on a connection of its own (committed state only).
    fn committed(pool: &Pool) -> Vec<String> {
        let conn = pool.config().open_connection().unwrap();
        let mut stmt = conn.prepare("SELECT name FROM t ORDER BY name").unwrap();
        stmt.query_map([], |r| r.get(0)).unwrap().collect::<rusqlite::Result<_>>().unwrap()
    }

    /// Hold the turn, queue `writes` behind it (waiting, bounded, until all are queued), let
    /// them go, and return their results in order with the transactions they took.
    async fn queued_behind_the_turn(pool: &Arc<Pool>, writes: Vec<TestWrite>) -> (Vec<Result<()>>, u64) {
        let turn = Arc::clone(&pool.writer).lock_owned().await;
        let n = writes.len();
        let tasks: Vec<_> = writes
            .into_iter()
            .map(|w| {
                let pool = Arc::clone(pool);
                tokio::spawn(async move { pool.write("test write", w).await })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.queue().len() < n {
            assert!(Instant::now() < deadline, "only {} of {n} writes queued within 10s", pool.queue().len());
            tokio::task::yield_now().await;
        }
        let before = pool.write_transactions();
        drop(turn);
        let mut out = Vec::new();
        for t in tasks {
            out.push(tokio::time::timeout(Duration::from_secs(10), t).await.expect("a write within 10s").unwrap());
        }
        (out, pool.write_transactions() - before)
    }

    /// Run one write that adds a row to a temporary table (one per connection) and returns how
    /// many that connection's temporary table holds then.
    async fn count_on_its_connection(pool: &Arc<Pool>) -> Result<i64> {
        pool.write("test write", |tx| {
            tx.execute_batch("CREATE TEMP TABLE IF NOT EXISTS seen (x); INSERT INTO temp.seen VALUES (1);")
                .ctx("temp")?;
            tx.query_row("SELECT count(*) FROM temp.seen", [], |r| r.get(0)).ctx("temp")
        })
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_write_of_the_turn_runs_on_one_connection_while_reads_take_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        const WRITES: i64 = 40;
        let tasks: Vec<_> = (0..WRITES)
            .map(|i| {
                let pool = Arc::clone(&pool);
                tokio::spawn(async move {
                    // Reads beside the writes keep the pool's connections busy and moving.
                    if i % 2 == 0 {
                        pool.run(|c| c.query_row("SELECT count(*) FROM t", [], |r| r.get::<_, i64>(0)).ctx("read"))
                            .await?;
                    }
                    count_on_its_connection(&pool).await
                })
            })
            .collect();
        let mut counts = Vec::new();
        for t in tasks {
            counts.push(
                tokio::time::timeout(Duration::from_secs(10), t).await.expect("a write within 10s").unwrap().unwrap(),
            );
        }
        counts.sort_unstable();
        let want: Vec<i64> = (1..=WRITES).collect();
        assert_eq!(
            counts, want,
            "each write saw the rows of every write before it in its connection's temporary table"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_panics_closes_the_turns_connection_and_the_next_write_opens_another() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        assert_eq!(count_on_its_connection(&pool).await.unwrap(), 1);
        let panicking = Arc::clone(&pool);
        let joined = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::spawn(async move {
                panicking
                    .write("test write", |tx| -> Result<()> {
                        tx.execute("INSERT INTO t VALUES ('never')", []).ctx("insert")?;
                        panic!("a write that panics")
                    })
                    .await
            }),
        )
        .await
        .expect("the panicking write ends within 10s");
        assert!(joined.is_err_and(|e| e.is_panic()), "the panic reaches the write's caller");
        // A fresh connection: its temporary table is new; the panicked write's insert is gone.
        assert_eq!(count_on_its_connection(&pool).await.unwrap(), 1, "the next write ran on a new connection");
        assert_eq!(committed(&pool), ["taken"], "nothing of the panicked write was kept");
    }

    fn insert(name: &'static str) -> TestWrite {
        Box::new(move |tx| tx.execute("INSERT INTO t VALUES (?1)", [name]).map(drop).ctx("insert"))
    }

    /// A write that inserts `half` and then fails on the name `taken`, which is there already.
    fn half_then_taken() -> TestWrite {
        Box::new(|tx| {
            tx.execute("INSERT INTO t VALUES ('half')", []).ctx("insert")?;
            tx.execute("INSERT INTO t VALUES ('taken')", []).map(drop).ctx("insert")
        })
    }

    /// Run `first` (alone, or queued behind the turn as a group of one when `queued`); while it
    /// runs, queue `others` behind it, and let it finish only once all of them are queued
    /// (waiting for that at most 10 s). Returns every result, `first`'s first, with the
    /// transactions they took.
    async fn queued_while_running(
        pool: &Arc<Pool>,
        first: TestWrite,
        queued: bool,
        others: Vec<TestWrite>,
    ) -> (Vec<Result<()>>, u64) {
        let before = pool.write_transactions();
        let n = others.len();
        let held = if queued { Some(Arc::clone(&pool.writer).lock_owned().await) } else { None };
        let (running, started) = oneshot::channel::<()>();
        let first = {
            let (pool, watched) = (Arc::clone(pool), Arc::clone(pool));
            tokio::spawn(async move {
                pool.write("first write", move |tx| {
                    let _ = running.send(());
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while watched.queue().len() < n {
                        assert!(Instant::now() < deadline, "{} of {n} writes queued within 10s", watched.queue().len());
                        std::thread::yield_now();
                    }
                    first(tx)
                })
                .await
            })
        };
        if held.is_some() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while pool.queue().is_empty() {
                assert!(Instant::now() < deadline, "the first write did not queue within 10s");
                tokio::task::yield_now().await;
            }
            drop(held);
        }
        tokio::time::timeout(Duration::from_secs(10), started).await.expect("the first write runs within 10s").unwrap();
        let tasks: Vec<_> = std::iter::once(first)
            .chain(others.into_iter().map(|w| {
                let pool = Arc::clone(pool);
                tokio::spawn(async move { pool.write("test write", w).await })
            }))
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(tokio::time::timeout(Duration::from_secs(10), t).await.expect("a write within 10s").unwrap());
        }
        (out, pool.write_transactions() - before)
    }

    /// Writes queued while a transaction runs are taken into it before it commits (module docs,
    /// "Group commit"), whether its first write ran alone or waited for the turn alone: one
    /// commit for all; a write taken along that fails is undone alone and gets its own error; a
    /// first write that fails takes nothing along, and the writes queued behind it commit in a
    /// transaction of their own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_queued_while_a_transaction_runs_are_taken_into_it() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        for (queued, names) in [(false, ["a", "b"]), (true, ["c", "d"])] {
            let (out, transactions) =
                queued_while_running(&pool, insert(names[0]), queued, vec![insert(names[1]), half_then_taken()]).await;
            assert_eq!(transactions, 1, "queued {queued}: three writes, one transaction: {out:?}");
            assert!(out[0].is_ok() && out[1].is_ok(), "queued {queued}: {out:?}");
            let error = out[2].as_ref().expect_err("the write taken along failed");
            assert!(error.to_string().contains("insert"), "its own error: {error}");
        }
        assert_eq!(committed(&pool), ["a", "b", "c", "d", "taken"], "nothing of the failed writes");

        for queued in [false, true] {
            let name = if queued { "f" } else { "e" };
            let (out, transactions) = queued_while_running(&pool, half_then_taken(), queued, vec![insert(name)]).await;
            assert!(out[0].is_err() && out[1].is_ok(), "queued {queued}: {out:?}");
            assert_eq!(transactions, 2, "queued {queued}: the write behind a failed one commits on its own");
        }
        assert_eq!(committed(&pool), ["a", "b", "c", "d", "e", "f", "taken"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_waiting_at_once_commit_in_one_transaction_and_a_failed_write_is_undone_alone() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        // The third write inserts two names and then fails: its first insert must be undone.
        let failing = half_then_taken();
        let (out, transactions) =
            queued_behind_the_turn(&pool, vec![insert("a"), insert("b"), failing, insert("c")]).await;

        assert_eq!(transactions, 1, "four writes waiting at once take one transaction");
        let failed: Vec<usize> = out.iter().enumerate().filter(|(_, r)| r.is_err()).map(|(i, _)| i).collect();
        assert_eq!(failed, vec![2], "only the write that failed gets an error: {out:?}");
        assert_eq!(committed(&pool), ["a", "b", "c", "taken"], "the others committed, nothing of the failed one");
    }

    /// A write that waited for the turn alone runs without a savepoint (see `commit_group`):
    /// when it fails, nothing of it is kept and it gets its own error; when it succeeds, it is
    /// committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_waited_alone_is_undone_whole_when_it_fails_and_committed_when_it_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        let failing = half_then_taken();
        let (out, transactions) = queued_behind_the_turn(&pool, vec![failing]).await;
        assert_eq!(transactions, 1, "{out:?}");
        let error = out[0].as_ref().expect_err("the write failed");
        assert!(error.to_string().contains("insert"), "its own error: {error}");
        assert_eq!(committed(&pool), ["taken"], "nothing of the failed write");

        let (out, _) = queued_behind_the_turn(&pool, vec![insert("a")]).await;
        assert!(out[0].is_ok(), "{out:?}");
        assert_eq!(committed(&pool), ["a", "taken"], "the write that succeeded committed");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_returns_only_after_the_commit_that_makes_it_durable() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        let turn = Arc::clone(&pool.writer).lock_owned().await;
        let tasks: Vec<_> = ["p", "q", "r"]
            .into_iter()
            .map(|name| {
                let pool = Arc::clone(&pool);
                tokio::spawn(async move {
                    pool.write("test write", move |tx| tx.execute("INSERT INTO t VALUES (?1)", [name]).ctx("insert"))
                        .await?;
                    // Read back at once, on a connection of its own: committed or not returned.
                    Ok::<_, Error>(committed(&pool).contains(&name.to_string()))
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.queue().len() < 3 {
            assert!(Instant::now() < deadline, "writes not queued within 10s");
            tokio::task::yield_now().await;
        }
        drop(turn);
        for t in tasks {
            let seen = tokio::time::timeout(Duration::from_secs(10), t).await.expect("within 10s").unwrap().unwrap();
            assert!(seen, "a write returned before its row was committed");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_commit_reaches_every_write_of_its_transaction_and_keeps_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        // A row whose deferred foreign key fails only at the commit.
        let orphan: TestWrite =
            Box::new(|tx| tx.execute("INSERT INTO child VALUES ('nobody')", []).map(drop).ctx("insert orphan"));
        let (out, transactions) = queued_behind_the_turn(&pool, vec![insert("x"), orphan, insert("y")]).await;

        assert_eq!(transactions, 1);
        for r in &out {
            let e = r.as_ref().expect_err("the commit failed for the whole transaction");
            assert!(e.operation().is_some_and(|o| o.contains("(commit)")), "the commit's error: {e}");
        }
        assert_eq!(committed(&pool), ["taken"], "nothing of the transaction was kept");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_whose_caller_left_before_its_turn_does_not_run() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        let turn = Arc::clone(&pool.writer).lock_owned().await;
        let task = {
            let pool = Arc::clone(&pool);
            tokio::spawn(async move {
                pool.write("test write", |tx| tx.execute("INSERT INTO t VALUES ('gone')", []).ctx("insert")).await
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.queue().is_empty() {
            assert!(Instant::now() < deadline, "the write was not queued within 10s");
            tokio::task::yield_now().await;
        }
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        assert!(pool.queue().is_empty(), "the write left the queue with its caller");
        drop(turn);
        pool.write("test write", |tx| tx.execute("INSERT INTO t VALUES ('after')", []).ctx("insert")).await.unwrap();
        assert_eq!(committed(&pool), ["after", "taken"]);
    }
}
