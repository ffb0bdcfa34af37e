//! What an operator sees: one counter per outcome (label `consumer`), the handle-latency
//! histogram, and one `outbox.handle` span per delivery around its guard, effect, commit and
//! acknowledgement.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use common::{dest, group, memory_broker};
use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use outbox_consumer_inbox::{Consumer, ConsumerConfig, EffectKind, Handled, Handler};
use outbox_core::memory::{MemoryInbox, MemoryTx};
use outbox_core::{
    Acknowledge, Broker, Delivery, Error, ErrorKind, Event, EventId, InboxAdmin, Received, Result, Subscription,
};
use tracing::span;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

const IDLE: std::time::Duration = std::time::Duration::from_millis(50);

/// The two tests run one at a time: `tracing` caches each callsite's interest process-wide, and
/// a callsite first hit by the test without a subscriber while the other installs its own can
/// be cached as "never" (seen once in the workspace run: no `outbox.handle` span recorded).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Counter totals and histogram sample counts by `name{consumer=...}`.
#[derive(Default)]
struct Values {
    counters: HashMap<String, u64>,
    samples: HashMap<String, Vec<f64>>,
}

#[derive(Clone, Default)]
struct TestRecorder(Arc<Mutex<Values>>);

struct Cell(Arc<Mutex<Values>>, String);

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        *self.0.lock().unwrap().counters.entry(self.1.clone()).or_default() += value;
    }
    fn absolute(&self, value: u64) {
        self.0.lock().unwrap().counters.insert(self.1.clone(), value);
    }
}

impl HistogramFn for Cell {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().samples.entry(self.1.clone()).or_default().push(value);
    }
}

fn render(key: &Key) -> String {
    let labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(Arc::new(Cell(self.0.clone(), render(key))))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(Arc::new(Cell(self.0.clone(), render(key))))
    }
}

/// The process-wide recorder of this test binary (each test uses its own consumer names).
fn recorder() -> &'static TestRecorder {
    static RECORDER: OnceLock<TestRecorder> = OnceLock::new();
    RECORDER.get_or_init(|| {
        let r = TestRecorder::default();
        metrics::set_global_recorder(r.clone()).expect("no other recorder in this test binary");
        r
    })
}

fn counter(name: &str, consumer: &str) -> u64 {
    recorder().0.lock().unwrap().counters.get(&format!("{name}{{consumer={consumer}}}")).copied().unwrap_or(0)
}

fn samples(consumer: &str) -> Vec<f64> {
    let key = format!("outbox_consumer_handle_seconds{{consumer={consumer}}}");
    recorder().0.lock().unwrap().samples.get(&key).cloned().unwrap_or_default()
}

/// Writes one effect row; `poison…` payloads fail; records which span it ran in.
struct Credit(SpanLog);

#[async_trait]
impl Handler<MemoryInbox> for Credit {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }
    async fn apply(&self, tx: &mut MemoryTx, event: &Event) -> Result<()> {
        self.0.note("apply", &event.id);
        if event.payload.starts_with(b"poison") {
            return Err(Error::permanent(ErrorKind::Handler, "test", "cannot parse payload"));
        }
        tx.insert("effects", event.payload.clone());
        Ok(())
    }
}

struct View;

#[async_trait]
impl Handler<MemoryInbox> for View {
    fn effect(&self) -> EffectKind {
        EffectKind::Projection
    }
    fn version(&self, event: &Event) -> Result<(String, u64)> {
        Ok(("order-1".into(), std::str::from_utf8(&event.payload).unwrap().parse().unwrap()))
    }
    async fn apply(&self, tx: &mut MemoryTx, event: &Event) -> Result<()> {
        tx.insert("view", event.payload.clone());
        Ok(())
    }
}

fn ev(id: &str, payload: &[u8]) -> Event {
    Event::new(EventId::new(id).unwrap(), dest(), payload.to_vec())
}

#[tokio::test]
async fn every_outcome_is_counted_once_per_delivery_with_its_latency() {
    let _serial = SERIAL.lock().await;
    let _ = recorder();
    let events = [ev("a", b"7"), ev("a", b"7"), ev("a", b"9"), ev("p", b"poison"), ev("b", b"1")];
    let broker = memory_broker(&events).await;
    broker.publish_raw(&dest(), vec![(b"junk".to_vec(), b"not an event".to_vec())]).unwrap();
    let inbox = MemoryInbox::default();
    let consumer = Consumer::new(
        inbox.clone(),
        Credit(SpanLog::default()),
        ConsumerConfig::new("metrics-additive").with_max_attempts(2),
    );
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let handled = consumer.drain(sub.as_mut(), IDLE).await.unwrap();
    assert_eq!(handled.len(), 7, "{handled:?}");
    let c = |name: &str| counter(name, "metrics-additive");
    assert_eq!(c("outbox_consumer_applied_total"), 2);
    assert_eq!(c("outbox_consumer_duplicate_total"), 1);
    assert_eq!(c("outbox_consumer_conflict_total"), 1);
    assert_eq!(c("outbox_consumer_failed_total"), 1, "the poison's first attempt");
    assert_eq!(c("outbox_consumer_dead_lettered_total"), 1, "the poison's second attempt");
    assert_eq!(c("outbox_consumer_malformed_total"), 1);
    assert_eq!(c("outbox_consumer_stale_total"), 0);
    let s = samples("metrics-additive");
    assert_eq!(s.len(), 7, "one latency sample per delivery");
    assert!(s.iter().all(|v| v.is_finite() && *v >= 0.0), "{s:?}");
    // The counters agree with durable state.
    assert_eq!(inbox.table("effects").len() as u64, c("outbox_consumer_applied_total"));
    assert_eq!(inbox.dead_letters("metrics-additive").await.unwrap().len(), 3, "conflict, poison, malformed");

    let broker = memory_broker(&[ev("v2", b"2"), ev("v1", b"1")].map(|e| e.with_key("order-1"))).await;
    let view = Consumer::new(inbox.clone(), View, ConsumerConfig::new("metrics-view"));
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    assert_eq!(view.drain(sub.as_mut(), IDLE).await.unwrap(), [Handled::Applied, Handled::Stale { current: 2 }]);
    assert_eq!(counter("outbox_consumer_applied_total", "metrics-view"), 1);
    assert_eq!(counter("outbox_consumer_stale_total", "metrics-view"), 1);
    assert_eq!(samples("metrics-view").len(), 2);
}

/// `outbox.handle` spans as the subscriber saw them, and where handler and acknowledgement ran.
#[derive(Clone, Default)]
struct SpanLog(Arc<Mutex<SpanRecords>>);

#[derive(Default)]
struct SpanRecords {
    /// span id → event id of each `outbox.handle` span created.
    spans: HashMap<u64, String>,
    /// (what, event id, id of the current `outbox.handle` span if any).
    notes: Vec<(String, String, Option<u64>)>,
}

impl SpanLog {
    fn note(&self, what: &str, event: &EventId) {
        let current = tracing::Span::current();
        let id = current.metadata().filter(|m| m.name() == "outbox.handle").and(current.id()).map(|i| i.into_u64());
        self.0.lock().unwrap().notes.push((what.into(), event.to_string(), id));
    }
}

struct EventIdField<'a>(&'a mut Option<String>);

impl tracing::field::Visit for EventIdField<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "event_id" {
            *self.0 = Some(format!("{value:?}"));
        }
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "event_id" {
            *self.0 = Some(value.to_string());
        }
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for SpanLog {
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, _: Context<'_, S>) {
        if attrs.metadata().name() == "outbox.handle" {
            let mut event_id = None;
            attrs.record(&mut EventIdField(&mut event_id));
            self.0.lock().unwrap().spans.insert(id.into_u64(), event_id.unwrap_or_default());
        }
    }
}

/// A subscription whose acknowledgements note the span they run in.
struct Noting(Box<dyn Subscription>, SpanLog);

struct NotingAck(Box<dyn Acknowledge>, SpanLog, EventId);

#[async_trait]
impl Acknowledge for NotingAck {
    async fn ack(self: Box<Self>) -> Result<()> {
        self.1.note("ack", &self.2);
        self.0.ack().await
    }
    async fn nack(self: Box<Self>) -> Result<()> {
        self.1.note("nack", &self.2);
        self.0.nack().await
    }
}

#[async_trait]
impl Subscription for Noting {
    async fn receive(&mut self, wait: std::time::Duration) -> Result<Option<Received>> {
        Ok(match self.0.receive(wait).await? {
            Some(Received::Event(d)) => {
                let (redelivered, attempt) = (d.redelivered, d.attempt);
                let (event, acker) = d.into_parts();
                let ack = NotingAck(acker, self.1.clone(), event.id.clone());
                Some(Received::Event(Delivery::new(event, redelivered, attempt, Box::new(ack))))
            }
            other => other,
        })
    }
}

/// Each delivery gets its own `outbox.handle` span, named after its event, and both its effect
/// and its acknowledgement run inside it, also with several deliveries in flight.
#[tokio::test]
async fn each_delivery_runs_in_one_handle_span_from_guard_to_ack() {
    let log = SpanLog::default();
    let subscriber = tracing_subscriber::registry().with(log.clone());
    let _serial = SERIAL.lock().await;
    let _guard = tracing::subscriber::set_default(subscriber);
    // Interest cached before this subscriber existed must not hide the handle spans from it.
    tracing::callsite::rebuild_interest_cache();

    let events: Vec<Event> = (0..6).map(|i| ev(&format!("s{i}"), format!("{i}").as_bytes())).collect();
    let broker = memory_broker(&events).await;
    let consumer =
        Consumer::new(MemoryInbox::default(), Credit(log.clone()), ConsumerConfig::new("spans").with_max_in_flight(4));
    let mut sub = Noting(broker.subscribe(&dest(), &group()).await.unwrap(), log.clone());
    let handled = consumer.drain(&mut sub, IDLE).await.unwrap();
    assert_eq!(handled, vec![Handled::Applied; 6]);

    let records = log.0.lock().unwrap();
    let mut named: Vec<&String> = records.spans.values().collect();
    named.sort();
    assert_eq!(
        named,
        (0..6).map(|i| format!("s{i}")).collect::<Vec<_>>().iter().collect::<Vec<_>>(),
        "one per delivery"
    );
    assert_eq!(records.notes.len(), 12, "{:?}", records.notes);
    for (what, event, span) in &records.notes {
        let span = span.unwrap_or_else(|| panic!("{what} of {event} ran outside an outbox.handle span"));
        assert_eq!(records.spans.get(&span), Some(event), "{what} of {event} ran in another delivery's span");
    }
}
