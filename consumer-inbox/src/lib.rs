#![doc = include_str!("../README.md")]

pub mod effect;
mod observe;
mod pump;
pub mod retention;
pub mod runtime;

pub use effect::{EffectKind, Handler};
pub use retention::Retention;
pub use runtime::{Consumer, ConsumerConfig, DEFAULT_MAX_IN_FLIGHT, Handled, InFlight, foreign_marker};
