#![doc = include_str!("../README.md")]

pub mod broker;
pub mod capabilities;
pub mod clock;
pub mod config;
pub mod error;
pub mod event;
pub mod inbox;
pub mod memory;
pub mod relay;
pub mod retention;
#[cfg(feature = "testkit")]
pub mod rng;
#[cfg(not(feature = "testkit"))]
mod rng;
pub mod store;
pub mod telemetry;
pub mod wakeup;

pub use broker::{Acknowledge, Broker, Delivery, ForeignDelivery, Malformed, RawMessage, Received, Subscription};
pub use capabilities::Capabilities;
pub use clock::{Clock, ManualClock, SharedClock, SystemClock, Timestamp};
pub use config::{ConnectionUrl, HostPort, UrlSpec, env_url, redact};
pub use error::{Error, ErrorKind, Result, Retry};
pub use event::{ConsumerGroup, Destination, Event, EventId, Fingerprint, Headers};
pub use inbox::{DeadLetter, DeadLetterReason, Inbox, InboxAdmin, LedgerState, MarkOutcome, Marker, VersionOutcome};
pub use relay::{Backoff, BatchReport, DEFAULT_PIPELINE_DEPTH, LOG_SUMMARY_EVERY, Relay, RelayConfig, Shutdown};
pub use retention::{Cleanup, CleanupConfig, CleanupReport, MarkerPruning};
pub use store::{
    Claimed, Completion, Lease, OutboxAdmin, OutboxRecord, OutboxStats, OutboxStore, Outcome, ParkedHead, ParkedRow,
    RowId, RowSnapshot, RowStatus,
};
pub use wakeup::{Wakeup, WakeupSender};
