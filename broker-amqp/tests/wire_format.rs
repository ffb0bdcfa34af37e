//! End-to-end check of the README's "Wire format" table: an event published through
//! `Broker::publish` against the real RabbitMQ is fetched raw with lapin's `basic_get` from the
//! queue the adapter declared for a group, and every row of the table is checked against the
//! message's properties, header table and body. The unit test in `codec.rs` checks the encoder
//! alone; this one checks what RabbitMQ actually delivers.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lapin::options::BasicGetOptions;
use lapin::types::{AMQPValue, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use outbox_broker_amqp::{AmqpBroker, AmqpConfig};
use outbox_core::{Broker, ConsumerGroup, Destination, Event, EventId};

const README: &str = include_str!("../README.md");
const WAIT: Duration = Duration::from_secs(10);

/// `(event part, AMQP slot, name)` of every row of the "Wire format" table.
fn wire_table() -> Vec<(String, String, String)> {
    let rows = outbox_conformance_tests::docs::markdown_table(README, "## Wire format");
    assert_eq!(rows[0], ["event part", "AMQP slot", "name"], "unexpected table header");
    rows[1..].iter().map(|r| (r[0].clone(), r[1].clone(), r[2].clone())).collect()
}

/// The single backtick-quoted name in a cell.
fn quoted(cell: &str) -> &str {
    let parts: Vec<&str> = cell.split('`').collect();
    assert_eq!(parts.len(), 3, "cell {cell:?} should hold exactly one `name`");
    parts[1]
}

/// The named property of `props` (only the properties the table can name).
fn property(props: &BasicProperties, name: &str) -> Option<Vec<u8>> {
    let value = match name {
        "message_id" => props.message_id(),
        "content_type" => props.content_type(),
        other => panic!("the wire-format table names property {other:?}, unknown to this test"),
    };
    value.as_ref().map(|s: &ShortString| s.as_str().as_bytes().to_vec())
}

/// Deletes the exchange and queues on drop (also when the test panics).
struct Cleanup {
    config: AmqpConfig,
    destination: Destination,
    groups: Vec<ConsumerGroup>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (config, destination, groups) = (self.config.clone(), self.destination.clone(), self.groups.clone());
        // The test's runtime may be the one dropping us; clean up on a runtime of its own.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            rt.block_on(async {
                let broker = AmqpBroker::new(config);
                let result = broker.delete(&destination, &groups).await;
                broker.close().await;
                result
            })
        });
        if !matches!(done.join(), Ok(Ok(()))) {
            eprintln!("cleanup of {} failed", self.destination);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_message_follows_the_readme_wire_format_table() {
    let url = outbox_conformance_tests::amqp_url();
    if !outbox_conformance_tests::require_service("RabbitMQ", "rabbitmq", &outbox_conformance_tests::service_addr(&url))
    {
        return;
    }
    let config = AmqpConfig::from_url(&url)
        .unwrap()
        .with_exchange_prefix("outbox-test.")
        .unwrap()
        .with_queue_prefix("outbox-test.")
        .unwrap();
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dest = Destination::new(format!("wire-{}-{nanos:x}", std::process::id())).unwrap();
    let group = ConsumerGroup::new("wire-g").unwrap();
    let broker = AmqpBroker::new(config.clone());
    let _cleanup = Cleanup { config: config.clone(), destination: dest.clone(), groups: vec![group.clone()] };

    let event = Event::new(
        EventId::new("wire-1/credit:7").unwrap(),
        dest.clone(),
        b"\0nul\xff\xfe not utf-8 \xc3\x28 \r\n\0".to_vec(),
    )
    .with_key("aggregate-42")
    .with_header("trace-id", b"abc-123".to_vec())
    .with_header("blob", vec![0u8, 0xff, b'\n', 0x80, 0xc3, 0x28, 0])
    .with_content_type("application/vnd.test+octets");

    broker.declare(&dest, std::slice::from_ref(&group)).await.expect("declare");
    broker.publish(&event).await.expect("publish");

    // Read the raw message from the group's queue, with the driver directly.
    let queue = config.queue_name(&dest, &group).expect("queue name");
    let conn = Connection::connect(&url, ConnectionProperties::default()).await.expect("connect to RabbitMQ");
    let channel = conn.create_channel().await.expect("channel");
    let deadline = Instant::now() + WAIT;
    let message = loop {
        let got = channel.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await.expect("basic_get");
        if let Some(m) = got {
            break m;
        }
        assert!(Instant::now() < deadline, "no message in queue {queue} within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(message.message_count, 0, "queue {queue} should hold exactly the one published message");
    let props = &message.delivery.properties;
    let body = &message.delivery.data;
    let empty = lapin::types::FieldTable::default();
    let table: &BTreeMap<ShortString, AMQPValue> = props.headers().as_ref().unwrap_or(&empty).inner();

    let long_string = |name: &str| -> Option<Vec<u8>> {
        match table.get(name) {
            None => None,
            Some(AMQPValue::LongString(s)) => Some(s.as_bytes().to_vec()),
            Some(other) => panic!("header {name:?} is {other:?}, not a long string"),
        }
    };

    // Every row: the slot it names holds exactly the event's part.
    let rows = wire_table();
    let mut covered: Vec<&str> = Vec::new();
    let mut named_headers: Vec<String> = Vec::new();
    for (part, slot, name) in &rows {
        covered.push(part);
        match (part.as_str(), slot.as_str()) {
            ("event id", "property") => {
                let n = quoted(name);
                assert_eq!(property(props, n), Some(event.id.as_str().as_bytes().to_vec()), "property {n}");
            }
            ("content type", "property") => {
                let n = quoted(name);
                assert_eq!(property(props, n), Some(event.content_type().unwrap().as_bytes().to_vec()), "property {n}");
            }
            ("key", "header (long string)") => {
                let n = quoted(name);
                named_headers.push(n.to_string());
                assert_eq!(long_string(n), Some(event.key.clone().unwrap().into_bytes()), "header {n}");
            }
            ("header", "header (long string, raw bytes)") => {
                assert_eq!(quoted(name), "<name>", "a header goes under its own name");
                for (h, v) in event.headers.iter().filter(|(h, _)| h.as_str() != "content-type") {
                    named_headers.push(h.clone());
                    assert_eq!(long_string(h).as_ref(), Some(v), "header {h}");
                }
            }
            ("header names", "header (array of long strings)") => {
                let n = quoted(name);
                named_headers.push(n.to_string());
                let Some(AMQPValue::FieldArray(names)) = table.get(n) else {
                    panic!("header {n} is {:?}, not an array", table.get(n));
                };
                let mut got: Vec<Vec<u8>> = names
                    .as_slice()
                    .iter()
                    .map(|v| match v {
                        AMQPValue::LongString(s) => s.as_bytes().to_vec(),
                        other => panic!("{n} holds {other:?}, not a long string"),
                    })
                    .collect();
                got.sort();
                let want: Vec<Vec<u8>> = event
                    .headers
                    .keys()
                    .filter(|h| h.as_str() != "content-type")
                    .map(|h| h.as_bytes().to_vec())
                    .collect();
                assert_eq!(got, want, "header {n} lists the event's header names");
            }
            ("payload", "body") => {
                assert_eq!(name, "raw bytes");
                assert_eq!(body, &event.payload, "body");
            }
            other => panic!("wire-format row {other:?} is not known to this test"),
        }
    }
    for needed in ["event id", "key", "header", "header names", "content type", "payload"] {
        assert!(covered.contains(&needed), "the wire-format table has no {needed:?} row");
    }
    // Nothing the table does not name is in the header table (the content type is a property,
    // not a header).
    let mut got_names: Vec<&str> = table.keys().map(ShortString::as_str).collect();
    got_names.sort_unstable();
    named_headers.sort();
    assert_eq!(got_names, named_headers, "header table holds names the wire-format table does not give");

    let _ = channel.close(200, "done".into()).await;
    let _ = conn.close(200, "done".into()).await;
}
