//! End-to-end check of the README's "Wire format" table: an event published through
//! `Broker::publish` against the real Redis server is read back raw with `XRANGE`, and every row
//! of the table is checked against the stream entry. The unit test in `codec.rs` checks the
//! encoder alone; this one checks what actually lands in Redis.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use outbox_broker_redis::{RedisBroker, RedisConfig};
use outbox_conformance_tests::redis_url;
use outbox_core::{Broker, ConsumerGroup, Destination, Event, EventId};

const README: &str = include_str!("../README.md");

/// `(event part, stream entry field, value)` of every row of the "Wire format" table.
fn wire_table() -> Vec<(String, String, String)> {
    let rows = outbox_conformance_tests::docs::markdown_table(README, "## Wire format");
    assert_eq!(rows[0], ["event part", "stream entry field", "value"], "unexpected table header");
    rows[1..].iter().map(|r| (r[0].clone(), r[1].clone(), r[2].clone())).collect()
}

/// The single backtick-quoted name in a cell.
fn quoted(cell: &str) -> &str {
    let parts: Vec<&str> = cell.split('`').collect();
    assert_eq!(parts.len(), 3, "cell {cell:?} should hold exactly one `name`");
    parts[1]
}

/// Deletes every key under the test's prefix when dropped (also when the test panics).
struct Cleanup {
    url: String,
    prefix: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let Ok(client) = redis::Client::open(self.url.as_str()) else { return };
        let Ok(mut conn) = client.get_connection() else { return };
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(format!("{}*", self.prefix)).query(&mut conn).unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(&keys).query(&mut conn);
        }
    }
}

#[tokio::test]
async fn published_entry_follows_the_readme_wire_format_table() {
    let url = redis_url();
    if !outbox_conformance_tests::require_service("Redis", "redis", &outbox_conformance_tests::service_addr(&url)) {
        return;
    }
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let prefix = format!("outbox-wire:{}-{nanos}:", std::process::id());
    let config = RedisConfig::from_url(&url).expect("OUTBOX_REDIS_URL").with_prefix(prefix.clone());
    let _cleanup = Cleanup { url: config.url.clone(), prefix: prefix.clone() };
    let broker = RedisBroker::connect(config).await.expect("connect to Redis");

    let dest = Destination::new("wire-orders").unwrap();
    let group = ConsumerGroup::new("wire-billing").unwrap();
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

    // The stream is `prefix + destination` (README); the broker's own view must agree.
    let stream = format!("{prefix}{}", dest.as_str());
    assert_eq!(broker.stream_key(&dest), stream, "stream name differs from `prefix + destination`");
    let mut raw = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let entries: Vec<(String, Vec<Vec<u8>>)> =
        redis::cmd("XRANGE").arg(&stream).arg("-").arg("+").query_async(&mut raw).await.expect("XRANGE");
    assert_eq!(entries.len(), 1, "stream {stream} should hold exactly the one published entry");
    let (entry_id, flat) = &entries[0];
    assert_eq!(flat.len() % 2, 0, "entry {entry_id} has an odd field/value list");
    let mut fields: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for pair in flat.chunks(2) {
        let name = String::from_utf8(pair[0].clone()).expect("field name is UTF-8");
        assert!(fields.insert(name.clone(), pair[1].clone()).is_none(), "field {name:?} appears twice");
    }

    // Every row: the field it names holds exactly the event's part.
    let mut expected: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let table = wire_table();
    for (part, field, value) in &table {
        let field = quoted(field);
        match part.as_str() {
            "format version" => {
                expected.insert(field.to_string(), quoted(value).as_bytes().to_vec());
            }
            "event id" => {
                expected.insert(field.to_string(), event.id.as_str().as_bytes().to_vec());
            }
            "key" => {
                expected.insert(field.to_string(), event.key.clone().unwrap().into_bytes());
            }
            "header" => {
                let field_prefix = field.strip_suffix("<name>").expect("header row names `<prefix><name>`");
                for (name, v) in event.headers.iter().filter(|(n, _)| n.as_str() != "content-type") {
                    expected.insert(format!("{field_prefix}{name}"), v.clone());
                }
            }
            "content type" => {
                expected.insert(field.to_string(), event.content_type().unwrap().as_bytes().to_vec());
            }
            "payload" => {
                expected.insert(field.to_string(), event.payload.clone());
            }
            other => panic!("wire-format row {other:?} is not known to this test"),
        }
    }
    let parts: Vec<&str> = table.iter().map(|r| r.0.as_str()).collect();
    for needed in ["event id", "key", "header", "content type", "payload"] {
        assert!(parts.contains(&needed), "the wire-format table has no {needed:?} row");
    }
    for (field, value) in &expected {
        assert_eq!(fields.get(field), Some(value), "field {field:?} of entry {entry_id} in {stream}");
    }
    assert_eq!(fields, expected, "entry {entry_id} has fields the wire-format table does not name");
}
