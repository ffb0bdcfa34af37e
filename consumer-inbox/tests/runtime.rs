//! The runtime on the reference backends, judged by durable state: effect rows, markers, dead
//! letters and what the broker still holds for the group.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_consumer_inbox::{Consumer, ConsumerConfig, EffectKind, Handled, Handler, Retention};
use outbox_core::memory::{MemoryBroker, MemoryInbox, MemoryTx};
use outbox_core::{
    Broker, ConsumerGroup, DeadLetterReason, Destination, Error, ErrorKind, Event, EventId, Inbox, InboxAdmin,
    ManualClock, Result,
};

const WAIT: Duration = Duration::from_millis(50);

struct Credit {
    fail_first: AtomicU32,
}

#[async_trait]
impl Handler<MemoryInbox> for Credit {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }
    async fn apply(&self, tx: &mut MemoryTx, event: &Event) -> Result<()> {
        if event.payload.starts_with(b"poison") {
            return Err(Error::permanent(ErrorKind::Handler, "test", "cannot parse payload"));
        }
        if self.fail_first.load(Ordering::SeqCst) > 0 {
            self.fail_first.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::transient(ErrorKind::Handler, "test", "downstream busy"));
        }
        tx.insert("effects", [event.id.as_str().as_bytes(), b"=", &event.payload].concat());
        Ok(())
    }
}

struct Projection;

#[async_trait]
impl Handler<MemoryInbox> for Projection {
    fn effect(&self) -> EffectKind {
        EffectKind::Projection
    }
    fn version(&self, event: &Event) -> Result<(String, u64)> {
        let v = std::str::from_utf8(&event.payload).unwrap().parse().unwrap();
        Ok(("order-1".into(), v))
    }
    async fn apply(&self, tx: &mut MemoryTx, event: &Event) -> Result<()> {
        tx.insert("projection", event.payload.clone());
        Ok(())
    }
}

fn ev(id: &str, payload: &[u8]) -> Event {
    Event::new(EventId::new(id).unwrap(), Destination::new("t").unwrap(), payload.to_vec())
}

async fn broker_with(events: &[Event]) -> (MemoryBroker, Box<dyn outbox_core::Subscription>) {
    let b = MemoryBroker::new();
    let d = Destination::new("t").unwrap();
    let g = ConsumerGroup::new("g").unwrap();
    b.declare(&d, std::slice::from_ref(&g)).await.unwrap();
    for e in events {
        b.publish(e).await.unwrap();
    }
    let sub = b.subscribe(&d, &g).await.unwrap();
    (b, sub)
}

fn table(inbox: &MemoryInbox, t: &str) -> Vec<String> {
    inbox.table(t).into_iter().map(|r| String::from_utf8(r).unwrap()).collect()
}

#[tokio::test]
async fn duplicates_apply_once_and_conflicts_are_dead_lettered() {
    let inbox = MemoryInbox::default();
    let consumer = Consumer::new(inbox.clone(), Credit { fail_first: 0.into() }, ConsumerConfig::new("billing"));
    // The conflicting delivery carries a key and binary headers: the dead letter keeps all of it.
    let conflicting = ev("a", b"9\0\xff").with_key("acct-1").with_header("trace", vec![0u8, 0xff, 1]);
    let events = [ev("a", b"7"), ev("b", b"7"), ev("a", b"7"), ev("c", b"0"), conflicting.clone()];
    let (broker, mut sub) = broker_with(&events).await;
    let handled = consumer.drain(sub.as_mut(), WAIT).await.unwrap();
    assert_eq!(handled, [Handled::Applied, Handled::Applied, Handled::Duplicate, Handled::Applied, Handled::Conflict]);
    let mut effects = table(&inbox, "effects");
    effects.sort(); // deliveries run concurrently: commit order is not receive order
    assert_eq!(effects, ["a=7", "b=7", "c=0"], "equal amounts are different events; zero gets one");
    assert_eq!(inbox.markers("billing").await.unwrap().len(), 3);
    let dead = inbox.dead_letters("billing").await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].consumer.as_str(), dead[0].reason), ("billing", DeadLetterReason::Conflict));
    assert_eq!(dead[0].event, conflicting, "the whole delivered event, byte-for-byte");
    assert!(dead[0].id > 0 && dead[0].destination_known());
    assert_eq!(broker.unacknowledged(&Destination::new("t").unwrap(), &ConsumerGroup::new("g").unwrap()), 0);
}

#[tokio::test]
async fn handler_errors_are_retried_then_dead_lettered_and_the_stream_keeps_flowing() {
    let inbox = MemoryInbox::default();
    let config = ConsumerConfig::new("billing").with_max_attempts(3);
    let consumer = Consumer::new(inbox.clone(), Credit { fail_first: 1.into() }, config);
    let (broker, mut sub) = broker_with(&[ev("flaky", b"5"), ev("poison-1", b"poison"), ev("next", b"1")]).await;
    let handled = consumer.drain(sub.as_mut(), WAIT).await.unwrap();
    // flaky fails once then applies on redelivery; poison fails 3 times and is dead-lettered.
    assert_eq!(handled.iter().filter(|h| matches!(h, Handled::Retry { .. })).count(), 3);
    assert!(handled.contains(&Handled::DeadLettered { attempts: 3 }));
    let mut effects = table(&inbox, "effects");
    effects.sort();
    assert_eq!(effects, ["flaky=5", "next=1"]);
    let dead = inbox.dead_letters("billing").await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason, DeadLetterReason::HandlerFailed);
    assert_eq!(dead[0].event, ev("poison-1", b"poison"));
    assert!(dead[0].error.contains("cannot parse payload") && dead[0].error.contains("3 times"), "{}", dead[0].error);
    assert!(inbox.markers("billing").await.unwrap().iter().all(|m| m.event_id.as_str() != "poison-1"));
    assert_eq!(broker.unacknowledged(&Destination::new("t").unwrap(), &ConsumerGroup::new("g").unwrap()), 0);
}

#[tokio::test]
async fn projections_never_move_backward() {
    let inbox = MemoryInbox::default();
    let consumer = Consumer::new(inbox.clone(), Projection, ConsumerConfig::new("view"));
    // One subject, one key: its events are handled in receive order.
    let events = [ev("v1", b"1"), ev("v3", b"3"), ev("v2", b"2"), ev("v3b", b"3")].map(|e| e.with_key("order-1"));
    let (_b, mut sub) = broker_with(&events).await;
    let handled = consumer.drain(sub.as_mut(), WAIT).await.unwrap();
    assert_eq!(
        handled,
        [Handled::Applied, Handled::Applied, Handled::Stale { current: 3 }, Handled::Stale { current: 3 }]
    );
    assert_eq!(table(&inbox, "projection"), ["1", "3"]);
    assert_eq!(inbox.version("view", "order-1"), Some(3));
}

struct Notify(Arc<AtomicU32>);

#[async_trait]
impl Handler<MemoryInbox> for Notify {
    fn effect(&self) -> EffectKind {
        EffectKind::Notification
    }
    async fn apply(&self, _tx: &mut MemoryTx, _event: &Event) -> Result<()> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[tokio::test]
async fn notifications_go_through_the_ledger_and_an_unknown_outcome_is_not_repeated() {
    let inbox = MemoryInbox::default();
    let calls = Arc::new(AtomicU32::new(0));
    let consumer = Consumer::new(inbox.clone(), Notify(calls.clone()), ConsumerConfig::new("mailer"));
    let (_b, mut sub) = broker_with(&[ev("m1", b"hi"), ev("m2", b"hi")]).await;

    // m1: crash after the external call, before "done" committed.
    let d = sub.next(WAIT).await.unwrap().unwrap();
    let mut f = consumer.receive(d);
    f.guard().await.unwrap();
    f.apply().await.unwrap();
    drop(f);
    drop(sub);
    assert_eq!(inbox.ledger("mailer", &EventId::new("m1").unwrap()), outbox_core::LedgerState::Attempted);

    let (_b2, _) = broker_with(&[]).await;
    let mut sub = _b.subscribe(&Destination::new("t").unwrap(), &ConsumerGroup::new("g").unwrap()).await.unwrap();
    let handled = consumer.drain(sub.as_mut(), WAIT).await.unwrap();
    assert!(handled.contains(&Handled::Uncertain) && handled.contains(&Handled::Applied), "{handled:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "m1 once (uncertain, not repeated), m2 once");
    assert_eq!(inbox.ledger("mailer", &EventId::new("m2").unwrap()), outbox_core::LedgerState::Done);
    let dead = inbox.dead_letters("mailer").await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].event.id.as_str(), dead[0].reason), ("m1", DeadLetterReason::Uncertain));
}

#[tokio::test]
async fn acknowledge_before_commit_is_refused() {
    let inbox = MemoryInbox::default();
    let consumer = Consumer::new(inbox.clone(), Credit { fail_first: 0.into() }, ConsumerConfig::new("billing"));
    let (broker, mut sub) = broker_with(&[ev("a", b"1")]).await;
    let d = sub.next(WAIT).await.unwrap().unwrap();
    let mut f = consumer.receive(d);
    f.guard().await.unwrap();
    f.apply().await.unwrap();
    let h = f.acknowledge().await.unwrap();
    assert!(matches!(h, Handled::Retry { .. }), "{h:?}");
    assert!(inbox.table("effects").is_empty() && inbox.markers("billing").await.unwrap().is_empty());
    assert_eq!(broker.unacknowledged(&Destination::new("t").unwrap(), &ConsumerGroup::new("g").unwrap()), 1);
    // The redelivery applies once.
    assert_eq!(consumer.drain(sub.as_mut(), WAIT).await.unwrap(), [Handled::Applied]);
    assert_eq!(inbox.table("effects").len(), 1);
}

#[tokio::test]
async fn pruning_respects_the_checked_retention() {
    let clock = ManualClock::default();
    let inbox = MemoryInbox::new(Arc::new(clock.clone()));
    let hour = Duration::from_secs(3600);
    assert!(Retention::new(hour, 2 * hour, hour).is_err());
    let retention = Retention::new(4 * hour, 2 * hour, hour).unwrap();
    let config = ConsumerConfig::new("billing").with_retention(Some(retention));
    let consumer = Consumer::new(inbox.clone(), Credit { fail_first: 0.into() }, config);
    let (_b, mut sub) = broker_with(&[ev("old", b"1")]).await;
    consumer.drain(sub.as_mut(), WAIT).await.unwrap();
    clock.advance(3 * hour);
    let mut tx = inbox.begin().await.unwrap();
    let _ = inbox
        .mark(&mut tx, "billing", &EventId::new("young").unwrap(), &ev("young", b"1").fingerprint())
        .await
        .unwrap();
    inbox.commit(tx).await.unwrap();
    assert_eq!(consumer.prune_markers().await.unwrap(), 0, "nothing is older than 4h yet");
    clock.advance(hour + Duration::from_secs(1));
    assert_eq!(consumer.prune_markers().await.unwrap(), 1);
    let left: Vec<_> = inbox.markers("billing").await.unwrap().into_iter().map(|m| m.event_id.to_string()).collect();
    assert_eq!(left, ["young"]);
}

#[tokio::test]
async fn a_removed_dead_letter_replays_with_its_full_attempts() {
    let inbox = MemoryInbox::default();
    let config = ConsumerConfig::new("billing").with_max_attempts(2);
    let consumer = Consumer::new(inbox.clone(), Credit { fail_first: 0.into() }, config);
    let poison = ev("p", b"poison").with_key("k").with_header("h", vec![0u8, 0xfe]);
    let (broker, mut sub) = broker_with(std::slice::from_ref(&poison)).await;
    let handled = consumer.drain(sub.as_mut(), WAIT).await.unwrap();
    assert!(matches!(handled.as_slice(), [Handled::Retry { attempts: 1, .. }, Handled::DeadLettered { attempts: 2 }]));
    let dead = inbox.dead_letters("billing").await.unwrap();
    assert_eq!(dead.len(), 1);

    // Replay as an operator would: publish the recorded event, then remove the record.
    broker.publish(&dead[0].event).await.unwrap();
    assert_eq!(inbox.remove_dead_letters("other", &[dead[0].id]).await.unwrap(), 0, "another consumer's id");
    assert_eq!(inbox.remove_dead_letters("billing", &[dead[0].id, dead[0].id + 100]).await.unwrap(), 1);
    assert!(inbox.dead_letters("billing").await.unwrap().is_empty());

    // The replayed delivery counts from 1 again, and is dead-lettered anew after 2 failures.
    let handled = consumer.drain(sub.as_mut(), WAIT).await.unwrap();
    assert!(
        matches!(handled.as_slice(), [Handled::Retry { attempts: 1, .. }, Handled::DeadLettered { attempts: 2 }]),
        "{handled:?}"
    );
    let again = inbox.dead_letters("billing").await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].event, poison);
    assert!(again[0].id > dead[0].id, "a new record with a new id");
}

/// Foreign messages do not slow the stream down: `run` records each as a `malformed` dead letter
/// and goes straight on (a pause of `receive_wait` after each would take 40 s here; the bound is
/// 10 s).
#[tokio::test]
async fn run_records_foreign_messages_and_goes_on_without_pausing() {
    const N: usize = 20;
    let b = MemoryBroker::new();
    let d = Destination::new("t").unwrap();
    let g = ConsumerGroup::new("g").unwrap();
    b.declare(&d, std::slice::from_ref(&g)).await.unwrap();
    for i in 0..N {
        b.publish(&ev(&format!("e{i}"), b"7")).await.unwrap();
        b.publish_raw(&d, vec![(b"junk".to_vec(), format!("foreign {i}").into_bytes())]).unwrap();
    }
    let mut sub = b.subscribe(&d, &g).await.unwrap();
    let inbox = MemoryInbox::new(Arc::new(ManualClock::default()));
    let config = ConsumerConfig::new("c").with_receive_wait(Duration::from_secs(2));
    let consumer = Consumer::new(inbox.clone(), Credit { fail_first: AtomicU32::new(0) }, config);
    let shutdown = outbox_core::Shutdown::default();
    let running = tokio::spawn({
        let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
        async move { consumer.run(sub.as_mut(), &shutdown).await }
    });
    let done = async {
        loop {
            let letters = inbox.dead_letters("c").await.unwrap();
            if table(&inbox, "effects").len() == N && letters.len() == N {
                return letters;
            }
            tokio::task::yield_now().await;
        }
    };
    let letters = tokio::time::timeout(Duration::from_secs(10), done)
        .await
        .expect("20 events and 20 foreign messages were not all handled within 10 s: the runtime pauses");
    shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(10), running).await.expect("run stops").unwrap().unwrap();
    assert!(letters.iter().all(|l| l.reason == DeadLetterReason::Malformed), "{letters:?}");
    let mut kept: Vec<String> = letters
        .iter()
        .map(|l| String::from_utf8_lossy(l.event.headers.get("junk").map_or(&[][..], Vec::as_slice)).into_owned())
        .collect();
    kept.sort();
    let mut expected: Vec<String> = (0..N).map(|i| format!("foreign {i}")).collect();
    expected.sort();
    assert_eq!(kept, expected, "each foreign message recorded once, its raw fields kept");
}
