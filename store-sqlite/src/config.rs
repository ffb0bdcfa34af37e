//! Where the database lives and how hard it works to keep a commit.
//!
//! One value describes the file and the per-connection settings, so that the store's pool and a
//! caller's own connection (the one its domain write and outbox row commit on) are opened the
//! same way: same journal mode, same durability, same busy timeout.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use outbox_core::config::{ConnectionUrl, UrlSpec, encode_path, env_url};
use outbox_core::event::DEFAULT_MAX_PAYLOAD;
use outbox_core::{Error, ParkedHead, Result};
use rusqlite::{Connection, OpenFlags};

use crate::error::{BACKEND, ResultExt};

/// Environment variable read by [`SqliteConfig::from_env`].
pub const ENV_URL: &str = "OUTBOX_SQLITE_URL";

/// The URLs [`SqliteConfig::from_url`] accepts: a scheme and a path, no host.
const URL_SPEC: UrlSpec = UrlSpec::new(BACKEND, &["sqlite"]).path_only();

/// Default [`SqliteConfig::busy_timeout`]: how long a connection waits for another writer.
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Default [`SqliteConfig::pool_size`].
pub const DEFAULT_POOL_SIZE: usize = 4;

/// How SQLite syncs the write-ahead log (`PRAGMA synchronous`).
///
/// The database is always in WAL mode; this only decides what a crash of the *machine* can take
/// away. A crash of the *process* loses nothing in either mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Synchronous {
    /// `FULL`: every commit is synced to disk before it returns. A committed outbox row or inbox
    /// marker survives power loss. The default, because the contract's promises are about
    /// durable state.
    #[default]
    Full,
    /// `NORMAL`: commits are synced at checkpoints only. Much faster for small transactions, and
    /// the file is never corrupted, but the last transactions before a power loss or OS crash
    /// can roll back, which can lose an enqueued event (together with its domain write) or
    /// forget an inbox marker (so a redelivery applies its effect again, only if that effect
    /// lives outside this file).
    Normal,
}

impl Synchronous {
    /// The pragma value and the URL form (`full`, `normal`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Normal => "normal",
        }
    }

    fn pragma(self) -> &'static str {
        match self {
            Self::Full => "FULL",
            Self::Normal => "NORMAL",
        }
    }
}

impl FromStr for Synchronous {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "full" => Ok(Self::Full),
            "normal" => Ok(Self::Normal),
            _ => Err(Error::config(BACKEND, format!("expected `full` or `normal` for synchronous, not {s:?}"))),
        }
    }
}

impl fmt::Display for Synchronous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Settings of a [`SqliteStore`](crate::SqliteStore).
///
/// Parses from a URL such as
/// `sqlite:///var/lib/app/outbox.db?outbox_synchronous=normal&outbox_busy_timeout_ms=5000&outbox_pool_size=4&outbox_max_payload=1048576`
/// (`sqlite:///abs/path` is absolute, `sqlite:rel/path` or `sqlite://rel/path` relative; the
/// path is percent-decoded; every query parameter is optional, and any other parameter is
/// rejected with the list of known ones). SQLite URLs carry no credentials, so `Debug` and
/// `Display` have nothing to redact.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteConfig {
    /// The database file. Created if absent; its directory must exist.
    pub path: PathBuf,
    /// Durability of commits (URL `outbox_synchronous=full|normal`); [`Synchronous::Full`] by default.
    pub synchronous: Synchronous,
    /// How long a statement waits for another connection's write lock before failing with
    /// [`ErrorKind::Busy`](outbox_core::ErrorKind::Busy) (URL `outbox_busy_timeout_ms`); 5 s by default.
    pub busy_timeout: Duration,
    /// Connections the store keeps, and so the number of its calls that run at once (URL
    /// `outbox_pool_size`); 4 by default. SQLite has one writer at a time; more connections help readers
    /// and let one consumer transaction stay open while relays wait for the lock. The store's own
    /// short writes (enqueue, claim, completions…) run on one more connection, kept for them.
    pub pool_size: usize,
    /// Largest accepted payload in bytes (URL `outbox_max_payload`); 1 MiB by default.
    pub max_payload: usize,
    /// What a parked row does to the later rows of its key when relays claim (URL
    /// `outbox_parked_head=block|skip`); [`ParkedHead::Block`] by default (see
    /// [`OutboxStore::claim`](outbox_core::OutboxStore::claim)).
    pub parked_head: ParkedHead,
}

impl SqliteConfig {
    /// Defaults for the file at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            synchronous: Synchronous::Full,
            busy_timeout: DEFAULT_BUSY_TIMEOUT,
            pool_size: DEFAULT_POOL_SIZE,
            max_payload: DEFAULT_MAX_PAYLOAD,
            parked_head: ParkedHead::Block,
        }
    }

    /// Set [`parked_head`](SqliteConfig::parked_head).
    #[must_use]
    pub fn with_parked_head(mut self, parked_head: ParkedHead) -> Self {
        self.parked_head = parked_head;
        self
    }

    /// Set [`synchronous`](SqliteConfig::synchronous).
    #[must_use]
    pub fn with_synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Set [`busy_timeout`](SqliteConfig::busy_timeout).
    #[must_use]
    pub fn with_busy_timeout(mut self, busy_timeout: Duration) -> Self {
        self.busy_timeout = busy_timeout;
        self
    }

    /// Set [`pool_size`](SqliteConfig::pool_size).
    #[must_use]
    pub fn with_pool_size(mut self, pool_size: usize) -> Self {
        self.pool_size = pool_size;
        self
    }

    /// Set [`max_payload`](SqliteConfig::max_payload).
    #[must_use]
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Parse a `sqlite:` URL (see the type's documentation).
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) for another scheme, an empty path,
    /// a bad or unknown parameter, or an in-memory database (relays and consumers must share a
    /// file).
    pub fn from_url(url: &str) -> Result<Self> {
        let mut url = ConnectionUrl::parse(&URL_SPEC, url)?;
        if url.fragment().is_some() {
            return Err(url.error("a `#` in the path must be written `%23`"));
        }
        let raw_path = url.raw_path();
        if raw_path.is_empty() {
            return Err(url.error("the path is empty"));
        }
        if raw_path == ":memory:" || raw_path.starts_with("file::memory:") {
            return Err(url.error("in-memory databases are not supported; relays and consumers need a shared file"));
        }
        let mut config = Self::new(url.path());
        if let Some(synchronous) = url.outbox_parse("outbox_synchronous")? {
            config.synchronous = synchronous;
        }
        if let Some(timeout) = url.outbox_duration_ms("outbox_busy_timeout_ms")? {
            config.busy_timeout = timeout;
        }
        if let Some(size) = url.outbox_usize("outbox_pool_size")? {
            config.pool_size = size;
        }
        if let Some(bytes) = url.outbox_usize("outbox_max_payload")? {
            config.max_payload = bytes;
        }
        if let Some(parked_head) = url.outbox_parse("outbox_parked_head")? {
            config.parked_head = parked_head;
        }
        url.reject_driver_params()?;
        url.finish()?;
        config.validate()?;
        Ok(config)
    }

    /// Read the URL from the environment variable [`ENV_URL`] (`OUTBOX_SQLITE_URL`).
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) when the variable is unset, blank,
    /// not Unicode, or not a valid URL.
    pub fn from_env() -> Result<Self> {
        Self::from_url(&env_url(ENV_URL, BACKEND)?)
    }

    /// Check the values that SQLite or the pool cannot take.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) for a zero pool size, an empty path
    /// or a busy timeout beyond `i32::MAX` milliseconds.
    pub fn validate(&self) -> Result<()> {
        if self.path.as_os_str().is_empty() {
            return Err(Error::config(BACKEND, "the database path is empty"));
        }
        if self.pool_size == 0 {
            return Err(Error::config(BACKEND, "pool_size must be at least 1"));
        }
        if self.busy_timeout.as_millis() > i32::MAX as u128 {
            return Err(Error::config(
                BACKEND,
                format!("busy_timeout of {:?} is longer than SQLite accepts (i32::MAX ms)", self.busy_timeout),
            ));
        }
        Ok(())
    }

    /// Open a connection to the file with the store's settings: WAL journal, this config's
    /// `synchronous` and busy timeout, foreign keys on.
    ///
    /// This is the connection to run a domain write and
    /// [`enqueue`](crate::enqueue) on, in one `rusqlite` transaction. It is a blocking call, like
    /// everything on a `rusqlite::Connection`. It does not create or migrate the outbox tables:
    /// open a [`SqliteStore`](crate::SqliteStore) on the file once for that.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) for invalid settings or when the
    /// file cannot be put in WAL mode; otherwise the SQLite error, converted (a file that is not
    /// a database is [`ErrorKind::Corrupt`](outbox_core::ErrorKind::Corrupt)).
    pub fn open_connection(&self) -> Result<Connection> {
        self.validate()?;
        let what = "open the database";
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&self.path, flags)
            .map_err(|e| crate::error::map(&format!("open {}", self.path.display()), e))?;
        conn.busy_timeout(self.busy_timeout).ctx(what)?;
        let mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0)).ctx("set journal_mode=WAL")?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(Error::config(
                BACKEND,
                format!("{}: journal_mode is {mode:?}, WAL is required", self.path.display()),
            ));
        }
        conn.pragma_update(None, "synchronous", self.synchronous.pragma()).ctx("set synchronous")?;
        conn.pragma_update(None, "foreign_keys", "ON").ctx("set foreign_keys")?;
        // The store's own statements plus a handler's effect statements stay prepared.
        conn.set_prepared_statement_cache_capacity(64);
        Ok(conn)
    }

    /// [`open_connection`](Self::open_connection) plus what the store's own connections add:
    /// temporary storage in memory (`temp_store=MEMORY`). The writes of a group commit each run
    /// in a savepoint (in the pool), and SQLite keeps the original of every page a savepoint
    /// changes in a sub-journal that goes to a temporary file once it passes 64 KiB, created,
    /// written and deleted per write; the claim's statements build small temporary tables too
    /// (`json_each` lists, `DISTINCT`, `RETURNING`). In memory each is bounded by one write's
    /// rows. A caller's own connection (`open_connection`,
    /// [`SqliteStore::connect_raw`](crate::SqliteStore::connect_raw)) keeps SQLite's default.
    pub(crate) fn open_store_connection(&self) -> Result<Connection> {
        let conn = self.open_connection()?;
        conn.pragma_update(None, "temp_store", "MEMORY").ctx("set temp_store=MEMORY")?;
        Ok(conn)
    }
}

impl FromStr for SqliteConfig {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::from_url(s)
    }
}

impl fmt::Display for SqliteConfig {
    /// The URL form; [`SqliteConfig::from_url`] parses it back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let encoded = encode_path(&self.path.to_string_lossy());
        if self.path.is_absolute() {
            write!(f, "sqlite://{encoded}")?;
        } else {
            write!(f, "sqlite:{encoded}")?;
        }
        write!(
            f,
            "?outbox_synchronous={}&outbox_busy_timeout_ms={}&outbox_pool_size={}&outbox_max_payload={}\
             &outbox_parked_head={}",
            self.synchronous,
            self.busy_timeout.as_millis(),
            self.pool_size,
            self.max_payload,
            self.parked_head
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::ErrorKind;

    #[test]
    fn parses_absolute_url_with_parameters() {
        let c = SqliteConfig::from_url(
            "sqlite:///tmp/a%20b.db?outbox_synchronous=normal&outbox_busy_timeout_ms=250&outbox_pool_size=8\
             &outbox_max_payload=10&outbox_parked_head=skip",
        )
        .unwrap();
        assert_eq!(c.parked_head, ParkedHead::Skip);
        assert_eq!(c.path, PathBuf::from("/tmp/a b.db"));
        assert_eq!(c.synchronous, Synchronous::Normal);
        assert_eq!(c.busy_timeout, Duration::from_millis(250));
        assert_eq!(c.pool_size, 8);
        assert_eq!(c.max_payload, 10);
        assert_eq!(SqliteConfig::from_url(&c.to_string()).unwrap(), c);
    }

    #[test]
    fn defaults_and_relative_paths() {
        let c = SqliteConfig::from_url("sqlite:data/outbox.db").unwrap();
        assert_eq!(c, SqliteConfig::new("data/outbox.db"));
        assert_eq!(c.synchronous, Synchronous::Full);
        assert_eq!(c.busy_timeout, DEFAULT_BUSY_TIMEOUT);
        assert_eq!(c.parked_head, ParkedHead::Block);
        assert_eq!(SqliteConfig::from_url("sqlite://data/outbox.db").unwrap().path, PathBuf::from("data/outbox.db"));
        assert_eq!(SqliteConfig::from_url(&c.to_string()).unwrap(), c);
    }

    #[test]
    fn rejects_bad_urls() {
        for bad in [
            "postgres://x/y",
            "sqlite://",
            "sqlite::memory:",
            "sqlite:///x.db?outbox_synchronous=off",
            "sqlite:///x.db?outbox_parked_head=sometimes",
            "sqlite:///x.db?outbox_pool_size=0",
            "sqlite:///x.db?outbox_pool_size=many",
            "sqlite:///x.db?outbox_busy_timeout_ms=-1",
            "sqlite:///x.db?outbox_busy_timeout_ms=2147483648",
            "sqlite:///x.db?colour=blue",
            "sqlite:///x.db?outbox_colour=blue",
            "sqlite:///x.db?synchronous=normal",
            "sqlite:///x%zz.db",
            "sqlite:///x.db#frag",
        ] {
            let err = SqliteConfig::from_url(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{bad}: {err}");
        }
    }

    #[test]
    fn errors_name_the_parameter_and_the_known_ones() {
        let err = SqliteConfig::from_url("sqlite:///x.db?busy_timeout_ms=10").unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("sqlite: "), "{text}");
        assert!(text.contains("\"busy_timeout_ms\""), "{text}");
        assert!(
            text.contains(
                "outbox_busy_timeout_ms, outbox_max_payload, outbox_parked_head, outbox_pool_size, outbox_synchronous"
            ),
            "{text}"
        );
        let err = SqliteConfig::from_url("sqlite:///x.db?outbox_synchronous=off").unwrap_err();
        assert!(err.to_string().contains("outbox_synchronous=\"off\""), "{err}");
        assert!(err.to_string().contains("`full` or `normal`"), "{err}");
        let err = SqliteConfig::from_url("sqlite:///x.db?outbox_pool_size=many").unwrap_err();
        assert!(err.to_string().contains("outbox_pool_size=\"many\": expected a whole number"), "{err}");
    }

    #[test]
    fn display_round_trips_odd_paths() {
        for path in ["/tmp/with space/ü%#?&=.db", "rel/a+b.db"] {
            let c = SqliteConfig::new(path).with_pool_size(2);
            let back = SqliteConfig::from_url(&c.to_string()).unwrap_or_else(|e| panic!("{c}: {e}"));
            assert_eq!(back, c);
        }
    }
}
