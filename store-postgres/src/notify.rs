//! Waking relays on PostgreSQL: a `NOTIFY` at commit, one `LISTEN` connection per store.
//!
//! The enqueue statement itself calls `pg_notify` on a channel named after the schema and table
//! prefix, so no extra round trip is spent and the notification follows the rows exactly:
//! PostgreSQL delivers it when the transaction that wrote them commits — the store's own or the
//! caller's — and drops it on rollback. Several notifications of one transaction fold into one.
//!
//! A relay in the same process asks the store for its [`Wakeup`]; the first such request starts
//! one task that keeps a `LISTEN` connection open (its own one-connection pool, so it never
//! holds a slot the store's queries need) and turns each notification into
//! [`WakeupSender::notify`]. Notifications are not queued for a session that is not listening,
//! so after every (re)connect the task signals once: the claim that follows finds whatever was
//! committed while nobody listened. A failed connection is retried with bounded exponential
//! backoff and logged; meanwhile relays still poll. The task ends when the store is closed or
//! its last clone is dropped.

use std::fmt::Write as _;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use outbox_core::{Wakeup, WakeupSender};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::config::MAX_IDENTIFIER_LEN;
use crate::tables::PgTables;

/// First delay before reconnecting the listener; doubled per failure up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// Longest delay between reconnect attempts; also how long a connection must have lived for the
/// next failure to start again from [`MIN_BACKOFF`].
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// How long [`Notifier::close`] waits for the listener to say goodbye.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// The notification channel of the tables in `schema` with `prefix`.
///
/// `outbox_<len(schema)>_<schema>_<prefix>` when that fits PostgreSQL's 63-byte identifier limit
/// (the length makes it unambiguous: `a_b` + `c` and `a` + `b_c` differ); otherwise
/// `outbox_h` followed by a 128-bit hash of both. Only `[a-z0-9_]`, so it is a valid
/// identifier and safe inside a string literal.
pub(crate) fn channel_name(schema: &str, prefix: &str) -> String {
    let readable = format!("outbox_{}_{schema}_{prefix}", schema.len());
    if readable.len() <= MAX_IDENTIFIER_LEN {
        return readable;
    }
    let mut name = String::from("outbox_h");
    for half in fnv1a_128(&[schema.as_bytes(), b".", prefix.as_bytes()]) {
        let _ = write!(name, "{half:016x}");
    }
    name
}

/// FNV-1a with a 128-bit state, as two 64-bit halves: stable across builds and platforms
/// (unlike `std`'s hasher), and enough to keep two configurations of one database apart.
fn fnv1a_128(parts: &[&[u8]]) -> [u64; 2] {
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013B;
    let mut h: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    for part in parts {
        for &b in *part {
            h ^= u128::from(b);
            h = h.wrapping_mul(PRIME);
        }
    }
    [(h >> 64) as u64, h as u64]
}

impl PgTables {
    /// The `LISTEN` / `NOTIFY` channel that enqueue notifies when its transaction commits;
    /// derived from the schema and table prefix (distinct for distinct pairs, at most 63 bytes,
    /// `[a-z0-9_]` only). For applications that want to listen themselves.
    pub fn notify_channel(&self) -> String {
        channel_name(self.schema(), self.prefix())
    }
}

/// The store's side of the wake-up: the signal and, once a relay asked, the listener task.
pub(crate) struct Notifier {
    channel: String,
    sender: WakeupSender,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    task: Option<Task>,
    closed: bool,
}

struct Task {
    /// Dropping it (with the store's last clone) stops the task, like sending does.
    stop: oneshot::Sender<()>,
    handle: JoinHandle<()>,
}

impl Notifier {
    pub(crate) fn new(tables: &PgTables) -> Self {
        Self { channel: tables.notify_channel(), sender: WakeupSender::new(), state: Mutex::default() }
    }

    /// A new subscription, starting the listener on the first call (it connects with `options`).
    ///
    /// `None` after [`close`](Notifier::close), or outside a tokio runtime.
    pub(crate) fn subscribe(&self, options: &PgConnectOptions, connect_timeout: Duration) -> Option<Wakeup> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.closed {
            return None;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            debug!(target: "outbox.postgres", "no tokio runtime: relays poll instead of listening");
            return None;
        };
        // Subscribe before the listener starts, so its first signal reaches this subscriber.
        let wakeup = self.sender.subscribe();
        if state.task.as_ref().is_none_or(|t| t.handle.is_finished()) {
            let (stop, stopped) = oneshot::channel();
            let listener = Listener {
                channel: self.channel.clone(),
                options: options.clone(),
                connect_timeout,
                sender: self.sender.clone(),
            };
            let handle = runtime.spawn(listener.run(stopped));
            state.task = Some(Task { stop, handle });
        }
        Some(wakeup)
    }

    /// Stop the listener and wait (briefly) until its connection is closed. Later
    /// subscriptions get `None`.
    pub(crate) async fn close(&self) {
        let task = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.closed = true;
            state.task.take()
        };
        if let Some(Task { stop, mut handle }) = task {
            let _ = stop.send(());
            if tokio::time::timeout(CLOSE_WAIT, &mut handle).await.is_err() {
                handle.abort();
            }
        }
    }
}

/// What the listener task owns: nothing of the store, so it cannot keep the store alive.
struct Listener {
    channel: String,
    options: PgConnectOptions,
    connect_timeout: Duration,
    sender: WakeupSender,
}

impl Listener {
    async fn run(self, stopped: oneshot::Receiver<()>) {
        tokio::select! {
            // Either `close` or a dropped store; the loop's listener is dropped with it.
            _ = stopped => {}
            () = self.listen_forever() => {}
        }
        debug!(target: "outbox.postgres", channel = %self.channel, "wake-up listener stopped");
    }

    async fn listen_forever(&self) {
        let mut delay = MIN_BACKOFF;
        let mut failures = 0u32;
        loop {
            let started = Instant::now();
            let error = self.listen_once(failures).await;
            let lasted = started.elapsed();
            if lasted >= MAX_BACKOFF {
                delay = MIN_BACKOFF;
                failures = 0;
            }
            failures += 1;
            warn!(
                target: "outbox.postgres",
                channel = %self.channel,
                error = %error,
                retry_in = ?delay,
                "wake-up listener is not connected; relays poll until it is back"
            );
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(MAX_BACKOFF);
        }
    }

    /// Connect, `LISTEN`, and relay notifications until the connection fails.
    async fn listen_once(&self, failures: u32) -> sqlx::Error {
        // A pool of one, only so that `PgListener` can own its connection; closed when dropped.
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(self.connect_timeout)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_lazy_with(self.options.clone());
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => return e,
        };
        listener.ignore_pool_close_event(true);
        // A lost connection ends this attempt; the caller reconnects with backoff.
        listener.eager_reconnect(false);
        if let Err(e) = listener.listen(&self.channel).await {
            return e;
        }
        if failures > 0 {
            info!(target: "outbox.postgres", channel = %self.channel, "wake-up listener reconnected");
        } else {
            debug!(target: "outbox.postgres", channel = %self.channel, "listening for enqueues");
        }
        // Nothing committed while no session listened was delivered: let relays look once.
        self.sender.notify();
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => self.sender.notify(),
                Ok(None) => return sqlx::Error::Io(std::io::ErrorKind::ConnectionAborted.into()),
                Err(e) => return e,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(name: &str) -> bool {
        name.len() <= MAX_IDENTIFIER_LEN
            && name.starts_with("outbox_")
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    }

    #[test]
    fn channels_are_valid_and_distinct() {
        let long = "s".repeat(63);
        let pairs = [
            ("public", "outbox_"),
            ("a_b", "c"),
            ("a", "b_c"),
            ("a_", "_b"),
            ("a", "__b"),
            (long.as_str(), "outbox_"),
            (long.as_str(), "outbox2_"),
            (&long[..60], "x_"),
            (&long[..61], "x_"),
        ];
        let mut seen = std::collections::BTreeSet::new();
        for (schema, prefix) in pairs {
            let name = channel_name(schema, prefix);
            assert!(valid(&name), "{schema:?} / {prefix:?} -> {name:?}");
            assert!(seen.insert(name.clone()), "{schema:?} / {prefix:?} collides: {name:?}");
            assert_eq!(name, channel_name(schema, prefix), "not deterministic");
        }
        assert_eq!(channel_name("public", "outbox_"), "outbox_6_public_outbox_");
        assert!(channel_name(&long, "outbox_").starts_with("outbox_h"));
    }
}
