//! The credit handler of `examples/credit/`, written once, run unchanged on the SQLite inbox
//! and the PostgreSQL inbox, fed by every broker (memory, Redis, RabbitMQ, Kafka), and judged by
//! durable state: outbox rows, inbox markers, the effect tables.
//!
//! Each run commits four orders (a:7, b:7, a:7, c:0) with their events, relays them, then
//! publishes the first event a second time (a relay that lost its lease after sending), and
//! consumes until all five deliveries are handled. Expected, on every combination: four credits
//! (one per event id), balances a=14 b=7 c=0, four markers, the duplicate applied nothing, every
//! outbox row published.
//!
//! A server that is down skips its combinations loudly outside CI and fails them under
//! `CI=true`.

#[allow(dead_code, unreachable_pub)]
#[path = "../examples/credit/mod.rs"]
mod credit;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use credit::{Accounts, Credit, Order, Orders};
use outbox::consumer::{Consumer, ConsumerConfig, Handled};
use outbox::core::memory::MemoryBroker;
use outbox::core::store::all_rows;
use outbox::postgres::sqlx::{self, AssertSqlSafe};
use outbox::postgres::{PgConfig, PgStore};
use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::{Broker, ConsumerGroup, Destination, Inbox, OutboxAdmin, Relay, RelayConfig, RowStatus};
use outbox_conformance_tests::{amqp_url, kafka_url, pg_url, redis_url, require_service, service_addr};

/// Longest a run waits for its deliveries (Kafka's first group join is the slow part).
const DEADLINE: Duration = Duration::from_secs(90);
const CONSUMER: &str = "billing";

fn tag() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{}{:x}{}", std::process::id(), nanos % 0xffff_ffff, N.fetch_add(1, Ordering::Relaxed))
}

/// `true` when the service answers; outside CI a missing one skips loudly (see the suite).
fn up(service: &str, script: &str, url: &str) -> bool {
    require_service(service, script, &service_addr(url))
}

/// The broker named `name`, or `None` (skipped) when its server is down.
async fn broker(name: &str) -> Option<Arc<dyn Broker>> {
    let url = match name {
        "memory" => return Some(Arc::new(MemoryBroker::new())),
        "redis" => redis_url(),
        "amqp" => amqp_url(),
        "kafka" => kafka_url(),
        other => panic!("unknown broker {other}"),
    };
    if !up(name, name, &url) {
        return None;
    }
    Some(outbox::broker_from_url(&url).await.unwrap_or_else(|e| panic!("{name}: {e}")))
}

/// The same story on any store: `store` is its outbox, `inbox` its inbox, `shop` the
/// application's ports on it. Only the types differ between stores; this code does not.
async fn story<I, S>(label: &str, store: Arc<dyn OutboxAdmin>, inbox: I, shop: S, broker: Arc<dyn Broker>)
where
    I: Inbox + Clone,
    S: Accounts<I> + Orders + Clone + 'static,
{
    let t = tag();
    let destination = Destination::new(format!("swap-{t}")).unwrap();
    let group = ConsumerGroup::new(format!("billing-{t}")).unwrap();
    broker.declare(&destination, std::slice::from_ref(&group)).await.unwrap();
    let mut subscription = broker.subscribe(&destination, &group).await.unwrap();

    // Producer: order row and event in one transaction of the application's.
    let orders = [("a", 7), ("b", 7), ("a", 7), ("c", 0)];
    for (i, (account, amount)) in orders.into_iter().enumerate() {
        shop.place_order(&Order::new(format!("{t}-{i}"), account, amount), &destination).await.unwrap();
    }
    let report =
        Relay::new(store.clone(), broker.clone(), RelayConfig::new(format!("relay-{t}"))).drain().await.unwrap();
    assert_eq!(report.published, 4, "{label}: {report:?}");
    // A resend of the first event, as after a relay lost its lease between send and complete.
    let rows = all_rows(&*store).await.unwrap();
    broker.publish(&rows[0].event).await.unwrap();

    let consumer = Consumer::new(inbox.clone(), Credit::new(shop.clone()), ConsumerConfig::new(CONSUMER));
    let start = Instant::now();
    let mut handled = Vec::new();
    while handled.iter().filter(|h| matches!(h, Handled::Applied | Handled::Duplicate)).count() < 5 {
        assert!(start.elapsed() < DEADLINE, "{label}: only {handled:?} within {DEADLINE:?}");
        handled.extend(consumer.drain(&mut *subscription, Duration::from_millis(500)).await.unwrap());
    }
    let count = |want: &Handled| handled.iter().filter(|h| *h == want).count();
    assert_eq!((count(&Handled::Applied), count(&Handled::Duplicate)), (4, 1), "{label}: {handled:?}");

    // Durable state.
    let mut credited: Vec<String> = shop.credits().await.unwrap().into_iter().map(|(id, _, _)| id).collect();
    credited.sort();
    let mut expected: Vec<String> = (0..4).map(|i| format!("order-{t}-{i}")).collect();
    expected.sort();
    assert_eq!(credited, expected, "{label}: one credit per event, the duplicate applied nothing");
    let balances = shop.balances().await.unwrap();
    assert_eq!(balances, BTreeMap::from([("a".into(), 14), ("b".into(), 7), ("c".into(), 0)]), "{label}");
    let mut marked: Vec<String> =
        inbox.markers(CONSUMER).await.unwrap().into_iter().map(|m| m.event_id.to_string()).collect();
    marked.sort();
    assert_eq!(marked, expected, "{label}: one marker per event, the zero-amount one included");
    assert!(
        all_rows(&*store).await.unwrap().iter().all(|r| r.status == RowStatus::Published),
        "{label}: every outbox row published"
    );
}

async fn on_sqlite(broker_name: &str) {
    let Some(broker) = broker(broker_name).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(SqliteConfig::new(dir.path().join("shop.db"))).await.unwrap();
    let shop = credit::sqlite::Shop::create(&store).await.unwrap();
    story(&format!("sqlite+{broker_name}"), Arc::new(store.clone()), store.inbox(), shop, broker).await;
}

async fn on_postgres(broker_name: &str) {
    let url = pg_url();
    if !up("postgres", "postgres", &url) {
        return;
    }
    let Some(broker) = broker(broker_name).await else { return };
    let schema = format!("obt_swap_{}", tag());
    let store = PgStore::open(PgConfig::from_url(&url).unwrap().with_schema(schema.clone())).await.unwrap();
    let shop = credit::postgres::Shop::create(&store).await.unwrap();
    story(&format!("postgres+{broker_name}"), Arc::new(store.clone()), store.inbox(), shop, broker).await;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE"))).execute(store.pool()).await.unwrap();
    store.close().await;
}

#[tokio::test]
async fn sqlite_memory() {
    on_sqlite("memory").await;
}

#[tokio::test]
async fn sqlite_redis() {
    on_sqlite("redis").await;
}

#[tokio::test]
async fn sqlite_amqp() {
    on_sqlite("amqp").await;
}

#[tokio::test]
async fn sqlite_kafka() {
    on_sqlite("kafka").await;
}

#[tokio::test]
async fn postgres_memory() {
    on_postgres("memory").await;
}

#[tokio::test]
async fn postgres_redis() {
    on_postgres("redis").await;
}

#[tokio::test]
async fn postgres_amqp() {
    on_postgres("amqp").await;
}

#[tokio::test]
async fn postgres_kafka() {
    on_postgres("kafka").await;
}

/// The README's count of the lines a swap changes is the examples' real difference.
#[test]
fn the_examples_differ_only_in_the_counted_swap_lines() {
    let before: Vec<&str> = include_str!("../examples/sqlite_redis.rs").lines().collect();
    let after: Vec<&str> = include_str!("../examples/postgres_kafka.rs").lines().collect();
    assert_eq!(before.len(), after.len(), "the two examples must line up");
    let changed: Vec<(&str, &str)> = before.iter().zip(&after).filter(|(a, b)| a != b).map(|(a, b)| (*a, *b)).collect();
    assert!(changed.iter().all(|(a, b)| a.ends_with("// swap") && b.ends_with("// swap")), "{changed:#?}");
    let marked = before.iter().filter(|l| l.ends_with("// swap")).count();
    assert_eq!(changed.len(), marked, "every line marked `// swap` changes, and only those");
    let broker_only = changed.iter().filter(|(a, _)| a.contains("BROKER_URL")).count();
    assert_eq!((changed.len() - broker_only, broker_only), (3, 1), "{changed:#?}");
    let readme = include_str!("../README.md");
    assert!(
        readme.contains("SQLite → PostgreSQL: **3 lines**") && readme.contains("Redis → Kafka: **1 line**"),
        "outbox/README.md states the counts this test checks"
    );
}
