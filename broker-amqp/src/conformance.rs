//! This crate's half of the conformance suite, so the suite can judge RabbitMQ with any store:
//! the crate's own run pairs it with the in-memory store and inbox, the store × broker matrix
//! and `outbox conformance --broker amqp://…` with real ones.
//!
//! Every fixture publishes to a destination of its own, under an exchange and queue prefix of
//! this harness, so cases run in parallel and a re-run on a dirty server starts clean. The
//! fixtures' exchanges and the queues of the suite's two groups are deleted when the harness is
//! dropped.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use outbox_conformance_tests::world::unique_tag;
use outbox_conformance_tests::{
    BrokerFixture, BrokerHarness, Capabilities, Capability, Foreign, ForeignKind, ForeignWriter,
};
use outbox_core::{Broker, ConsumerGroup, Destination, Result};

use crate::{AmqpBroker, AmqpConfig, QueueType};

/// The groups the suite declares on every fixture's destination.
const GROUPS: [&str; 2] = ["suite", "audit"];

/// RabbitMQ, with every name under a prefix of this harness.
pub struct AmqpBrokerHarness {
    /// The server and this harness's exchange and queue prefix.
    config: AmqpConfig,
    /// Every destination a fixture was given, to delete at the end.
    created: Mutex<Vec<Destination>>,
}

impl std::fmt::Debug for AmqpBrokerHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpBrokerHarness")
            .field("server", &self.config.redacted_url())
            .field("prefix", &self.config.queue_prefix())
            .finish_non_exhaustive()
    }
}

impl AmqpBrokerHarness {
    /// Fixtures on the server of `config`, with its queue type, under exchange and queue prefixes
    /// unique to this harness (appended to the config's).
    ///
    /// # Errors
    /// [`outbox_core::ErrorKind::Config`] when the prefixed names are not valid.
    pub fn new(config: AmqpConfig) -> Result<Self> {
        let tag = format!("outbox-conformance.{}.", unique_tag());
        let exchange_prefix = format!("{}{tag}", config.exchange_prefix());
        let queue_prefix = format!("{}{tag}", config.queue_prefix());
        let config = config
            .with_exchange_prefix(exchange_prefix)?
            .with_queue_prefix(queue_prefix)?
            .with_connection_name("outbox conformance");
        Ok(Self { config, created: Mutex::new(Vec::new()) })
    }

    /// Fixtures on the server of `url`. The groups' queues are quorum queues unless the URL
    /// names an `outbox_queue_type`: RabbitMQ's recommended durable queue type, and the one that
    /// reports a delivery count (`Delivery::attempt`) on top of the `redelivered` flag, so the
    /// redelivery case checks both. A batch is spread over every publishing channel unless the
    /// URL names an `outbox_batch_channels`: the spread is where a batch's keys are assigned to
    /// channels, so the suite's batch cases judge that assignment; the default, one channel per
    /// batch, is the spread's one-channel case (and `tests/batch.rs` runs it).
    ///
    /// # Errors
    /// As [`AmqpConfig::from_url`] and [`new`](Self::new).
    pub fn from_url(url: &str) -> Result<Self> {
        let mut config = AmqpConfig::from_url(url)?;
        if !url.contains("outbox_queue_type=") {
            config = config.with_queue_type(QueueType::Quorum);
        }
        if !url.contains("outbox_batch_channels=") {
            let all = config.publish_channels();
            config = config.with_batch_channels(all)?;
        }
        Self::new(config)
    }

    /// The configuration every fixture's broker uses.
    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

    async fn delete_all(&self, destinations: Vec<Destination>) {
        let broker = AmqpBroker::new(self.config.clone());
        let groups: Vec<ConsumerGroup> = GROUPS.iter().filter_map(|g| ConsumerGroup::new(*g).ok()).collect();
        let failures: Vec<String> = futures::stream::iter(destinations)
            .map(|d| {
                let (broker, groups) = (&broker, &groups);
                async move { broker.delete(&d, groups).await.err().map(|e| format!("{d}: {e}")) }
            })
            .buffer_unordered(8)
            .filter_map(|failure| async move { failure })
            .collect()
            .await;
        broker.close().await;
        for failure in failures {
            eprintln!("cleanup failed: {failure}");
        }
    }
}

impl Drop for AmqpBrokerHarness {
    fn drop(&mut self) {
        let destinations = std::mem::take(self.created.get_mut().unwrap_or_else(PoisonError::into_inner));
        if destinations.is_empty() {
            return;
        }
        // Drop may run inside a runtime (which cannot block on another): clean up on a thread.
        std::thread::scope(|s| {
            s.spawn(|| match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt.block_on(self.delete_all(destinations)),
                Err(e) => eprintln!("cleanup skipped: cannot build a tokio runtime: {e}"),
            });
        });
    }
}

#[async_trait]
impl BrokerHarness for AmqpBrokerHarness {
    fn name(&self) -> String {
        format!("RabbitMQ broker ({} queues)", self.config.queue_type())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // Unroutable: a publish to an exchange that does not exist fails with 404, and one
            // that no queue is bound to comes back as a `mandatory` return. RedeliveryInfo: the
            // `redelivered` flag (and on quorum queues the delivery count). Nack: `basic.nack`
            // with requeue.
            present: {
                let mut present = Capability::present_in(&self.config.capabilities());
                // Raw messages are published with lapin ([`AmqpForeign`]).
                present.push(Capability::ForeignMessages);
                // A queue keeps an unacknowledged delivery with its channel's consumer until the
                // channel closes: a consumer that joins does not get it.
                present.push(Capability::HeldWhileLive);
                present
            },
            // RabbitMQ requeues a closed channel's unacknowledged deliveries at once and pushes
            // them to the remaining consumers: no server-side timeout to wait out, only round
            // trips (about 50 ms here), so the wait is a margin for a loaded machine.
            delivery_wait: Duration::from_millis(500),
            // A sampled path costs about 1.6 s, mostly quiet waits (the final drain has two), so
            // the whole target stays near 90 s.
            sampled_iterations: 50,
            exhaustive: false,
        }
    }

    async fn fixture(&self, case: &str) -> Result<BrokerFixture> {
        let destination = Destination::new(format!("{case}.{}", unique_tag()))?;
        let broker = AmqpBroker::new(self.config.clone());
        // Connected now, not on first use: a server that cannot be reached fails the fixture
        // here, with the broker's own error, and leaves the harness nothing to delete.
        broker.connect().await?;
        self.created.lock().unwrap_or_else(PoisonError::into_inner).push(destination.clone());
        let mut fixture = BrokerFixture::new(Arc::new(broker) as Arc<dyn Broker>, destination);
        // A restarted process has connections of its own; what survives is on the server.
        let config = self.config.clone();
        fixture.restart_broker = Arc::new(move || Arc::new(AmqpBroker::new(config.clone())) as Arc<dyn Broker>);
        fixture.foreign = Some(Arc::new(AmqpForeign { config: self.config.clone() }));
        Ok(fixture)
    }
}

/// Publishes raw messages with lapin (publisher confirms, `mandatory`) to a destination's
/// exchange, as another AMQP client would. A message cannot carry
/// [`ForeignKind::DuplicateIdHeader`]: it has one `message_id` property and a header table holds
/// each name once.
pub struct AmqpForeign {
    config: AmqpConfig,
}

impl std::fmt::Debug for AmqpForeign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpForeign").field("server", &self.config.redacted_url()).finish()
    }
}

#[async_trait]
impl ForeignWriter for AmqpForeign {
    async fn write(&self, destination: &Destination, kind: ForeignKind, id: &str, payload: &[u8]) -> Result<Foreign> {
        use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
        use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};
        use lapin::{BasicProperties, Connection, ConnectionProperties};

        use crate::codec::{HEADER_NAMES_HEADER, KEY_HEADER};
        let mut table = FieldTable::default();
        let mut names = FieldArray::default();
        let mut header = |table: &mut FieldTable, name: &str, value: Vec<u8>| {
            table.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
            names.push(AMQPValue::LongString(LongString::from(name.as_bytes())));
        };
        let mut message_id = Some(id.to_string());
        match kind {
            ForeignKind::NoEventId => message_id = None,
            ForeignKind::BadEventId => message_id = Some(format!("{id} has spaces")),
            ForeignKind::DuplicateIdHeader => {
                return Ok(Foreign::Unsupported(
                    "an AMQP message has one message_id and its header table holds each name once".into(),
                ));
            }
            ForeignKind::BadHeaderName => header(&mut table, "bad name", b"v".to_vec()),
            ForeignKind::OversizedHeaders => {
                header(&mut table, "big", vec![b'x'; ForeignKind::OVERSIZED_HEADER_BYTES]);
            }
            ForeignKind::BadKey => {
                table.insert(KEY_HEADER.into(), AMQPValue::LongString(LongString::from(vec![0xffu8, 0xfe, b'k'])));
            }
            ForeignKind::UnknownFormat => {}
        }
        let listed = if kind == ForeignKind::UnknownFormat {
            AMQPValue::LongString(LongString::from("not an array"))
        } else {
            AMQPValue::FieldArray(names)
        };
        table.insert(HEADER_NAMES_HEADER.into(), listed);
        let mut properties = BasicProperties::default().with_delivery_mode(2).with_headers(table);
        if let Some(id) = message_id {
            properties = properties.with_message_id(id.into());
        }
        let failed = |what: &'static str| {
            move |e: lapin::Error| {
                outbox_core::Error::transient(outbox_core::ErrorKind::Connection, crate::error::BACKEND, what)
                    .with_source(e)
            }
        };
        let conn = Connection::connect_uri(self.config.amqp_uri(), ConnectionProperties::default())
            .await
            .map_err(failed("connecting to publish a raw message"))?;
        let channel = conn.create_channel().await.map_err(failed("opening a channel"))?;
        channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(failed("confirm.select"))?;
        let exchange = self.config.exchange_name(destination)?;
        let confirm = channel
            .basic_publish(
                exchange.as_str().into(),
                destination.as_str().into(),
                BasicPublishOptions { mandatory: true, immediate: false },
                payload,
                properties,
            )
            .await
            .map_err(failed("publishing a raw message"))?
            .await
            .map_err(failed("confirming a raw message"))?;
        let _ = conn.close(200, "OK".into()).await;
        if confirm.is_nack() || confirm.take_message().is_some() {
            return Err(outbox_core::Error::transient(
                outbox_core::ErrorKind::Unroutable,
                crate::error::BACKEND,
                format!("the raw {kind} message to {exchange} was not routed or not confirmed"),
            ));
        }
        Ok(Foreign::Written)
    }
}
