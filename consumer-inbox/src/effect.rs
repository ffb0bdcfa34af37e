//! Handlers name their business effect, and the guard follows from the name.
//!
//! There is no single deduplication recipe that fits every effect: crediting an account needs a
//! marker, a projection needs a version that never goes backward, an e-mail needs a ledger, and
//! a cache invalidation needs nothing. Making the handler *say* which one it is turns that
//! choice into code review instead of an incident.
//!
//! [`Handler`] is generic over the inbox so that the same business code can run on every store;
//! its docs show how (a port trait of the application's own, one short impl per store).

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

/// A consumer's business logic, run unchanged on any broker — and, written as below, on any
/// store.
///
/// # One handler for every store
///
/// `I::Tx` is a different type on each store (`SqliteTx` runs blocking `rusqlite` closures,
/// `PgTx` is an async `sqlx` connection), so a handler that writes SQL on `tx` itself is tied
/// to one store. To write it once, make it generic over the inbox and put its business writes
/// behind a small trait of your own — a *port* with one method per write, taking
/// `&mut I::Tx` — that each store implements in a few lines of its own SQL. The handler keeps
/// the decision (parse, validate, compute); the port is the only code a store swap touches, and
/// it still runs on the inbox transaction, so the effect commits with the marker or not at all.
///
/// ```
/// use async_trait::async_trait;
/// use outbox_consumer_inbox::{EffectKind, Handler};
/// use outbox_core::memory::{MemoryInbox, MemoryTx};
/// use outbox_core::{Event, EventId, Inbox, Result};
///
/// /// The port: the handler's one business write.
/// #[async_trait]
/// trait Accounts<I: Inbox>: Send + Sync {
///     async fn credit(&self, tx: &mut I::Tx, event: &EventId, amount: i64) -> Result<()>;
/// }
///
/// /// Written once, for every inbox whose transaction the port knows.
/// struct Credit<A>(A);
///
/// #[async_trait]
/// impl<I: Inbox, A: Accounts<I>> Handler<I> for Credit<A> {
///     fn effect(&self) -> EffectKind {
///         EffectKind::Additive
///     }
///     async fn apply(&self, tx: &mut I::Tx, event: &Event) -> Result<()> {
///         let amount = event.payload.len() as i64; // the business decision
///         self.0.credit(tx, &event.id, amount).await
///     }
/// }
///
/// /// One short impl per store: here the in-memory one; on SQLite it is `impl
/// /// Accounts<SqliteInbox>` running an `INSERT` through `SqliteTx::run`, on PostgreSQL `impl
/// /// Accounts<PgInbox>` running it on `&mut **tx`.
/// struct MemoryAccounts;
///
/// #[async_trait]
/// impl Accounts<MemoryInbox> for MemoryAccounts {
///     async fn credit(&self, tx: &mut MemoryTx, event: &EventId, amount: i64) -> Result<()> {
///         tx.insert("credits", format!("{event}:{amount}").into_bytes());
///         Ok(())
///     }
/// }
///
/// fn assert_handler<I: Inbox, H: Handler<I>>(_: &H) {}
/// assert_handler::<MemoryInbox, _>(&Credit(MemoryAccounts));
/// ```
///
/// The `outbox` crate's `examples/` move one such handler from SQLite to PostgreSQL and from
/// Redis to Kafka, and its `tests/handler_swap.rs` runs it on both stores with every broker.
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
