//! `Broker::publish_batch` against a real RabbitMQ: many messages in flight per channel, every
//! event delivered once byte-for-byte in per-key order, an invalid event failing alone, and
//! `basic.return` attributed to exactly the message that was returned. Each test uses fresh
//! exchange and queue names and deletes them when it ends (also when it fails).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use outbox_broker_amqp::{AmqpBroker, AmqpConfig, RoutingKey};
use outbox_core::{Broker, ConsumerGroup, Destination, ErrorKind, Event, EventId, Subscription};

mod common;
use common::{server, unique, url};

/// Longest wait for the deliveries of one test.
const WAIT: Duration = Duration::from_secs(10);

/// A broker with its own names; deletes its exchanges and queues on drop.
struct Fixture {
    broker: AmqpBroker,
    destinations: Vec<Destination>,
    group: ConsumerGroup,
}

impl Fixture {
    fn new(tag: &str, adjust: impl FnOnce(AmqpConfig) -> AmqpConfig) -> Self {
        let config = AmqpConfig::from_url(&url())
            .unwrap()
            .with_exchange_prefix("outbox-test.")
            .unwrap()
            .with_queue_prefix("outbox-test.")
            .unwrap();
        Self {
            broker: AmqpBroker::new(adjust(config)),
            destinations: vec![Destination::new(unique(tag)).unwrap()],
            group: ConsumerGroup::new("readers").unwrap(),
        }
    }

    fn dest(&self) -> &Destination {
        &self.destinations[0]
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let config = self.broker.config().clone();
        let destinations = self.destinations.clone();
        let groups = vec![self.group.clone()];
        // Our runtime may be the one dropping us; clean up on a thread with a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            rt.block_on(async {
                let broker = AmqpBroker::new(config);
                for d in &destinations {
                    if let Err(e) = broker.delete(d, &groups).await {
                        eprintln!("cleanup of {d} failed: {e}");
                    }
                }
                broker.close().await;
            });
        });
        if cleanup.join().is_err() {
            eprintln!("cleanup panicked");
        }
    }
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

/// Receive (and acknowledge) `n` events within [`WAIT`], then make sure nothing else comes.
async fn read(sub: &mut dyn Subscription, n: usize) -> Vec<Event> {
    let deadline = Instant::now() + WAIT;
    let mut got = Vec::new();
    while got.len() < n {
        assert!(Instant::now() < deadline, "only {} of {n} events arrived within {WAIT:?}", got.len());
        if let Some(d) = sub.next(Duration::from_millis(200)).await.expect("next") {
            got.push(d.event.clone());
            d.ack().await.expect("ack");
        }
    }
    if let Some(extra) = sub.next(Duration::from_millis(300)).await.expect("next") {
        panic!("an event arrived beyond the {n} expected: {}", extra.event.id);
    }
    got
}

/// Every event of `sent` is in `received` exactly once and equal byte-for-byte, and the
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

/// A mixed batch (three keys, keyless events, headers, binary payloads) on the default one channel
/// per batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_batch_arrives_once_byte_for_byte_in_key_order() {
    mixed_batch_arrives_once_in_key_order("mixed", |c| c).await;
}

/// The same batch spread over every publishing channel: each key stays on one channel, so its
/// events still arrive in slice order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_batch_spread_over_sixteen_channels_arrives_once_in_key_order() {
    mixed_batch_arrives_once_in_key_order("spread", |c| c.with_batch_channels(16).unwrap()).await;
}

async fn mixed_batch_arrives_once_in_key_order(tag: &str, adjust: impl FnOnce(AmqpConfig) -> AmqpConfig) {
    if !server() {
        return;
    }
    let fx = Fixture::new(tag, adjust);
    fx.broker.declare(fx.dest(), std::slice::from_ref(&fx.group)).await.unwrap();
    let events = mixed(fx.dest(), "m");
    let results = fx.broker.publish_batch(&events).await;
    assert_eq!(results.len(), events.len());
    for (e, r) in events.iter().zip(&results) {
        assert!(r.is_ok(), "event {}: {r:?}", e.id);
    }
    let mut sub = fx.broker.subscribe(fx.dest(), &fx.group).await.unwrap();
    let received = read(sub.as_mut(), events.len()).await;
    assert_once_in_order(&events, &received);
    assert!(fx.broker.publish_batch(&[]).await.is_empty(), "an empty batch is an empty result");
}

/// Two batches at once, each on one channel of its own (the default, set here explicitly with
/// two publishing channels), still deliver every event once in key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_capped_to_one_channel_each_arrive_once_in_key_order() {
    if !server() {
        return;
    }
    let fx = Fixture::new("capped", |c| c.with_publish_channels(2).unwrap().with_batch_channels(1).unwrap());
    assert_eq!(fx.broker.config().batch_channels(), 1);
    fx.broker.declare(fx.dest(), std::slice::from_ref(&fx.group)).await.unwrap();
    let (first, second) = (mixed(fx.dest(), "x"), mixed(fx.dest(), "y"));
    let (r1, r2) = tokio::join!(fx.broker.publish_batch(&first), fx.broker.publish_batch(&second));
    for (e, r) in first.iter().chain(&second).zip(r1.iter().chain(&r2)) {
        assert!(r.is_ok(), "event {}: {r:?}", e.id);
    }
    let mut sub = fx.broker.subscribe(fx.dest(), &fx.group).await.unwrap();
    let received = read(sub.as_mut(), first.len() + second.len()).await;
    for (tag, sent) in [("x-", &first), ("y-", &second)] {
        let mine: Vec<Event> = received.iter().filter(|e| e.id.as_str().starts_with(tag)).cloned().collect();
        assert_once_in_order(sent, &mine);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_event_fails_alone_and_stops_only_its_key() {
    if !server() {
        return;
    }
    let fx = Fixture::new("invalid", |c| c);
    fx.broker.declare(fx.dest(), std::slice::from_ref(&fx.group)).await.unwrap();
    let mut events = mixed(fx.dest(), "i");
    let reserved = Event::new(EventId::new("i-reserved").unwrap(), fx.dest().clone(), b"x".to_vec())
        .with_key("a")
        .with_header("x-outbox-key", b"forged".to_vec());
    events.insert(40, reserved);
    let results = fx.broker.publish_batch(&events).await;
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
    let mut sub = fx.broker.subscribe(fx.dest(), &fx.group).await.unwrap();
    let received = read(sub.as_mut(), expected.len()).await;
    assert_once_in_order(&expected, &received);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_are_attributed_to_exactly_the_returned_messages() {
    if !server() {
        return;
    }
    // Routing by event key: only key `a` has a binding, so in one window the events of `a` are
    // routed while those of `b` and the keyless ones (routing key = destination) come back.
    let mut fx = Fixture::new("returns", |c| c.with_routing_key(RoutingKey::EventKey));
    fx.broker.declare(fx.dest(), &[]).await.unwrap();
    let exchange = fx.broker.config().exchange_name(fx.dest()).unwrap();
    let queue = fx.broker.config().queue_name(fx.dest(), &fx.group).unwrap();
    let conn = Connection::connect(&url(), ConnectionProperties::default()).await.unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions { durable: true, ..Default::default() },
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "a".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = conn.close(200, "OK".into()).await;

    // A second destination whose exchange does not exist: the server closes the channel (404).
    let missing = Destination::new(unique("missing")).unwrap();
    fx.destinations.push(missing.clone());
    let mut events: Vec<Event> = mixed(fx.dest(), "r").into_iter().filter(|e| e.key.as_deref() != Some("c")).collect();
    for i in 0..10 {
        events.insert(i * 7, Event::new(EventId::new(format!("gone-{i}")).unwrap(), missing.clone(), b"x".to_vec()));
    }
    let results = fx.broker.publish_batch(&events).await;
    let mut routed = Vec::new();
    let mut first_b = true;
    for (e, r) in events.iter().zip(&results) {
        match e.key.as_deref() {
            Some("a") => {
                assert!(r.is_ok(), "event {} has a binding: {r:?}", e.id);
                routed.push(e.clone());
            }
            Some("b") if first_b => {
                first_b = false;
                assert_eq!(r.as_ref().unwrap_err().kind(), ErrorKind::Unroutable, "{r:?}");
            }
            Some("b") => {
                assert_eq!(r.as_ref().unwrap_err().kind(), ErrorKind::Skipped, "later event {} of key b: {r:?}", e.id)
            }
            _ => assert_eq!(r.as_ref().unwrap_err().kind(), ErrorKind::Unroutable, "event {}: {r:?}", e.id),
        }
    }
    let mut sub = fx.broker.subscribe(fx.dest(), &fx.group).await.unwrap();
    let received = read(sub.as_mut(), routed.len()).await;
    assert_once_in_order(&routed, &received);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_deleted_behind_the_brokers_back_is_checked_again() {
    if !server() {
        return;
    }
    let fx = Fixture::new("deleted", |c| c);
    fx.broker.declare(fx.dest(), std::slice::from_ref(&fx.group)).await.unwrap();
    let event = |i: u32| Event::new(EventId::new(format!("d-{i}")).unwrap(), fx.dest().clone(), vec![i as u8]);
    assert!(fx.broker.publish_batch(&[event(0)]).await[0].is_ok(), "the declared exchange routes");

    // Another client deletes the exchange: the broker still takes it to exist.
    let exchange = fx.broker.config().exchange_name(fx.dest()).unwrap();
    let conn = Connection::connect(&url(), ConnectionProperties::default()).await.unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel.exchange_delete(exchange.as_str().into(), Default::default()).await.unwrap();
    let _ = conn.close(200, "OK".into()).await;

    // One message in the window: the server's 404 closes its channel, reported `Unroutable`.
    let first = fx.broker.publish_batch(&[event(1)]).await;
    let err = first[0].as_ref().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unroutable, "{err}");
    // The next batch checks the exchange before sending: every event fails alone, nothing is sent.
    let batch: Vec<Event> = (2..40).map(event).collect();
    for (e, r) in batch.iter().zip(fx.broker.publish_batch(&batch).await) {
        let err = r.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unroutable, "event {}: {err}", e.id);
        assert!(err.to_string().contains("does not exist"), "event {}: {err}", e.id);
    }
    // Declared again, it routes again; the queue holds event 0 and the new one, nothing else.
    fx.broker.declare(fx.dest(), std::slice::from_ref(&fx.group)).await.unwrap();
    assert!(fx.broker.publish_batch(&[event(40)]).await[0].is_ok(), "the exchange was declared again");
    let mut sub = fx.broker.subscribe(fx.dest(), &fx.group).await.unwrap();
    let received = read(sub.as_mut(), 2).await;
    let ids: Vec<&str> = received.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["d-0", "d-40"]);
}
