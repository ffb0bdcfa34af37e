//! Handlers name their business effect, and the guard follows from the name.
//!
//! There is no single deduplication recipe that fits every effect: crediting an account needs a
//! marker, a projection needs a version that never goes backward, an e-mail needs a ledger, and
//! a cache invalidation needs nothing. Making the handler *say* which one it is turns that
//! choice into code review instead of an incident.

use async_trait::async_trait;
use outbox_core::{Event, Inbox, Result};

/// The kind of business effect a handler performs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EffectKind {
    /// Additive and not idempotent (credit an account): guarded by an inbox marker written in
    /// the effect's transaction.
    Additive,
    /// A state projection: guarded by a monotonic version per subject; an older version never
    /// moves the projection backward. The handler reports the version with
    /// [`Handler::version`].
    Projection,
    /// A notification or external call: guarded by a delivery ledger (attempted / done). An
    /// attempt whose outcome is unknown is dead-lettered as uncertain, never repeated blindly.
    Notification,
    /// Naturally idempotent (cache invalidation): no guard, stated explicitly.
    Idempotent,
}

/// A consumer's business logic, written once against its store's transaction type and run
/// unchanged on any broker.
#[async_trait]
pub trait Handler<I: Inbox>: Send + Sync {
    /// The effect this handler performs; decides the guard.
    fn effect(&self) -> EffectKind;

    /// For [`EffectKind::Projection`]: the subject (projection row) and version the event carries.
    ///
    /// # Errors
    /// The default is an error: projection handlers must implement it.
    fn version(&self, event: &Event) -> Result<(String, u64)> {
        Err(outbox_core::Error::config(
            "consumer-inbox",
            format!("handler declares a projection but gives no version for event {}", event.id),
        ))
    }

    /// Apply the effect on `tx`, the same transaction that holds the guard's marker or version.
    ///
    /// For [`EffectKind::Notification`] this is where the external call happens; returning an
    /// error means "it did not happen" and the delivery is retried.
    ///
    /// # Errors
    /// Any error: the transaction is rolled back, the failure is counted durably and the
    /// delivery is negatively acknowledged (dead-lettered after the configured attempts).
    async fn apply(&self, tx: &mut I::Tx, event: &Event) -> Result<()>;
}
