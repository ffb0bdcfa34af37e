//! The code the suite judges besides a backend: the relay that moves rows from a store to a
//! broker, and the consumer runtime that turns deliveries into effects.
//!
//! A backend can be correct and still lose or duplicate events if the code driving it is wrong
//! (completing a row whose publish failed, publishing one key's rows concurrently, keeping rows
//! leased across a shutdown, acknowledging before the commit). Cases that judge those promises
//! build their relay and run their consumer through [`Engines`], so that the teeth test can swap
//! in deliberately wrong ones ([`crate::mutants`]) and show that the cases catch them. Every
//! backend's run uses the reference engines: [`outbox_core::Relay`] and
//! [`outbox_consumer_inbox::Consumer`].

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use outbox_consumer_inbox::{Consumer, Handled, Handler};
use outbox_core::{BatchReport, Broker, Delivery, Inbox, OutboxStore, Received, Relay, RelayConfig, Result};

/// A relay as the suite drives it.
#[async_trait]
pub trait RelayUnderTest: Send + Sync {
    /// Claim one batch, publish it, record the outcomes ([`Relay::run_once`]).
    async fn run_once(&self) -> Result<BatchReport>;

    /// Run until [`shutdown`](RelayUnderTest::shutdown) ([`Relay::run`]); returns the totals.
    async fn run(&self) -> Result<BatchReport>;

    /// Ask [`run`](RelayUnderTest::run) to stop gracefully.
    fn shutdown(&self);
}

#[async_trait]
impl RelayUnderTest for Relay {
    async fn run_once(&self) -> Result<BatchReport> {
        Relay::run_once(self).await
    }

    async fn run(&self) -> Result<BatchReport> {
        Relay::run(self).await
    }

    fn shutdown(&self) {
        self.shutdown_handle().trigger();
    }
}

/// Builds a relay over a store and a broker.
pub type RelayFactory =
    Arc<dyn Fn(Arc<dyn OutboxStore>, Arc<dyn Broker>, RelayConfig) -> Arc<dyn RelayUnderTest> + Send + Sync>;

/// How a delivery is taken through guard, effect, commit and acknowledgement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ConsumerRuntime {
    /// [`Consumer::process`].
    #[default]
    Reference,
    /// Wrong on purpose ([`crate::mutants`]): acknowledges after the effect, before the commit.
    AckThenCommit,
    /// Wrong on purpose: acknowledges a foreign message without recording it.
    DropsForeign,
    /// Wrong on purpose: acknowledges a foreign message, then records it.
    AckForeignThenRecord,
    /// Wrong on purpose: records a foreign message on every delivery (no inbox marker).
    RecordsForeignEachDelivery,
    /// Wrong on purpose: a batch that acknowledges what its failure rolled back.
    BatchAcksRolledBack,
}

/// The relay and consumer runtime the cases run. [`Engines::default`] is the reference pair.
#[derive(Clone)]
pub struct Engines {
    name: String,
    relay: RelayFactory,
    consumer: ConsumerRuntime,
}

impl Default for Engines {
    fn default() -> Self {
        Self {
            name: "outbox_core::Relay + outbox_consumer_inbox::Consumer".into(),
            relay: Arc::new(|store, broker, config| Arc::new(Relay::new(store, broker, config))),
            consumer: ConsumerRuntime::Reference,
        }
    }
}

impl fmt::Debug for Engines {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engines").field("name", &self.name).field("consumer", &self.consumer).finish_non_exhaustive()
    }
}

impl Engines {
    /// The reference engines.
    pub fn reference() -> Self {
        Self::default()
    }

    /// These engines with another relay, named `name` in reports.
    #[must_use]
    pub fn with_relay(mut self, name: impl Into<String>, relay: RelayFactory) -> Self {
        self.name = name.into();
        self.relay = relay;
        self
    }

    #[must_use]
    pub(crate) fn with_consumer(mut self, name: impl Into<String>, consumer: ConsumerRuntime) -> Self {
        self.name = name.into();
        self.consumer = consumer;
        self
    }

    /// What runs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A relay over `store` and `broker`.
    pub fn relay(
        &self,
        store: Arc<dyn OutboxStore>,
        broker: Arc<dyn Broker>,
        config: RelayConfig,
    ) -> Arc<dyn RelayUnderTest> {
        (self.relay)(store, broker, config)
    }

    /// Handle one delivery completely, as [`Consumer::process`] does.
    ///
    /// # Errors
    /// As [`Consumer::process`].
    pub async fn process<I: Inbox, H: Handler<I>>(
        &self,
        consumer: &Consumer<I, H>,
        delivery: Delivery,
    ) -> Result<Handled> {
        match self.consumer {
            ConsumerRuntime::Reference => consumer.process(delivery).await,
            ConsumerRuntime::AckThenCommit => crate::mutants::ack_then_commit(consumer, delivery).await,
            ConsumerRuntime::DropsForeign
            | ConsumerRuntime::AckForeignThenRecord
            | ConsumerRuntime::RecordsForeignEachDelivery
            | ConsumerRuntime::BatchAcksRolledBack => consumer.process(delivery).await,
        }
    }

    /// Handle several deliveries with one commit, as [`Consumer::process_batch`] does.
    ///
    /// # Errors
    /// Per delivery, as [`Consumer::process_batch`].
    pub async fn process_batch<I: Inbox, H: Handler<I>>(
        &self,
        consumer: &Consumer<I, H>,
        deliveries: Vec<Delivery>,
    ) -> Vec<Result<Handled>> {
        match self.consumer {
            ConsumerRuntime::BatchAcksRolledBack => crate::mutants::batch_acks_rolled_back(consumer, deliveries).await,
            _ => consumer.process_batch(deliveries).await,
        }
    }

    /// Handle whatever a subscription received, as [`Consumer::handle`] does: an event as
    /// [`process`](Self::process), a foreign message recorded and then acknowledged.
    ///
    /// # Errors
    /// As [`Consumer::handle`].
    pub async fn handle<I: Inbox, H: Handler<I>>(
        &self,
        consumer: &Consumer<I, H>,
        received: Received,
    ) -> Result<Handled> {
        match (self.consumer, received) {
            (_, Received::Event(d)) => self.process(consumer, d).await,
            (ConsumerRuntime::DropsForeign, Received::Foreign(f)) => crate::mutants::drop_foreign(f).await,
            (ConsumerRuntime::AckForeignThenRecord, Received::Foreign(f)) => {
                crate::mutants::ack_foreign_then_record(consumer, f).await
            }
            (ConsumerRuntime::RecordsForeignEachDelivery, Received::Foreign(f)) => {
                crate::mutants::record_foreign_each_delivery(consumer, f).await
            }
            (_, Received::Foreign(f)) => consumer.process_foreign(f).await,
        }
    }
}
