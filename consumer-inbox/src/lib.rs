#![doc = include_str!("../README.md")]

pub mod effect;
pub mod retention;
pub mod runtime;

pub use effect::{EffectKind, Handler};
pub use retention::Retention;
pub use runtime::{Consumer, ConsumerConfig, Handled, InFlight, foreign_marker};
