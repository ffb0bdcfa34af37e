//! One trace from enqueue to effect, on SQLite with every broker (memory, Redis, RabbitMQ,
//! Kafka), seen through an in-memory OpenTelemetry exporter behind a `tracing` subscriber.
//!
//! Each run commits an order row and its event in one transaction of the application's, inside
//! an `app.place_order` span; relays it inside a span of another trace; consumes it with the
//! credit handler of `examples/credit/` inside a third. Expected: the outbox row carries the
//! enqueue's `traceparent` (durable), the publish span's parent is the enqueue span, the handle
//! span is in the same trace, and the credit and its inbox marker are in the database.
//!
//! A server that is down skips its combination loudly outside CI and fails it under `CI=true`.

#[allow(dead_code, unreachable_pub)]
#[path = "../examples/credit/mod.rs"]
mod credit;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use credit::{Credit, Order, Orders};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox::consumer::{Consumer, ConsumerConfig, Handled};
use outbox::core::memory::MemoryBroker;
use outbox::core::store::all_rows;
use outbox::core::telemetry::TRACEPARENT_HEADER;
use outbox::sqlite::rusqlite::{TransactionBehavior, params};
use outbox::sqlite::{SqliteConfig, SqliteStore, enqueue_one, sqlite_error};
use outbox::{Broker, ConsumerGroup, Destination, InboxAdmin, Relay, RelayConfig, RowStatus};
use outbox_conformance_tests::{amqp_url, kafka_url, redis_url, require_service, service_addr};
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

/// Longest a run waits for its delivery (Kafka's first group join is the slow part).
const DEADLINE: Duration = Duration::from_secs(90);
const CONSUMER: &str = "billing";

/// One exporter for the whole test binary: a `tracing` dispatcher is process-wide once spans
/// cross threads (the SQLite pool, the blocking enqueue), so runs tell their spans apart by
/// their event id.
fn exporter() -> &'static (SdkTracerProvider, InMemorySpanExporter) {
    static TELEMETRY: OnceLock<(SdkTracerProvider, InMemorySpanExporter)> = OnceLock::new();
    TELEMETRY.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-trace-test")));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this test binary");
        (provider, exporter)
    })
}

fn tag() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{}{:x}{}", std::process::id(), nanos % 0xffff_ffff, N.fetch_add(1, Ordering::Relaxed))
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
    if !require_service(name, name, &service_addr(&url)) {
        return None;
    }
    Some(outbox::broker_from_url(&url).await.unwrap_or_else(|e| panic!("{name}: {e}")))
}

/// The finished spans about `event_id`, by name.
fn spans_of(event_id: &str) -> Vec<SpanData> {
    let (provider, exporter) = exporter();
    provider.force_flush().expect("flush spans");
    exporter
        .get_finished_spans()
        .expect("read spans")
        .into_iter()
        .filter(|s| s.attributes.iter().any(|kv| kv.key.as_str() == "event_id" && kv.value.as_str() == event_id))
        .collect()
}

fn one<'a>(spans: &'a [SpanData], name: &str, label: &str) -> &'a SpanData {
    let found: Vec<&SpanData> = spans.iter().filter(|s| s.name == name).collect();
    let names: Vec<&str> = spans.iter().map(|s| &*s.name).collect();
    assert!(!found.is_empty(), "{label}: no span {name:?} among {names:?}");
    found[0]
}

async fn story(broker_name: &str) {
    exporter();
    let Some(broker) = broker(broker_name).await else { return };
    let label = format!("sqlite+{broker_name}");
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(SqliteConfig::new(dir.path().join("shop.db"))).await.unwrap();
    let shop = credit::sqlite::Shop::create(&store).await.unwrap();
    let t = tag();
    let destination = Destination::new(format!("trace-{t}")).unwrap();
    let group = ConsumerGroup::new(format!("billing-{t}")).unwrap();
    broker.declare(&destination, std::slice::from_ref(&group)).await.unwrap();
    let mut subscription = broker.subscribe(&destination, &group).await.unwrap();

    // Producer: the order row and its event in one transaction, inside the request's span.
    let order = Order::new(t.clone(), "a", 7);
    let event = order.event(&destination).unwrap();
    let event_id = event.id.to_string();
    let span = tracing::info_span!("app.place_order", event_id = %event_id);
    let producer = store.clone();
    tokio::task::spawn_blocking(move || {
        span.in_scope(|| {
            let mut conn = producer.connect_raw()?;
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(sqlite_error)?;
            tx.execute(
                "INSERT INTO orders (id, account, amount) VALUES (?1, ?2, ?3)",
                params![order.id, order.account, order.amount],
            )
            .map_err(sqlite_error)?;
            enqueue_one(&tx, &producer, &event)?;
            tx.commit().map_err(sqlite_error)
        })
    })
    .await
    .unwrap()
    .unwrap();
    let spans = spans_of(&event_id);
    let enqueue = one(&spans, "app.place_order", &label).span_context.clone();
    assert_ne!(enqueue.trace_id(), TraceId::INVALID, "{label}");

    // Durable: the row carries the enqueue's context.
    let rows = all_rows(&store).await.unwrap();
    let header = rows[0].event.headers.get(TRACEPARENT_HEADER).map(|v| String::from_utf8_lossy(v).into_owned());
    assert_eq!(header, Some(format!("00-{}-{}-01", enqueue.trace_id(), enqueue.span_id())), "{label}");

    // The relay and the consumer run under spans of traces of their own.
    let relay = Relay::new(Arc::new(store.clone()), broker.clone(), RelayConfig::new(format!("relay-{t}")));
    let report = relay.drain().instrument(tracing::info_span!("relay.loop")).await.unwrap();
    assert_eq!(report.published, 1, "{label}: {report:?}");

    let consumer = Consumer::new(store.inbox(), Credit::new(shop.clone()), ConsumerConfig::new(CONSUMER));
    let start = Instant::now();
    let mut handled = Vec::new();
    while !handled.contains(&Handled::Applied) {
        assert!(start.elapsed() < DEADLINE, "{label}: only {handled:?} within {DEADLINE:?}");
        // Bounded: an adapter whose receive ignored its wait would otherwise hang the drain.
        let drain = consumer
            .drain(&mut *subscription, Duration::from_millis(500))
            .instrument(tracing::info_span!("consumer.loop"));
        let batch = tokio::time::timeout(DEADLINE, drain)
            .await
            .unwrap_or_else(|_| panic!("{label}: a drain did not end within {DEADLINE:?}"))
            .unwrap();
        handled.extend(batch);
    }

    // Durable state: the effect, its marker, the published row.
    let credited: Vec<String> = shop.credits().await.unwrap().into_iter().map(|(id, _, _)| id).collect();
    assert_eq!(credited, std::slice::from_ref(&event_id), "{label}");
    let marked: Vec<String> =
        store.inbox().markers(CONSUMER).await.unwrap().into_iter().map(|m| m.event_id.to_string()).collect();
    assert_eq!(marked, std::slice::from_ref(&event_id), "{label}");
    assert_eq!(all_rows(&store).await.unwrap()[0].status, RowStatus::Published, "{label}");

    // One trace: enqueue → publish → handle.
    let spans = spans_of(&event_id);
    let publish = one(&spans, "outbox.publish", &label);
    let handle = one(&spans, "outbox.handle", &label);
    assert_eq!(publish.span_context.trace_id(), enqueue.trace_id(), "{label}: publish continues the enqueue's trace");
    assert_eq!(publish.parent_span_id, enqueue.span_id(), "{label}: publish is a child of the enqueue");
    assert_eq!(handle.span_context.trace_id(), enqueue.trace_id(), "{label}: handle continues the same trace");
    let parents: [SpanId; 2] = [enqueue.span_id(), publish.span_context.span_id()];
    assert!(parents.contains(&handle.parent_span_id), "{label}: handle's parent is the enqueue or the publish");
}

#[tokio::test]
async fn sqlite_memory() {
    story("memory").await;
}

#[tokio::test]
async fn sqlite_redis() {
    story("redis").await;
}

#[tokio::test]
async fn sqlite_amqp() {
    story("amqp").await;
}

#[tokio::test]
async fn sqlite_kafka() {
    story("kafka").await;
}
