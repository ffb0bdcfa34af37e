//! This crate's half of the conformance suite, so the suite can judge Kafka with any store: the
//! crate's own run pairs it with the in-memory store and inbox, the store × broker matrix and
//! `outbox conformance --broker kafka://…` with real ones.
//!
//! Each fixture gets a topic of its own and consumer groups of its own (the suite's group names
//! are prefixed per fixture), so cases running in parallel never share a group and never make
//! each other's groups rebalance. The topics and groups the fixtures created are deleted when
//! the harness is dropped: by then every case has finished and dropped its subscriptions, so no
//! consumer fetches from a deleted topic (which crashes librdkafka on tansu).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use outbox_conformance_tests::world::unique_tag;
use outbox_conformance_tests::{
    BrokerFixture, BrokerHarness, Capabilities, Capability, Foreign, ForeignKind, ForeignWriter,
};
use outbox_core::{Broker, ConsumerGroup, Destination, Event, Result, Subscription};
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::{EVENT_ID_HEADER, KafkaBroker, KafkaConfig};

/// How long `next` waits before deciding nothing is coming. A redelivery after a dropped
/// subscription is a fresh member joining the group, being assigned the partition, fetching the
/// committed offset and then the record: about 0.2 s on a local tansu (the dropped member has
/// already left the group when `drop` returns), so this leaves a wide margin for a loaded
/// machine. Every scenario pays it at least twice (the recovery consumer's and the audit's final
/// empty `next`), which is what bounds the sampled iterations.
pub const DELIVERY_WAIT: Duration = Duration::from_secs(2);

/// Sampled permutation paths per run. Each costs about 6 s (at least two delivery waits, often
/// a third for a consume that finds nothing): about 70 s, the longest case of the run.
pub const SAMPLED_ITERATIONS: u32 = 12;

/// The adapter with the suite's consumer groups renamed into a namespace of one fixture.
struct Namespaced {
    kafka: KafkaBroker,
    prefix: String,
}

impl Namespaced {
    fn group(&self, group: &ConsumerGroup) -> Result<ConsumerGroup> {
        ConsumerGroup::new(format!("{}-{group}", self.prefix))
    }
}

#[async_trait]
impl Broker for Namespaced {
    fn backend(&self) -> &'static str {
        self.kafka.backend()
    }

    fn capabilities(&self) -> outbox_core::Capabilities {
        self.kafka.capabilities()
    }

    fn preferred_pipeline_depth(&self) -> Option<usize> {
        self.kafka.preferred_pipeline_depth()
    }

    async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        let groups = groups.iter().map(|g| self.group(g)).collect::<Result<Vec<_>>>()?;
        self.kafka.declare(destination, &groups).await
    }

    async fn publish(&self, event: &Event) -> Result<()> {
        self.kafka.publish(event).await
    }

    async fn publish_batch(&self, events: &[Event]) -> Vec<Result<()>> {
        self.kafka.publish_batch(events).await
    }

    async fn subscribe(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        self.kafka.subscribe(destination, &self.group(group)?).await
    }
}

/// Names a fixture may have created on the server.
#[derive(Default)]
struct Created {
    topics: Vec<Destination>,
    prefixes: Vec<String>,
}

/// Kafka, a topic and consumer groups per fixture, deleted when the harness is dropped.
pub struct KafkaBrokerHarness {
    config: KafkaConfig,
    kafka: KafkaBroker,
    created: Mutex<Created>,
}

impl std::fmt::Debug for KafkaBrokerHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaBrokerHarness").field("servers", &self.config.bootstrap_servers).finish_non_exhaustive()
    }
}

impl KafkaBrokerHarness {
    /// Fixtures on the cluster of `config`, used as given (see [`from_url`](Self::from_url) for
    /// the settings the suite's delivery wait assumes).
    ///
    /// # Errors
    /// As [`KafkaBroker::new`].
    pub fn new(config: KafkaConfig) -> Result<Self> {
        let kafka = KafkaBroker::new(config.clone())?;
        Ok(Self { config, kafka, created: Mutex::new(Created::default()) })
    }

    /// Fixtures on the cluster of `url`, with timeouts that fit the suite's [`DELIVERY_WAIT`].
    ///
    /// # Errors
    /// As [`KafkaConfig::from_url`] and [`new`](Self::new).
    pub fn from_url(url: &str) -> Result<Self> {
        let config = KafkaConfig::from_url(url)?
            .with_client_id(format!("outbox-conformance-{}", std::process::id()))
            .with_delivery_timeout(Duration::from_secs(10))
            .with_session_timeout(Duration::from_secs(6))
            .with_operation_timeout(Duration::from_secs(10))
            // A single in-memory broker has nothing to propagate: an undeclared topic is
            // unroutable after 1 s instead of 5 s.
            .option("topic.metadata.propagation.max.ms", "1000")
            // tansu holds a fetch for its whole maximum wait even when records arrive meanwhile
            // (Kafka answers at once): 100 ms instead of librdkafka's 500 ms per idle fetch.
            .option("fetch.wait.max.ms", "100");
        Self::new(config)
    }

    fn created(&self) -> std::sync::MutexGuard<'_, Created> {
        self.created.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn clean_up(&self) {
        let created = std::mem::take(&mut *self.created());
        for topic in &created.topics {
            if let Err(e) = self.kafka.delete_topic(topic).await {
                eprintln!("could not delete topic {topic}: {e}");
            }
        }
        let groups: Vec<String> =
            created.prefixes.iter().flat_map(|p| ["suite", "audit"].map(|g| format!("{p}-{g}"))).collect();
        if groups.is_empty() {
            return;
        }
        // Groups are not part of the adapter's API; the admin client deletes their offsets.
        let admin = match self.config_for_admin().create::<AdminClient<DefaultClientContext>>() {
            Ok(a) => a,
            Err(e) => return eprintln!("could not create an admin client: {e}"),
        };
        let names: Vec<&str> = groups.iter().map(String::as_str).collect();
        let options = AdminOptions::new().request_timeout(Some(self.config.operation_timeout));
        match admin.delete_groups(&names, &options).await {
            Ok(results) => {
                for r in results {
                    match r {
                        Ok(_) | Err((_, RDKafkaErrorCode::GroupIdNotFound)) => {}
                        Err((group, code)) => eprintln!("could not delete consumer group {group}: {code}"),
                    }
                }
            }
            Err(e) => eprintln!("could not delete consumer groups: {e}"),
        }
    }

    fn config_for_admin(&self) -> rdkafka::ClientConfig {
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", self.config.bootstrap_servers.join(","));
        c.set("client.id", &self.config.client_id);
        for (k, v) in &self.config.options {
            c.set(k, v);
        }
        c
    }
}

impl Drop for KafkaBrokerHarness {
    fn drop(&mut self) {
        if self.created().topics.is_empty() {
            return;
        }
        // Every case has finished and dropped its subscriptions: no consumer fetches from these
        // topics any more, so deleting them is safe. Drop may run inside a runtime (which cannot
        // block on another): clean up on a thread.
        std::thread::scope(|s| {
            s.spawn(|| match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt.block_on(self.clean_up()),
                Err(e) => eprintln!("cannot build a runtime to clean up the topics: {e}"),
            });
        });
    }
}

#[async_trait]
impl BrokerHarness for KafkaBrokerHarness {
    fn name(&self) -> String {
        format!("kafka broker ({})", self.config.bootstrap_servers.join(","))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // Unroutable: an unknown topic fails the publish after
            // topic.metadata.propagation.max.ms. Nack: the subscription hands the delivery out
            // again. Not redelivery info: a record re-read by a new member after a dropped one
            // is that member's first delivery of it (Kafka keeps no delivery count).
            present: {
                let mut present = Capability::present_in(&self.config.capabilities());
                // Raw records are produced with librdkafka ([`KafkaForeign`]).
                present.push(Capability::ForeignMessages);
                // A member joining rebalances the group. The subscription's assignor,
                // cooperative-sticky, leaves a partition with its live owner unless moving it
                // balances the group: with one partition per topic (the default) a held record
                // stays; with more, a partition may move to the new member with its uncommitted
                // records. (With the eager `range` assignor the case fails: the partition is
                // revoked from the holder on every join.)
                if self.config.partitions == 1 {
                    present.push(Capability::HeldWhileLive);
                }
                present
            },
            delivery_wait: DELIVERY_WAIT,
            sampled_iterations: SAMPLED_ITERATIONS,
            // A fixture is a topic, two groups and a rejoin on a real server: far too slow for
            // the thousands of paths of the exhaustive exploration.
            exhaustive: false,
        }
    }

    async fn fixture(&self, case: &str) -> Result<BrokerFixture> {
        let tag = unique_tag();
        let prefix = format!("{case}-{tag}");
        let destination = Destination::new(format!("suite-{prefix}"))?;
        {
            let mut created = self.created();
            created.topics.push(destination.clone());
            // broker_unroutable_is_error publishes there; nothing should create it, but a broker
            // that auto-creates topics would.
            created.topics.push(Destination::new(format!("{destination}-nowhere"))?);
            created.prefixes.push(prefix.clone());
        }
        let broker = Arc::new(Namespaced { kafka: self.kafka.clone(), prefix });
        let mut fx = BrokerFixture::new(broker, destination);
        let producer = self.config_for_admin().create::<FutureProducer>().map_err(|e| {
            outbox_core::Error::config(crate::BACKEND, "creating the raw-record producer").with_source(e)
        })?;
        fx.foreign = Some(Arc::new(KafkaForeign { producer, timeout: self.config.delivery_timeout }));
        Ok(fx)
    }
}

/// Produces raw records with librdkafka, as another Kafka client would. Kafka records carry no
/// format marker, so [`ForeignKind::UnknownFormat`] is unsupported: every record with one valid
/// id header is read as an event.
pub struct KafkaForeign {
    producer: FutureProducer,
    timeout: Duration,
}

impl std::fmt::Debug for KafkaForeign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaForeign").finish_non_exhaustive()
    }
}

#[async_trait]
impl ForeignWriter for KafkaForeign {
    async fn write(&self, destination: &Destination, kind: ForeignKind, id: &str, payload: &[u8]) -> Result<Foreign> {
        let bad_id = format!("{id} has spaces");
        let other_id = format!("{id}-other");
        let big = vec![b'x'; ForeignKind::OVERSIZED_HEADER_BYTES];
        let mut headers: Vec<(&str, &[u8])> = Vec::new();
        let mut key: Option<&[u8]> = None;
        match kind {
            ForeignKind::NoEventId => {}
            ForeignKind::BadEventId => headers.push((EVENT_ID_HEADER, bad_id.as_bytes())),
            ForeignKind::UnknownFormat => {
                return Ok(Foreign::Unsupported("a Kafka record carries no format marker".into()));
            }
            ForeignKind::DuplicateIdHeader => {
                headers.push((EVENT_ID_HEADER, id.as_bytes()));
                headers.push((EVENT_ID_HEADER, other_id.as_bytes()));
            }
            ForeignKind::BadHeaderName => {
                headers.push((EVENT_ID_HEADER, id.as_bytes()));
                headers.push(("bad name", b"v"));
            }
            ForeignKind::OversizedHeaders => {
                headers.push((EVENT_ID_HEADER, id.as_bytes()));
                headers.push(("big", &big));
            }
            ForeignKind::BadKey => {
                headers.push((EVENT_ID_HEADER, id.as_bytes()));
                key = Some(&[0xff, 0xfe, b'k']);
            }
        }
        let mut owned = OwnedHeaders::new_with_capacity(headers.len());
        for (name, value) in headers {
            owned = owned.insert(Header { key: name, value: Some(value) });
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(destination.as_str()).payload(payload).headers(owned);
        if let Some(key) = key {
            record = record.key(key);
        }
        self.producer.send(record, self.timeout).await.map_err(|(e, _)| {
            outbox_core::Error::transient(outbox_core::ErrorKind::Connection, crate::BACKEND, "producing a raw record")
                .with_source(e)
        })?;
        Ok(Foreign::Written)
    }
}
