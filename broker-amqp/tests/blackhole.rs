//! Publishing through a connection that died silently (a "black hole": the TCP connection stays
//! open but no byte flows either way, so no error and no heartbeat miss comes for a long while)
//! never hangs: every publish returns within its bounds with a retryable error, and once the
//! network is back the next publish succeeds on a new connection. Uses fresh exchange and queue
//! names and deletes them when it ends (also when it fails).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use outbox_broker_amqp::{AmqpBroker, AmqpConfig};
use outbox_core::{Broker, ConsumerGroup, Destination, ErrorKind, Event, EventId, Retry};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

mod common;
use common::{server, unique, url};

/// The adapter's confirm and connect timeouts in this test.
const CONFIRM: Duration = Duration::from_secs(1);
const CONNECT: Duration = Duration::from_secs(1);
/// Longest a publish may take on a black-holed connection before the test calls it a hang.
const BOUND: Duration = Duration::from_secs(1 + 1 + 5);
/// Longest wait for an operation on a healthy connection.
const WAIT: Duration = Duration::from_secs(10);
/// Publishes tried after the black hole ends before the test gives up.
const RECOVERY_ATTEMPTS: usize = 5;

/// `url` with its host and port replaced by `addr` (user, vhost and query kept). With `amqps://`
/// the server's certificate would not match 127.0.0.1: this test is for plain `amqp://`.
fn via(url: &str, addr: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").expect("the AMQP URL has a scheme");
    let (authority, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let userinfo = authority.rfind('@').map_or("", |i| &authority[..=i]);
    format!("{scheme}://{userinfo}{addr}{tail}")
}

/// A TCP proxy on 127.0.0.1 with a black-hole switch. While the switch is on, a connection that
/// carries a byte in either direction freezes for good: that byte is dropped, nothing more is read
/// or written, and both sockets stay open (a connection that stays idle throughout resumes). A
/// connection accepted while it is on is frozen at once, never connected upstream. Turning the
/// switch off affects only connections that are not frozen, so a client recovers only by
/// reconnecting. Dropping the proxy aborts its tasks (the connection tasks live in the accept
/// task's `JoinSet`), which closes every socket.
struct BlackHoleProxy {
    addr: SocketAddr,
    hole: Arc<AtomicBool>,
    accept: JoinHandle<()>,
}

impl BlackHoleProxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let hole = Arc::new(AtomicBool::new(false));
        let switch = hole.clone();
        let accept = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                while conns.try_join_next().is_some() {}
                conns.spawn(forward(client, upstream, switch.clone()));
            }
        });
        Self { addr, hole, accept }
    }

    fn black_hole(&self, on: bool) {
        self.hole.store(on, Ordering::SeqCst);
    }
}

impl Drop for BlackHoleProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn forward(client: TcpStream, upstream: SocketAddr, hole: Arc<AtomicBool>) {
    if hole.load(Ordering::SeqCst) {
        // Held open, never answered.
        std::future::pending::<()>().await;
    }
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    tokio::select! {
        () = pump(&client, &server, &hole) => {}
        () = pump(&server, &client, &hole) => {}
    }
}

/// Copy `from` to `to` until either closes; freeze forever once the hole is on.
async fn pump(from: &TcpStream, to: &TcpStream, hole: &AtomicBool) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        from.readable().await.ok();
        let read = from.try_read(&mut buf);
        if hole.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let mut rest = match read {
            Ok(0) => return,
            Ok(n) => &buf[..n],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(_) => return,
        };
        while !rest.is_empty() {
            to.writable().await.ok();
            match to.try_write(rest) {
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
    }
}

/// Deletes the exchange and queue through a direct connection when the test ends, also when it
/// fails.
struct Cleanup {
    config: AmqpConfig,
    destination: Destination,
    group: ConsumerGroup,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (config, destination, groups) = (self.config.clone(), self.destination.clone(), vec![self.group.clone()]);
        // Our runtime may be the one dropping us; clean up on a thread with a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            rt.block_on(async {
                let broker = AmqpBroker::new(config);
                let result = tokio::time::timeout(WAIT, broker.delete(&destination, &groups)).await;
                broker.close().await;
                result
            })
        });
        match cleanup.join() {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => eprintln!("cleanup of {} failed: {e}", self.destination),
            Ok(Err(_)) => eprintln!("cleanup of {} timed out after {WAIT:?}", self.destination),
            Err(_) => eprintln!("cleanup of {} panicked", self.destination),
        }
    }
}

/// `f`, or a panic naming `what` when it takes longer than `limit`.
async fn bounded<T>(what: &str, limit: Duration, f: impl Future<Output = T>) -> T {
    let start = Instant::now();
    let out =
        tokio::time::timeout(limit, f).await.unwrap_or_else(|_| panic!("{what} hung: no result within {limit:?}"));
    eprintln!("{what}: returned after {:?}", start.elapsed());
    out
}

/// One test's world: the proxy, a broker through it and one direct (both with the short
/// timeouts above), a fresh destination and group, deleted when the world drops.
struct World {
    proxy: BlackHoleProxy,
    proxied: AmqpBroker,
    direct: AmqpBroker,
    destination: Destination,
    group: ConsumerGroup,
    _cleanup: Cleanup,
}

async fn world(tag: &str) -> World {
    let upstream = tokio::net::lookup_host(outbox_conformance_tests::service_addr(&url()))
        .await
        .expect("resolve the RabbitMQ address")
        .next()
        .expect("RabbitMQ has an address");
    let proxy = BlackHoleProxy::start(upstream).await;
    let config = |url: &str| {
        AmqpConfig::from_url(url)
            .unwrap()
            .with_exchange_prefix("outbox-test.")
            .unwrap()
            .with_queue_prefix("outbox-test.")
            .unwrap()
            .with_confirm_timeout(CONFIRM)
            .unwrap()
            .with_connect_timeout(CONNECT)
            .unwrap()
    };
    let proxied = AmqpBroker::new(config(&via(&url(), proxy.addr)));
    let direct = AmqpBroker::new(config(&url()));
    let destination = Destination::new(unique(tag)).unwrap();
    let group = ConsumerGroup::new("readers").unwrap();
    let _cleanup = Cleanup { config: direct.config().clone(), destination: destination.clone(), group: group.clone() };
    bounded("declare through the proxy", WAIT, proxied.declare(&destination, std::slice::from_ref(&group)))
        .await
        .expect("declare through the proxy");
    World { proxy, proxied, direct, destination, group, _cleanup }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_connection_never_hangs_a_publish_and_a_new_one_recovers() {
    if !server() {
        return;
    }
    let World { proxy, proxied, direct, destination, group, _cleanup } = world("blackhole").await;
    let event =
        |id: &str| Event::new(EventId::new(id).unwrap(), destination.clone(), format!("payload {id}").into_bytes());
    // What each publish returned, by event id: Ok, or the error's retry class.
    let mut outcomes: HashMap<String, Result<(), Retry>> = HashMap::new();

    bounded("publish before the black hole", WAIT, proxied.publish(&event("before")))
        .await
        .expect("publish before the black hole");
    outcomes.insert("before".into(), Ok(()));
    let depth = bounded("queue_depth", WAIT, direct.queue_depth(&destination, &group)).await.unwrap();
    assert_eq!(depth, 1, "the confirmed event is in the queue");

    proxy.black_hole(true);
    // The publish goes out on the idle confirm channel of the now silent connection; its confirm
    // never comes.
    let err = bounded("publish into the black hole", BOUND, proxied.publish(&event("lost")))
        .await
        .expect_err("a publish into the black hole cannot be confirmed");
    assert_eq!(err.kind(), ErrorKind::Timeout, "no confirm within confirm_timeout: {err}");
    assert_eq!(err.retry(), Retry::OutcomeUnknown, "the message was sent, it may have been routed: {err}");
    eprintln!("  {err}");
    outcomes.insert("lost".into(), Err(err.retry()));

    // That channel was thrown away, so this one opens a channel on the silent connection: the
    // channel.open gets no reply, which gives the connection up. Nothing was sent.
    let err = bounded("second publish into the black hole", BOUND, proxied.publish(&event("unsent")))
        .await
        .expect_err("a publish on a silent connection cannot succeed");
    assert!(
        matches!(err.kind(), ErrorKind::Connection | ErrorKind::Timeout),
        "channel.open / confirm.select got no reply: {err}"
    );
    assert_eq!(err.retry(), Retry::Transient, "nothing was sent: {err}");
    eprintln!("  {err}");
    outcomes.insert("unsent".into(), Err(err.retry()));

    // The connection was given up: the batch reconnects, into the black hole again.
    let batch: Vec<Event> = (0..3).map(|i| event(&format!("batch-{i}"))).collect();
    let results = bounded("publish_batch into the black hole", BOUND, proxied.publish_batch(&batch)).await;
    assert_eq!(results.len(), batch.len());
    for (e, r) in batch.iter().zip(&results) {
        let err = r.as_ref().expect_err("no event of a batch into the black hole is published");
        assert_eq!(err.kind(), ErrorKind::Connection, "event {}: connecting times out: {err}", e.id);
        assert_eq!(err.retry(), Retry::Transient, "event {}: nothing was sent: {err}", e.id);
        eprintln!("  {}: {err}", e.id);
        outcomes.insert(e.id.to_string(), Err(err.retry()));
    }

    proxy.black_hole(false);
    let mut recovered = None;
    for attempt in 1..=RECOVERY_ATTEMPTS {
        let id = format!("after-{attempt}");
        match bounded(&format!("publish #{attempt} after the black hole"), BOUND, proxied.publish(&event(&id))).await {
            Ok(()) => {
                outcomes.insert(id, Ok(()));
                recovered = Some(attempt);
                break;
            }
            Err(e) => {
                assert!(!e.is_permanent(), "a lost connection is never a permanent error: {e}");
                outcomes.insert(id, Err(e.retry()));
            }
        }
    }
    let recovered = recovered
        .unwrap_or_else(|| panic!("no publish succeeded in {RECOVERY_ATTEMPTS} attempts after the black hole ended"));
    eprintln!("recovered at attempt {recovered}");

    // Durable state, read through a direct connection: every Ok event is in the queue exactly
    // once, no event whose error was transient (nothing sent) is, and an outcome-unknown one may
    // or may not be.
    let depth = bounded("queue_depth", WAIT, direct.queue_depth(&destination, &group)).await.unwrap() as usize;
    let mut sub = bounded("subscribe directly", WAIT, direct.subscribe(&destination, &group)).await.unwrap();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for i in 0..depth {
        let d = sub.next(WAIT).await.unwrap().unwrap_or_else(|| panic!("message {} of {depth} within {WAIT:?}", i + 1));
        *seen.entry(d.event.id.to_string()).or_default() += 1;
        d.ack().await.unwrap();
    }
    drop(sub);
    for (id, outcome) in &outcomes {
        let copies = seen.get(id).copied().unwrap_or(0);
        match outcome {
            Ok(()) => assert_eq!(copies, 1, "event {id} was confirmed: it is in the queue exactly once"),
            Err(Retry::OutcomeUnknown) => assert!(copies <= 1, "event {id}: at most once ({copies})"),
            Err(retry) => assert_eq!(copies, 0, "event {id} failed {retry:?}: nothing was sent"),
        }
    }
    for id in seen.keys() {
        assert!(outcomes.contains_key(id), "the queue holds an event nobody published: {id}");
    }
    bounded("closing the proxied broker", WAIT, proxied.close()).await;
    bounded("closing the direct broker", WAIT, direct.close()).await;
}

/// Closing a broker whose connections died silently returns within the connect timeout (the
/// close handshake's reply never comes), so a relay's shutdown cannot hang on it; the event
/// confirmed before the black hole is in the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_black_holed_broker_never_hangs() {
    if !server() {
        return;
    }
    let World { proxy, proxied, direct, destination, group, _cleanup } = world("close").await;
    // Both connections (publish and consume) open, so `close` has two handshakes to give up.
    bounded("connect through the proxy", WAIT, proxied.connect()).await.expect("connect through the proxy");
    let event = Event::new(EventId::new("before-close").unwrap(), destination.clone(), b"x".to_vec());
    bounded("publish before the black hole", WAIT, proxied.publish(&event))
        .await
        .expect("publish before the black hole");

    proxy.black_hole(true);
    bounded("closing the black-holed broker", BOUND, proxied.close()).await;

    let depth = bounded("queue_depth", WAIT, direct.queue_depth(&destination, &group)).await.unwrap();
    assert_eq!(depth, 1, "the event confirmed before the black hole is in the queue");
    bounded("closing the direct broker", WAIT, direct.close()).await;
}
