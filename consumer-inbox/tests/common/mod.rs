//! Test tools shared by the runtime's test files: a subscription that logs acknowledgements, a
//! gauge of concurrent handler calls, a seeded generator and bounded waits.
#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_consumer_inbox::{Consumer, Handler};
use outbox_core::memory::MemoryBroker;
use outbox_core::{
    Acknowledge, Broker, ConsumerGroup, Delivery, Destination, Event, Inbox, Received, Result, Shutdown, Subscription,
};

/// Longest any wait in these tests may take before it fails the test.
pub const BOUND: Duration = Duration::from_secs(10);

/// An ordered log of what handlers and acknowledgements did, shared across tasks.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    pub fn push(&self, line: String) {
        self.0.lock().unwrap().push(line);
    }
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    pub fn position(&self, line: &str) -> Option<usize> {
        self.0.lock().unwrap().iter().position(|l| l == line)
    }
}

/// The label a test event goes by in the log: its payload as text.
pub fn label(event: &Event) -> String {
    String::from_utf8_lossy(&event.payload).into_owned()
}

/// Wraps a subscription so that every acknowledgement of an event is logged (`ack <label>`,
/// `nack <label>`) once the broker accepted it.
pub struct Recording {
    pub inner: Box<dyn Subscription>,
    pub log: Log,
}

struct LoggedAck {
    inner: Box<dyn Acknowledge>,
    label: String,
    log: Log,
}

#[async_trait]
impl Acknowledge for LoggedAck {
    async fn ack(self: Box<Self>) -> Result<()> {
        self.inner.ack().await?;
        self.log.push(format!("ack {}", self.label));
        Ok(())
    }
    async fn nack(self: Box<Self>) -> Result<()> {
        self.inner.nack().await?;
        self.log.push(format!("nack {}", self.label));
        Ok(())
    }
}

#[async_trait]
impl Subscription for Recording {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        Ok(match self.inner.receive(wait).await? {
            Some(Received::Event(d)) => {
                let (redelivered, attempt) = (d.redelivered, d.attempt);
                let (event, acker) = d.into_parts();
                let ack = LoggedAck { inner: acker, label: label(&event), log: self.log.clone() };
                Some(Received::Event(Delivery::new(event, redelivered, attempt, Box::new(ack))))
            }
            other => other,
        })
    }
}

/// How many handler calls run at once, and the most seen.
#[derive(Clone, Default)]
pub struct Gauge(Arc<(AtomicUsize, AtomicUsize)>);

impl Gauge {
    pub fn enter(&self) {
        let now = self.0.0.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.1.fetch_max(now, Ordering::SeqCst);
    }
    pub fn leave(&self) {
        self.0.0.fetch_sub(1, Ordering::SeqCst);
    }
    pub fn max(&self) -> usize {
        self.0.1.load(Ordering::SeqCst)
    }
    pub fn now(&self) -> usize {
        self.0.0.load(Ordering::SeqCst)
    }
}

/// SplitMix64, for seeded handler schedules.
pub struct Rng(u64);

impl Rng {
    /// From `OUTBOX_TEST_SEED` when set, else from the clock; prints the seed so that a failing
    /// run replays with `OUTBOX_TEST_SEED=<seed>`.
    pub fn seeded(test: &str) -> Self {
        let seed = std::env::var("OUTBOX_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
        });
        println!("{test}: seed {seed} (replay with OUTBOX_TEST_SEED={seed})");
        Self(seed)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n.max(1)
    }
}

pub fn dest() -> Destination {
    Destination::new("t").unwrap()
}

pub fn group() -> ConsumerGroup {
    ConsumerGroup::new("g").unwrap()
}

/// A memory broker with `events` published to `t` for group `g`.
pub async fn memory_broker(events: &[Event]) -> MemoryBroker {
    let b = MemoryBroker::new();
    b.declare(&dest(), &[group()]).await.unwrap();
    for e in events {
        b.publish(e).await.unwrap();
    }
    b
}

/// Wait until `cond` holds, checking every millisecond (a poll interval, not a wait for time to
/// pass); fails the test with `what` after [`BOUND`].
pub async fn wait_until<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let waited = tokio::time::timeout(BOUND, async {
        while !cond().await {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "not within {BOUND:?}: {what}");
}

/// [`Consumer::run`] on a new subscription of a broker, in a task of its own, until
/// [`stop`](Running::stop).
pub struct Running {
    shutdown: Shutdown,
    task: tokio::task::JoinHandle<Box<dyn Subscription>>,
}

impl Running {
    /// Subscribe `consumer` to [`dest`] as [`group`] on `broker` and run it.
    pub async fn start<I: Inbox, H: Handler<I> + 'static>(consumer: &Consumer<I, H>, broker: &MemoryBroker) -> Self {
        let shutdown = Shutdown::default();
        let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
        let task = tokio::spawn({
            let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
            async move {
                consumer.run(sub.as_mut(), &shutdown).await.unwrap();
                sub
            }
        });
        Self { shutdown, task }
    }

    /// Wait (bounded) until `n` deliveries are inside the handler measured by `gauge`.
    pub async fn wait_inside(&self, gauge: &Gauge, n: usize, what: &str) {
        wait_until(what, || {
            let g = gauge.clone();
            async move { g.now() == n }
        })
        .await;
    }

    /// Trigger the shutdown; `run` then lets its running deliveries finish within the grace.
    pub fn trigger(&self) {
        self.shutdown.trigger();
    }

    /// Wait (bounded by [`BOUND`]) for `run` to return; its subscription is handed back.
    pub async fn stopped(self, what: &str) -> Box<dyn Subscription> {
        tokio::time::timeout(BOUND, self.task).await.expect(what).unwrap()
    }
}
