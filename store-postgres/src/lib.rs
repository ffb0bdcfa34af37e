#![doc = include_str!("../README.md")]

mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
mod enqueue;
mod error;
mod inbox;
mod kept;
mod notify;
mod retention;
mod store;
mod tables;

pub use config::{MAX_IDENTIFIER_LEN, MAX_PREFIX_LEN, PgConfig, URL_ENV, validate_identifier};
pub use enqueue::{enqueue, enqueue_one};
pub use error::{BACKEND, is_retryable_conflict, is_unique_violation, map_commit_error, map_error};
pub use inbox::{PgInbox, PgTx};
pub use store::PgStore;
pub use tables::{PgTables, SCHEMA_VERSION};

/// The sqlx version this crate is built against, re-exported so applications use the same types.
pub use sqlx;
