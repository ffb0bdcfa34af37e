//! In-memory reference backends: the executable model of the contract.
//!
//! They implement the exact state model of the design (leases, fencing tokens, consumer groups
//! with redelivery, transactional inbox) with an injected clock. The conformance suite is
//! checked against them first, so they are precise rather than convenient: anything they allow,
//! a real backend must allow, and anything they reject, a real backend must reject.
//!
//! They keep state in process memory, so they are durable only as long as the values live.
//! Clones share state: a clone is "another connection to the same server".

mod broker;
mod inbox;
mod store;

pub use broker::{MemoryBroker, MemorySubscription};
pub use inbox::{MemoryInbox, MemoryTx};
pub use store::MemoryOutbox;

pub(crate) const BACKEND: &str = "memory";

pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving it.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
