#![doc = include_str!("../README.md")]

mod batch;
mod broker;
mod codec;
mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
mod error;
mod subscription;

pub use broker::AmqpBroker;
pub use codec::{DELIVERY_COUNT_HEADER, HEADER_NAMES_HEADER, KEY_HEADER, is_reserved_header};
pub use config::{
    AmqpConfig, DEFAULT_CONFIRM_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PREFETCH, DEFAULT_PUBLISH_CHANNELS, ENV_URL,
    MAX_NAME_LEN, PREFERRED_PIPELINE_DEPTH, QueueType, RoutingKey,
};
pub use subscription::AmqpSubscription;

/// The backend name this crate puts in its errors (`"amqp"`).
pub const BACKEND: &str = error::BACKEND;
