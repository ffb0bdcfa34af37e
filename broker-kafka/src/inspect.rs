//! Reading a topic's durable contents and a group's committed position, outside any group.
//!
//! Tests judge runs by what the broker holds, not by what a consumer happened to see; these
//! reads use a consumer that never joins a group, so they move no offsets and trigger no
//! rebalance.
//!
//! Compiled only with the `testkit` feature: test inspectors, not part of the stable API.

use std::time::Instant;

use outbox_core::{ConsumerGroup, Destination, Error, ErrorKind, Event, Result};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use crate::config::KafkaConfig;
use crate::subscription::decode;
use crate::{BACKEND, KafkaBroker, blocking, error};

/// Where a group stands on one partition of a topic, read from the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPosition {
    /// The partition.
    pub partition: i32,
    /// Its earliest retained offset.
    pub low: i64,
    /// Its end offset: the offset the next record will get.
    pub high: i64,
    /// The group's committed offset (the next record it will read), `None` where it committed
    /// nothing.
    pub committed: Option<i64>,
}

/// One record of a topic, as stored by the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    /// Partition it was written to.
    pub partition: i32,
    /// Its offset in that partition.
    pub offset: i64,
    /// The event, decoded exactly as a subscription would deliver it.
    pub event: Event,
}

impl KafkaBroker {
    /// Every record of `destination`, partition by partition in offset order (from the earliest
    /// retained to the end at the time of the call). Joins no group and commits nothing.
    ///
    /// # Errors
    /// [`ErrorKind::Unroutable`] when the topic does not exist; [`ErrorKind::Corrupt`] for a
    /// record this adapter did not write; connection and timeout errors; a read that makes no
    /// progress for [`operation_timeout`](KafkaConfig::operation_timeout) is
    /// [`ErrorKind::Timeout`].
    pub async fn read_topic(&self, destination: &Destination) -> Result<Vec<StoredMessage>> {
        let config = self.config().clone();
        let destination = destination.clone();
        blocking(move || read_topic_blocking(&config, &destination, false)).await?.map(|(events, _)| events)
    }

    /// As [`read_topic`](Self::read_topic), but a record this adapter did not write (another
    /// service's message on a shared topic) is skipped and counted instead of failing the read:
    /// the events, and how many records were skipped.
    ///
    /// # Errors
    /// As for [`read_topic`](Self::read_topic), without the corrupt case.
    pub async fn read_events(&self, destination: &Destination) -> Result<(Vec<StoredMessage>, u64)> {
        let config = self.config().clone();
        let destination = destination.clone();
        blocking(move || read_topic_blocking(&config, &destination, true)).await?
    }

    /// How many records of `destination` `group` has not committed past: the sum over partitions
    /// of the end offset minus the group's committed offset (or the earliest retained offset
    /// where the group committed nothing). Deliveries in flight count as unacknowledged.
    ///
    /// # Errors
    /// As for [`read_topic`](Self::read_topic), without the corrupt case.
    pub async fn unacknowledged(&self, destination: &Destination, group: &ConsumerGroup) -> Result<u64> {
        let config = self.config().clone();
        let destination = destination.clone();
        let group = group.clone();
        blocking(move || unacknowledged_blocking(&config, &destination, &group)).await?
    }

    /// Where `group` stands on each partition of `destination`, in partition order: the
    /// watermarks and the committed offset. Joins no group and moves nothing.
    ///
    /// # Errors
    /// As for [`unacknowledged`](Self::unacknowledged).
    pub async fn group_positions(
        &self,
        destination: &Destination,
        group: &ConsumerGroup,
    ) -> Result<Vec<GroupPosition>> {
        let config = self.config().clone();
        let destination = destination.clone();
        let group = group.clone();
        blocking(move || positions_blocking(&config, &destination, &group)).await?
    }
}

/// A consumer that never subscribes, so it never joins `group`: it only assigns partitions
/// (which librdkafka allows only with some group id) or fetches the group's offsets.
fn reader(config: &KafkaConfig, group: Option<&ConsumerGroup>) -> Result<BaseConsumer> {
    let group = group.map_or_else(|| format!("{}-reader", config.client_id), |g| g.as_str().to_string());
    let fixed = [("enable.auto.commit", "false"), ("enable.auto.offset.store", "false"), ("group.id", group.as_str())];
    config
        .client_config(&[("enable.partition.eof", "false".to_string())], &fixed)
        .create::<BaseConsumer>()
        .map_err(|e| error::convert("creating a reader", e))
}

/// `(partition, low, high)` watermarks of every partition of the topic.
fn watermarks(consumer: &BaseConsumer, config: &KafkaConfig, topic: &Destination) -> Result<Vec<(i32, i64, i64)>> {
    let timeout = config.operation_timeout;
    let metadata = consumer
        .fetch_metadata(Some(topic.as_str()), timeout)
        .map_err(|e| error::convert(&format!("reading metadata of {topic}"), e))?;
    let meta = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic.as_str())
        .ok_or_else(|| error::from_code(&format!("reading metadata of {topic}"), RDKafkaErrorCode::UnknownTopic))?;
    if let Some(code) = meta.error() {
        return Err(error::from_code(&format!("reading metadata of {topic}"), code.into()));
    }
    let mut out = Vec::with_capacity(meta.partitions().len());
    for p in meta.partitions() {
        let (low, high) = consumer
            .fetch_watermarks(topic.as_str(), p.id(), timeout)
            .map_err(|e| error::convert(&format!("reading offsets of {topic}[{}]", p.id()), e))?;
        out.push((p.id(), low, high));
    }
    out.sort_unstable();
    Ok(out)
}

/// Every record of `topic`; with `skip_foreign`, records this adapter did not write are counted
/// instead of failing the read.
fn read_topic_blocking(
    config: &KafkaConfig,
    topic: &Destination,
    skip_foreign: bool,
) -> Result<(Vec<StoredMessage>, u64)> {
    let consumer = reader(config, None)?;
    let marks = watermarks(&consumer, config, topic)?;
    let mut list = TopicPartitionList::new();
    let mut remaining = 0usize;
    for &(partition, low, high) in &marks {
        if high > low {
            list.add_partition_offset(topic.as_str(), partition, Offset::Offset(low))
                .map_err(|e| error::convert("building the assignment", e))?;
            remaining += 1;
        }
    }
    let (mut out, mut foreign) = (Vec::new(), 0u64);
    if remaining == 0 {
        return Ok((out, foreign));
    }
    consumer.assign(&list).map_err(|e| error::convert(&format!("assigning {topic}"), e))?;
    let mut progress = Instant::now();
    let end: std::collections::HashMap<i32, i64> = marks.iter().map(|&(p, _, h)| (p, h)).collect();
    let mut done = std::collections::HashSet::new();
    while done.len() < remaining {
        if progress.elapsed() > config.operation_timeout {
            return Err(Error::transient(
                ErrorKind::Timeout,
                BACKEND,
                format!("reading {topic}: no record for {:?}", config.operation_timeout),
            ));
        }
        let Some(polled) = consumer.poll(std::time::Duration::from_millis(100)) else { continue };
        let m = polled.map_err(|e| error::convert(&format!("reading {topic}"), e))?;
        progress = Instant::now();
        let (partition, offset) = (m.partition(), m.offset());
        let high = end.get(&partition).copied().unwrap_or(0);
        if offset >= high {
            continue;
        }
        if offset + 1 >= high {
            done.insert(partition);
        }
        match decode(&m) {
            Ok(event) => out.push(StoredMessage { partition, offset, event }),
            Err(_) if skip_foreign => foreign += 1,
            Err(reason) => {
                return Err(Error::permanent(
                    ErrorKind::Corrupt,
                    BACKEND,
                    format!("{topic}[{partition}]@{offset}: {reason}"),
                ));
            }
        }
    }
    out.sort_by_key(|m| (m.partition, m.offset));
    Ok((out, foreign))
}

fn unacknowledged_blocking(config: &KafkaConfig, topic: &Destination, group: &ConsumerGroup) -> Result<u64> {
    let total = positions_blocking(config, topic, group)?
        .into_iter()
        .map(|p| u64::try_from(p.high - p.committed.map_or(p.low, |c| c.max(p.low))).unwrap_or(0))
        .sum();
    Ok(total)
}

fn positions_blocking(config: &KafkaConfig, topic: &Destination, group: &ConsumerGroup) -> Result<Vec<GroupPosition>> {
    let consumer = reader(config, Some(group))?;
    let marks = watermarks(&consumer, config, topic)?;
    let mut list = TopicPartitionList::new();
    for &(partition, _, _) in &marks {
        list.add_partition(topic.as_str(), partition);
    }
    let committed = consumer
        .committed_offsets(list, config.operation_timeout)
        .map_err(|e| error::convert(&format!("reading committed offsets of group {group}"), e))?;
    Ok(marks
        .into_iter()
        .map(|(partition, low, high)| GroupPosition {
            partition,
            low,
            high,
            committed: match committed.find_partition(topic.as_str(), partition).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => Some(o),
                _ => None,
            },
        })
        .collect())
}
