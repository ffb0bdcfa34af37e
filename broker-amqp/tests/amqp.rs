//! The adapter against a real RabbitMQ. Each test uses fresh exchange and queue names and
//! deletes them when it ends (also when it fails).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_broker_amqp::{AmqpBroker, AmqpConfig, QueueType};
use outbox_core::InboxAdmin;
use outbox_core::memory::{MemoryInbox, MemoryOutbox};
use outbox_core::{
    Backoff, Broker, ConsumerGroup, Delivery, Destination, ErrorKind, Event, EventId, Inbox, MarkOutcome, OutboxStore,
    Relay, RelayConfig, Retry, RowStatus, Subscription, SystemClock,
};

mod common;
use common::{server, unique, url};

const WAIT: Duration = Duration::from_secs(10);
/// How long a test waits to conclude that nothing more arrives.
const QUIET: Duration = Duration::from_millis(1500);

/// A broker with its own names; deletes its exchange and queues on drop.
struct Fixture {
    broker: AmqpBroker,
    destination: Destination,
    groups: Vec<ConsumerGroup>,
}

impl Fixture {
    fn new(tag: &str, groups: &[&str]) -> Self {
        Self::with_config(tag, groups, |c| c)
    }

    fn with_config(tag: &str, groups: &[&str], adjust: impl FnOnce(AmqpConfig) -> AmqpConfig) -> Self {
        let config = AmqpConfig::from_url(&url())
            .unwrap()
            .with_exchange_prefix("outbox-test.")
            .unwrap()
            .with_queue_prefix("outbox-test.")
            .unwrap();
        Self {
            broker: AmqpBroker::new(adjust(config)),
            destination: Destination::new(unique(tag)).unwrap(),
            groups: groups.iter().map(|g| ConsumerGroup::new(*g).unwrap()).collect(),
        }
    }

    fn group(&self, i: usize) -> &ConsumerGroup {
        &self.groups[i]
    }

    async fn declare(&self) {
        self.broker.declare(&self.destination, &self.groups).await.unwrap();
    }

    async fn subscribe(&self, group: usize) -> Box<dyn Subscription> {
        self.broker.subscribe(&self.destination, self.group(group)).await.unwrap()
    }

    fn event(&self, id: &str) -> Event {
        Event::new(EventId::new(id).unwrap(), self.destination.clone(), format!("payload of {id}").into_bytes())
    }

    async fn depth(&self, group: usize) -> u32 {
        self.broker.queue_depth(&self.destination, self.group(group)).await.unwrap()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let config = self.broker.config().clone();
        let destination = self.destination.clone();
        let groups = self.groups.clone();
        // Our runtime may be the one dropping us; clean up on a thread with a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            rt.block_on(async {
                let broker = AmqpBroker::new(config);
                let result = broker.delete(&destination, &groups).await;
                broker.close().await;
                result
            })
        });
        match cleanup.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("cleanup of {} failed: {e}", self.destination),
            Err(_) => eprintln!("cleanup of {} panicked", self.destination),
        }
    }
}

async fn next(sub: &mut Box<dyn Subscription>) -> Delivery {
    sub.next(WAIT).await.unwrap().expect("a delivery within the wait")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_is_byte_for_byte() {
    if !server() {
        return;
    }
    let fx = Fixture::new("roundtrip", &["g"]);
    fx.declare().await;
    let event = Event::new(
        EventId::new("evt/1:no-space~!#").unwrap(),
        fx.destination.clone(),
        vec![0u8, b'a', 0xff, 0xfe, 0, 0x80, 0xc3, 0x28, 0],
    )
    .with_key("customer-7.eu")
    .with_header("bin", vec![0u8, 0xff, 0, 0xc0, 0xaf])
    .with_header("empty", Vec::new())
    .with_header("trace-id", b"abc-123".to_vec());
    fx.broker.publish(&event).await.unwrap();
    assert_eq!(fx.depth(0).await, 1, "the confirmed message is in the group's queue");

    let mut sub = fx.subscribe(0).await;
    let d = next(&mut sub).await;
    assert_eq!(d.event, event, "id, destination, key, headers and payload arrive unchanged");
    assert_eq!(d.event.fingerprint(), event.fingerprint());
    assert!(!d.redelivered);
    assert_eq!(d.attempt, None, "classic queues keep no delivery count");
    d.ack().await.unwrap();
    assert!(sub.next(QUIET).await.unwrap().is_none());
    assert_eq!(fx.depth(0).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wire_format_seen_by_a_plain_amqp_client() {
    use lapin::options::BasicGetOptions;
    use lapin::types::AMQPValue;
    if !server() {
        return;
    }
    let fx = Fixture::new("wire", &["g"]);
    fx.declare().await;
    let event = fx.event("wire-1").with_key("k-1").with_header("bin", vec![0u8, 0xff, 0]);
    fx.broker.publish(&event).await.unwrap();

    let conn = lapin::Connection::connect(&url(), lapin::ConnectionProperties::default()).await.unwrap();
    let channel = conn.create_channel().await.unwrap();
    let queue = fx.broker.config().queue_name(&fx.destination, fx.group(0)).unwrap();
    let msg = channel.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap().unwrap();
    let props = &msg.delivery.properties;
    assert_eq!(props.message_id().as_ref().map(|m| m.as_str()), Some("wire-1"), "event id is the message_id");
    assert_eq!(props.delivery_mode(), &Some(2), "persistent");
    assert_eq!(msg.delivery.data, event.payload);
    assert_eq!(msg.delivery.exchange.as_str(), format!("outbox-test.{}", fx.destination));
    assert_eq!(msg.delivery.routing_key.as_str(), fx.destination.as_str());
    let headers = props.headers().as_ref().unwrap().inner();
    let bytes = |name: &str| match headers.get(name) {
        Some(AMQPValue::LongString(s)) => s.as_bytes().to_vec(),
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(bytes("x-outbox-key"), b"k-1");
    assert_eq!(bytes("bin"), vec![0u8, 0xff, 0]);
    conn.close(200, "OK".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_without_a_binding_is_unroutable() {
    if !server() {
        return;
    }
    let fx = Fixture::new("nobinding", &[]);
    fx.declare().await; // the exchange only: no queue is bound
    let err = fx.broker.publish(&fx.event("lost-1")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unroutable, "{err}");
    assert_eq!(err.retry(), Retry::Transient);
    assert!(err.to_string().contains("unroutable"), "{err}");

    // An exchange that does not exist at all: also unroutable.
    let missing =
        Event::new(EventId::new("lost-2").unwrap(), Destination::new(unique("nothing")).unwrap(), b"x".to_vec());
    let err = fx.broker.publish(&missing).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unroutable, "{err}");
    assert!(err.is_transient());

    // The broker is still usable afterwards, and a bound queue gets only later messages.
    let bound = Fixture::new("nobinding-then-bound", &["g"]);
    bound.declare().await;
    bound.broker.publish(&bound.event("ok-1")).await.unwrap();
    assert_eq!(bound.depth(0).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_does_not_mark_an_unroutable_row_published() {
    if !server() {
        return;
    }
    let fx = Fixture::new("relay", &["g"]);
    // The exchange exists, but no queue is bound to it yet.
    fx.broker.declare(&fx.destination, &[]).await.unwrap();
    let store = Arc::new(MemoryOutbox::new(Arc::new(SystemClock)));
    store.enqueue(&[fx.event("row-1")]).await.unwrap();
    let config = RelayConfig::new("relay-amqp-test").with_backoff(Backoff::none()).with_seed(Some(7));
    let relay = Relay::new(store.clone(), Arc::new(fx.broker.clone()), config);

    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.published, report.retried, report.parked), (1, 0, 1, 0), "{report:?}");
    let rows = outbox_core::store::all_rows(store.as_ref()).await.unwrap();
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(row.status, RowStatus::Pending, "{row:?}");
    assert_eq!(row.attempts, 1);
    assert_eq!(row.published_token, None);
    let last_error = row.last_error.as_deref().unwrap_or_default();
    assert!(last_error.contains("unroutable"), "{last_error}");

    // Nothing reached any queue: bind the group now and look.
    fx.declare().await;
    assert_eq!(fx.depth(0).await, 0, "RabbitMQ dropped nothing into a queue");

    // Once routable, the same row is published and is in the queue exactly once.
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.published), (1, 1), "{report:?}");
    let row = &outbox_core::store::all_rows(store.as_ref()).await.unwrap()[0];
    assert_eq!(row.status, RowStatus::Published);
    assert_eq!(fx.depth(0).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_delivery_returns_to_another_member_when_its_subscription_drops() {
    if !server() {
        return;
    }
    let fx = Fixture::new("redeliver", &["g"]);
    fx.declare().await;
    let mut first = fx.subscribe(0).await;
    let event = fx.event("e-unacked");
    fx.broker.publish(&event).await.unwrap();
    let d = next(&mut first).await;
    assert_eq!(d.event, event);
    assert!(!d.redelivered);

    let mut second = fx.subscribe(0).await;
    assert!(second.next(Duration::from_millis(300)).await.unwrap().is_none(), "held by the first member");
    drop(first); // goes away without acknowledging; `d` is still in our hands
    let again = next(&mut second).await;
    assert_eq!(again.event, event);
    assert!(again.redelivered, "RabbitMQ flags the redelivery");

    // The stale delivery of the dropped member can no longer be acknowledged.
    let err = d.ack().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
    assert!(err.is_transient());

    again.ack().await.unwrap();
    assert!(second.next(QUIET).await.unwrap().is_none());
    assert_eq!(fx.depth(0).await, 0);
}

/// Dropping a subscription cancels its consumer and closes its channel. If the channel's close
/// overtook the `basic.cancel`, RabbitMQ would answer the late cancel with a connection error
/// (504 "expected 'channel.open'") and take down every other subscription of the broker, which
/// all share one consuming connection. The race is narrow: many rounds, each dropping a member
/// that holds a delivery while a sibling keeps consuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_subscription_leaves_its_siblings_on_the_connection_alone() {
    if !server() {
        return;
    }
    const ROUNDS: usize = 300;
    let fx = Fixture::new("drop-sibling", &["a", "b"]);
    fx.declare().await;
    let mut a = fx.subscribe(0).await;
    for i in 0..ROUNDS {
        let mut b = fx.subscribe(1).await;
        let event = fx.event(&format!("e{i}"));
        fx.broker.publish(&event).await.unwrap();
        let held = next(&mut b).await;
        drop(b); // goes away holding `held` unacknowledged
        drop(held);
        let d = a.next(WAIT).await.unwrap_or_else(|e| panic!("round {i}: the sibling subscription broke: {e}"));
        let d = d.expect("a delivery within the wait");
        assert_eq!(d.event, event);
        d.ack().await.unwrap_or_else(|e| panic!("round {i}: ack on the sibling failed: {e}"));
    }
    assert!(a.next(QUIET).await.unwrap().is_none());
    // Every round's message is back in b's queue, none was lost with a broken connection.
    let mut b = fx.subscribe(1).await;
    let mut ids = BTreeSet::new();
    while let Some(d) = b.next(QUIET).await.unwrap() {
        ids.insert(d.event.id.to_string());
        d.ack().await.unwrap();
    }
    assert_eq!(ids.len(), ROUNDS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_delivery_is_not_redelivered() {
    if !server() {
        return;
    }
    let fx = Fixture::new("acked", &["g"]);
    fx.declare().await;
    fx.broker.publish(&fx.event("e-acked")).await.unwrap();
    let mut first = fx.subscribe(0).await;
    next(&mut first).await.ack().await.unwrap();
    drop(first);
    let mut second = fx.subscribe(0).await;
    assert!(second.next(QUIET).await.unwrap().is_none(), "an acknowledged message never comes back");
    assert_eq!(fx.depth(0).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_redelivers() {
    if !server() {
        return;
    }
    let fx = Fixture::new("nack", &["g"]);
    fx.declare().await;
    let mut sub = fx.subscribe(0).await;
    let event = fx.event("e-nacked");
    fx.broker.publish(&event).await.unwrap();
    let d = next(&mut sub).await;
    assert!(!d.redelivered);
    d.nack().await.unwrap();
    let d = next(&mut sub).await;
    assert_eq!(d.event, event);
    assert!(d.redelivered);
    d.ack().await.unwrap();
    assert!(sub.next(QUIET).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queue_delivery_count_is_the_attempt() {
    if !server() {
        return;
    }
    let fx = Fixture::with_config("quorum", &["g"], |c| c.with_queue_type(QueueType::Quorum));
    fx.declare().await;
    fx.declare().await; // idempotent, also for quorum arguments
    let event = fx.event("e-quorum");
    fx.broker.publish(&event).await.unwrap();
    let mut sub = fx.subscribe(0).await;
    let d = next(&mut sub).await;
    assert_eq!((d.redelivered, d.attempt), (false, Some(1)));
    d.nack().await.unwrap();
    let d = next(&mut sub).await;
    assert!(d.redelivered);
    let second = d.attempt.unwrap();
    assert!(second >= 2, "attempt {second}");
    // Going away without an ack also counts.
    let mut other = fx.subscribe(0).await;
    drop(sub);
    let d = next(&mut other).await;
    assert_eq!(d.event, event);
    let third = d.attempt.unwrap();
    assert!(third >= 2 && third >= second, "attempt {third} after {second}");
    eprintln!("quorum attempts: 1, {second}, {third}");
    d.ack().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_a_quick_transient_connection_error() {
    let config = AmqpConfig::from_url("amqp://guest:s3cret-pw@127.0.0.1:1/%2f").unwrap();
    let broker = AmqpBroker::new(config);
    let dest = Destination::new("nowhere").unwrap();
    let started = Instant::now();
    let err = broker.publish(&Event::new(EventId::new("x").unwrap(), dest.clone(), b"x".to_vec())).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    assert_eq!(err.retry(), Retry::Transient);
    assert_eq!(err.backend(), "amqp");
    assert!(!format!("{err} {err:?}").contains("s3cret-pw"), "{err:?}");
    let group = ConsumerGroup::new("g").unwrap();
    let err = broker.subscribe(&dest, &group).await.err().expect("subscribe fails");
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    assert!(err.is_transient());
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
    eprintln!("unreachable server reported after {elapsed:?}");
}

#[test]
fn debug_and_display_hide_the_password() {
    let config =
        AmqpConfig::from_url("amqp://outbox:pa%24%24-w0rd@rabbit.internal:5672/%2f?outbox_prefetch=4").unwrap();
    let broker = AmqpBroker::new(config.clone());
    for shown in [format!("{config}"), format!("{config:?}"), format!("{broker:?}"), config.redacted_url()] {
        assert!(!shown.contains("w0rd") && !shown.contains("pa%24%24"), "{shown}");
        assert!(shown.contains("outbox:***@rabbit.internal"), "{shown}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishes_are_all_confirmed_and_queued() {
    if !server() {
        return;
    }
    const N: usize = 200;
    let fx = Fixture::new("concurrent", &["g"]);
    fx.declare().await;
    let started = Instant::now();
    let publishes = (0..N).map(|i| {
        let broker = fx.broker.clone();
        let event = fx.event(&format!("c-{i}"));
        async move { broker.publish(&event).await }
    });
    let results = futures::future::join_all(publishes).await;
    let elapsed = started.elapsed();
    for r in &results {
        r.as_ref().unwrap();
    }
    eprintln!(
        "{N} concurrent confirmed publishes in {elapsed:?} ({:.0}/s, {} channels)",
        N as f64 / elapsed.as_secs_f64(),
        fx.broker.config().publish_channels()
    );
    assert_eq!(fx.depth(0).await, N as u32);

    let mut sub = fx.subscribe(0).await;
    let mut seen = BTreeSet::new();
    while seen.len() < N {
        let d = next(&mut sub).await;
        assert!(seen.insert(d.event.id.to_string()), "duplicate {}", d.event.id);
        d.ack().await.unwrap();
    }
    let expected: BTreeSet<String> = (0..N).map(|i| format!("c-{i}")).collect();
    assert_eq!(seen, expected);
    assert!(sub.next(QUIET).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivery_after_a_committed_effect_applies_nothing_twice() {
    if !server() {
        return;
    }
    let fx = Fixture::new("inbox", &["g"]);
    fx.declare().await;
    let inbox = MemoryInbox::default();
    let event = fx.event("credit-7");
    fx.broker.publish(&event).await.unwrap();

    // Consumer 1 commits marker and effect together, then goes away before acknowledging.
    let mut one = fx.subscribe(0).await;
    let d = next(&mut one).await;
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(inbox.mark(&mut tx, "billing", &d.event.id, &d.event.fingerprint()).await.unwrap(), MarkOutcome::New);
    tx.insert("effects", d.event.payload.clone());
    inbox.commit(tx).await.unwrap();
    drop(d);
    drop(one);

    // Consumer 2 gets the redelivery; the marker says it was done.
    let mut two = fx.subscribe(0).await;
    let d = next(&mut two).await;
    assert!(d.redelivered);
    assert_eq!(d.event, event);
    let mut tx = inbox.begin().await.unwrap();
    let outcome = inbox.mark(&mut tx, "billing", &d.event.id, &d.event.fingerprint()).await.unwrap();
    assert_eq!(outcome, MarkOutcome::Duplicate);
    inbox.commit(tx).await.unwrap();
    d.ack().await.unwrap();

    assert_eq!(inbox.table("effects"), vec![event.payload.clone()], "exactly one effect");
    assert_eq!(inbox.markers("billing").await.unwrap().len(), 1);
    assert!(two.next(QUIET).await.unwrap().is_none());
    assert_eq!(fx.depth(0).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_is_idempotent_and_keeps_messages() {
    if !server() {
        return;
    }
    let fx = Fixture::new("idempotent", &["a", "b"]);
    fx.declare().await;
    fx.broker.publish(&fx.event("kept")).await.unwrap();
    fx.declare().await;
    assert_eq!((fx.depth(0).await, fx.depth(1).await), (1, 1), "each group got its copy and kept it");

    // With declare_topology off, a missing queue is reported, not created.
    let passive = Fixture::with_config("passive", &["g"], |c| c.with_declare_topology(false));
    let err = passive.broker.subscribe(&passive.destination, passive.group(0)).await.err().expect("subscribe fails");
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.is_transient());
    assert!(err.to_string().contains("does not exist"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_declaration_is_a_permanent_config_error() {
    if !server() {
        return;
    }
    let classic = Fixture::new("conflict", &["g"]);
    classic.declare().await;
    let quorum = AmqpBroker::new(classic.broker.config().clone().with_queue_type(QueueType::Quorum));
    let err = quorum.declare(&classic.destination, &classic.groups).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.is_permanent());
    // The failed declaration closed only its own channel: publishing still works.
    classic.broker.publish(&classic.event("after-conflict")).await.unwrap();
    assert_eq!(classic.depth(0).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_after_the_server_closes_the_connections() {
    if !server() {
        return;
    }
    if std::process::Command::new("rabbitmqctl").arg("--help").output().is_err() {
        eprintln!("SKIPPED: rabbitmqctl is not installed; cannot close connections from the server side");
        return;
    }
    let name = unique("conn");
    let fx = Fixture::with_config("reconnect", &["g"], |c| c.with_connection_name(name.clone()));
    fx.declare().await;
    let mut sub = fx.subscribe(0).await;
    fx.broker.publish(&fx.event("before")).await.unwrap();
    let d = next(&mut sub).await;
    d.ack().await.unwrap();

    let closed = close_connections_named(&name);
    assert_eq!(closed, 2, "the publishing and the consuming connection");

    // The subscription reports the loss once, as a transient connection error...
    let deadline = Instant::now() + WAIT;
    let err = loop {
        match sub.next(Duration::from_millis(200)).await {
            Err(e) => break e,
            Ok(None) if Instant::now() < deadline => continue,
            other => panic!("expected the connection loss, got {other:?}"),
        }
    };
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    assert!(err.is_transient());

    // ...and the next operations reconnect.
    fx.broker.publish(&fx.event("after")).await.unwrap();
    let d = next(&mut sub).await;
    assert_eq!(d.event.id.as_str(), "after");
    d.ack().await.unwrap();
}

/// Close, from the server side, every connection whose name starts with `name`; returns how many.
fn close_connections_named(name: &str) -> usize {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["list_connections", "-q", "--no-table-headers", "pid", "client_properties"])
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    let mut closed = 0;
    for line in listing.lines().filter(|l| l.contains(name)) {
        let Some(pid) = line.split_whitespace().next() else { continue };
        let status = std::process::Command::new("rabbitmqctl")
            .args(["close_connection", pid, "closed by the outbox reconnect test"])
            .status()
            .unwrap();
        assert!(status.success());
        closed += 1;
    }
    closed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_routable_and_unroutable_publishes_are_told_apart() {
    if !server() {
        return;
    }
    const N: usize = 100;
    let bound = Fixture::new("mixed-bound", &["g"]);
    bound.declare().await;
    let unbound = Fixture::new("mixed-unbound", &[]);
    unbound.declare().await;
    // One broker publishes to both, so returns and confirms of both kinds share its channels.
    let broker = bound.broker.clone();
    let publishes = (0..N).map(|i| {
        let broker = broker.clone();
        let event = if i.is_multiple_of(2) { bound.event(&format!("b-{i}")) } else { unbound.event(&format!("u-{i}")) };
        async move { (i, broker.publish(&event).await) }
    });
    for (i, result) in futures::future::join_all(publishes).await {
        if i.is_multiple_of(2) {
            result.unwrap_or_else(|e| panic!("routable message {i} reported as failed: {e}"));
        } else {
            let err = result.err().unwrap_or_else(|| panic!("unroutable message {i} reported as routed"));
            assert_eq!(err.kind(), ErrorKind::Unroutable, "{i}: {err}");
        }
    }
    assert_eq!(bound.depth(0).await, (N / 2) as u32);
}

/// The server-side ids of the connections whose name starts with `name`, or `None` without
/// `rabbitmqctl`.
fn connection_pids(name: &str) -> Option<BTreeSet<String>> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["list_connections", "-q", "--no-table-headers", "pid", "client_properties"])
        .output()
        .ok()?;
    let listing = String::from_utf8_lossy(&out.stdout);
    Some(
        listing
            .lines()
            .filter(|l| l.contains(name))
            .filter_map(|l| l.split_whitespace().next())
            .map(String::from)
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_header_beyond_frame_max_is_refused_unsent_and_the_connection_survives() {
    if !server() {
        return;
    }
    // RabbitMQ answers a frame over the negotiated frame_max with FRAME_ERROR and closes the
    // whole connection. A small frame_max makes a header within the outbox's own limit too big.
    const FRAME_MAX: usize = 8192;
    let sep = if url().contains('?') { '&' } else { '?' };
    let name = unique("frame");
    let config = AmqpConfig::from_url(&format!("{}{sep}frame_max={FRAME_MAX}", url()))
        .unwrap()
        .with_exchange_prefix("outbox-test.")
        .unwrap()
        .with_queue_prefix("outbox-test.")
        .unwrap()
        .with_connection_name(name.clone());
    let fx = Fixture {
        broker: AmqpBroker::new(config),
        destination: Destination::new(unique("frame")).unwrap(),
        groups: vec![ConsumerGroup::new("g").unwrap()],
    };
    fx.declare().await;
    let mut sub = fx.subscribe(0).await;
    fx.broker.publish(&fx.event("first")).await.unwrap();
    assert_eq!(next(&mut sub).await.event.id.as_str(), "first");
    let before = connection_pids(&name);

    // The content-header frame of an event with id "at-limit" (8 bytes), no key and one header
    // "h" of v bytes: frame envelope 8 + class/weight/size/flags 14 + delivery mode 1 +
    // message_id 1+8 + table (4 + "h" entry 1+1+1+4+v + x-outbox-headers entry 1+16+1+(4+1+4+1))
    // = 71 + v bytes.
    let value_at_limit = FRAME_MAX - 71;
    let over = fx.event("over-limit").with_header("h", vec![b'x'; value_at_limit + 1]);
    let err = fx.broker.publish(&over).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert_eq!(err.retry(), Retry::Permanent, "{err}");
    assert!(err.message().contains("over-limit") && err.message().contains("8192"), "{err}");

    // Exactly at the limit: sent, and the server takes it (the size computation is exact).
    let at = Event::new(EventId::new("at-limit").unwrap(), fx.destination.clone(), b"p".to_vec())
        .with_header("h", vec![b'y'; value_at_limit]);
    fx.broker.publish(&at).await.unwrap();
    let d = next(&mut sub).await;
    assert_eq!(d.event, at, "the event at the limit arrives whole; the oversized one never does");
    d.ack().await.unwrap();
    assert!(sub.next(QUIET).await.unwrap().is_none(), "nothing else arrives");

    if let (Some(before), Some(after)) = (before, connection_pids(&name)) {
        assert_eq!(before.len(), 2, "a publishing and a consuming connection: {before:?}");
        assert_eq!(before, after, "the refused publish must not cost a connection");
    } else {
        eprintln!("rabbitmqctl is not installed; connection identity not checked");
    }
}
