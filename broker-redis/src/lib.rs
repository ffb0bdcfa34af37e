#![doc = include_str!("../README.md")]

mod broker;
mod codec;
mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
mod error;
mod scripts;
mod subscription;

pub use broker::RedisBroker;
pub use config::{
    DEFAULT_BLOCK, DEFAULT_CLAIM_IDLE, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PREFIX, DEFAULT_RESPONSE_TIMEOUT, ENV_URL,
    RedisConfig,
};
pub use subscription::RedisSubscription;

/// The backend name in errors and logs.
pub const BACKEND: &str = "redis";
