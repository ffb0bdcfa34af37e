//! Several deliveries in flight on the reference backends, judged by durable state (effect
//! rows, markers, dead letters, what the broker still holds) and by the order of handler starts
//! and broker acknowledgements.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use common::{BOUND, Gauge, Log, Recording, Rng, Running, dest, group, label, memory_broker};
use outbox_consumer_inbox::{Consumer, ConsumerConfig, DEFAULT_MAX_IN_FLIGHT, EffectKind, Handled, Handler};
use outbox_core::memory::{MemoryInbox, MemoryTx};
use outbox_core::{Broker, DeadLetterReason, Error, ErrorKind, Event, EventId, InboxAdmin, Result};
use tokio::sync::{Barrier, Semaphore};

const IDLE: std::time::Duration = std::time::Duration::from_millis(50);

/// Credits on the memory inbox; logs `start <label>` when its effect begins and yields a
/// seeded number of times in the middle of it, so that concurrent deliveries interleave.
struct Credit {
    log: Log,
    gauge: Gauge,
    rng: std::sync::Mutex<Rng>,
    /// Payloads starting with `gate` wait here (bounded) until this many are inside at once.
    gate: Option<Arc<Barrier>>,
    gate_missed: AtomicBool,
    /// Payloads starting with `hold` wait for a permit (bounded by the test's own timeout).
    hold: Arc<Semaphore>,
}

impl Credit {
    fn new(test: &str) -> Self {
        Self {
            log: Log::default(),
            gauge: Gauge::default(),
            rng: std::sync::Mutex::new(Rng::seeded(test)),
            gate: None,
            gate_missed: AtomicBool::new(false),
            hold: Arc::new(Semaphore::new(0)),
        }
    }
    fn gated(mut self, n: usize) -> Self {
        self.gate = Some(Arc::new(Barrier::new(n)));
        self
    }
}

#[async_trait]
impl Handler<MemoryInbox> for Credit {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }
    async fn apply(&self, tx: &mut MemoryTx, event: &Event) -> Result<()> {
        let me = label(event);
        self.log.push(format!("start {me}"));
        self.gauge.enter();
        let result = async {
            if me.starts_with("poison") {
                return Err(Error::permanent(ErrorKind::Handler, "test", "cannot parse payload"));
            }
            if me.starts_with("gate")
                && let Some(gate) = &self.gate
                && tokio::time::timeout(BOUND, gate.wait()).await.is_err()
            {
                self.gate_missed.store(true, Ordering::SeqCst);
                return Err(Error::transient(ErrorKind::Handler, "test", "gate not reached: not enough concurrency"));
            }
            if me.starts_with("hold") {
                self.hold.acquire().await.expect("semaphore open").forget();
            }
            let yields = self.rng.lock().unwrap().below(8);
            for _ in 0..yields {
                tokio::task::yield_now().await;
            }
            tx.insert("effects", me.clone().into_bytes());
            Ok(())
        }
        .await;
        self.gauge.leave();
        result
    }
}

fn ev(id: &str, payload: &str) -> Event {
    Event::new(EventId::new(id).unwrap(), dest(), payload.as_bytes().to_vec())
}

fn keyed(key: &str, idx: usize) -> Event {
    ev(&format!("{key}-{idx}"), &format!("{key}:{idx}")).with_key(key)
}

fn effects(inbox: &MemoryInbox) -> Vec<String> {
    inbox.table("effects").into_iter().map(|r| String::from_utf8(r).unwrap()).collect()
}

fn unacked(broker: &outbox_core::memory::MemoryBroker) -> usize {
    broker.unacknowledged(&dest(), &group())
}

#[test]
fn the_default_is_documented_and_one_is_the_floor() {
    assert_eq!(ConsumerConfig::new("c").max_in_flight, DEFAULT_MAX_IN_FLIGHT);
    assert_eq!(DEFAULT_MAX_IN_FLIGHT, 8);
    assert_eq!(ConsumerConfig::new("c").with_max_in_flight(0).max_in_flight, 1);
}

/// `max_in_flight(1)` is the one-at-a-time consumer: each delivery is received only after the
/// one before it was acknowledged.
#[tokio::test]
async fn one_in_flight_handles_one_delivery_at_a_time() {
    let events: Vec<Event> = (0..12).map(|i| ev(&format!("e{i}"), &format!("e{i}"))).collect();
    let broker = memory_broker(&events).await;
    let handler = Credit::new("one_in_flight_handles_one_delivery_at_a_time");
    let (log, gauge) = (handler.log.clone(), handler.gauge.clone());
    let inbox = MemoryInbox::default();
    let consumer = Consumer::new(inbox.clone(), handler, ConsumerConfig::new("c").with_max_in_flight(1));
    let mut sub = Recording { inner: broker.subscribe(&dest(), &group()).await.unwrap(), log: log.clone() };
    let handled = consumer.drain(&mut sub, IDLE).await.unwrap();
    assert_eq!(handled, vec![Handled::Applied; 12]);
    let expected: Vec<String> = (0..12).flat_map(|i| [format!("start e{i}"), format!("ack e{i}")]).collect();
    assert_eq!(log.lines(), expected);
    assert_eq!(gauge.max(), 1);
    assert_eq!(effects(&inbox), (0..12).map(|i| format!("e{i}")).collect::<Vec<_>>());
    assert_eq!(unacked(&broker), 0);
}

/// Different keys run at once, never more than the limit: four `gate` deliveries meet at a
/// barrier of four (a bounded wait; a consumer handling fewer at once would miss it).
#[tokio::test]
async fn different_keys_run_concurrently_up_to_the_limit() {
    let mut events: Vec<Event> = (0..4).map(|i| ev(&format!("g{i}"), &format!("gate{i}"))).collect();
    events.extend((0..20).map(|i| ev(&format!("e{i}"), &format!("e{i}")).with_key(format!("k{}", i % 5))));
    let broker = memory_broker(&events).await;
    let handler = Credit::new("different_keys_run_concurrently_up_to_the_limit").gated(4);
    let gauge = handler.gauge.clone();
    let inbox = MemoryInbox::default();
    let consumer = Consumer::new(inbox.clone(), handler, ConsumerConfig::new("c").with_max_in_flight(4));
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let handled = tokio::time::timeout(BOUND, consumer.drain(sub.as_mut(), IDLE)).await.expect("drain ends").unwrap();
    assert_eq!(handled, vec![Handled::Applied; 24], "the gate was met on the first attempt");
    assert_eq!(gauge.max(), 4, "four at once, never more");
    assert_eq!(effects(&inbox).len(), 24);
    assert_eq!(inbox.markers("c").await.unwrap().len(), 24);
    assert_eq!(unacked(&broker), 0);
}

/// Events of one key are handled strictly in receive order: each starts only after the one
/// before it was acknowledged, while other keys (and keyless events) interleave with it.
#[tokio::test]
async fn one_key_is_handled_in_receive_order_while_keys_interleave() {
    const KEYS: [&str; 3] = ["acct-a", "acct-b", "acct-c"];
    const PER_KEY: usize = 12;
    let mut events = Vec::new();
    for i in 0..PER_KEY {
        for k in KEYS {
            events.push(keyed(k, i));
        }
        events.push(ev(&format!("free-{i}"), &format!("free:{i}")));
    }
    // The first event of each key meets the others at a barrier of three.
    for e in events.iter_mut().filter(|e| e.payload.ends_with(b":0") && e.key.is_some()) {
        e.payload = [b"gate-".as_slice(), &e.payload].concat();
    }
    let broker = memory_broker(&events).await;
    let handler = Credit::new("one_key_is_handled_in_receive_order_while_keys_interleave").gated(3);
    let (log, gauge) = (handler.log.clone(), handler.gauge.clone());
    let inbox = MemoryInbox::default();
    let consumer = Consumer::new(inbox.clone(), handler, ConsumerConfig::new("c").with_max_in_flight(8));
    let mut sub = Recording { inner: broker.subscribe(&dest(), &group()).await.unwrap(), log: log.clone() };
    let handled = tokio::time::timeout(BOUND, consumer.drain(&mut sub, IDLE)).await.expect("drain ends").unwrap();
    assert_eq!(handled.len(), events.len());
    assert!(handled.iter().all(|h| *h == Handled::Applied), "{handled:?}");
    assert!(gauge.max() > 1, "keys ran concurrently (max {})", gauge.max());

    let name = |k: &str, i: usize| if i == 0 { format!("gate-{k}:0") } else { format!("{k}:{i}") };
    let lines = log.lines();
    for k in KEYS {
        for i in 1..PER_KEY {
            let acked = log.position(&format!("ack {}", name(k, i - 1))).expect("acknowledged");
            let started = log.position(&format!("start {}", name(k, i))).expect("started");
            assert!(acked < started, "{k}:{i} started before {k}:{} was acknowledged: {lines:?}", i - 1);
        }
        let order: Vec<String> = effects(&inbox).into_iter().filter(|e| e.contains(k)).collect();
        let expected: Vec<String> = (0..PER_KEY).map(|i| name(k, i)).collect();
        assert_eq!(order, expected, "effects of {k} committed in receive order");
    }
    assert_eq!(inbox.markers("c").await.unwrap().len(), events.len());
    assert_eq!(unacked(&broker), 0);
}

/// Copies of one event delivered concurrently (to one member, and to two members of the group
/// at once) apply once; the rest are duplicates, acknowledged.
#[tokio::test]
async fn duplicates_in_flight_at_once_apply_once() {
    const N: usize = 30;
    let mut events: Vec<Event> = (0..N).map(|i| ev(&format!("e{i}"), &format!("e{i}"))).collect();
    // Each event three times: right after itself, and again after all of them.
    let copies: Vec<Event> = events.iter().flat_map(|e| [e.clone(), e.clone()]).chain(events.clone()).collect();
    events = copies;
    let broker = memory_broker(&events).await;
    let inbox = MemoryInbox::default();
    let config = ConsumerConfig::new("c").with_max_in_flight(8);
    let one = Consumer::new(inbox.clone(), Credit::new("duplicates_in_flight_at_once_apply_once/1"), config.clone());
    let two = Consumer::new(inbox.clone(), Credit::new("duplicates_in_flight_at_once_apply_once/2"), config);
    let mut sub1 = broker.subscribe(&dest(), &group()).await.unwrap();
    let mut sub2 = broker.subscribe(&dest(), &group()).await.unwrap();
    let (a, b) = tokio::time::timeout(BOUND, async {
        tokio::join!(one.drain(sub1.as_mut(), IDLE), two.drain(sub2.as_mut(), IDLE))
    })
    .await
    .expect("both drains end");
    let handled: Vec<Handled> = a.unwrap().into_iter().chain(b.unwrap()).collect();
    let count = |f: fn(&Handled) -> bool| handled.iter().filter(|h| f(h)).count();
    assert_eq!(count(|h| *h == Handled::Applied), N, "{handled:?}");
    // A copy racing the first to the marker may fail to commit (a write conflict) and come back.
    assert_eq!(count(|h| *h == Handled::Duplicate), 2 * N, "{handled:?}");
    let mut applied = effects(&inbox);
    applied.sort();
    let mut expected: Vec<String> = (0..N).map(|i| format!("e{i}")).collect();
    expected.sort();
    assert_eq!(applied, expected, "one effect per event");
    assert_eq!(inbox.markers("c").await.unwrap().len(), N);
    assert_eq!(unacked(&broker), 0);
}

/// A poison event fails and is dead-lettered; the events after it in its key wait for it and
/// then apply, other keys are not disturbed, and nothing applies twice.
#[tokio::test]
async fn a_failing_delivery_disturbs_no_other() {
    let mut events = Vec::new();
    for i in 0..6 {
        events.push(keyed("acct-a", i));
        events.push(keyed("acct-b", i));
    }
    events.insert(4, ev("acct-a-p", "poison").with_key("acct-a"));
    let broker = memory_broker(&events).await;
    let handler = Credit::new("a_failing_delivery_disturbs_no_other");
    let inbox = MemoryInbox::default();
    let config = ConsumerConfig::new("c").with_max_in_flight(8).with_max_attempts(3);
    let consumer = Consumer::new(inbox.clone(), handler, config);
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let handled = tokio::time::timeout(BOUND, consumer.drain(sub.as_mut(), IDLE)).await.expect("drain ends").unwrap();
    assert_eq!(handled.iter().filter(|h| **h == Handled::Applied).count(), 12, "{handled:?}");
    assert_eq!(handled.iter().filter(|h| matches!(h, Handled::Retry { .. })).count(), 2, "{handled:?}");
    assert!(handled.contains(&Handled::DeadLettered { attempts: 3 }), "{handled:?}");
    let mut applied = effects(&inbox);
    applied.sort();
    let mut expected: Vec<String> = (0..6).flat_map(|i| [format!("acct-a:{i}"), format!("acct-b:{i}")]).collect();
    expected.sort();
    assert_eq!(applied, expected);
    let dead = inbox.dead_letters("c").await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].event.id.as_str(), dead[0].reason), ("acct-a-p", DeadLetterReason::HandlerFailed));
    assert_eq!(inbox.markers("c").await.unwrap().len(), 12);
    assert_eq!(unacked(&broker), 0);
}

/// Shutdown while deliveries are running: no new receive, the running ones finish and are
/// acknowledged, everything else stays with the broker and is handled once by the next run.
#[tokio::test]
async fn shutdown_lets_running_deliveries_finish_and_loses_nothing() {
    let mut events: Vec<Event> = (0..4).map(|i| ev(&format!("h{i}"), &format!("hold{i}"))).collect();
    events.extend((0..6).map(|i| ev(&format!("e{i}"), &format!("e{i}"))));
    let broker = memory_broker(&events).await;
    let handler = Credit::new("shutdown_lets_running_deliveries_finish_and_loses_nothing");
    let (hold, gauge) = (handler.hold.clone(), handler.gauge.clone());
    let inbox = MemoryInbox::default();
    let consumer = Consumer::new(inbox.clone(), handler, ConsumerConfig::new("c").with_max_in_flight(4));
    let running = Running::start(&consumer, &broker).await;
    running.wait_inside(&gauge, 4, "four deliveries inside the handler").await;
    running.trigger();
    hold.add_permits(4);
    let sub = running.stopped("run stops").await;
    let mut applied = effects(&inbox);
    applied.sort();
    assert_eq!(applied, ["hold0", "hold1", "hold2", "hold3"], "the running ones finished");
    assert_eq!(unacked(&broker), 6, "the rest was never received or never acknowledged");
    drop(sub);

    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let handled = consumer.drain(sub.as_mut(), IDLE).await.unwrap();
    assert_eq!(handled, vec![Handled::Applied; 6]);
    assert_eq!(effects(&inbox).len(), 10, "each event once");
    assert_eq!(inbox.markers("c").await.unwrap().len(), 10);
    assert_eq!(unacked(&broker), 0);
}

/// Deliveries still running when the shutdown grace is over are dropped: rolled back, never
/// acknowledged, and redelivered to the next member, which applies each once.
#[tokio::test]
async fn shutdown_after_the_grace_drops_unfinished_deliveries_unacknowledged() {
    let events: Vec<Event> = (0..3).map(|i| ev(&format!("h{i}"), &format!("hold{i}"))).collect();
    let broker = memory_broker(&events).await;
    let handler = Credit::new("shutdown_after_the_grace_drops_unfinished_deliveries_unacknowledged");
    let gauge = handler.gauge.clone();
    let inbox = MemoryInbox::default();
    let config = ConsumerConfig::new("c").with_max_in_flight(4).with_shutdown_grace(std::time::Duration::ZERO);
    let consumer = Consumer::new(inbox.clone(), handler, config.with_receive_wait(IDLE));
    let running = Running::start(&consumer, &broker).await;
    running.wait_inside(&gauge, 3, "three deliveries inside the handler").await;
    running.trigger();
    let sub = running.stopped("run stops after the grace").await;
    assert!(effects(&inbox).is_empty() && inbox.markers("c").await.unwrap().is_empty(), "nothing committed");
    assert_eq!(unacked(&broker), 3);
    drop(sub);

    // The next member: the same handler, its `hold` permits open.
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let open = Credit::new("after-grace/open");
    open.hold.add_permits(3);
    let next = Consumer::new(inbox.clone(), open, ConsumerConfig::new("c"));
    let handled = tokio::time::timeout(BOUND, next.drain(sub.as_mut(), IDLE)).await.expect("drain ends").unwrap();
    assert_eq!(handled, vec![Handled::Applied; 3]);
    let mut applied = effects(&inbox);
    applied.sort();
    assert_eq!(applied, ["hold0", "hold1", "hold2"]);
    assert_eq!(inbox.markers("c").await.unwrap().len(), 3);
    assert_eq!(unacked(&broker), 0);
}

/// A conflicting copy of an event (same id, other content, even under another key) waits for
/// the first copy: the first received wins, deterministically, and the other is dead-lettered.
#[tokio::test]
async fn the_first_received_copy_wins_a_conflict() {
    let first = ev("x", "first").with_key("k1");
    let other = ev("x", "other").with_key("k2");
    let broker = memory_broker(&[first, other.clone(), ev("y", "y")]).await;
    let inbox = MemoryInbox::default();
    let consumer = Consumer::new(
        inbox.clone(),
        Credit::new("the_first_received_copy_wins_a_conflict"),
        ConsumerConfig::new("c").with_max_in_flight(8),
    );
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let handled = consumer.drain(sub.as_mut(), IDLE).await.unwrap();
    assert_eq!(handled, [Handled::Applied, Handled::Conflict, Handled::Applied]);
    let mut applied = effects(&inbox);
    applied.sort();
    assert_eq!(applied, ["first", "y"]);
    let dead = inbox.dead_letters("c").await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].reason, &dead[0].event), (DeadLetterReason::Conflict, &other));
}
