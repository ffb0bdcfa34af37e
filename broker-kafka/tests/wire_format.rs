//! End-to-end check of the README's "Wire format" table: an event published through
//! `Broker::publish` against the real Kafka-protocol broker is read back raw with an rdkafka
//! consumer of a fresh group from the start of the topic, and every row of the table is checked
//! against the record's key, headers and value. The unit test in `subscription.rs` checks only
//! the adapter's reading of a record; this one checks what the adapter writes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use outbox_broker_kafka::{KafkaBroker, KafkaConfig};
use outbox_core::{Broker, ConsumerGroup, Destination, Event, EventId};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

const README: &str = include_str!("../README.md");
/// Upper bound for the record to be readable.
const PATIENCE: Duration = Duration::from_secs(60);

/// `(event part, Kafka slot, name)` of every row of the "Wire format" table.
fn wire_table() -> Vec<(String, String, String)> {
    let rows = outbox_conformance_tests::docs::markdown_table(README, "## Wire format");
    assert_eq!(rows[0], ["event part", "Kafka slot", "name"], "unexpected table header");
    rows[1..].iter().map(|r| (r[0].clone(), r[1].clone(), r[2].clone())).collect()
}

/// The single backtick-quoted name in a cell.
fn quoted(cell: &str) -> &str {
    let parts: Vec<&str> = cell.split('`').collect();
    assert_eq!(parts.len(), 3, "cell {cell:?} should hold exactly one `name`");
    parts[1]
}

/// What the driver reads: key, headers in record order, value.
struct RawRecord {
    key: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
    value: Option<Vec<u8>>,
    count: usize,
}

/// Read every record of partition 0 of `topic` from the beginning with a consumer of a fresh
/// group, until one arrived and the partition's end is reached, or [`PATIENCE`] passed.
fn read_raw(bootstrap: &str, topic: &str, group: &str) -> RawRecord {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "true")
        .create()
        .expect("create consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning).expect("partition 0");
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + PATIENCE;
    let mut first: Option<RawRecord> = None;
    let mut count = 0;
    loop {
        assert!(Instant::now() < deadline, "no record read from {topic} within {PATIENCE:?}");
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(_))) if first.is_some() => break,
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(_))) => {}
            Some(Err(e)) => eprintln!("poll {topic}: {e} (retrying until the deadline)"),
            Some(Ok(m)) => {
                count += 1;
                if first.is_none() {
                    let headers = m
                        .headers()
                        .map(|h| h.iter().map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec))).collect())
                        .unwrap_or_default();
                    first = Some(RawRecord {
                        key: m.key().map(<[u8]>::to_vec),
                        headers,
                        value: m.payload().map(<[u8]>::to_vec),
                        count: 0,
                    });
                }
            }
        }
    }
    let mut record = first.expect("a record");
    record.count = count;
    record
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_record_follows_the_readme_wire_format_table() {
    let url = outbox_conformance_tests::kafka_url();
    if !outbox_conformance_tests::require_service(
        "Kafka-protocol broker (tansu)",
        "kafka",
        &outbox_conformance_tests::service_addr(&url),
    ) {
        return;
    }
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let unique = format!("{}-{nanos:x}", std::process::id());
    let config = KafkaConfig::from_url(&url)
        .expect("OUTBOX_KAFKA_URL")
        .with_client_id(format!("outbox-wire-{unique}"))
        .with_partitions(1)
        .with_delivery_timeout(Duration::from_secs(15))
        .with_operation_timeout(Duration::from_secs(10));
    let bootstrap = config.bootstrap_servers.join(",");
    let broker = KafkaBroker::connect(config).await.expect("connect");
    let topic = Destination::new(format!("wire-{unique}")).unwrap();
    let group = ConsumerGroup::new(format!("wire-g-{unique}")).unwrap();
    broker.declare(&topic, std::slice::from_ref(&group)).await.expect("declare");

    let event = Event::new(
        EventId::new("wire-1/credit:7").unwrap(),
        topic.clone(),
        b"\0nul\xff\xfe not utf-8 \xc3\x28 \r\n\0".to_vec(),
    )
    .with_key("aggregate-42")
    .with_header("trace-id", b"abc-123".to_vec())
    .with_header("blob", vec![0u8, 0xff, b'\n', 0x80, 0xc3, 0x28, 0])
    .with_content_type("application/vnd.test+octets");
    broker.publish(&event).await.expect("publish");

    let (t, g) = (topic.as_str().to_string(), format!("wire-raw-{unique}"));
    let read = tokio::task::spawn_blocking(move || read_raw(&bootstrap, &t, &g)).await;
    if let Err(e) = broker.delete_topic(&topic).await {
        eprintln!("could not delete topic {topic}: {e}");
    }
    let record = read.expect("reader thread");
    assert_eq!(record.count, 1, "topic {topic} should hold exactly the one published record");

    let mut headers: BTreeMap<String, Option<Vec<u8>>> = BTreeMap::new();
    for (name, value) in &record.headers {
        assert!(headers.insert(name.clone(), value.clone()).is_none(), "header {name:?} appears twice");
    }

    // Every row: the slot it names holds exactly the event's part.
    let rows = wire_table();
    let mut expected_headers: BTreeMap<String, Option<Vec<u8>>> = BTreeMap::new();
    let mut covered: Vec<&str> = Vec::new();
    for (part, slot, name) in &rows {
        covered.push(part);
        match (part.as_str(), slot.as_str()) {
            ("event id", "header") => {
                expected_headers.insert(quoted(name).to_string(), Some(event.id.as_str().as_bytes().to_vec()));
            }
            ("header", "header") => {
                assert_eq!(quoted(name), "<name>", "a header goes under its own name");
                for (h, v) in event.headers.iter().filter(|(h, _)| h.as_str() != "content-type") {
                    expected_headers.insert(h.clone(), Some(v.clone()));
                }
            }
            ("content type", "header") => {
                expected_headers
                    .insert(quoted(name).to_string(), Some(event.content_type().unwrap().as_bytes().to_vec()));
            }
            ("key", "record key") => {
                assert!(name.starts_with("UTF-8 bytes"), "key row: {name:?}");
                assert_eq!(record.key, Some(event.key.clone().unwrap().into_bytes()), "record key");
            }
            ("payload", "record value") => {
                assert_eq!(name, "raw bytes");
                assert_eq!(record.value.as_ref(), Some(&event.payload), "record value");
            }
            other => panic!("wire-format row {other:?} is not known to this test"),
        }
    }
    for needed in ["event id", "key", "header", "content type", "payload"] {
        assert!(covered.contains(&needed), "the wire-format table has no {needed:?} row");
    }
    for (name, value) in &expected_headers {
        assert_eq!(headers.get(name), Some(value), "header {name:?}");
    }
    assert_eq!(headers, expected_headers, "record has headers the wire-format table does not name");
}
