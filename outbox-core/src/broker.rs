//! The broker side of the contract: publish with the strongest acknowledgement the broker
//! offers, and subscribe with explicit acknowledgement.
//!
//! Acknowledgement is explicit and happens only after the consumer's effect committed; a
//! delivery that is never acknowledged comes back once its subscription goes away. That is what
//! turns a consumer crash into a redelivery instead of a lost effect.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::Result;
use crate::event::{ConsumerGroup, Destination, Event};

/// Acknowledges or rejects one delivery. Implemented by each broker adapter.
#[async_trait]
pub trait Acknowledge: Send {
    /// The consumer is done with the message: never deliver it to this group again.
    async fn ack(self: Box<Self>) -> Result<()>;
    /// The consumer could not process the message: deliver it again (to any member of the group).
    async fn nack(self: Box<Self>) -> Result<()>;
}

/// A message as delivered to a consumer group member.
pub struct Delivery {
    /// The event, byte-for-byte as published.
    pub event: Event,
    /// The broker says this message was delivered before (to this group).
    pub redelivered: bool,
    /// 1-based delivery count, where the broker tracks one.
    pub attempt: Option<u32>,
    acker: Box<dyn Acknowledge>,
}

impl Delivery {
    /// Assemble a delivery (for adapters).
    pub fn new(event: Event, redelivered: bool, attempt: Option<u32>, acker: Box<dyn Acknowledge>) -> Self {
        Self { event, redelivered, attempt, acker }
    }

    /// Acknowledge: only after the effect committed.
    ///
    /// # Errors
    /// The adapter's error; an ack that fails leaves the message to be redelivered. An ack of a
    /// delivery the broker already handed to another member (idle timeout, rebalance) may fail
    /// with a transient [`Closed`](crate::ErrorKind::Closed) error; the effect's marker makes
    /// that redelivery harmless.
    pub async fn ack(self) -> Result<()> {
        self.acker.ack().await
    }

    /// Negative acknowledgement: redeliver.
    ///
    /// # Errors
    /// The adapter's error; the message is redelivered when the subscription ends in any case.
    pub async fn nack(self) -> Result<()> {
        self.acker.nack().await
    }

    /// Split into the event and its acknowledger.
    pub fn into_parts(self) -> (Event, Box<dyn Acknowledge>) {
        (self.event, self.acker)
    }
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("event", &self.event)
            .field("redelivered", &self.redelivered)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

/// One member of a consumer group, receiving deliveries.
///
/// Dropping it without acknowledging is the model of a consumer that went away: every delivery
/// it holds unacknowledged returns to the group (at once, or after the broker's own timeout).
#[async_trait]
pub trait Subscription: Send {
    /// Wait up to `wait` for the next delivery.
    ///
    /// # Behavior
    /// - returns `Ok(None)` when nothing arrived within `wait`;
    /// - a delivery not yet acknowledged is not handed to another member of the group while
    ///   this subscription lives, unless the broker's own idle / session timeout passes or the
    ///   group rebalances (then acknowledging the old delivery may fail with a transient
    ///   [`Closed`](crate::ErrorKind::Closed) error, and the new holder gets it).
    async fn next(&mut self, wait: Duration) -> Result<Option<Delivery>>;
}

/// A message broker.
#[async_trait]
pub trait Broker: Send + Sync {
    /// Short backend name for logs and errors (`"kafka"`, `"amqp"`, `"redis"`, `"memory"`).
    fn backend(&self) -> &'static str;

    /// Make sure `destination` exists and each group in `groups` will receive everything
    /// published to it from now on.
    ///
    /// # Behavior
    /// - idempotent: declaring twice is not an error and loses nothing;
    /// - a group declared here, or created by [`subscribe`](Broker::subscribe), starts at the
    ///   beginning of what the broker retains for the destination.
    async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()>;

    /// Publish one event.
    ///
    /// # Behavior
    /// - returns `Ok` only once the broker accepted the message with its strongest
    ///   acknowledgement (replication / confirm / reply);
    /// - the event id, key, headers and payload arrive byte-for-byte;
    /// - a destination that cannot route is an error of kind
    ///   [`Unroutable`](crate::ErrorKind::Unroutable) where the broker can tell;
    /// - a timeout after sending is [`Retry::OutcomeUnknown`](crate::Retry::OutcomeUnknown);
    /// - safe to call concurrently.
    async fn publish(&self, event: &Event) -> Result<()>;

    /// Join `group` on `destination`.
    ///
    /// # Behavior
    /// - creates the group if absent (starting at the beginning);
    /// - deliveries must be acknowledged explicitly; unacknowledged ones come back after the
    ///   subscription is dropped.
    async fn subscribe(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Box<dyn Subscription>>;
}
