//! The credit handler, written once: no store, no broker, no SQL.
//!
//! The handler talks to the database only through [`Accounts`], a port of the application's
//! own with one method per business write. Each store implements the port in a few lines of its
//! own SQL ([`sqlite`], [`postgres`]); the handler is generic over the inbox, so the same
//! `Credit` value runs on the SQLite inbox and the PostgreSQL inbox, fed by any broker.
//!
//! Shared by `examples/sqlite_redis.rs`, `examples/postgres_kafka.rs` and
//! `tests/handler_swap.rs`.

use std::collections::BTreeMap;

use async_trait::async_trait;
use outbox::consumer::{EffectKind, Handler};
use outbox::{Destination, Error, ErrorKind, Event, EventId, Inbox, Result, RowId};

#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

/// The handler's port: the business writes it makes, each on the inbox transaction `tx`, so
/// they commit together with the inbox marker or not at all.
#[async_trait]
pub trait Accounts<I: Inbox>: Send + Sync {
    /// Record the credit `event` brings and add `amount` to `account`'s balance.
    async fn credit(&self, tx: &mut I::Tx, event: &EventId, account: &str, amount: i64) -> Result<()>;
}

/// The producer's side and the read-back, also per store: commit an order and its event in one
/// transaction, and read the consumer's tables.
#[async_trait]
pub trait Orders: Send + Sync {
    /// Insert the order row and enqueue its event in one transaction of the caller's.
    async fn place_order(&self, order: &Order, destination: &Destination) -> Result<RowId>;
    /// Every credit row, in insertion order: (event id, account, amount).
    async fn credits(&self) -> Result<Vec<(String, String, i64)>>;
    /// Account → balance.
    async fn balances(&self) -> Result<BTreeMap<String, i64>>;
}

/// An order: `amount` is credited to `account` once its event is consumed.
#[derive(Debug, Clone)]
pub struct Order {
    /// Order id; the event id is `order-<id>`.
    pub id: String,
    /// Account credited.
    pub account: String,
    /// Amount credited.
    pub amount: i64,
}

impl Order {
    /// An order.
    pub fn new(id: impl Into<String>, account: impl Into<String>, amount: i64) -> Self {
        Self { id: id.into(), account: account.into(), amount }
    }

    /// The event announcing it: payload `account:amount`, keyed by account.
    pub fn event(&self, destination: &Destination) -> Result<Event> {
        let payload = format!("{}:{}", self.account, self.amount);
        Ok(Event::new(EventId::new(format!("order-{}", self.id))?, destination.clone(), payload)
            .with_key(self.account.clone()))
    }
}

/// Credits an account. Additive and not idempotent, so it names [`EffectKind::Additive`]: the
/// consumer runtime writes an inbox marker in the same transaction, and a redelivered event
/// credits nothing.
#[derive(Debug, Clone)]
pub struct Credit<A> {
    accounts: A,
}

impl<A> Credit<A> {
    /// The handler, writing through `accounts`.
    pub fn new(accounts: A) -> Self {
        Self { accounts }
    }
}

#[async_trait]
impl<I: Inbox, A: Accounts<I>> Handler<I> for Credit<A> {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }

    async fn apply(&self, tx: &mut I::Tx, event: &Event) -> Result<()> {
        let (account, amount) = parse(event)?;
        self.accounts.credit(tx, &event.id, &account, amount).await
    }
}

/// `account:amount`; anything else is a permanent handler error (dead-lettered).
fn parse(event: &Event) -> Result<(String, i64)> {
    let bad =
        || Error::permanent(ErrorKind::Handler, "credit", format!("event {}: payload is not account:amount", event.id));
    let text = std::str::from_utf8(&event.payload).map_err(|_| bad())?;
    let (account, amount) = text.split_once(':').ok_or_else(bad)?;
    Ok((account.to_string(), amount.parse().map_err(|_| bad())?))
}
