//! The whole conformance suite with RabbitMQ as the broker: the outbox store and the inbox are
//! the in-memory reference ones, so every failure here is about the AMQP adapter (or the suite).
//!
//! Every fixture publishes to a destination of its own, under a prefix of this run, so cases run
//! in parallel and a re-run on a dirty server starts clean. Its exchange and the queues of the
//! suite's two groups are deleted when the harness is dropped at the end of `main`.
//!
//! The server is `OUTBOX_AMQP_URL` (default the local one). The groups' queues are quorum queues
//! unless that URL names an `outbox_queue_type`: RabbitMQ's recommended durable queue type, and the one
//! that reports a delivery count (`Delivery::attempt`) on top of the `redelivered` flag, so the
//! redelivery case checks both. The suite runs as fast on them as on classic queues; add
//! `?outbox_queue_type=classic` to the URL to judge those.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use outbox_broker_amqp::{AmqpBroker, AmqpConfig, QueueType};
use outbox_conformance_tests::reference::MemoryEffects;
use outbox_conformance_tests::world::unique_tag;
use outbox_conformance_tests::{Capabilities, Capability, Fixture, Harness};
use outbox_core::memory::{MemoryInbox, MemoryOutbox};
use outbox_core::{Broker, ConsumerGroup, Destination, ManualClock, Result};

/// The groups the suite declares on every fixture's destination.
const GROUPS: [&str; 2] = ["suite", "audit"];

struct AmqpHarness {
    /// The server and this run's exchange and queue prefix.
    config: AmqpConfig,
    /// Every destination a fixture was given, to delete at the end.
    created: Mutex<Vec<Destination>>,
}

impl AmqpHarness {
    fn new() -> Result<Self> {
        let url = outbox_conformance_tests::amqp_url();
        let prefix = format!("outbox-conformance.{}.", unique_tag());
        let mut config = AmqpConfig::from_url(&url)?;
        let named_type = url::Url::parse(&url).is_ok_and(|u| u.query_pairs().any(|(k, _)| k == "outbox_queue_type"));
        if !named_type {
            config = config.with_queue_type(QueueType::Quorum);
        }
        let config = config
            .with_exchange_prefix(prefix.clone())?
            .with_queue_prefix(prefix)?
            .with_connection_name("outbox conformance");
        Ok(Self { config, created: Mutex::new(Vec::new()) })
    }

    async fn delete_all(&self, destinations: Vec<Destination>) {
        let broker = AmqpBroker::new(self.config.clone());
        let groups = GROUPS.map(|g| ConsumerGroup::new(g).expect("valid group name"));
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

impl Drop for AmqpHarness {
    fn drop(&mut self) {
        let destinations = std::mem::take(self.created.get_mut().unwrap_or_else(PoisonError::into_inner));
        if destinations.is_empty() {
            return;
        }
        match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt.block_on(self.delete_all(destinations)),
            Err(e) => eprintln!("cleanup skipped: cannot build a tokio runtime: {e}"),
        }
    }
}

#[async_trait]
impl Harness for AmqpHarness {
    type Inbox = MemoryInbox;

    fn name(&self) -> String {
        format!("memory store + RabbitMQ broker ({} queues) + memory inbox", self.config.queue_type())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // Unroutable: a publish to an exchange that does not exist fails with 404, and one
            // that no queue is bound to comes back as a `mandatory` return. RedeliveryInfo: the
            // `redelivered` flag (and on quorum queues the delivery count). Nack: `basic.nack`
            // with requeue.
            present: vec![Capability::DetectsUnroutable, Capability::RedeliveryInfo, Capability::Nack],
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

    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<Fixture<MemoryInbox>> {
        let destination = Destination::new(format!("{case}.{}", unique_tag()))?;
        self.created.lock().unwrap_or_else(PoisonError::into_inner).push(destination.clone());
        let inbox = MemoryInbox::new(Arc::new(clock.clone()));
        let broker: Arc<dyn Broker> = Arc::new(AmqpBroker::new(self.config.clone()));
        let mut fixture = Fixture::new(
            Arc::new(MemoryOutbox::new(Arc::new(clock))),
            broker,
            inbox.clone(),
            Arc::new(MemoryEffects(inbox)),
            destination,
        );
        // A restarted process has connections of its own; what survives is on the server.
        let config = self.config.clone();
        fixture.restart_broker = Arc::new(move || Arc::new(AmqpBroker::new(config.clone())) as Arc<dyn Broker>);
        Ok(fixture)
    }
}

fn main() -> std::process::ExitCode {
    let addr = outbox_conformance_tests::service_addr(&outbox_conformance_tests::amqp_url());
    if !outbox_conformance_tests::require_service("RabbitMQ", "rabbitmq", &addr) {
        return std::process::ExitCode::SUCCESS;
    }
    match AmqpHarness::new() {
        Ok(harness) => outbox_conformance_tests::main(harness),
        Err(e) => {
            eprintln!("conformance harness: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
