#![doc = include_str!("../README.md")]

pub mod service;

pub use service::{in_ci, require_service};
