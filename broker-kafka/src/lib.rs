#![doc = include_str!("../README.md")]

mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
mod error;
#[cfg(feature = "testkit")]
mod inspect;
mod subscription;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::broker::skipped;
use outbox_core::{Broker, ConsumerGroup, Destination, Error, ErrorKind, Event, Result, Subscription};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::KafkaError;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;
use tokio::time::timeout_at;
use tracing::{debug, warn};

pub use config::{ENV_BOOTSTRAP, ENV_URL, KafkaConfig};
#[cfg(feature = "testkit")]
pub use inspect::{GroupPosition, StoredMessage};
pub use subscription::KafkaSubscription;

/// Backend name in errors and logs.
const BACKEND: &str = "kafka";

/// The Kafka header that carries the event id. It is reserved: publishing an event that has an
/// application header of this name fails with
/// [`InvalidInput`](outbox_core::ErrorKind::InvalidInput).
pub const EVENT_ID_HEADER: &str = "outbox-event-id";

/// A [`Broker`] on Kafka (or any Kafka-protocol broker) through librdkafka.
///
/// Cheap to clone: clones share the producer and the admin client. See the crate
/// documentation for the delivery guarantees.
#[derive(Clone)]
pub struct KafkaBroker {
    shared: Arc<Shared>,
}

struct Shared {
    config: KafkaConfig,
    /// The idempotent producer, replaced when librdkafka reports a fatal error (after which
    /// the old instance refuses every message).
    producer: RwLock<ProducerSlot>,
    admin: AdminClient<DefaultClientContext>,
}

#[derive(Clone)]
struct ProducerSlot {
    /// Bumped on every rebuild, so concurrent publishers that saw one fatal error rebuild once.
    generation: u64,
    producer: FutureProducer,
}

impl std::fmt::Debug for KafkaBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaBroker").field("config", &self.shared.config).finish_non_exhaustive()
    }
}

impl KafkaBroker {
    /// Build the clients without contacting the brokers (librdkafka connects in the
    /// background; an unreachable cluster shows up as errors of the first operations).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for settings librdkafka rejects.
    pub fn new(config: KafkaConfig) -> Result<Self> {
        config.validate()?;
        let producer = build_producer(&config)?;
        let admin = config
            .client_config(&[], &[])
            .create::<AdminClient<DefaultClientContext>>()
            .map_err(|e| error::convert("creating the admin client", e))?;
        Ok(Self {
            shared: Arc::new(Shared { config, producer: RwLock::new(ProducerSlot { generation: 0, producer }), admin }),
        })
    }

    /// Build the clients and check that the cluster answers a metadata request within
    /// [`operation_timeout`](KafkaConfig::operation_timeout).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for bad settings; [`ErrorKind::Connection`] (transient) when no
    /// broker answers in time.
    pub async fn connect(config: KafkaConfig) -> Result<Self> {
        let broker = Self::new(config)?;
        let producer = broker.producer().producer;
        let timeout = broker.shared.config.operation_timeout;
        let servers = broker.shared.config.bootstrap_servers.join(",");
        blocking(move || producer.client().fetch_metadata(None, timeout)).await?.map_err(|e| {
            let operation = format!("connecting to {servers}");
            // Refused SASL credentials are permanent; anything else means nobody answered.
            if error::code_of(&e).map(error::classify).is_some_and(|(kind, _)| kind == ErrorKind::Auth) {
                return error::convert(&operation, e);
            }
            Error::transient(ErrorKind::Connection, BACKEND, format!("no broker answered within {timeout:?}"))
                .with_operation(operation)
                .with_source(e)
        })?;
        Ok(broker)
    }

    /// [`connect`](Self::connect) with settings parsed by [`KafkaConfig::from_url`].
    ///
    /// # Errors
    /// As for `from_url` and `connect`.
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(KafkaConfig::from_url(url)?).await
    }

    /// The settings this broker was built with.
    pub fn config(&self) -> &KafkaConfig {
        &self.shared.config
    }

    fn producer(&self) -> ProducerSlot {
        self.shared.producer.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Replace the producer after a fatal error, unless another publisher already did.
    fn rebuild_producer(&self, failed_generation: u64) -> Result<()> {
        let mut slot = self.shared.producer.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.generation == failed_generation {
            slot.producer = build_producer(&self.shared.config)?;
            slot.generation += 1;
        }
        Ok(())
    }

    fn admin_options(&self) -> AdminOptions {
        let t = self.shared.config.operation_timeout;
        AdminOptions::new().request_timeout(Some(t)).operation_timeout(Some(t))
    }

    /// Delete a topic and everything in it (cleanup for tests and tools). Deleting a topic that
    /// does not exist is not an error.
    ///
    /// # Errors
    /// Connection, timeout or authorization errors of the admin request.
    pub async fn delete_topic(&self, destination: &Destination) -> Result<()> {
        let results = self
            .shared
            .admin
            .delete_topics(&[destination.as_str()], &self.admin_options())
            .await
            .map_err(|e| error::convert("deleting a topic", e))?;
        for r in results {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
                Err((name, code)) => return Err(error::from_code(&format!("deleting topic {name}"), code)),
            }
        }
        Ok(())
    }
}

fn build_producer(config: &KafkaConfig) -> Result<FutureProducer> {
    config
        .client_config(
            &[
                ("message.timeout.ms", config.delivery_timeout_ms()),
                ("topic.metadata.propagation.max.ms", config.topic_propagation_ms()),
            ],
            &[("enable.idempotence", "true"), ("acks", "all")],
        )
        .create::<FutureProducer>()
        .map_err(|e| error::convert("creating the producer", e))
}

/// Run a blocking librdkafka call off the async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        Error::transient(ErrorKind::Closed, BACKEND, format!("blocking librdkafka call did not finish: {e}"))
    })
}

/// How long past the delivery timeout a batch waits for a record's delivery report: librdkafka
/// times each record out itself, this only keeps a lost report from hanging the batch.
const REPORT_GRACE: Duration = Duration::from_secs(5);

/// Validate `event` as `publish` does and build its Kafka headers (the event id first).
fn record_headers(event: &Event) -> Result<OwnedHeaders> {
    // Size is left to librdkafka (`message.max.bytes`) and the broker, which know the limit.
    event.validate(usize::MAX)?;
    if event.headers.contains_key(EVENT_ID_HEADER) {
        return Err(Error::invalid_input(
            BACKEND,
            format!("event {}: header {EVENT_ID_HEADER:?} is reserved for the event id", event.id),
        ));
    }
    let mut headers = OwnedHeaders::new_with_capacity(event.headers.len() + 1)
        .insert(Header { key: EVENT_ID_HEADER, value: Some(event.id.as_str().as_bytes()) });
    for (name, value) in &event.headers {
        headers = headers.insert(Header { key: name.as_str(), value: Some(value.as_slice()) });
    }
    Ok(headers)
}

fn record(event: &Event, headers: OwnedHeaders) -> FutureRecord<'_, [u8], [u8]> {
    let mut record =
        FutureRecord::<[u8], [u8]>::to(event.destination.as_str()).payload(event.payload.as_slice()).headers(headers);
    if let Some(key) = &event.key {
        record = record.key(key.as_bytes());
    }
    record
}

impl KafkaBroker {
    async fn publish_events(&self, events: &[Event]) -> Vec<Result<()>> {
        let mut out: Vec<Option<Result<()>>> = (0..events.len()).map(|_| None).collect();
        if events.is_empty() {
            return Vec::new();
        }
        let slot = self.producer();
        let timeout = self.shared.config.delivery_timeout;
        // Keys whose event failed first (before sending, or while enqueuing): later events of
        // the key are not sent.
        let mut failed: HashMap<&str, String> = HashMap::new();
        // Each record's delivery report is due within `message.timeout.ms` (the delivery timeout)
        // of its enqueueing; waiting longer would hang on a lost callback.
        let due = |enqueued: Instant| tokio::time::Instant::from_std(enqueued + timeout + REPORT_GRACE);
        let mut in_flight: VecDeque<(usize, DeliveryFuture, Instant)> = VecDeque::new();
        let mut delivered: Vec<(usize, Option<<DeliveryFuture as std::future::Future>::Output>)> = Vec::new();
        for (i, event) in events.iter().enumerate() {
            if let Some(first) = event.key.as_deref().and_then(|k| failed.get(k)) {
                out[i] = Some(Err(skipped(BACKEND, first)));
                continue;
            }
            let enqueued = match record_headers(event) {
                Err(e) => Err(e),
                Ok(headers) => {
                    let mut record = record(event, headers);
                    let started = Instant::now();
                    loop {
                        match slot.producer.send_result(record) {
                            Ok(future) => break Ok(future),
                            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                                if started.elapsed() < timeout =>
                            {
                                // librdkafka's queue is full: wait for the oldest delivery of
                                // this batch (or a moment, as `send` does), then try again.
                                record = back;
                                match in_flight.pop_front() {
                                    Some((j, f, at)) => delivered.push((j, timeout_at(due(at), f).await.ok())),
                                    None => tokio::time::sleep(Duration::from_millis(100)).await,
                                }
                            }
                            Err((e, _)) => {
                                break Err(error::convert(
                                    &format!("publishing event {} to {}", event.id, event.destination),
                                    e,
                                ));
                            }
                        }
                    }
                }
            };
            match enqueued {
                Ok(future) => in_flight.push_back((i, future, Instant::now())),
                Err(e) => {
                    if let Some(k) = event.key.as_deref() {
                        failed.insert(k, event.id.to_string());
                    }
                    out[i] = Some(Err(e));
                }
            }
        }
        for (i, future, at) in in_flight {
            delivered.push((i, timeout_at(due(at), future).await.ok()));
        }
        let fatal = slot.producer.client().fatal_error();
        if let Some((code, reason)) = &fatal {
            warn!(target: "outbox.kafka", %code, %reason, "fatal producer error; rebuilding the producer");
            if let Err(e) = self.rebuild_producer(slot.generation) {
                warn!(target: "outbox.kafka", error = %e, "rebuilding the producer failed");
            }
        }
        for (i, result) in delivered {
            let event = &events[i];
            out[i] = Some(match result {
                Some(Ok(Ok(delivery))) => {
                    debug!(target: "outbox.kafka", event = %event.id, topic = %event.destination,
                        partition = delivery.partition, offset = delivery.offset, "published");
                    Ok(())
                }
                Some(Ok(Err((e, _)))) => match &fatal {
                    Some((code, reason)) => Err(Error::transient(
                        ErrorKind::Rejected,
                        BACKEND,
                        format!("event {}: fatal producer error {code} ({reason}); producer rebuilt", event.id),
                    )
                    .with_source(e)),
                    None => Err(error::convert(&format!("publishing event {} to {}", event.id, event.destination), e)),
                },
                Some(Err(_canceled)) => Err(Error::outcome_unknown(
                    ErrorKind::Closed,
                    BACKEND,
                    format!("event {}: the producer went away before its delivery report", event.id),
                )),
                None => Err(Error::outcome_unknown(
                    ErrorKind::Timeout,
                    BACKEND,
                    format!(
                        "event {}: no delivery report within the delivery timeout of {timeout:?} (and {REPORT_GRACE:?} \
                         more); it may or may not have been stored",
                        event.id
                    ),
                )),
            });
        }
        // A key stops at its first failure: its later events are reported `Skipped`, also when
        // librdkafka delivered them (the relay re-offers them after the failed one).
        let mut first_failure: HashMap<&str, String> = HashMap::new();
        for (i, r) in out.iter_mut().enumerate() {
            let Some(key) = events[i].key.as_deref() else { continue };
            if let Some(first) = first_failure.get(key) {
                if !matches!(r, Some(Err(e)) if e.kind() == ErrorKind::Skipped) {
                    *r = Some(Err(skipped(BACKEND, first)));
                }
            } else if matches!(r, Some(Err(_)) | None) {
                first_failure.insert(key, events[i].id.to_string());
            }
        }
        out.into_iter().map(|r| r.unwrap_or_else(|| Err(skipped(BACKEND, "?")))).collect()
    }
}

#[async_trait]
impl Broker for KafkaBroker {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// [`KafkaConfig::capabilities`]: unroutable detection and per-key ordering, no delivery
    /// count.
    fn capabilities(&self) -> outbox_core::Capabilities {
        self.shared.config.capabilities()
    }

    /// Create the topic with the configured partitions and replication factor unless it
    /// exists. Groups need nothing: a group without committed offsets starts at the earliest
    /// retained message.
    async fn declare(&self, destination: &Destination, _groups: &[ConsumerGroup]) -> Result<()> {
        let config = &self.shared.config;
        let topic =
            NewTopic::new(destination.as_str(), config.partitions, TopicReplication::Fixed(config.replication_factor));
        let results = self
            .shared
            .admin
            .create_topics([&topic], &self.admin_options())
            .await
            .map_err(|e| error::convert(&format!("creating topic {destination}"), e))?;
        for r in results {
            match r {
                Ok(_) => {
                    debug!(target: "outbox.kafka", topic = %destination, partitions = config.partitions, "topic created")
                }
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => return Err(error::from_code(&format!("creating topic {name}"), code)),
            }
        }
        Ok(())
    }

    async fn publish(&self, event: &Event) -> Result<()> {
        let headers = record_headers(event)?;
        let record = record(event, headers);
        let slot = self.producer();
        match slot.producer.send(record, Timeout::After(self.shared.config.delivery_timeout)).await {
            Ok(delivery) => {
                debug!(target: "outbox.kafka", event = %event.id, topic = %event.destination,
                    partition = delivery.partition, offset = delivery.offset, "published");
                Ok(())
            }
            Err((e, _message)) => {
                if let Some((code, reason)) = slot.producer.client().fatal_error() {
                    warn!(target: "outbox.kafka", %code, %reason, "fatal producer error; rebuilding the producer");
                    self.rebuild_producer(slot.generation)?;
                    return Err(Error::transient(
                        ErrorKind::Rejected,
                        BACKEND,
                        format!("event {}: fatal producer error {code} ({reason}); producer rebuilt", event.id),
                    )
                    .with_source(e));
                }
                let err = error::convert(&format!("publishing event {} to {}", event.id, event.destination), e);
                Err(err)
            }
        }
    }

    /// Every record of the batch handed to librdkafka first (in slice order), then every delivery
    /// report awaited: many deliveries in flight, per-key order kept by the idempotent producer
    /// (see the crate documentation, "Batching").
    async fn publish_batch(&self, events: &[Event]) -> Vec<Result<()>> {
        self.publish_events(events).await
    }

    /// Join `group` on `destination` with a consumer of its own. Creates the topic first if it
    /// is missing (as `declare` does).
    async fn subscribe(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        self.declare(destination, std::slice::from_ref(group)).await?;
        let sub = KafkaSubscription::new(&self.shared.config, destination, group)?;
        Ok(Box::new(sub))
    }
}
