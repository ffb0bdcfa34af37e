//! `Broker::publish_batch` against a real Kafka-protocol broker (tansu locally:
//! `scripts/services ensure kafka`): every record of the batch in flight at once, each event
//! stored once byte-for-byte in per-key order, an invalid event failing alone. Every test uses
//! its own topic and deletes it at the end.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use outbox_broker_kafka::{EVENT_ID_HEADER, KafkaBroker, KafkaConfig};
use outbox_core::{Broker, ConsumerGroup, Destination, ErrorKind, Event, EventId};

fn broker_up() -> bool {
    outbox_conformance_tests::require_service(
        "Kafka-protocol broker (tansu)",
        "kafka",
        &outbox_conformance_tests::service_addr(&outbox_conformance_tests::kafka_url()),
    )
}

fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    format!("{prefix}-{}-{}-{nanos:x}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// A broker and a fresh topic with 3 partitions.
async fn setup() -> (KafkaBroker, Destination) {
    let config = KafkaConfig::from_url(&outbox_conformance_tests::kafka_url())
        .expect("OUTBOX_KAFKA_URL")
        .with_client_id(unique("outbox-batch-test"))
        .with_delivery_timeout(Duration::from_secs(15))
        .with_operation_timeout(Duration::from_secs(10))
        .with_partitions(3);
    let broker = KafkaBroker::connect(config).await.expect("connect");
    let topic = Destination::new(unique("batch")).unwrap();
    broker.declare(&topic, &[]).await.expect("declare");
    (broker, topic)
}

/// Deletes the topic when dropped (also when the test panics).
struct Cleanup(KafkaBroker, Destination);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (broker, topic) = (self.0.clone(), self.1.clone());
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                if let Err(e) = broker.delete_topic(&topic).await {
                    eprintln!("could not delete topic {topic}: {e}");
                }
            });
        });
        let _ = done.join();
    }
}

/// What `topic` holds, read by a fresh group through the adapter's subscription: `n` events
/// within the wait, then nothing more. (Not `read_topic`: tansu reports a partition's high
/// watermark as one past the first offset of its last record batch, so a reader that stops there
/// misses the rest of a batch of several records.) Per-key order is delivery order: a key's
/// records are in one partition, delivered in offset order.
async fn stored(broker: &KafkaBroker, topic: &Destination, n: usize) -> Vec<Event> {
    let group = ConsumerGroup::new(unique("g")).unwrap();
    let mut sub = broker.subscribe(topic, &group).await.expect("subscribe");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.len() < n {
        assert!(Instant::now() < deadline, "only {} of {n} events arrived", got.len());
        if let Some(d) = sub.next(Duration::from_millis(200)).await.expect("next") {
            got.push(d.event.clone());
            d.ack().await.expect("ack");
        }
    }
    if let Some(extra) = sub.next(Duration::from_millis(500)).await.expect("next") {
        panic!("an event arrived beyond the {n} expected: {}", extra.event.id);
    }
    got
}

/// 240 events on `dest`: keys `a`, `b`, `c` and keyless ones interleaved, distinct binary
/// payloads, some with headers.
fn mixed(dest: &Destination, tag: &str) -> Vec<Event> {
    (0..240u32)
        .map(|i| {
            let payload: Vec<u8> = (0..64u32).map(|j| ((i * 31 + j * 7) % 256) as u8).chain(i.to_be_bytes()).collect();
            let mut e = Event::new(EventId::new(format!("{tag}-{i}")).unwrap(), dest.clone(), payload);
            match i % 4 {
                0 => e = e.with_key("a"),
                1 => e = e.with_key("b").with_header("trace", format!("t{i}").into_bytes()),
                2 => e = e.with_key("c"),
                _ => {}
            }
            e
        })
        .collect()
}

/// Every event of `sent` is in `received` (what the topic holds) exactly once and equal byte-for-byte, and the
/// received events of each key are in the order they were sent.
fn assert_once_in_order(sent: &[Event], received: &[Event]) {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for e in received {
        *seen.entry(e.id.as_str()).or_default() += 1;
    }
    for e in sent {
        assert_eq!(seen.get(e.id.as_str()), Some(&1), "event {} must arrive exactly once", e.id);
    }
    assert_eq!(received.len(), sent.len(), "nothing else arrives");
    let by_id: HashMap<&str, &Event> = received.iter().map(|e| (e.id.as_str(), e)).collect();
    for e in sent {
        assert!(by_id[e.id.as_str()] == e, "event {} must arrive byte-for-byte", e.id);
    }
    for key in ["a", "b", "c"] {
        let want: Vec<&str> = sent.iter().filter(|e| e.key.as_deref() == Some(key)).map(|e| e.id.as_str()).collect();
        let got: Vec<&str> = received.iter().filter(|e| e.key.as_deref() == Some(key)).map(|e| e.id.as_str()).collect();
        assert_eq!(got, want, "key {key} in slice order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_batch_is_stored_once_byte_for_byte_in_key_order() {
    if !broker_up() {
        return;
    }
    let (broker, topic) = setup().await;
    let _cleanup = Cleanup(broker.clone(), topic.clone());
    let events = mixed(&topic, "m");
    let results = broker.publish_batch(&events).await;
    assert_eq!(results.len(), events.len());
    for (e, r) in events.iter().zip(&results) {
        assert!(r.is_ok(), "event {}: {r:?}", e.id);
    }
    assert_once_in_order(&events, &stored(&broker, &topic, events.len()).await);
    assert!(broker.publish_batch(&[]).await.is_empty(), "an empty batch is an empty result");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_event_fails_alone_and_stops_only_its_key() {
    if !broker_up() {
        return;
    }
    let (broker, topic) = setup().await;
    let _cleanup = Cleanup(broker.clone(), topic.clone());
    let mut events = mixed(&topic, "i");
    let reserved = Event::new(EventId::new("i-reserved").unwrap(), topic.clone(), b"x".to_vec())
        .with_key("a")
        .with_header(EVENT_ID_HEADER, b"forged".to_vec());
    events.insert(40, reserved);
    let results = broker.publish_batch(&events).await;
    let mut expected = Vec::new();
    for (i, (e, r)) in events.iter().zip(&results).enumerate() {
        if i == 40 {
            let err = r.as_ref().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        } else if e.key.as_deref() == Some("a") && i > 40 {
            let err = r.as_ref().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Skipped, "event {} after its key failed: {err}", e.id);
            assert!(err.is_transient());
        } else {
            assert!(r.is_ok(), "event {}: {r:?}", e.id);
            expected.push(e.clone());
        }
    }
    assert_once_in_order(&expected, &stored(&broker, &topic, expected.len()).await);
}
