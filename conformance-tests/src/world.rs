//! The interpreter: executes a path of actions step by step against a harness's components,
//! then recovers (every lease expires, a fresh relay and a fresh consumer run to the end) and
//! reads the durable state back.
//!
//! Crashes are actions, not threads: a crashed worker runs no further steps, its open
//! transaction is rolled back (dropped) and its unacknowledged deliveries return to the broker
//! (its subscription is dropped).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_consumer_inbox::{Consumer, ConsumerConfig, EffectKind, Handled, Handler, InFlight};
use outbox_core::store::all_rows;
use outbox_core::{
    Backoff, Claimed, Completion, ConsumerGroup, Error, ErrorKind, Event, EventId, Inbox, ManualClock, Marker, Relay,
    RelayConfig, Result, RowSnapshot, Subscription,
};

use crate::harness::{EffectRow, EffectTable, Fixture, Harness};
use crate::script::{Action, Check, RelayId};

/// Lease length used by scenario relays.
pub const LEASE: Duration = Duration::from_secs(30);
/// The consumer name used by the suite.
pub const CONSUMER: &str = "suite-consumer";
const BATCH: usize = 2;

/// The suite's business effect: payload `credit:<account>:<amount>` (additive) or
/// `proj:<subject>:<version>` (projection).
pub struct SuiteHandler<I: Inbox> {
    kind: EffectKind,
    effects: Arc<dyn EffectTable<I>>,
}

fn parse(payload: &[u8]) -> Result<(String, String, i64)> {
    let bad = || Error::permanent(ErrorKind::Handler, "suite", format!("unparseable payload {payload:?}"));
    let text = std::str::from_utf8(payload).map_err(|_| bad())?;
    let mut parts = text.splitn(3, ':');
    let (Some(kind), Some(subject), Some(value)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad());
    };
    Ok((kind.to_string(), subject.to_string(), value.parse().map_err(|_| bad())?))
}

#[async_trait]
impl<I: Inbox> Handler<I> for SuiteHandler<I> {
    fn effect(&self) -> EffectKind {
        self.kind
    }

    fn version(&self, event: &Event) -> Result<(String, u64)> {
        let (_, subject, v) = parse(&event.payload)?;
        Ok((subject, u64::try_from(v).unwrap_or(0)))
    }

    async fn apply(&self, tx: &mut I::Tx, event: &Event) -> Result<()> {
        let (_, subject, value) = parse(&event.payload)?;
        self.effects
            .insert(tx, &EffectRow { consumer: CONSUMER.into(), event_id: event.id.clone(), subject, value })
            .await
    }
}

/// The suite's consumer over a fixture's inbox.
pub type SuiteConsumer<I> = Consumer<I, SuiteHandler<I>>;

/// Build the suite's consumer for an inbox handle.
pub fn suite_consumer<I: Inbox>(inbox: I, effects: Arc<dyn EffectTable<I>>, kind: EffectKind) -> SuiteConsumer<I> {
    let config = ConsumerConfig::new(CONSUMER).with_max_attempts(1000);
    suite_consumer_with(inbox, effects, kind, config)
}

/// The suite's handler under another name or attempt limit (dead-letter cases).
pub(crate) fn suite_consumer_with<I: Inbox>(
    inbox: I,
    effects: Arc<dyn EffectTable<I>>,
    kind: EffectKind,
    config: ConsumerConfig,
) -> SuiteConsumer<I> {
    Consumer::new(inbox, SuiteHandler { kind, effects }, config)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowState {
    Unsent,
    Sent,
    Done,
}

#[derive(Default)]
struct RelayWorker {
    crashed: bool,
    batch: Vec<(Claimed, RowState)>,
    last_completion: Option<Completion>,
}

impl RelayWorker {
    fn idle(&self) -> bool {
        self.batch.iter().all(|(_, s)| *s == RowState::Done)
    }
    fn next(&self, state: RowState) -> Option<usize> {
        self.batch.iter().position(|(_, s)| *s == state)
    }
}

struct ConsumerWorker<I: Inbox> {
    crashed: bool,
    consumer: SuiteConsumer<I>,
    sub: Option<Box<dyn Subscription>>,
    inflight: Option<(InFlight<I, SuiteHandler<I>>, Stage)>,
    /// Deliveries whose acknowledgement was lost and that this process still holds.
    holding: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Received,
    Guarded,
    Applied,
    Committed,
}

/// Durable state read back after a run.
#[derive(Debug, Clone, Default)]
pub struct DurableState {
    /// The scenario's committed events.
    pub events: Vec<Event>,
    /// Outbox rows of those events.
    pub rows: Vec<RowSnapshot>,
    /// How many times each event id is on the broker (read through an audit group after the
    /// full drain).
    pub offers: BTreeMap<EventId, usize>,
    /// Effect rows.
    pub effects: Vec<EffectRow>,
    /// Inbox markers of the suite's consumer.
    pub markers: Vec<Marker>,
    /// Dead letters of the suite's consumer (`(event id, reason)`).
    pub dead_letters: Vec<(EventId, String)>,
    /// What the recovery consumer did with each delivery.
    pub recovery: Vec<Handled>,
    /// Recovery steps that hit their bound instead of finishing (a relay that kept claiming, a
    /// broker that kept delivering): judged as violations, never waited out.
    pub unfinished: Vec<String>,
}

impl std::fmt::Display for DurableState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "  outbox rows:")?;
        for r in &self.rows {
            writeln!(
                f,
                "    row {} {} {:?} token={} published_token={:?} attempts={}",
                r.row_id, r.event.id, r.status, r.token, r.published_token, r.attempts
            )?;
        }
        writeln!(f, "  broker offers: {:?}", self.offers.iter().map(|(k, v)| format!("{k}×{v}")).collect::<Vec<_>>())?;
        writeln!(
            f,
            "  effects: {:?}",
            self.effects.iter().map(|e| format!("{}:{}:{}", e.event_id, e.subject, e.value)).collect::<Vec<_>>()
        )?;
        writeln!(f, "  markers: {:?}", self.markers.iter().map(|m| m.event_id.to_string()).collect::<Vec<_>>())?;
        writeln!(f, "  dead letters: {:?}", self.dead_letters)?;
        write!(f, "  recovery consumer: {:?}", self.recovery)?;
        if !self.unfinished.is_empty() {
            write!(f, "\n  unfinished: {:?}", self.unfinished)?;
        }
        Ok(())
    }
}

static FIXTURE_SEQ: AtomicU64 = AtomicU64::new(0);

/// A unique tag for names inside one fixture (event ids).
pub fn unique_tag() -> String {
    let n = FIXTURE_SEQ.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros()).unwrap_or(0);
    format!("{:x}{:x}{n:x}", std::process::id(), t % 0xffff_ffff)
}

/// One scenario being executed.
pub struct World<I: Inbox> {
    fx: Fixture<I>,
    clock: ManualClock,
    wait: Duration,
    kind: EffectKind,
    events: Vec<Event>,
    relays: [RelayWorker; 2],
    consumer: ConsumerWorker<I>,
    audit: Box<dyn Subscription>,
    offers: BTreeMap<EventId, usize>,
    /// Human-readable trace of what each action did.
    pub trace: Vec<String>,
}

/// The consumer group the suite's consumer joins.
pub fn suite_group() -> ConsumerGroup {
    ConsumerGroup::new("suite").expect("valid group name")
}

fn audit_group() -> ConsumerGroup {
    ConsumerGroup::new("audit").expect("valid group name")
}

fn no_op(what: &str) -> Error {
    Error::invalid_input("suite", format!("no-op: {what}"))
}

/// Whether an error from [`World::step`] means "this action did nothing" (pruned paths).
pub fn is_no_op(e: &Error) -> bool {
    e.kind() == ErrorKind::InvalidInput && e.backend() == "suite" && e.message().starts_with("no-op")
}

impl<I: Inbox> World<I> {
    /// Build a fixture for `case`, enqueue the events with the given payloads (in one producer
    /// transaction) and subscribe the consumer.
    ///
    /// # Errors
    /// Fixture, enqueue or subscribe errors.
    pub async fn new<H: Harness<Inbox = I>>(
        harness: &H,
        case: &str,
        payloads: &[&str],
        kind: EffectKind,
    ) -> Result<Self> {
        let clock = ManualClock::default();
        let fx = harness.fixture(case, clock.clone()).await?;
        let wait = harness.capabilities().delivery_wait;
        let tag = unique_tag();
        let events: Vec<Event> = payloads
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let id = EventId::new(format!("{case}.{tag}.e{i}"))?;
                Ok(Event::new(id, fx.destination.clone(), p.as_bytes().to_vec()).with_key(format!("k{i}")))
            })
            .collect::<Result<_>>()?;
        fx.broker.declare(&fx.destination, &[suite_group(), audit_group()]).await?;
        let audit = fx.broker.subscribe(&fx.destination, &audit_group()).await?;
        if !events.is_empty() {
            fx.store.enqueue(&events).await?;
        }
        let consumer = suite_consumer(fx.inbox_handle(), fx.effects.clone(), kind);
        let sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
        Ok(Self {
            consumer: ConsumerWorker { crashed: false, consumer, sub: Some(sub), inflight: None, holding: 0 },
            fx,
            clock,
            wait,
            kind,
            events,
            relays: Default::default(),
            audit,
            offers: BTreeMap::new(),
            trace: Vec::new(),
        })
    }

    /// The scenario's events.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// The fixture.
    pub fn fixture(&self) -> &Fixture<I> {
        &self.fx
    }

    fn owner(r: RelayId) -> String {
        format!("relay-{r:?}")
    }

    /// Actions that can run now, given the budgets (exploration).
    pub fn enabled(&self, crashes: u32, expiries: u32, lost: u32) -> Vec<Action> {
        let mut out = Vec::new();
        for r in RelayId::ALL {
            let w = &self.relays[r.index()];
            if w.crashed {
                continue;
            }
            if w.idle() {
                out.push(Action::Claim(r));
            }
            if w.next(RowState::Unsent).is_some() {
                out.push(Action::Send(r));
                if lost > 0 {
                    out.push(Action::LoseConfirm(r));
                }
            }
            if w.next(RowState::Sent).is_some() {
                out.push(Action::Complete(r));
            }
            if crashes > 0 && !w.idle() {
                out.push(Action::CrashRelay(r));
            }
        }
        if expiries > 0 && self.relays.iter().any(|w| !w.idle()) {
            out.push(Action::Expire);
        }
        let c = &self.consumer;
        if !c.crashed {
            match c.inflight.as_ref().map(|(_, s)| *s) {
                None => out.push(Action::Consume),
                Some(Stage::Applied) => out.push(Action::Commit),
                Some(Stage::Committed) => {
                    out.push(Action::Ack);
                    if lost > 0 {
                        out.push(Action::LoseAck);
                    }
                }
                Some(_) => {}
            }
            if crashes > 0 && (c.inflight.is_some() || c.holding > 0) {
                out.push(Action::CrashConsumer);
            }
        }
        out
    }

    /// Run one action.
    ///
    /// # Errors
    /// A backend error, a failed [`Check`], or a "no-op" error (see [`is_no_op`]) when the action
    /// did nothing (nothing claimable, nothing to receive, worker crashed or busy).
    pub async fn step(&mut self, action: &Action) -> Result<()> {
        let note = self.step_inner(action).await?;
        self.trace.push(format!("{action} → {note}"));
        Ok(())
    }

    async fn step_inner(&mut self, action: &Action) -> Result<String> {
        match action {
            Action::Claim(r) => {
                let w = &mut self.relays[r.index()];
                if w.crashed || !w.idle() {
                    return Err(no_op("relay crashed or busy"));
                }
                let claimed = self.fx.store.claim(&Self::owner(*r), BATCH, LEASE).await?;
                if claimed.is_empty() {
                    return Err(no_op("nothing claimable"));
                }
                let note = claimed.iter().map(|c| format!("row {} token {}", c.record.row_id, c.lease.token)).collect();
                w.batch = claimed.into_iter().map(|c| (c, RowState::Unsent)).collect();
                Ok(join(note))
            }
            Action::Send(r) | Action::LoseConfirm(r) => {
                let w = &mut self.relays[r.index()];
                let Some(i) = w.next(RowState::Unsent).filter(|_| !w.crashed) else {
                    return Err(no_op("nothing to send"));
                };
                let c = w.batch[i].0.clone();
                self.fx.broker.publish(&c.record.event).await?;
                if matches!(action, Action::Send(_)) {
                    w.batch[i].1 = RowState::Sent;
                    Ok(format!("published {}", c.record.event.id))
                } else {
                    let outcome = self.fx.store.fail(c.record.row_id, &c.lease, Duration::ZERO, "confirm lost").await?;
                    w.batch[i].1 = RowState::Done;
                    Ok(format!("published {} but the relay recorded a failure: {outcome:?}", c.record.event.id))
                }
            }
            Action::Complete(r) => {
                let w = &mut self.relays[r.index()];
                if w.crashed || w.next(RowState::Sent).is_none() {
                    return Err(no_op("nothing to complete"));
                }
                // One `complete_many` for the batch's sent rows, as a relay records a batch.
                let sent: Vec<usize> = (0..w.batch.len()).filter(|i| w.batch[*i].1 == RowState::Sent).collect();
                let rows: Vec<_> =
                    sent.iter().map(|i| (w.batch[*i].0.record.row_id, w.batch[*i].0.lease.clone())).collect();
                let outcomes = self.fx.store.complete_many(&rows).await?;
                if outcomes.len() != rows.len() {
                    return Err(Error::permanent(
                        ErrorKind::Rejected,
                        "suite",
                        format!("complete_many answered {} results for {} rows", outcomes.len(), rows.len()),
                    ));
                }
                let mut notes = Vec::new();
                for (i, outcome) in sent.into_iter().zip(outcomes) {
                    let (c, s) = &mut w.batch[i];
                    w.last_completion = Some(outcome);
                    *s = RowState::Done;
                    notes.push(format!("row {} token {}: {outcome:?}", c.record.row_id, c.lease.token));
                }
                Ok(join(notes))
            }
            Action::CrashRelay(r) => {
                let w = &mut self.relays[r.index()];
                if w.crashed {
                    return Err(no_op("already crashed"));
                }
                w.crashed = true;
                w.batch.clear();
                Ok("relay stopped; its leases stay until they expire".into())
            }
            Action::Expire => {
                self.clock.advance(LEASE + Duration::from_millis(1));
                Ok(format!("clock at {}", outbox_core::Clock::now(&self.clock)))
            }
            Action::Receive => self.receive().await,
            Action::Guard => self.consumer_step(Stage::Received, Stage::Guarded).await,
            Action::Apply => self.consumer_step(Stage::Guarded, Stage::Applied).await,
            Action::Consume => {
                let a = self.receive().await?;
                self.consumer_step(Stage::Received, Stage::Guarded).await?;
                let b = self.consumer_step(Stage::Guarded, Stage::Applied).await?;
                Ok(format!("{a}; {b}"))
            }
            Action::Commit => self.consumer_step(Stage::Applied, Stage::Committed).await,
            Action::Ack => {
                let Some((f, Stage::Committed)) = self.consumer.inflight.take() else {
                    return Err(no_op("nothing committed to acknowledge"));
                };
                let handled = f.acknowledge().await?;
                Ok(format!("{handled:?}"))
            }
            Action::LoseAck => {
                let Some((f, Stage::Committed)) = self.consumer.inflight.take() else {
                    return Err(no_op("nothing committed to acknowledge"));
                };
                f.abandon();
                self.consumer.holding += 1;
                Ok("acknowledgement lost; the delivery stays unacknowledged".into())
            }
            Action::CrashConsumer => {
                let c = &mut self.consumer;
                if c.crashed {
                    return Err(no_op("consumer already crashed"));
                }
                c.crashed = true;
                c.inflight = None; // open transaction rolled back
                c.sub = None; // unacknowledged deliveries return
                Ok("consumer stopped; transaction rolled back; deliveries returned".into())
            }
            Action::Inject(i, payload) => {
                let mut e = self.events.get(*i).cloned().ok_or_else(|| no_op("no such event"))?;
                if let Some(p) = payload {
                    e.payload = p.as_bytes().to_vec();
                }
                self.fx.broker.publish(&e).await?;
                Ok(format!("published {} directly", e.id))
            }
            Action::Check(check) => self.check(check).await,
        }
    }

    async fn receive(&mut self) -> Result<String> {
        let c = &mut self.consumer;
        if c.crashed || c.inflight.is_some() {
            return Err(no_op("consumer crashed or busy"));
        }
        let Some(sub) = c.sub.as_mut() else { return Err(no_op("no subscription")) };
        let Some(d) = next_bounded(sub.as_mut(), self.wait).await? else {
            return Err(no_op("nothing to receive"));
        };
        let note = format!("received {} (redelivered {}, attempt {:?})", d.event.id, d.redelivered, d.attempt);
        c.inflight = Some((c.consumer.receive(d), Stage::Received));
        Ok(note)
    }

    async fn consumer_step(&mut self, from: Stage, to: Stage) -> Result<String> {
        let c = &mut self.consumer;
        let Some((f, stage)) = c.inflight.as_mut().filter(|(_, s)| *s == from && !c.crashed) else {
            return Err(no_op("consumer not at that step"));
        };
        let r = match to {
            Stage::Guarded => f.guard().await,
            Stage::Applied => f.apply().await,
            Stage::Committed => f.commit().await,
            Stage::Received => Ok(()),
        };
        *stage = to;
        let note = format!("{:?}", f.verdict());
        // A failed step leaves a verdict of Retry: the delivery is nacked on Ack.
        r.map(|()| note.clone()).or_else(|e| Ok(format!("{note} ({e})")))
    }

    async fn check(&mut self, check: &Check) -> Result<String> {
        let fail = |msg: String| Err(Error::permanent(ErrorKind::Rejected, "suite", msg));
        match check {
            Check::Effects(i, n) => {
                let id = &self.events[*i].id;
                let got = self.fx.effects.rows().await?.iter().filter(|r| &r.event_id == id).count();
                if got != *n {
                    return fail(format!("expected {n} effect(s) for {id}, found {got}"));
                }
                Ok(format!("{got} effect(s) for {id}"))
            }
            Check::Marker(i, present) => {
                let id = &self.events[*i].id;
                let got = self.fx.inbox.markers(CONSUMER).await?.iter().any(|m| &m.event_id == id);
                if got != *present {
                    return fail(format!("expected marker for {id} present={present}, found present={got}"));
                }
                Ok(format!("marker present={got}"))
            }
            Check::Completed(r, published) => {
                let got = self.relays[r.index()].last_completion;
                let want = if *published { Completion::Published } else { Completion::Fenced };
                if got != Some(want) {
                    return fail(format!("expected relay {r:?}'s last completion {want:?}, found {got:?}"));
                }
                Ok(format!("{want:?}"))
            }
        }
    }

    /// Recover and read back: drop every worker (crash semantics), expire every lease, run a
    /// fresh relay until nothing is claimable and a fresh consumer until nothing arrives, then
    /// read the durable state.
    ///
    /// # Errors
    /// Backend errors during recovery or read-back.
    pub async fn finish(mut self) -> Result<DurableState> {
        self.consumer.inflight = None;
        self.consumer.sub = None;
        self.relays = Default::default();
        self.clock.advance(LEASE * 4);
        let recovery = Relay::new(
            self.fx.store.clone(),
            (self.fx.restart_broker)(),
            RelayConfig::default()
                .with_owner("relay-recovery")
                .with_batch_size(64)
                .with_lease(LEASE)
                .with_max_attempts(1000)
                .with_backoff(Backoff::none())
                .with_seed(Some(1)),
        );
        let mut unfinished = Vec::new();
        // Bounded: a store that hands out the same rows forever must fail the case, not hang it.
        let mut batches = 0;
        loop {
            if batches == MAX_RECOVERY_BATCHES {
                unfinished
                    .push(format!("the recovery relay was still claiming rows after {MAX_RECOVERY_BATCHES} batches"));
                break;
            }
            batches += 1;
            if recovery.run_once().await?.claimed == 0 {
                break;
            }
        }
        let broker = (self.fx.restart_broker)();
        let consumer = suite_consumer((self.fx.restart_inbox)(), self.fx.effects.clone(), self.kind);
        let mut sub = broker.subscribe(&self.fx.destination, &suite_group()).await?;
        let (handled, done) = drain_bounded(&consumer, sub.as_mut(), self.wait, MAX_DELIVERIES).await?;
        if !done {
            unfinished.push(format!("the recovery consumer was still receiving after {MAX_DELIVERIES} deliveries"));
        }
        drop(sub);
        if !self.read_offers(self.wait).await? {
            unfinished.push(format!("the audit group was still receiving after {MAX_DELIVERIES} deliveries"));
        }
        let ids: std::collections::BTreeSet<&EventId> = self.events.iter().map(|e| &e.id).collect();
        let rows = all_rows(self.fx.store.as_ref()).await?.into_iter().filter(|r| ids.contains(&r.event.id)).collect();
        // Only this scenario's ids: a harness may share tables between fixtures.
        let effects = self.fx.effects.rows().await?.into_iter().filter(|r| ids.contains(&r.event_id)).collect();
        let markers =
            self.fx.inbox.markers(CONSUMER).await?.into_iter().filter(|m| ids.contains(&m.event_id)).collect();
        let dead_letters = self
            .fx
            .inbox
            .dead_letters(CONSUMER)
            .await?
            .into_iter()
            .filter(|d| ids.contains(&d.event.id))
            .map(|d| (d.event.id, d.reason.as_str().to_string()))
            .collect();
        Ok(DurableState {
            events: self.events,
            rows,
            offers: self.offers,
            effects,
            markers,
            dead_letters,
            recovery: handled,
            unfinished,
        })
    }

    /// Count what the audit group receives until it is quiet; `false` if it never was.
    async fn read_offers(&mut self, wait: Duration) -> Result<bool> {
        for _ in 0..MAX_DELIVERIES {
            let Some(d) = next_bounded(self.audit.as_mut(), wait).await? else { return Ok(true) };
            *self.offers.entry(d.event.id.clone()).or_default() += 1;
            d.ack().await?;
        }
        Ok(false)
    }
}

/// Recovery batches before the recovery relay is judged as never finishing.
const MAX_RECOVERY_BATCHES: usize = 50;
/// Deliveries one reader takes before it is judged as never quiet (scenarios have a handful).
pub const MAX_DELIVERIES: usize = 200;

/// [`Subscription::next`], failing with a message instead of hanging when an adapter does not
/// return within (a generous margin over) its `wait`.
///
/// # Errors
/// The subscription's error, or [`ErrorKind::Timeout`] naming the overrun.
pub async fn next_bounded(sub: &mut dyn Subscription, wait: Duration) -> Result<Option<outbox_core::Delivery>> {
    let limit = wait * 3 + Duration::from_secs(30);
    match tokio::time::timeout(limit, sub.next(wait)).await {
        Ok(r) => r,
        Err(_) => Err(Error::permanent(
            ErrorKind::Timeout,
            "suite",
            format!("Subscription::next({wait:?}) did not return within {limit:?}"),
        )),
    }
}

/// [`Consumer::drain`] with a bound: process deliveries until none arrives within `wait` (the first
/// within `3 × wait`: a fresh member may have to join its group first), at
/// most `max`. Returns what happened to each and whether the subscription went quiet.
///
/// # Errors
/// A subscription or acknowledgement error.
pub async fn drain_bounded<I: Inbox>(
    consumer: &SuiteConsumer<I>,
    sub: &mut dyn Subscription,
    wait: Duration,
    max: usize,
) -> Result<(Vec<Handled>, bool)> {
    let mut out = Vec::new();
    while out.len() < max {
        // A fresh member may first have to join its group (Kafka: a rebalance of a few seconds on
        // a loaded machine): give the first delivery a longer grace than "quiet" needs.
        let this_wait = if out.is_empty() { wait * 3 } else { wait };
        let Some(d) = next_bounded(sub, this_wait).await? else { return Ok((out, true)) };
        out.push(consumer.process(d).await?);
    }
    Ok((out, false))
}

impl<I: Inbox> Fixture<I> {
    fn inbox_handle(&self) -> I {
        (self.restart_inbox)()
    }
}

fn join(v: Vec<String>) -> String {
    v.join(", ")
}
