//! The consumer runtime: for each delivery, guard → effect → commit → acknowledge.
//!
//! The order is the whole point. The guard (marker, version or ledger entry) and the effect are
//! written in one local transaction; the broker is acknowledged only after that transaction
//! committed. A crash anywhere before the commit leaves neither marker nor effect and the broker
//! redelivers; a crash after the commit leaves both and the redelivery is a duplicate.
//!
//! Each step is a method of [`InFlight`] so that the conformance suite can crash a consumer
//! between any two of them; [`Consumer::process`] runs them all for normal use. The order is
//! checked at run time in every build: a step called out of order fails, rolls back what is open
//! and leaves the delivery to be negatively acknowledged. (A typestate API would reject a wrong
//! order at compile time, but the suite's interpreter drives the steps from a script and needs
//! one value that can stop between any two of them.)
//!
//! A message that is not an outbox event ([`Received::Foreign`]) takes the same path in one
//! step: its dead letter ([`DeadLetterReason::Malformed`]) is written and committed, and only
//! then is it acknowledged; the consumer goes on with the next message at once.
//!
//! Every delivery runs inside one span ([`outbox_core::telemetry::handle_span`]) from the guard
//! to the acknowledgement, so a trace that began at enqueue continues through its effect.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::{
    Acknowledge, DeadLetter, DeadLetterReason, Delivery, Error, ErrorKind, Event, EventId, Fingerprint,
    ForeignDelivery, Inbox, LedgerState, Malformed, MarkOutcome, Received, Result, Subscription, VersionOutcome,
};
use tracing::{Instrument, debug, warn};

use crate::effect::{EffectKind, Handler};
use crate::retention::Retention;

/// Consumer settings.
///
/// `#[non_exhaustive]`: build it with [`ConsumerConfig::new`] and the `with_*` setters, so a
/// new setting is not a breaking change.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// Consumer name: the first half of every inbox key. Stable across restarts.
    pub name: String,
    /// Handler failures per event before it is dead-lettered and acknowledged.
    pub max_attempts: u32,
    /// How long [`Consumer::run`] waits for a delivery before checking for shutdown.
    pub receive_wait: Duration,
    /// Marker retention, checked at construction; `None` keeps markers forever.
    pub retention: Option<Retention>,
    /// Deliveries [`Consumer::run`] and [`Consumer::drain`] hold at once (handling, or waiting
    /// behind an earlier delivery of the same key); at least 1. Default
    /// [`DEFAULT_MAX_IN_FLIGHT`].
    pub max_in_flight: usize,
    /// How long [`Consumer::run`] lets running deliveries finish after shutdown; what is still
    /// running then is dropped unacknowledged (rolled back, redelivered). Default 10 s.
    pub shutdown_grace: Duration,
    /// Batch commit: up to this many deliveries that are ready at once (different keys and
    /// ids) share one transaction in [`Consumer::run`] and [`Consumer::drain`], for
    /// [`EffectKind::Additive`] and [`EffectKind::Projection`] handlers; at least 1, default 1
    /// (a transaction per delivery). See [`Consumer::process_batch`] for what a batch promises.
    pub max_per_commit: usize,
}

/// Default [`ConsumerConfig::max_in_flight`]: 8.
///
/// Enough to hide the round trips of one delivery (begin, guard, effect, commit on the store;
/// the acknowledgement on the broker) behind each other; below the PostgreSQL store's default
/// pool of 10 connections (each running delivery holds one for its transaction, so the pool is
/// not exhausted by the consumer alone) and below RabbitMQ's default prefetch of 32; and it
/// bounds what a crash hands back for redelivery to 8 deliveries.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 8;

impl ConsumerConfig {
    /// Defaults (5 attempts, markers kept forever) with a name.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            max_attempts: 5,
            receive_wait: Duration::from_millis(500),
            retention: None,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            shutdown_grace: Duration::from_secs(10),
            max_per_commit: 1,
        }
    }

    /// Set [`max_per_commit`](Self::max_per_commit); 0 is taken as 1. Above 1, at most
    /// `max_in_flight / max_per_commit` (at least one) batch transactions are open at once, and a
    /// batch takes every ready delivery up to `max_per_commit`: while those transactions run,
    /// deliveries received meanwhile gather into the next batch.
    #[must_use]
    pub fn with_max_per_commit(mut self, n: usize) -> Self {
        self.max_per_commit = n.max(1);
        self
    }

    /// Whether the runtime batches deliveries of a handler with this effect.
    pub(crate) fn batches(&self, effect: EffectKind) -> bool {
        self.max_per_commit > 1 && shares_transactions(effect)
    }

    /// Set [`max_in_flight`](Self::max_in_flight); 0 is taken as 1. With 1 the consumer handles
    /// one delivery at a time, in receive order, and receives the next only after the previous
    /// was acknowledged.
    #[must_use]
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// Set [`shutdown_grace`](Self::shutdown_grace).
    #[must_use]
    pub fn with_shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// Set [`max_attempts`](Self::max_attempts).
    #[must_use]
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// Set [`receive_wait`](Self::receive_wait).
    #[must_use]
    pub fn with_receive_wait(mut self, receive_wait: Duration) -> Self {
        self.receive_wait = receive_wait;
        self
    }

    /// Set [`retention`](Self::retention).
    #[must_use]
    pub fn with_retention(mut self, retention: Option<Retention>) -> Self {
        self.retention = retention;
        self
    }
}

/// What happened to one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled {
    /// The effect committed (or, for idempotent handlers, ran).
    Applied,
    /// Seen before with the same content: nothing applied, acknowledged.
    Duplicate,
    /// A projection event older than the stored version: nothing applied, acknowledged.
    Stale {
        /// The stored version.
        current: u64,
    },
    /// Same id, different payload: nothing applied, dead-lettered, acknowledged.
    Conflict,
    /// A notification whose earlier attempt has an unknown outcome: dead-lettered, acknowledged.
    Uncertain,
    /// Not done; negatively acknowledged for redelivery.
    Retry {
        /// Failed handler attempts so far (0 when the failure was not the handler's).
        attempts: u32,
        /// Why.
        error: String,
    },
    /// The handler failed `max_attempts` times: dead-lettered, acknowledged.
    DeadLettered {
        /// Attempts made.
        attempts: u32,
    },
    /// Not an outbox event: recorded as a [`DeadLetterReason::Malformed`] dead letter, then
    /// acknowledged.
    Malformed {
        /// What was wrong with it.
        problem: Malformed,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Received,
    Guarded,
    Applied,
    Committed,
    /// A step was called out of order: nothing more runs; the delivery is negatively
    /// acknowledged.
    Broken,
}

impl Stage {
    fn name(self) -> &'static str {
        match self {
            Self::Received => "received",
            Self::Guarded => "guarded",
            Self::Applied => "applied",
            Self::Committed => "committed",
            Self::Broken => "broken by an earlier out-of-order call",
        }
    }
}

/// The consumer runtime for one handler. Cheap to clone: clones share the handler and inbox.
#[derive(Debug)]
pub struct Consumer<I, H> {
    inner: Arc<Inner<I, H>>,
}

#[derive(Debug)]
struct Inner<I, H> {
    inbox: I,
    handler: H,
    config: ConsumerConfig,
    metrics: crate::observe::Metrics,
}

impl<I, H> Clone for Consumer<I, H> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone() }
    }
}

impl<I: Inbox, H: Handler<I>> Consumer<I, H> {
    /// A consumer over `inbox` running `handler`. Its metrics are registered here, with the
    /// `metrics` recorder installed at this point: install one before, if any.
    pub fn new(inbox: I, handler: H, config: ConsumerConfig) -> Self {
        let metrics = crate::observe::Metrics::new(&config.name);
        Self { inner: Arc::new(Inner { inbox, handler, config, metrics }) }
    }

    /// The inbox.
    pub fn inbox(&self) -> &I {
        &self.inner.inbox
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.inner.handler
    }

    /// The configuration.
    pub fn config(&self) -> &ConsumerConfig {
        &self.inner.config
    }

    /// The handler's effect.
    pub(crate) fn effect(&self) -> EffectKind {
        self.inner.handler.effect()
    }

    /// Start handling a delivery step by step (see [`InFlight`]).
    pub fn receive(&self, delivery: Delivery) -> InFlight<I, H> {
        let (redelivered, attempt) = (delivery.redelivered, delivery.attempt);
        let (event, acker) = delivery.into_parts();
        InFlight {
            consumer: self.clone(),
            span: outbox_core::telemetry::handle_span(&self.inner.config.name, &event),
            started: Instant::now(),
            event,
            acker: Some(acker),
            redelivered,
            attempt,
            tx: None,
            stage: Stage::Received,
            verdict: None,
        }
    }

    /// Handle one delivery completely: guard, effect, commit, then ack (or nack).
    ///
    /// # Errors
    /// Only an acknowledgement error; every other failure becomes a [`Handled`] value and a
    /// negative acknowledgement.
    pub async fn process(&self, delivery: Delivery) -> Result<Handled> {
        let mut f = self.receive(delivery);
        // Step errors are recorded in the verdict; acknowledge decides ack vs nack from it.
        if f.guard().await.is_ok() && f.apply().await.is_ok() {
            let _ = f.commit().await;
        }
        f.acknowledge().await
    }

    /// Handle several deliveries with one transaction: every guard and effect written in it,
    /// one commit, then every acknowledgement. What [`run`](Self::run) and
    /// [`drain`](Self::drain) do with deliveries that are ready together when
    /// [`ConsumerConfig::max_per_commit`] is above 1; one commit for many deliveries is what lets a
    /// consumer with an inbox keep up with a loop that writes no marker.
    ///
    /// # Behavior
    /// - for an [`EffectKind::Additive`] or [`EffectKind::Projection`] handler, the deliveries
    ///   are guarded and applied in the given order in one transaction (two copies of one event
    ///   in a batch: the second is a duplicate), and all of them are acknowledged only after it
    ///   committed: [`Handled::Applied`], [`Handled::Duplicate`] or [`Handled::Stale`];
    /// - when anything else happens in the batch (a handler error, a copy with different
    ///   content, a store error, a failed commit), the transaction is rolled back, nothing of
    ///   the batch is durable or acknowledged, and each delivery is then handled alone, one
    ///   after the other in the given order, as [`process`](Self::process) handles it: one
    ///   event's failure never undoes another's effect, and failures are counted per event, by
    ///   the lone attempt;
    /// - a notification or idempotent handler, or a single delivery: each handled alone;
    /// - one result per delivery, in the given order.
    ///
    /// # Errors
    /// Per delivery, only an acknowledgement error, as [`process`](Self::process).
    pub async fn process_batch(&self, deliveries: Vec<Delivery>) -> Vec<Result<Handled>> {
        let effect = self.inner.handler.effect();
        if deliveries.len() > 1 && shares_transactions(effect) {
            let started = Instant::now();
            let events: Vec<&Event> = deliveries.iter().map(|d| &d.event).collect();
            let name = self.inner.config.name.as_str();
            // One span per delivery, from its guard to its acknowledgement, as alone.
            let spans: Vec<tracing::Span> =
                events.iter().map(|e| outbox_core::telemetry::handle_span(name, e)).collect();
            match self.batch_commit(&events, &spans, effect).await {
                Ok(Some(verdicts)) => {
                    let mut out = Vec::with_capacity(deliveries.len());
                    for ((d, verdict), span) in deliveries.into_iter().zip(verdicts).zip(spans) {
                        let outcome = d.ack().instrument(span).await.map(|()| verdict);
                        self.inner.metrics.record(&outcome, started.elapsed());
                        out.push(outcome);
                    }
                    return out;
                }
                Ok(None) => {
                    debug!(target: "outbox.consumer", consumer = name, deliveries = events.len(), "a copy with different content in the batch: rolled back, handling each alone");
                }
                Err(e) => {
                    debug!(target: "outbox.consumer", consumer = name, deliveries = events.len(), error = %e, "batch transaction failed: rolled back, handling each alone");
                }
            }
        }
        let mut out = Vec::with_capacity(deliveries.len());
        for d in deliveries {
            out.push(self.process(d).await);
        }
        out
    }

    /// The batch's one transaction: `Ok(None)` when a copy conflicts (each delivery is then
    /// handled alone, where the conflict is dead-lettered), an error when anything failed.
    /// Dropping the transaction on either path rolls it back.
    async fn batch_commit(
        &self,
        events: &[&Event],
        spans: &[tracing::Span],
        effect: EffectKind,
    ) -> Result<Option<Vec<Handled>>> {
        let (inbox, handler) = (&self.inner.inbox, &self.inner.handler);
        let name = self.inner.config.name.as_str();
        let mut tx: Option<I::Tx> = None;
        let mut verdicts = Vec::with_capacity(events.len());
        for (event, span) in events.iter().zip(spans) {
            // The transaction is taken for the step and put back after it; a failed step drops
            // it, which rolls the batch back.
            let step = async {
                let (mut t, skip) = match effect {
                    EffectKind::Additive => {
                        let fingerprint = event.fingerprint();
                        let (t, outcome) = match tx.take() {
                            Some(mut t) => {
                                let outcome = inbox.mark(&mut t, name, &event.id, &fingerprint).await?;
                                (t, outcome)
                            }
                            None => inbox.begin_marked(name, &event.id, &fingerprint).await?,
                        };
                        let skip = match outcome {
                            MarkOutcome::New => None,
                            MarkOutcome::Duplicate => Some(Handled::Duplicate),
                            MarkOutcome::Conflict { .. } => return Ok(None),
                        };
                        (t, skip)
                    }
                    _ => {
                        let (subject, version) = handler.version(event)?;
                        let mut t = match tx.take() {
                            Some(t) => t,
                            None => inbox.begin().await?,
                        };
                        let skip = match inbox.advance_version(&mut t, name, &subject, version).await? {
                            VersionOutcome::Stale { current } => Some(Handled::Stale { current }),
                            VersionOutcome::Advanced { .. } => None,
                        };
                        (t, skip)
                    }
                };
                let verdict = match skip {
                    Some(v) => v,
                    None => {
                        handler.apply(&mut t, event).await?;
                        Handled::Applied
                    }
                };
                Ok::<_, Error>(Some((t, verdict)))
            }
            .instrument(span.clone())
            .await?;
            let Some((t, verdict)) = step else { return Ok(None) };
            tx = Some(t);
            verdicts.push(verdict);
        }
        if let Some(t) = tx {
            inbox.commit(t).await?;
        }
        Ok(Some(verdicts))
    }

    /// Record a message that is not an outbox event and acknowledge it: a
    /// [`DeadLetterReason::Malformed`] dead letter (raw payload, headers as far as an event holds
    /// them, an id from the message or its broker position, the problem and position in the
    /// error text) in a transaction of its own, committed, and only then the acknowledgement.
    ///
    /// The same transaction writes an inbox marker keyed by a digest of the message's content
    /// (`malformed:sha256-…`, see [`foreign_marker`]): a redelivery of a message already recorded
    /// (a crash between the commit and the acknowledgement) is acknowledged as
    /// [`Handled::Duplicate`] without a second record, on every broker, including RabbitMQ where
    /// the broker position changes between deliveries. Byte-identical foreign messages on one
    /// destination are therefore recorded once.
    ///
    /// # Errors
    /// Only an acknowledgement error. A store failure negatively acknowledges the message (it
    /// comes back and is recorded then) and returns [`Handled::Retry`].
    pub async fn process_foreign(&self, foreign: ForeignDelivery) -> Result<Handled> {
        let started = Instant::now();
        let (event, lost) = foreign.message.to_event();
        let span = outbox_core::telemetry::handle_span(&self.inner.config.name, &event);
        let outcome = self.record_foreign(foreign, event, lost).instrument(span).await;
        self.inner.metrics.record(&outcome, started.elapsed());
        outcome
    }

    async fn record_foreign(&self, foreign: ForeignDelivery, event: Event, lost: Vec<String>) -> Result<Handled> {
        let name = self.inner.config.name.as_str();
        let mut error = foreign.describe();
        if !lost.is_empty() {
            error.push_str("; not kept as they were: ");
            error.push_str(&lost.join("; "));
        }
        warn!(target: "outbox.consumer", consumer = name, record_id = %event.id, problem = %foreign.problem, "{error}; recording it as a malformed dead letter");
        let (marker, fingerprint) = foreign_marker(&event);
        let record = DeadLetter::new(name, event, DeadLetterReason::Malformed, error);
        let inbox = &self.inner.inbox;
        let written = async {
            let mut tx = inbox.begin().await?;
            match inbox.mark(&mut tx, name, &marker, &fingerprint).await? {
                MarkOutcome::New => {
                    inbox.dead_letter(&mut tx, &record).await?;
                    inbox.commit(tx).await?;
                    Ok(true)
                }
                // Recorded before (dropping `tx` rolls it back).
                MarkOutcome::Duplicate | MarkOutcome::Conflict { .. } => Ok::<_, Error>(false),
            }
        }
        .await;
        match written {
            Ok(true) => {
                let problem = foreign.problem;
                foreign.ack().await?;
                Ok(Handled::Malformed { problem })
            }
            Ok(false) => {
                debug!(target: "outbox.consumer", consumer = name, marker = %marker, "malformed message recorded before; acknowledged");
                foreign.ack().await?;
                Ok(Handled::Duplicate)
            }
            Err(e) => {
                warn!(target: "outbox.consumer", consumer = name, error = %e, "could not record a malformed message; it will be redelivered");
                foreign.nack().await?;
                Ok(Handled::Retry { attempts: 0, error: e.to_string() })
            }
        }
    }

    /// Handle whatever a subscription received: [`process`](Self::process) for an event,
    /// [`process_foreign`](Self::process_foreign) for anything else.
    ///
    /// # Errors
    /// Only an acknowledgement error.
    pub async fn handle(&self, received: Received) -> Result<Handled> {
        match received {
            Received::Event(d) => self.process(d).await,
            Received::Foreign(f) => self.process_foreign(f).await,
        }
    }

    /// Process deliveries from `subscription` until none arrives within `idle` and none is
    /// held. Returns what happened to each, in receive order. Messages that are not events are
    /// recorded and acknowledged ([`Handled::Malformed`]) and the drain goes on.
    ///
    /// # Behavior
    /// - up to [`max_in_flight`](ConsumerConfig::max_in_flight) deliveries at once; deliveries
    ///   with the same event key (keyless: the same event id) one after the other in receive
    ///   order, each starting only after the one before it was acknowledged or negatively
    ///   acknowledged; different keys concurrently;
    /// - every delivery goes guard → effect → commit → acknowledge, the acknowledgement only
    ///   after the commit;
    /// - it ends when a receive of `idle` brought nothing while nothing was held and nothing
    ///   settled during that receive (a negative acknowledgement hands the delivery back, and
    ///   the drain receives it again);
    /// - on a subscription or acknowledgement error it stops receiving, lets the running
    ///   deliveries finish, leaves the waiting ones unacknowledged and returns the first error.
    ///
    /// # Errors
    /// A subscription or acknowledgement error.
    pub async fn drain(&self, subscription: &mut dyn Subscription, idle: Duration) -> Result<Vec<Handled>> {
        crate::pump::pump(self, subscription, crate::pump::Until::Idle(idle)).await
    }

    /// Process deliveries until `shutdown` is triggered.
    ///
    /// # Behavior
    /// - concurrency and per-key order as in [`drain`](Self::drain);
    /// - a message that is not an event is recorded and acknowledged like any other delivery,
    ///   without a pause;
    /// - subscription errors are logged and the next receive waits `receive_wait` first;
    ///   acknowledgement errors are logged (the broker redelivers; the inbox absorbs it);
    /// - shutdown is noticed between receives (within `receive_wait`): no new receive starts,
    ///   deliveries waiting behind their key are not started, running ones get
    ///   [`shutdown_grace`](ConsumerConfig::shutdown_grace) to finish; whatever is unfinished is
    ///   dropped unacknowledged (its transaction rolls back) and comes back from the broker.
    ///   A receive in progress is awaited, never cancelled.
    ///
    /// # Errors
    /// None today; the signature leaves room for fatal errors.
    pub async fn run(&self, subscription: &mut dyn Subscription, shutdown: &outbox_core::Shutdown) -> Result<()> {
        crate::pump::pump(self, subscription, crate::pump::Until::Shutdown(shutdown)).await.map(|_| ())
    }

    /// Delete markers older than the configured retention.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] when no retention was configured
    /// (markers are then kept forever); the store's error otherwise.
    pub async fn prune_markers(&self) -> Result<u64> {
        let Some(r) = self.inner.config.retention else {
            return Err(Error::config(
                "consumer-inbox",
                "no marker retention configured: markers are kept forever and nothing is pruned",
            ));
        };
        self.inner.inbox.prune_markers(&self.inner.config.name, r.markers()).await
    }

    /// The record of giving up on `event`: the whole event as delivered, so that a replay
    /// publishes exactly what arrived.
    fn dead_letter(&self, event: &Event, reason: DeadLetterReason, error: String) -> DeadLetter {
        DeadLetter::new(self.inner.config.name.clone(), event.clone(), reason, error)
    }
}

/// One delivery being handled, one step at a time:
/// [`guard`](InFlight::guard) → [`apply`](InFlight::apply) → [`commit`](InFlight::commit) →
/// [`acknowledge`](InFlight::acknowledge).
///
/// Dropping it at any point is a crash: the open transaction rolls back and the delivery, never
/// acknowledged, returns to the broker when its subscription goes away.
pub struct InFlight<I: Inbox, H> {
    consumer: Consumer<I, H>,
    /// The delivery's span: every step runs in it.
    span: tracing::Span,
    started: Instant,
    event: Event,
    acker: Option<Box<dyn Acknowledge>>,
    /// The broker's redelivered flag.
    pub redelivered: bool,
    /// The broker's delivery count, if known.
    pub attempt: Option<u32>,
    tx: Option<I::Tx>,
    stage: Stage,
    verdict: Option<Handled>,
}

impl<I: Inbox, H: Handler<I>> InFlight<I, H> {
    /// The event being handled.
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// What will be reported once acknowledged, if already decided.
    pub fn verdict(&self) -> Option<&Handled> {
        self.verdict.as_ref()
    }

    fn retry(&mut self, attempts: u32, e: &Error) -> Error {
        self.tx = None;
        self.verdict = Some(Handled::Retry { attempts, error: e.to_string() });
        e.clone()
    }

    /// Move from `expected` to `next`, or fail: a step called out of order rolls back what is
    /// open, makes the delivery a retry (negatively acknowledged) and stops every later step.
    fn enter(&mut self, step: &str, expected: Stage, next: Stage) -> Result<()> {
        if self.stage == expected {
            self.stage = next;
            return Ok(());
        }
        let e = Error::permanent(
            ErrorKind::InvalidInput,
            "consumer-inbox",
            format!(
                "InFlight::{step} called when the delivery of event {} is {} (it must be {}): the order is guard → \
                 apply → commit → acknowledge; rolled back, it will be negatively acknowledged",
                self.event.id,
                self.stage.name(),
                expected.name()
            ),
        );
        warn!(target: "outbox.consumer", consumer = %self.consumer.inner.config.name, event_id = %self.event.id, "{e}");
        self.stage = Stage::Broken;
        Err(self.retry(0, &e))
    }

    /// Open the transaction and apply the guard that the handler's effect names.
    ///
    /// # Errors
    /// Store errors; the delivery will then be negatively acknowledged.
    /// [`ErrorKind::InvalidInput`] when called more than once.
    pub async fn guard(&mut self) -> Result<()> {
        let span = self.span.clone();
        async {
            self.enter("guard", Stage::Received, Stage::Guarded)?;
            let r = self.guard_inner().await;
            r.map_err(|e| self.retry(0, &e))
        }
        .instrument(span)
        .await
    }

    async fn guard_inner(&mut self) -> Result<()> {
        let c = self.consumer.clone();
        let inbox = &c.inner.inbox;
        let name = c.inner.config.name.as_str();
        let tx = match c.inner.handler.effect() {
            // The transaction opens with the marker in it: one round trip where the store can.
            EffectKind::Additive => {
                let (mut tx, outcome) = inbox.begin_marked(name, &self.event.id, &self.event.fingerprint()).await?;
                match outcome {
                    MarkOutcome::New => {}
                    MarkOutcome::Duplicate => self.verdict = Some(Handled::Duplicate),
                    MarkOutcome::Conflict { stored } => {
                        let msg = format!(
                            "event {} was first delivered with fingerprint {} and now with {}: same id, different content",
                            self.event.id,
                            stored.to_hex(),
                            self.event.fingerprint().to_hex()
                        );
                        warn!(target: "outbox.consumer", consumer = name, event_id = %self.event.id, "{msg}");
                        inbox
                            .dead_letter(&mut tx, &c.dead_letter(&self.event, DeadLetterReason::Conflict, msg))
                            .await?;
                        self.verdict = Some(Handled::Conflict);
                    }
                }
                tx
            }
            EffectKind::Projection => {
                let mut tx = inbox.begin().await?;
                let (subject, version) = c.inner.handler.version(&self.event)?;
                if let VersionOutcome::Stale { current } =
                    inbox.advance_version(&mut tx, name, &subject, version).await?
                {
                    debug!(target: "outbox.consumer", consumer = name, %subject, version, current, "stale projection event");
                    self.verdict = Some(Handled::Stale { current });
                }
                tx
            }
            EffectKind::Notification => {
                let mut tx = inbox.begin().await?;
                match inbox.ledger_state(&mut tx, name, &self.event.id).await? {
                    LedgerState::Done => self.verdict = Some(Handled::Duplicate),
                    LedgerState::Attempted => {
                        let msg = format!(
                            "notification {} was attempted before and its outcome is unknown; not repeating it",
                            self.event.id
                        );
                        inbox
                            .dead_letter(&mut tx, &c.dead_letter(&self.event, DeadLetterReason::Uncertain, msg))
                            .await?;
                        self.verdict = Some(Handled::Uncertain);
                    }
                    LedgerState::Fresh => {
                        // "Attempted" must be durable before the external call.
                        inbox.set_ledger_state(&mut tx, name, &self.event.id, LedgerState::Attempted).await?;
                        inbox.commit(tx).await?;
                        tx = inbox.begin().await?;
                    }
                }
                tx
            }
            EffectKind::Idempotent => inbox.begin().await?,
        };
        self.tx = Some(tx);
        Ok(())
    }

    /// Run the handler's effect on the guard's transaction (skipped for duplicates, stale and
    /// conflicting events).
    ///
    /// # Errors
    /// The handler's error (after counting it durably and, at `max_attempts`, dead-lettering the
    /// event), or a store error; [`ErrorKind::InvalidInput`] when not called right after
    /// [`guard`](InFlight::guard).
    pub async fn apply(&mut self) -> Result<()> {
        let span = self.span.clone();
        self.apply_inner().instrument(span).await
    }

    async fn apply_inner(&mut self) -> Result<()> {
        self.enter("apply", Stage::Guarded, Stage::Applied)?;
        if self.verdict.is_some() {
            return Ok(());
        }
        let c = self.consumer.clone();
        let Some(tx) = self.tx.as_mut() else { return Ok(()) };
        match c.inner.handler.apply(tx, &self.event).await {
            Ok(()) => {
                if c.inner.handler.effect() == EffectKind::Notification {
                    c.inner
                        .inbox
                        .set_ledger_state(tx, &c.inner.config.name, &self.event.id, LedgerState::Done)
                        .await
                        .map_err(|e| self.retry(0, &e))?;
                }
                Ok(())
            }
            Err(e) => {
                self.tx = None; // roll back whatever the handler wrote
                let attempts = match self.handler_failed(&e).await {
                    Ok(n) => n,
                    Err(store) => return Err(self.retry(0, &store)),
                };
                if self.verdict.is_none() {
                    self.verdict = Some(Handled::Retry { attempts, error: e.to_string() });
                }
                Err(e)
            }
        }
    }

    async fn handler_failed(&mut self, e: &Error) -> Result<u32> {
        let c = self.consumer.clone();
        let name = c.inner.config.name.as_str();
        let attempts = c.inner.inbox.record_failure(name, &self.event.id).await?;
        let notification = c.inner.handler.effect() == EffectKind::Notification;
        if attempts >= c.inner.config.max_attempts {
            warn!(target: "outbox.consumer", consumer = name, event_id = %self.event.id, attempts, error = %e, "dead-lettered after repeated handler failures");
            let mut tx = c.inner.inbox.begin().await?;
            let msg = format!("handler failed {attempts} times; last error: {e}");
            c.inner
                .inbox
                .dead_letter(&mut tx, &c.dead_letter(&self.event, DeadLetterReason::HandlerFailed, msg))
                .await?;
            if notification {
                c.inner.inbox.set_ledger_state(&mut tx, name, &self.event.id, LedgerState::Fresh).await?;
            }
            c.inner.inbox.commit(tx).await?;
            self.verdict = Some(Handled::DeadLettered { attempts });
        } else if notification {
            // The handler says the call did not happen: make the next attempt possible.
            let mut tx = c.inner.inbox.begin().await?;
            c.inner.inbox.set_ledger_state(&mut tx, name, &self.event.id, LedgerState::Fresh).await?;
            c.inner.inbox.commit(tx).await?;
        }
        Ok(attempts)
    }

    /// Commit guard and effect together.
    ///
    /// # Errors
    /// The store's commit error (a concurrent duplicate, a lost connection); the delivery will
    /// be negatively acknowledged and its redelivery finds the marker or applies once;
    /// [`ErrorKind::InvalidInput`] when not called right after [`apply`](InFlight::apply).
    pub async fn commit(&mut self) -> Result<()> {
        let span = self.span.clone();
        self.commit_inner().instrument(span).await
    }

    async fn commit_inner(&mut self) -> Result<()> {
        self.enter("commit", Stage::Applied, Stage::Committed)?;
        let Some(tx) = self.tx.take() else { return Ok(()) };
        match self.consumer.inner.inbox.commit(tx).await {
            Ok(()) => {
                if self.verdict.is_none() {
                    self.verdict = Some(Handled::Applied);
                }
                Ok(())
            }
            Err(e) => Err(self.retry(0, &e)),
        }
    }

    /// Acknowledge (or, when the event is to be retried, negatively acknowledge) the delivery.
    /// Called after [`commit`](InFlight::commit); calling it earlier is treated as a failure
    /// and negatively acknowledges, so an acknowledgement can never precede the commit.
    ///
    /// The outcome is counted here (see the crate's metrics), once per delivery.
    ///
    /// # Errors
    /// The broker's acknowledgement error.
    pub async fn acknowledge(self) -> Result<Handled> {
        let span = self.span.clone();
        let (inner, started) = (Arc::clone(&self.consumer.inner), self.started);
        let outcome = self.acknowledge_inner().instrument(span).await;
        inner.metrics.record(&outcome, started.elapsed());
        outcome
    }

    async fn acknowledge_inner(mut self) -> Result<Handled> {
        // A failed step may end the delivery early (its verdict set, its transaction gone): that
        // is not uncommitted work. An open transaction or no verdict yet is.
        if self.tx.is_some() || self.verdict.is_none() {
            // Uncommitted work: never acknowledge it. Roll back and hand the delivery back.
            self.tx = None;
            if self.stage != Stage::Broken {
                warn!(target: "outbox.consumer", consumer = %self.consumer.inner.config.name, event_id = %self.event.id, stage = self.stage.name(), "acknowledge called before commit; rolled back, negatively acknowledging");
                self.verdict = Some(Handled::Retry {
                    attempts: 0,
                    error: format!("acknowledge called when the delivery is {}; rolled back", self.stage.name()),
                });
            }
        }
        let verdict = self.verdict.take().unwrap_or(Handled::Retry { attempts: 0, error: "no verdict".into() });
        let Some(acker) = self.acker.take() else { return Ok(verdict) };
        match &verdict {
            Handled::Retry { .. } => acker.nack().await?,
            _ => acker.ack().await?,
        }
        Ok(verdict)
    }

    /// Give up without acknowledging (the suite's "acknowledgement lost"): the transaction, if
    /// still open, rolls back and the delivery stays unacknowledged until its subscription ends.
    pub fn abandon(self) {}
}

/// Whether deliveries of a handler with this effect may share a transaction: a marker or a
/// version lives in the effect's transaction alone; a notification's ledger commits before its
/// external call, and an idempotent effect has no guard.
fn shares_transactions(effect: EffectKind) -> bool {
    matches!(effect, EffectKind::Additive | EffectKind::Projection)
}

/// The inbox marker that makes recording a foreign message idempotent: `malformed:sha256-<32 hex
/// digits>` of the content the record keeps (destination, key, headers, payload; not the broker
/// position, which RabbitMQ changes between deliveries, and not the `x-delivery-count` header a
/// RabbitMQ quorum queue adds), and that content's fingerprint.
pub fn foreign_marker(record: &Event) -> (EventId, Fingerprint) {
    let mut content = record.clone();
    content.headers.retain(|name, _| !name.eq_ignore_ascii_case("x-delivery-count"));
    let fingerprint = content.fingerprint();
    let hex: String = fingerprint.0.iter().take(16).map(|b| format!("{b:02x}")).collect();
    let id = EventId::new(format!("{}sha256-{hex}", outbox_core::broker::MALFORMED_ID_PREFIX))
        .expect("\"malformed:sha256-\" and 32 hex digits is a valid event id");
    (id, fingerprint)
}
