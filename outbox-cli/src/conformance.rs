//! `outbox conformance`: the suite's verdict on any store × broker combination, for people
//! rather than test runners. Each adapter ships its half of the suite (its `conformance`
//! feature); this command pairs the two the user names, so "pick any combination" can be
//! checked on the user's own servers.
//!
//! Cases run one after another and each prints its line as it finishes: the slow brokers take
//! a few seconds per case, and a silent terminal for minutes looks like a hang.

use std::time::{Duration, Instant};

use outbox_broker_amqp::conformance::AmqpBrokerHarness;
use outbox_broker_kafka::conformance::KafkaBrokerHarness;
use outbox_broker_redis::RedisConfig;
use outbox_broker_redis::conformance::RedisBrokerHarness;
use outbox_conformance_tests::{
    BrokerHarness, CaseResult, Combined, Harness, MemoryBrokerHarness, MemoryStoreHarness, StoreHarness, all_cases,
    run_case,
};
use outbox_core::{ConsumerGroup, Error, ManualClock, Result};
use outbox_store_postgres::PgConfig;
use outbox_store_postgres::conformance::PgStoreHarness;
use outbox_store_sqlite::conformance::SqliteStoreHarness;

/// The store side a `--store` value names.
enum StoreSpec {
    Memory,
    SqliteTemp,
    SqliteDir(String),
    Postgres(String),
}

/// The broker side a `--broker` value names.
enum BrokerSpec {
    Memory,
    Redis(String),
    Amqp(String),
    Kafka(String),
}

fn scheme(url: &str) -> &str {
    url.split_once("://").map_or(url, |(s, _)| s)
}

fn store_spec(url: &str) -> Result<StoreSpec> {
    Ok(match (url, scheme(url)) {
        ("memory" | "memory://", _) => StoreSpec::Memory,
        ("sqlite" | "sqlite://", _) => StoreSpec::SqliteTemp,
        (_, "sqlite") => {
            let dir = &url["sqlite://".len()..];
            StoreSpec::SqliteDir(dir.to_string())
        }
        (_, "postgres" | "postgresql") => StoreSpec::Postgres(url.to_string()),
        (_, other) => {
            return Err(Error::invalid_input(
                "conformance",
                format!(
                    "--store: unknown store scheme {other:?}; use `sqlite` (temporary files), sqlite:///DIR, \
                     postgres://…, or `memory`"
                ),
            ));
        }
    })
}

fn broker_spec(url: &str) -> Result<BrokerSpec> {
    Ok(match (url, scheme(url)) {
        ("memory" | "memory://", _) => BrokerSpec::Memory,
        (_, "redis" | "rediss") => BrokerSpec::Redis(url.to_string()),
        (_, "amqp" | "amqps") => BrokerSpec::Amqp(url.to_string()),
        (_, "kafka" | "kafka+ssl") => BrokerSpec::Kafka(url.to_string()),
        (_, other) => {
            return Err(Error::invalid_input(
                "conformance",
                format!("--broker: unknown broker scheme {other:?}; use kafka://…, amqp://…, redis://…, or `memory`"),
            ));
        }
    })
}

/// Run the suite on the combination `store` × `broker` (URLs, or `sqlite` / `memory`), printing
/// each case's line as it finishes; `Ok(false)` when any case failed.
///
/// # Errors
/// An unknown scheme or a bad URL (before anything runs), or a store or broker that cannot be
/// reached (checked before the cases: one fixture, the store's stats and a declared destination).
pub(crate) async fn run(store: &str, broker: &str) -> Result<bool> {
    let broker = broker_spec(broker)?;
    match store_spec(store)? {
        StoreSpec::Memory => with_store(MemoryStoreHarness, broker).await,
        StoreSpec::SqliteTemp => with_store(SqliteStoreHarness::temporary()?, broker).await,
        StoreSpec::SqliteDir(dir) => with_store(SqliteStoreHarness::in_dir(dir)?, broker).await,
        StoreSpec::Postgres(url) => with_store(PgStoreHarness::new(PgConfig::from_url(&url)?), broker).await,
    }
}

/// The broker half as a trait object: the suite is compiled once per store type rather than
/// once per store × broker pair (which made this binary the slowest crate of the build).
async fn with_store<S: StoreHarness>(store: S, broker: BrokerSpec) -> Result<bool> {
    let broker: Box<dyn BrokerHarness> = match broker {
        BrokerSpec::Memory => Box::new(MemoryBrokerHarness),
        BrokerSpec::Redis(url) => Box::new(RedisBrokerHarness::new(RedisConfig::from_url(&url)?)),
        BrokerSpec::Amqp(url) => Box::new(AmqpBrokerHarness::from_url(&url)?),
        BrokerSpec::Kafka(url) => Box::new(KafkaBrokerHarness::from_url(&url)?),
    };
    judge(Combined::new(store, broker)).await
}

async fn judge<S: StoreHarness, B: BrokerHarness>(harness: Combined<S, B>) -> Result<bool> {
    let started = Instant::now();
    println!("conformance suite against {}\n", harness.name());
    // One fixture first, and one round trip to each server: an unreachable server is one clear
    // error, not a failure per case. A fixture alone does not prove the broker answers (the
    // Kafka and AMQP clients connect on first use), so its destination is declared with a group.
    let fixture = harness.fixture("connection-check", ManualClock::default()).await?;
    fixture.store.stats().await?;
    fixture.broker.declare(&fixture.destination, &[ConsumerGroup::new("connection-check")?]).await?;
    drop(fixture);
    let cases = all_cases();
    let wn = cases.iter().map(|c| c.name.len()).max().unwrap_or(4);
    let wc = cases.iter().map(|c| c.class.len()).max().unwrap_or(5);
    println!("{:<wn$} {:<wc$} {:<26} {:>8}  property", "case", "class", "verdict", "time");
    let (mut passed, mut skipped, mut failed) = (0, 0, 0);
    let mut details = String::new();
    for case in &cases {
        let case_started = Instant::now();
        let verdict = match run_case(&harness, case).await {
            Ok(CaseResult::Passed(_)) => {
                passed += 1;
                "pass".to_string()
            }
            Ok(CaseResult::Skipped(cap)) => {
                skipped += 1;
                format!("skipped (needs {cap})")
            }
            Ok(CaseResult::Failed(c)) => {
                failed += 1;
                details.push_str(&format!("\n{c}\n"));
                "FAIL".to_string()
            }
            Err(e) => {
                failed += 1;
                details.push_str(&format!("\n{}: setup failed: {e}\n", case.name));
                "ERROR".to_string()
            }
        };
        println!(
            "{:<wn$} {:<wc$} {verdict:<26} {:>8}  {}",
            case.name,
            case.class,
            seconds(case_started.elapsed()),
            case.property
        );
    }
    print!("{details}");
    let ok = failed == 0;
    println!(
        "\n{passed} of {} cases passed, {skipped} skipped, {failed} failed in {:.1?}; verdict: {}",
        cases.len(),
        started.elapsed(),
        if ok { "PASS" } else { "FAIL" }
    );
    Ok(ok)
}

fn seconds(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_pick_the_halves_and_unknown_schemes_are_usage_errors() {
        assert!(matches!(store_spec("sqlite"), Ok(StoreSpec::SqliteTemp)));
        assert!(matches!(store_spec("memory"), Ok(StoreSpec::Memory)));
        assert!(matches!(store_spec("sqlite:///tmp/x"), Ok(StoreSpec::SqliteDir(d)) if d == "/tmp/x"));
        assert!(matches!(store_spec("postgres://u@h/db"), Ok(StoreSpec::Postgres(_))));
        assert!(matches!(broker_spec("memory://"), Ok(BrokerSpec::Memory)));
        assert!(matches!(broker_spec("kafka://127.0.0.1:9092"), Ok(BrokerSpec::Kafka(_))));
        assert!(matches!(broker_spec("amqp://h"), Ok(BrokerSpec::Amqp(_))));
        assert!(matches!(broker_spec("redis://h"), Ok(BrokerSpec::Redis(_))));
        let e = store_spec("mysql://secret@h").err().map(|e| e.kind());
        assert_eq!(e, Some(outbox_core::ErrorKind::InvalidInput));
        assert!(broker_spec("nats://h").is_err());
    }
}
