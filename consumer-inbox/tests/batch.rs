//! Batch commit on the reference backends: several deliveries in one transaction
//! ([`Consumer::process_batch`], and [`Consumer::drain`] with `max_per_commit` above 1), judged by
//! durable state (effect rows, markers, dead letters, failure counts, what the broker still
//! holds) and by the order of handler starts and broker acknowledgements.

mod common;

use async_trait::async_trait;
use common::{BOUND, Log, Recording, dest, group, label, memory_broker};
use outbox_consumer_inbox::{Consumer, ConsumerConfig, EffectKind, Handled, Handler};
use outbox_core::memory::{MemoryBroker, MemoryInbox, MemoryTx};
use outbox_core::{
    Broker, DeadLetterReason, Delivery, Error, ErrorKind, Event, EventId, InboxAdmin, Received, Result, Subscription,
};

const IDLE: std::time::Duration = std::time::Duration::from_millis(50);

/// Credits on the memory inbox and logs `start <label>` when its effect begins. Payloads
/// starting with `poison` fail; `flaky…` ones fail the first time each is applied.
#[derive(Default)]
struct Credit {
    log: Log,
    failed_once: std::sync::Mutex<std::collections::BTreeSet<String>>,
    kind: Option<EffectKind>,
}

#[async_trait]
impl Handler<MemoryInbox> for Credit {
    fn effect(&self) -> EffectKind {
        self.kind.unwrap_or(EffectKind::Additive)
    }
    fn version(&self, event: &Event) -> Result<(String, u64)> {
        // `<subject>@<version>`
        let text = label(event);
        let (subject, version) = text.split_once('@').ok_or_else(|| Error::invalid_input("test", "no version"))?;
        Ok((subject.to_string(), version.parse().map_err(|_| Error::invalid_input("test", "bad version"))?))
    }
    async fn apply(&self, tx: &mut MemoryTx, event: &Event) -> Result<()> {
        let me = label(event);
        self.log.push(format!("start {me}"));
        if me.starts_with("poison") {
            return Err(Error::permanent(ErrorKind::Handler, "test", "cannot parse payload"));
        }
        if me.starts_with("flaky") && self.failed_once.lock().unwrap().insert(me.clone()) {
            return Err(Error::transient(ErrorKind::Handler, "test", "first attempt fails"));
        }
        tokio::task::yield_now().await;
        tx.insert("effects", me.into_bytes());
        Ok(())
    }
}

fn ev(id: &str, payload: &str) -> Event {
    Event::new(EventId::new(id).unwrap(), dest(), payload.as_bytes().to_vec())
}

fn effects(inbox: &MemoryInbox) -> Vec<String> {
    inbox.table("effects").into_iter().map(|r| String::from_utf8(r).unwrap()).collect()
}

fn unacked(broker: &MemoryBroker) -> usize {
    broker.unacknowledged(&dest(), &group())
}

/// The next `n` deliveries of `sub`, each within [`BOUND`].
async fn take(sub: &mut dyn Subscription, n: usize) -> Vec<Delivery> {
    let mut out = Vec::new();
    while out.len() < n {
        match tokio::time::timeout(BOUND, sub.receive(IDLE)).await.expect("a receive ends").unwrap() {
            Some(Received::Event(d)) => out.push(d),
            Some(Received::Foreign(_)) => panic!("a foreign message"),
            None => panic!("{} of {n} deliveries received", out.len()),
        }
    }
    out
}

fn consumer(handler: Credit, config: ConsumerConfig) -> (Consumer<MemoryInbox, Credit>, MemoryInbox, Log) {
    let inbox = MemoryInbox::default();
    let log = handler.log.clone();
    (Consumer::new(inbox.clone(), handler, config), inbox, log)
}

#[test]
fn one_is_the_default_and_the_floor() {
    assert_eq!(ConsumerConfig::new("c").max_per_commit, 1);
    assert_eq!(ConsumerConfig::new("c").with_max_per_commit(0).max_per_commit, 1);
    assert_eq!(ConsumerConfig::new("c").with_max_per_commit(8).max_per_commit, 8);
}

/// Behavior: guarded and applied in order in one transaction, a second copy in the batch is a
/// duplicate, and every acknowledgement follows the batch's commit (the first delivery's
/// acknowledgement comes after the last delivery's effect began).
#[tokio::test]
async fn a_batch_applies_each_once_and_acknowledges_after_its_commit() {
    let (a, b, c) = (ev("a", "a"), ev("b", "b"), ev("c", "c"));
    let broker = memory_broker(&[a.clone(), b, a, c]).await;
    let (consumer, inbox, log) = consumer(Credit::default(), ConsumerConfig::new("c"));
    let mut sub = Recording { inner: broker.subscribe(&dest(), &group()).await.unwrap(), log: log.clone() };
    let deliveries = take(&mut sub, 4).await;
    let results: Vec<Handled> = consumer.process_batch(deliveries).await.into_iter().map(Result::unwrap).collect();
    assert_eq!(results, vec![Handled::Applied, Handled::Applied, Handled::Duplicate, Handled::Applied]);
    assert_eq!(effects(&inbox), vec!["a", "b", "c"]);
    assert_eq!(inbox.markers("c").await.unwrap().len(), 3);
    assert_eq!(unacked(&broker), 0);
    let lines = log.lines();
    assert_eq!(&lines[..3], ["start a", "start b", "start c"], "{lines:?}");
    assert_eq!(lines.iter().filter(|l| l.starts_with("ack ")).count(), 4, "{lines:?}");
}

/// Behavior: a handler error rolls the whole batch back; then each is handled alone, so the
/// others apply once (their effect began twice, committed once) and the failing one counts one
/// failure and is negatively acknowledged.
#[tokio::test]
async fn a_handler_error_rolls_the_batch_back_and_each_is_handled_alone() {
    let broker = memory_broker(&[ev("a", "a"), ev("p", "poison"), ev("b", "b")]).await;
    let (consumer, inbox, log) = consumer(Credit::default(), ConsumerConfig::new("c").with_max_attempts(3));
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let deliveries = take(sub.as_mut(), 3).await;
    let results: Vec<Handled> = consumer.process_batch(deliveries).await.into_iter().map(Result::unwrap).collect();
    assert_eq!(results[0], Handled::Applied);
    assert!(matches!(&results[1], Handled::Retry { attempts: 1, .. }), "{results:?}");
    assert_eq!(results[2], Handled::Applied);
    let mut applied = effects(&inbox);
    applied.sort();
    assert_eq!(applied, vec!["a", "b"]);
    assert_eq!(log.lines().iter().filter(|l| *l == "start a").count(), 2, "a's effect began in the batch and alone");
    let markers: Vec<String> = inbox.markers("c").await.unwrap().into_iter().map(|m| m.event_id.to_string()).collect();
    assert_eq!(markers.len(), 2, "{markers:?}");
    assert!(!markers.contains(&"p".to_string()));
    // The failing event came back: one delivery outstanding, the others acknowledged.
    let again = take(sub.as_mut(), 1).await;
    assert_eq!(again[0].event.id.as_str(), "p");
}

/// Behavior: a copy with different content in the batch rolls it back; alone, the first copy
/// applies and the conflicting one is dead-lettered without an effect.
#[tokio::test]
async fn a_conflicting_copy_rolls_the_batch_back_and_is_dead_lettered_alone() {
    let broker = memory_broker(&[ev("a", "a"), ev("a", "a-changed"), ev("b", "b")]).await;
    let (consumer, inbox, _) = consumer(Credit::default(), ConsumerConfig::new("c"));
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let deliveries = take(sub.as_mut(), 3).await;
    let results: Vec<Handled> = consumer.process_batch(deliveries).await.into_iter().map(Result::unwrap).collect();
    assert_eq!(results, vec![Handled::Applied, Handled::Conflict, Handled::Applied]);
    assert_eq!(effects(&inbox), vec!["a", "b"]);
    let dead = inbox.dead_letters("c").await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].event.id.as_str(), dead[0].reason), ("a", DeadLetterReason::Conflict));
    assert_eq!(unacked(&broker), 0);
}

/// Behavior (projection): a batch moves each subject to its newest version and reports an older
/// one as stale, all in one commit.
#[tokio::test]
async fn a_projection_batch_reports_stale_versions_and_applies_newer_ones() {
    let broker = memory_broker(&[ev("1", "s@2"), ev("2", "t@1"), ev("3", "s@1")]).await;
    let handler = Credit { kind: Some(EffectKind::Projection), ..Credit::default() };
    let (consumer, inbox, _) = consumer(handler, ConsumerConfig::new("c"));
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let deliveries = take(sub.as_mut(), 3).await;
    let results: Vec<Handled> = consumer.process_batch(deliveries).await.into_iter().map(Result::unwrap).collect();
    assert_eq!(results, vec![Handled::Applied, Handled::Applied, Handled::Stale { current: 2 }]);
    assert_eq!(effects(&inbox), vec!["s@2", "t@1"]);
    assert_eq!((inbox.version("c", "s"), inbox.version("c", "t")), (Some(2), Some(1)));
    assert_eq!(unacked(&broker), 0);
}

/// `drain` with batches of up to 4 (8 in flight): 5 keys × 6 events, every event twice, a
/// flaky event in one key and a poison one in another. Each key's effects in receive order,
/// each event once, the poison dead-lettered after its attempts, nothing left on the broker.
#[tokio::test]
async fn drain_in_batches_keeps_key_order_and_applies_once() {
    let mut once = Vec::new();
    for i in 0..6 {
        for k in 0..5 {
            once.push(ev(&format!("k{k}-{i}"), &format!("k{k}:{i}")).with_key(format!("k{k}")));
        }
    }
    once.insert(7, ev("k1-flaky", "flaky-k1").with_key("k1"));
    let mut events: Vec<Event> = once.iter().flat_map(|e| [e.clone(), e.clone()]).collect();
    // Once: each copy of a poison event would count its own failures after the first's dead letter.
    events.insert(25, ev("k3-poison", "poison-k3").with_key("k3"));
    let broker = memory_broker(&events).await;
    let config = ConsumerConfig::new("c").with_max_in_flight(8).with_max_per_commit(4).with_max_attempts(3);
    let (consumer, inbox, _) = consumer(Credit::default(), config);
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let handled = tokio::time::timeout(BOUND, consumer.drain(sub.as_mut(), IDLE)).await.expect("drain ends").unwrap();
    let applied = handled.iter().filter(|h| **h == Handled::Applied).count();
    assert_eq!(applied, 31, "30 events and the flaky one: {handled:?}");
    assert!(handled.contains(&Handled::DeadLettered { attempts: 3 }), "{handled:?}");
    let rows = effects(&inbox);
    let mut sorted = rows.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), rows.len(), "an effect twice: {rows:?}");
    assert_eq!(rows.len(), 31);
    for k in 0..5 {
        let mine: Vec<&String> = rows.iter().filter(|r| r.starts_with(&format!("k{k}:"))).collect();
        let expected: Vec<String> = (0..6).map(|i| format!("k{k}:{i}")).collect();
        assert_eq!(mine, expected.iter().collect::<Vec<_>>(), "key k{k} in receive order");
    }
    let flaky = rows.iter().position(|r| r == "flaky-k1").expect("the flaky event applied");
    let after = rows.iter().position(|r| r == "k1:2").unwrap();
    assert!(flaky < after, "k1's flaky event before the k1 events received after it: {rows:?}");
    let dead = inbox.dead_letters("c").await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].event.id.as_str(), dead[0].reason), ("k3-poison", DeadLetterReason::HandlerFailed));
    assert_eq!(inbox.markers("c").await.unwrap().len(), 31);
    assert_eq!(unacked(&broker), 0);
}

/// `run` with batches of up to 4: every event applied once, then shutdown; the consumer stops
/// within its bound and nothing is left unacknowledged.
#[tokio::test]
async fn run_in_batches_applies_each_once_and_stops() {
    let events: Vec<Event> =
        (0..40).map(|i| ev(&format!("e{i}"), &format!("e{i}")).with_key(format!("k{}", i % 7))).collect();
    let broker = memory_broker(&events).await;
    let config = ConsumerConfig::new("c").with_max_in_flight(8).with_max_per_commit(4).with_receive_wait(IDLE);
    let (consumer, inbox, _) = consumer(Credit::default(), config);
    let running = common::Running::start(&consumer, &broker).await;
    common::wait_until("all 40 applied", || {
        let n = effects(&inbox).len();
        async move { n == 40 }
    })
    .await;
    running.trigger();
    let _sub = running.stopped("run ends after shutdown").await;
    let mut applied = effects(&inbox);
    applied.sort();
    let mut expected: Vec<String> = (0..40).map(|i| format!("e{i}")).collect();
    expected.sort();
    assert_eq!(applied, expected);
    assert_eq!(inbox.markers("c").await.unwrap().len(), 40);
    assert_eq!(unacked(&broker), 0);
}
