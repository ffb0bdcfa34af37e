//! Many deliveries in flight, one key at a time.
//!
//! One delivery at a time leaves the consumer waiting on round trips: the store's (begin, guard,
//! effect, commit) and the broker's (ack). Handling several at once hides that latency, but two
//! events of one key (one aggregate) must still take effect in the order they were received, or
//! a later state change could commit before an earlier one. So deliveries are put in *lanes*:
//! one lane per event key, and one per event id (so that two copies of one event, even with
//! different keys as in a conflict, are handled one after the other by this member, the first
//! received first). A lane runs one delivery at a time, and a delivery starts only after the
//! ones before it in its lanes were acknowledged or negatively acknowledged. Different lanes
//! run concurrently, up to
//! [`ConsumerConfig::max_in_flight`](crate::ConsumerConfig::max_in_flight) deliveries held in
//! total (running or waiting for their lane).
//!
//! Everything runs on the caller's task. That keeps the runtime free of `'static` bounds on
//! handlers and, above all, never cancels a pending [`Subscription::receive`] (not every adapter
//! can take a receive back once its request went out): the one receive in progress is kept
//! across wake-ups and only ever polled to completion. Stopping is therefore "stop asking for
//! more, finish what is held": after a shutdown (or, in a drain, an error) no new receive is
//! started and no waiting delivery is started; running ones finish, within the grace period of
//! [`Consumer::run`]. Whatever is dropped unfinished was never acknowledged and comes back.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use outbox_core::{Delivery, Error, Inbox, Received, Result, Shutdown, Subscription};
use tracing::{debug, warn};

use crate::effect::Handler;
use crate::runtime::{Consumer, Handled};

/// A queue that deliveries go through one at a time.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Lane {
    Key(String),
    Id(String),
}

/// The lanes of a delivery: its event id's, and its key's when it has one. A message that is
/// not an event has none and is independent of everything.
fn lanes_of(r: &Received) -> Vec<Lane> {
    match r {
        Received::Event(d) => {
            let mut lanes = vec![Lane::Id(d.event.id.to_string())];
            if let Some(k) = &d.event.key {
                lanes.push(Lane::Key(k.clone()));
            }
            lanes
        }
        Received::Foreign(_) => Vec::new(),
    }
}

struct Finished {
    seq: u64,
    lanes: Vec<Lane>,
    result: Result<Handled>,
}

/// What one running future settles: one delivery, or a batch committed together.
type Work<'a> = Pin<Box<dyn Future<Output = Vec<Finished>> + Send + 'a>>;
type Recv<'s> = Pin<Box<dyn Future<Output = (&'s mut (dyn Subscription + 's), Result<Option<Received>>)> + Send + 's>>;

/// Deliveries held by this member: running, ready for the next batch transaction, or waiting
/// for the deliveries before them in their lanes.
///
/// Each lane is a queue of receive numbers; a delivery runs when it is at the front of every
/// lane it is in. The oldest waiting delivery is always at the front of all of its lanes (every
/// one before it in a lane is older and already gone or running), so lanes never deadlock.
///
/// With batch commit ([`ConsumerConfig::max_per_commit`](crate::ConsumerConfig::max_per_commit) above 1)
/// a delivery at the front of its lanes is *ready*: it joins the next batch, which starts as
/// soon as fewer than `max_in_flight / max_per_commit` batch transactions run. Deliveries in one
/// batch are all at the front of their lanes, so no two share a key or an event id.
struct Lanes<'a, I: Inbox, H> {
    consumer: &'a Consumer<I, H>,
    running: FuturesUnordered<Work<'a>>,
    /// Deliveries inside `running`.
    running_deliveries: usize,
    queues: HashMap<Lane, VecDeque<u64>>,
    waiting: BTreeMap<u64, (Vec<Lane>, Received)>,
    ready: VecDeque<(u64, Vec<Lane>, Delivery)>,
    /// Deliveries per batch transaction (1: no batches).
    per_commit: usize,
    /// Batch transactions open at once.
    transactions: usize,
}

impl<'a, I: Inbox, H: Handler<I>> Lanes<'a, I, H> {
    fn new(consumer: &'a Consumer<I, H>) -> Self {
        let config = consumer.config();
        let per_commit = if config.batches(consumer.effect()) { config.max_per_commit } else { 1 };
        Self {
            consumer,
            running: FuturesUnordered::new(),
            running_deliveries: 0,
            queues: HashMap::new(),
            waiting: BTreeMap::new(),
            ready: VecDeque::new(),
            per_commit,
            transactions: (config.max_in_flight / per_commit).max(1),
        }
    }

    /// Deliveries received and not yet settled.
    fn held(&self) -> usize {
        self.running_deliveries + self.waiting.len() + self.ready.len()
    }

    fn first_in_all(&self, seq: u64, lanes: &[Lane]) -> bool {
        lanes.iter().all(|l| self.queues.get(l).and_then(VecDeque::front) == Some(&seq))
    }

    fn admit(&mut self, seq: u64, received: Received) {
        let lanes = lanes_of(&received);
        for l in &lanes {
            self.queues.entry(l.clone()).or_default().push_back(seq);
        }
        if self.first_in_all(seq, &lanes) {
            self.start(seq, lanes, received);
        } else {
            self.waiting.insert(seq, (lanes, received));
        }
    }

    fn start(&mut self, seq: u64, lanes: Vec<Lane>, received: Received) {
        match received {
            Received::Event(d) if self.per_commit > 1 => self.ready.push_back((seq, lanes, d)),
            received => {
                let consumer = self.consumer;
                self.running_deliveries += 1;
                self.running.push(Box::pin(async move {
                    let result = consumer.handle(received).await;
                    vec![Finished { seq, lanes, result }]
                }));
            }
        }
    }

    /// Start batch transactions for the ready deliveries, as many as are allowed.
    fn launch(&mut self) {
        while !self.ready.is_empty() && self.running.len() < self.transactions {
            let n = self.ready.len().min(self.per_commit);
            let batch: Vec<_> = self.ready.drain(..n).collect();
            let consumer = self.consumer;
            self.running_deliveries += n;
            self.running.push(Box::pin(async move {
                let (slots, deliveries): (Vec<_>, Vec<_>) =
                    batch.into_iter().map(|(seq, lanes, d)| ((seq, lanes), d)).unzip();
                let results = consumer.process_batch(deliveries).await;
                slots.into_iter().zip(results).map(|((seq, lanes), result)| Finished { seq, lanes, result }).collect()
            }));
        }
    }

    /// Running work was dropped (the grace ran out).
    fn drop_running(&mut self) {
        self.running = FuturesUnordered::new();
        self.running_deliveries = 0;
    }

    /// Delivery `seq` settled: leave its lanes and start what that unblocked, if allowed.
    fn settled(&mut self, seq: u64, lanes: &[Lane], start_next: bool) {
        let mut next = Vec::new();
        for l in lanes {
            if let Some(q) = self.queues.get_mut(l) {
                debug_assert_eq!(q.front(), Some(&seq));
                q.pop_front();
                match q.front() {
                    Some(&n) => next.push(n),
                    None => {
                        self.queues.remove(l);
                    }
                }
            }
        }
        if !start_next {
            return;
        }
        next.sort_unstable();
        next.dedup();
        for n in next {
            let ready = self.waiting.get(&n).is_some_and(|(lanes, _)| self.first_in_all(n, lanes));
            if ready && let Some((lanes, received)) = self.waiting.remove(&n) {
                self.start(n, lanes, received);
            }
        }
    }
}

fn receive_on<'s>(sub: &'s mut (dyn Subscription + 's), pause: Option<Duration>, wait: Duration) -> Recv<'s> {
    Box::pin(async move {
        if let Some(p) = pause {
            tokio::time::sleep(p).await;
        }
        let r = sub.receive(wait).await;
        (sub, r)
    })
}

/// How a pump ends.
pub(crate) enum Until<'a> {
    /// [`Consumer::drain`]: when a receive of `idle` brought nothing and nothing is held; the
    /// first subscription or acknowledgement error stops it (after what runs has finished).
    Idle(Duration),
    /// [`Consumer::run`]: when `shutdown` is triggered (then running deliveries get `grace`).
    Shutdown(&'a Shutdown),
}

enum Step<'s> {
    Done(Vec<Finished>),
    Received(&'s mut (dyn Subscription + 's), Result<Option<Received>>),
    GraceOver,
}

/// Receive and handle deliveries until `until` says stop. Returns what happened to each, in
/// receive order (empty for [`Until::Shutdown`], which keeps no history).
pub(crate) async fn pump<I: Inbox, H: Handler<I>>(
    consumer: &Consumer<I, H>,
    sub: &mut dyn Subscription,
    until: Until<'_>,
) -> Result<Vec<Handled>> {
    let config = consumer.config();
    let name = config.name.as_str();
    let max = config.max_in_flight.max(1);
    let (wait, shutdown, keep) = match until {
        Until::Idle(idle) => (idle, None, true),
        Until::Shutdown(s) => (config.receive_wait, Some(s), false),
    };
    let mut lanes = Lanes::new(consumer);
    let mut idle_sub = Some(sub);
    let mut recv: Option<Recv<'_>> = None;
    let mut pause = None;
    let mut stopping = false;
    let mut grace: Option<Pin<Box<tokio::time::Sleep>>> = None;
    let mut grace_over = false;
    let mut first_error: Option<Error> = None;
    // Whether a delivery settled while the current receive was waiting (a negative
    // acknowledgement may have handed one back that this receive did not see yet).
    let mut settled_during_receive = false;
    let mut seq = 0u64;
    let mut out: Vec<(u64, Handled)> = Vec::new();
    loop {
        if !stopping && shutdown.is_some_and(Shutdown::is_triggered) {
            stopping = true;
        }
        if stopping && grace.is_none() && !grace_over && shutdown.is_some() {
            grace = Some(Box::pin(tokio::time::sleep(config.shutdown_grace)));
            if lanes.held() > 0 {
                debug!(target: "outbox.consumer", consumer = name, held = lanes.held(), "stopping: letting running deliveries finish");
            }
        }
        if !stopping {
            lanes.launch();
        }
        if recv.is_none()
            && !stopping
            && lanes.held() < max
            && let Some(s) = idle_sub.take()
        {
            recv = Some(receive_on(s, pause.take(), wait));
            settled_during_receive = false;
        }
        if recv.is_none() && lanes.running.is_empty() {
            break;
        }
        let step = std::future::poll_fn(|cx| {
            if let Poll::Ready(Some(done)) = lanes.running.poll_next_unpin(cx) {
                return Poll::Ready(Step::Done(done));
            }
            if let Some(r) = recv.as_mut()
                && let Poll::Ready((s, result)) = r.as_mut().poll(cx)
            {
                return Poll::Ready(Step::Received(s, result));
            }
            if let Some(g) = grace.as_mut()
                && g.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(Step::GraceOver);
            }
            Poll::Pending
        })
        .await;
        match step {
            Step::Done(finished) => {
                settled_during_receive = true;
                lanes.running_deliveries -= finished.len();
                for Finished { seq: n, lanes: its_lanes, result } in finished {
                    lanes.settled(n, &its_lanes, !stopping);
                    match result {
                        Ok(h) if keep => out.push((n, h)),
                        Ok(_) => {}
                        Err(e) if keep => {
                            warn!(target: "outbox.consumer", consumer = name, error = %e, "acknowledgement failed; stopping the drain");
                            stopping = true;
                            first_error.get_or_insert(e);
                        }
                        Err(e) => {
                            warn!(target: "outbox.consumer", consumer = name, error = %e, "acknowledgement failed; the broker will redeliver");
                        }
                    }
                }
            }
            Step::Received(s, result) => {
                recv = None;
                idle_sub = Some(s);
                match result {
                    // Received while the grace ran out: left unacknowledged, it comes back.
                    Ok(Some(_)) if grace_over => {}
                    Ok(Some(r)) => {
                        lanes.admit(seq, r);
                        seq += 1;
                    }
                    Ok(None) => {
                        if keep && lanes.held() == 0 && !settled_during_receive {
                            stopping = true;
                        }
                    }
                    Err(e) if keep => {
                        stopping = true;
                        first_error.get_or_insert(e);
                    }
                    Err(e) => {
                        warn!(target: "outbox.consumer", consumer = name, error = %e, "receive failed");
                        pause = Some(config.receive_wait);
                    }
                }
            }
            Step::GraceOver => {
                warn!(target: "outbox.consumer", consumer = name, running = lanes.running.len(), grace = ?config.shutdown_grace,
                    "shutdown grace over: dropping unfinished deliveries unacknowledged (rolled back; the broker redelivers them)");
                // Dropping a running delivery is a crash of it: its transaction rolls back and it
                // is never acknowledged. A receive in progress is still awaited (at most
                // `receive_wait`), never cancelled.
                lanes.drop_running();
                grace = None;
                grace_over = true;
            }
        }
    }
    if !lanes.waiting.is_empty() || !lanes.ready.is_empty() {
        debug!(target: "outbox.consumer", consumer = name, waiting = lanes.waiting.len() + lanes.ready.len(), "not started; left unacknowledged for redelivery");
    }
    drop(lanes);
    if let Some(e) = first_error {
        return Err(e);
    }
    out.sort_by_key(|(n, _)| *n);
    Ok(out.into_iter().map(|(_, h)| h).collect())
}
