#![doc = include_str!("../README.md")]

mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
mod enqueue;
mod error;
mod inbox;
mod pool;
mod retention;
mod schema;
mod store;

pub use config::{DEFAULT_BUSY_TIMEOUT, DEFAULT_POOL_SIZE, ENV_URL, SqliteConfig, Synchronous};
pub use enqueue::{enqueue, enqueue_one};
pub use error::sqlite_error;
pub use inbox::SqliteTx;
pub use schema::SCHEMA_VERSION;
#[cfg(feature = "testkit")]
pub use store::ClaimSql;
pub use store::{SqliteInbox, SqliteStore};

/// The `rusqlite` this crate is built with, so callers use the same `Connection` and
/// `Transaction` types.
pub use rusqlite;
