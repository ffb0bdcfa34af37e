//! The README's capability table against what each broker reports at run time.
//!
//! The table is documentation users plan with; `Broker::capabilities()` is what code plans with.
//! This test parses the table (root README, "Broker capabilities") and compares every cell with
//! the adapters' values, so the two cannot drift apart. The brokers are built without a server:
//! RabbitMQ's and the memory broker's constructors do not connect, and Redis' and Kafka's
//! brokers report their configuration's [`capabilities`](outbox_broker_redis::RedisConfig::capabilities)
//! unchanged.

use std::collections::BTreeMap;

use outbox_broker_amqp::{AmqpBroker, AmqpConfig, QueueType};
use outbox_broker_kafka::KafkaConfig;
use outbox_broker_redis::RedisConfig;
use outbox_core::memory::MemoryBroker;
use outbox_core::{Broker, Capabilities};

const README: &str = include_str!("../../README.md");

/// Column name → row name → cell text.
fn table() -> BTreeMap<String, BTreeMap<String, String>> {
    let mut lines = README.lines().skip_while(|l| !l.starts_with("| capability |"));
    let header: Vec<String> = cells(lines.next().expect("the README has a `| capability |` table"));
    let mut columns: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for line in lines.take_while(|l| l.starts_with('|')).filter(|l| !l.starts_with("|---")) {
        let row = cells(line);
        assert_eq!(row.len(), header.len(), "row {line:?} has as many cells as the header");
        for (column, cell) in header.iter().zip(&row).skip(1) {
            columns.entry(column.clone()).or_default().insert(row[0].clone(), cell.clone());
        }
    }
    columns
}

fn cells(line: &str) -> Vec<String> {
    line.trim().trim_matches('|').split('|').map(|c| c.trim().to_string()).collect()
}

fn yes_no(cell: &str, what: &str) -> bool {
    match cell {
        "yes" => true,
        "no" => false,
        other => panic!("{what}: expected yes or no, found {other:?}"),
    }
}

fn check(column: &str, rows: &BTreeMap<String, String>, caps: Capabilities) {
    let cell = |row: &str| rows.get(row).unwrap_or_else(|| panic!("the table has a {row:?} row")).as_str();
    let flags = [
        ("detects unroutable", caps.detects_unroutable),
        ("delivery count", caps.delivery_count),
        ("redelivery flag", caps.redelivery_flag),
        ("nack redelivers", caps.nack_redelivers),
        ("per-key ordering", caps.per_key_ordering),
    ];
    for (row, reported) in flags {
        assert_eq!(
            yes_no(cell(row), &format!("{column} / {row}")),
            reported,
            "README says {column} / {row} = {:?}, the broker reports {reported}",
            cell(row)
        );
    }
    // The adapter enforces a limit of its own exactly when the README names its setting.
    let names_own_limit = cell("max payload").contains("max_payload");
    assert_eq!(
        names_own_limit,
        caps.max_payload.is_some(),
        "README says {column} / max payload = {:?}, the broker reports {:?}",
        cell("max payload"),
        caps.max_payload
    );
    assert_eq!(rows.len(), flags.len() + 1, "{column}: every row of the table is checked: {rows:?}");
}

#[test]
fn readme_capability_table_matches_the_brokers() {
    let table = table();
    let amqp = AmqpConfig::from_url("amqp://guest:guest@127.0.0.1:5672/%2f").expect("an AMQP URL");
    let mut expected: BTreeMap<&str, Capabilities> = BTreeMap::new();
    expected.insert("Kafka", KafkaConfig::new(["127.0.0.1:9092"]).capabilities());
    expected.insert("RabbitMQ (classic)", AmqpBroker::new(amqp.clone()).capabilities());
    expected.insert("RabbitMQ (quorum)", AmqpBroker::new(amqp.with_queue_type(QueueType::Quorum)).capabilities());
    expected
        .insert("Redis Streams", RedisConfig::from_url("redis://127.0.0.1:6379").expect("a Redis URL").capabilities());
    expected.insert("memory", MemoryBroker::new().capabilities());
    assert_eq!(
        table.keys().map(String::as_str).collect::<Vec<_>>(),
        expected.keys().copied().collect::<Vec<_>>(),
        "the table's columns are the brokers"
    );
    for (column, caps) in expected {
        check(column, &table[column], caps);
    }
}

#[test]
fn a_broker_that_says_nothing_promises_nothing() {
    // The trait's default: a new adapter that has not looked into it claims no capability.
    assert_eq!(Capabilities::default(), Capabilities::none());
    assert!(!Capabilities::none().reports_redelivery());
}
