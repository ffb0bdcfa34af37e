#![doc = include_str!("../README.md")]

use std::fmt;
use std::sync::Arc;

use outbox_core::config::scheme_of;
use outbox_core::memory::{MemoryBroker, MemoryInbox, MemoryOutbox};

pub use outbox_consumer_inbox as consumer;
pub use outbox_core as core;
pub use outbox_core::{
    Broker, Clock, ConsumerGroup, DEFAULT_PIPELINE_DEPTH, DeadLetter, Destination, Error, ErrorKind, Event, EventId,
    Inbox, InboxAdmin, LOG_SUMMARY_EVERY, OutboxAdmin, OutboxStats, OutboxStore, Relay, RelayConfig, Result, Retry,
    RowId, RowSnapshot, RowStatus, Shutdown,
};

#[cfg(feature = "kafka")]
pub use outbox_broker_kafka as kafka;

#[cfg(feature = "amqp")]
pub use outbox_broker_amqp as amqp;

#[cfg(feature = "redis")]
pub use outbox_broker_redis as redis;

#[cfg(feature = "postgres")]
pub use outbox_store_postgres as postgres;

#[cfg(feature = "sqlite")]
pub use outbox_store_sqlite as sqlite;

/// Every store scheme this crate knows, with the cargo feature that enables it.
const STORE_SCHEMES: &[(&str, &str)] =
    &[("postgres", "postgres"), ("postgresql", "postgres"), ("sqlite", "sqlite"), ("memory", "")];

/// Every broker scheme this crate knows, with the cargo feature that enables it.
const BROKER_SCHEMES: &[(&str, &str)] =
    &[("kafka", "kafka"), ("amqp", "amqp"), ("amqps", "amqp"), ("redis", "redis"), ("rediss", "redis"), ("memory", "")];

fn unknown_scheme(what: &str, url: &str, known: &[(&str, &str)]) -> Error {
    let list: Vec<String> = known
        .iter()
        .map(|(scheme, feature)| {
            if feature.is_empty() || feature_enabled(feature) {
                format!("{scheme}://")
            } else {
                format!("{scheme}:// (needs the `{feature}` feature)")
            }
        })
        .collect();
    let shown = match scheme_of(url) {
        Some(s) => format!("scheme {s:?}"),
        None => "a URL without a scheme".to_string(),
    };
    Error::config(format!("{what} URL"), format!("{shown} names no {what}; known: {}", list.join(", ")))
}

// Unused in a build that has every feature.
#[allow(dead_code)]
fn feature_missing(scheme: &str, feature: &str) -> Error {
    Error::config(
        scheme.to_string(),
        format!("{scheme}:// URLs need the `{feature}` feature of the `outbox` crate, which this build does not have"),
    )
}

fn feature_enabled(feature: &str) -> bool {
    let enabled = [
        ("postgres", cfg!(feature = "postgres")),
        ("sqlite", cfg!(feature = "sqlite")),
        ("kafka", cfg!(feature = "kafka")),
        ("amqp", cfg!(feature = "amqp")),
        ("redis", cfg!(feature = "redis")),
    ];
    enabled.iter().any(|(name, on)| *name == feature && *on)
}

/// A store chosen by URL: its outbox, its inbox, and the operations only some stores need
/// (explicit migrations on PostgreSQL).
///
/// `memory://` gives the in-memory reference backends: state lives as long as this value (and
/// its clones), so it is only useful inside one process (demos, tests).
#[derive(Clone)]
#[non_exhaustive]
pub enum AnyStore {
    /// `postgres://` / `postgresql://`.
    #[cfg(feature = "postgres")]
    Postgres(outbox_store_postgres::PgStore),
    /// `sqlite:`.
    #[cfg(feature = "sqlite")]
    Sqlite(outbox_store_sqlite::SqliteStore),
    /// `memory://`.
    Memory(MemoryOutbox, MemoryInbox),
}

impl fmt::Debug for AnyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => f.debug_tuple("Postgres").field(s.config()).finish(),
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => f.debug_tuple("Sqlite").field(s.config()).finish(),
            Self::Memory(..) => f.write_str("Memory"),
        }
    }
}

impl AnyStore {
    /// Open the store `url` names: `postgres://…`, `sqlite:///path/file.db` or `memory://`.
    ///
    /// Connecting checks that the server answers (a wrong password or an unreachable host fails
    /// here). SQLite applies its migrations on open; PostgreSQL's are explicit
    /// ([`migrate`](Self::migrate)), and [`check_schema`](Self::check_schema) says whether they ran.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for an unknown scheme, a scheme whose feature is not compiled in, or
    /// a bad URL; the backend's connection error otherwise. The URL's password never appears.
    pub async fn connect(url: &str) -> Result<Self> {
        match scheme_of(url).as_deref() {
            Some("postgres" | "postgresql") => {
                #[cfg(feature = "postgres")]
                {
                    let config = outbox_store_postgres::PgConfig::from_url(url)?;
                    Ok(Self::Postgres(outbox_store_postgres::PgStore::connect(config).await?))
                }
                #[cfg(not(feature = "postgres"))]
                Err(feature_missing("postgres", "postgres"))
            }
            Some("sqlite") => {
                #[cfg(feature = "sqlite")]
                {
                    let config = outbox_store_sqlite::SqliteConfig::from_url(url)?;
                    Ok(Self::Sqlite(outbox_store_sqlite::SqliteStore::open(config).await?))
                }
                #[cfg(not(feature = "sqlite"))]
                Err(feature_missing("sqlite", "sqlite"))
            }
            Some("memory") => {
                check_memory_url(url)?;
                let clock: outbox_core::SharedClock = Arc::new(outbox_core::SystemClock);
                Ok(Self::Memory(MemoryOutbox::new(clock.clone()), MemoryInbox::new(clock)))
            }
            _ => Err(unknown_scheme("store", url, STORE_SCHEMES)),
        }
    }

    /// Short backend name (`"postgres"`, `"sqlite"`, `"memory"`).
    pub fn backend(&self) -> &'static str {
        self.outbox().backend()
    }

    /// The outbox, for operators ([`OutboxAdmin`]) or a [`Relay`] (it converts to the
    /// `Arc<dyn OutboxStore>` a relay takes).
    pub fn outbox(&self) -> Arc<dyn OutboxAdmin> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => Arc::new(s.clone()),
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => Arc::new(s.clone()),
            Self::Memory(o, _) => Arc::new(o.clone()),
        }
    }

    /// The inbox's operator side (markers, dead letters), on the same database.
    pub fn inbox_admin(&self) -> Arc<dyn InboxAdmin> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => Arc::new(s.inbox()),
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => Arc::new(s.inbox()),
            Self::Memory(_, i) => Arc::new(i.clone()),
        }
    }

    /// Bring the schema to the version this library knows; returns that version.
    ///
    /// Idempotent and safe from several processes at once (PostgreSQL: under an advisory lock;
    /// SQLite: one `BEGIN IMMEDIATE` transaction per version); memory has no schema (0).
    ///
    /// # Errors
    /// The backend's error; [`ErrorKind::Corrupt`] when the database is newer than this library.
    pub async fn migrate(&self) -> Result<i64> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => Ok(i64::from(s.migrate().await?)),
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => s.migrate().await,
            Self::Memory(..) => Ok(0),
        }
    }

    /// Check that the schema is in place and at the version this library knows.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] naming the fix when the tables are missing or older
    /// (`outbox migrate --store URL`); [`ErrorKind::Corrupt`] when newer.
    pub async fn check_schema(&self) -> Result<()> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(s) => s.check_schema().await,
            #[cfg(feature = "sqlite")]
            Self::Sqlite(s) => s.check_schema().await,
            Self::Memory(..) => Ok(()),
        }
    }
}

fn check_memory_url(url: &str) -> Result<()> {
    let rest = url.split_once(':').map_or("", |(_, r)| r);
    let rest = rest.trim_start_matches('/');
    if rest.is_empty() {
        Ok(())
    } else {
        Err(Error::config("memory", format!("memory:// takes no host, path or parameters (got {url:?})")))
    }
}

/// Open the outbox store `url` names (see [`AnyStore::connect`]) and check its schema.
///
/// # Errors
/// As [`AnyStore::connect`] and [`AnyStore::check_schema`].
pub async fn store_from_url(url: &str) -> Result<Arc<dyn OutboxStore>> {
    let store = AnyStore::connect(url).await?;
    store.check_schema().await?;
    Ok(store.outbox())
}

/// Connect to the broker `url` names: `kafka://host:port[,host:port…]`, `amqp://…`,
/// `redis://…` or `memory://` (in-process; only useful inside one process).
///
/// The connection is checked before this returns, so an unreachable server or a wrong password
/// fails here rather than at the first publish.
///
/// # Errors
/// [`ErrorKind::Config`] for an unknown scheme, a scheme whose feature is not compiled in, or a
/// bad URL; the backend's connection error otherwise. The URL's password never appears.
pub async fn broker_from_url(url: &str) -> Result<Arc<dyn Broker>> {
    match scheme_of(url).as_deref() {
        Some("kafka") => {
            #[cfg(feature = "kafka")]
            {
                let config = outbox_broker_kafka::KafkaConfig::from_url(url)?;
                Ok(Arc::new(outbox_broker_kafka::KafkaBroker::connect(config).await?))
            }
            #[cfg(not(feature = "kafka"))]
            Err(feature_missing("kafka", "kafka"))
        }
        Some("amqp" | "amqps") => {
            #[cfg(feature = "amqp")]
            {
                let config = outbox_broker_amqp::AmqpConfig::from_url(url)?;
                let broker = outbox_broker_amqp::AmqpBroker::new(config);
                broker.connect().await?;
                Ok(Arc::new(broker))
            }
            #[cfg(not(feature = "amqp"))]
            Err(feature_missing("amqp", "amqp"))
        }
        Some("redis" | "rediss") => {
            #[cfg(feature = "redis")]
            {
                let config = outbox_broker_redis::RedisConfig::from_url(url)?;
                Ok(Arc::new(outbox_broker_redis::RedisBroker::connect(config).await?))
            }
            #[cfg(not(feature = "redis"))]
            Err(feature_missing("redis", "redis"))
        }
        Some("memory") => {
            check_memory_url(url)?;
            Ok(Arc::new(MemoryBroker::new()))
        }
        _ => Err(unknown_scheme("broker", url, BROKER_SCHEMES)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unknown_schemes_are_clear_config_errors() {
        for url in ["mysql://u:hunter2@h/db", "no-scheme-here", "://x", "http://u:hunter2@h"] {
            let e = AnyStore::connect(url).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config, "{url}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
            assert!(e.to_string().contains("names no store"), "{e}");
            let e = broker_from_url(url).await.err().expect("an error");
            assert_eq!(e.kind(), ErrorKind::Config, "{url}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
            assert!(e.to_string().contains("names no broker"), "{e}");
        }
    }

    #[tokio::test]
    async fn memory_backends_open_and_refuse_extras() {
        let store = AnyStore::connect("memory://").await.unwrap();
        assert_eq!(store.backend(), "memory");
        assert_eq!(store.outbox().stats().await.unwrap(), OutboxStats::default());
        assert_eq!(broker_from_url("memory://").await.unwrap().backend(), "memory");
        let e = AnyStore::connect("memory://host/x").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
    }
}
