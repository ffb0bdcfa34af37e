//! Cases of the consumer runtime's own loop ([`Consumer::drain`]): what it promises when it
//! holds several deliveries at once.
//!
//! The other consumer cases take one delivery through [`Consumer::process`] at a time, so a loop
//! that ran two events of one key at once, or two copies of one event, would pass them all. Here
//! the deliveries go through the real loop with many in flight, and the verdict is read back
//! from durable state: effect rows, inbox markers, and what the broker still holds afterwards.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_consumer_inbox::{Consumer, ConsumerConfig, EffectKind, Handled, Handler};
use outbox_core::{Event, EventId, Inbox, InboxAdmin, ManualClock, Result};

use crate::cases::CaseResult;
use crate::harness::{EffectRow, EffectTable, Harness};
use crate::world::{CONSUMER, MAX_DELIVERIES, next_bounded, suite_group};

/// The additive credit of the suite, with a handler that gives way to the runtime a number of
/// times before its effect: `later` events of a key give way less, so if two events of one key
/// ever ran at once, the later one would commit first.
struct Staggered<I: Inbox> {
    effects: Arc<dyn EffectTable<I>>,
    per_key: usize,
}

/// `credit:<account>:<position in its key>`.
fn parse(event: &Event) -> Result<(String, i64)> {
    let bad = || outbox_core::Error::invalid_input("suite", format!("unexpected payload of {}", event.id));
    let text = std::str::from_utf8(&event.payload).map_err(|_| bad())?;
    let mut parts = text.splitn(3, ':');
    let (Some("credit"), Some(account), Some(n)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad());
    };
    Ok((account.to_string(), n.parse().map_err(|_| bad())?))
}

#[async_trait]
impl<I: Inbox> Handler<I> for Staggered<I> {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }

    async fn apply(&self, tx: &mut I::Tx, event: &Event) -> Result<()> {
        let (subject, value) = parse(event)?;
        // Earlier events of a key yield more: concurrent events of one key would finish in
        // reverse order. Yields, not sleeps: no time passes, the runtime only polls others first.
        let turns = self.per_key.saturating_sub(usize::try_from(value).unwrap_or(0));
        for _ in 0..turns * 4 {
            tokio::task::yield_now().await;
        }
        self.effects
            .insert(tx, &EffectRow { consumer: CONSUMER.into(), event_id: event.id.clone(), subject, value })
            .await
    }
}

/// `Consumer::drain` with `max_in_flight(8)` over 3 keys × 10 events, every event on the broker
/// twice: one effect per event, one marker per event, each key's effects committed in publish
/// order, and nothing left unacknowledged.
pub(crate) async fn consumer_concurrent_keeps_key_order_and_applies_once<H: Harness>(h: &H) -> Result<CaseResult> {
    concurrent(h, "consumer_concurrent_keeps_key_order_and_applies_once", 1).await
}

/// The same with batch commit ([`ConsumerConfig::with_max_per_commit`] 4): deliveries ready at
/// once share a transaction, and the promises are the same.
pub(crate) async fn consumer_batches_keep_key_order_and_apply_once<H: Harness>(h: &H) -> Result<CaseResult> {
    concurrent(h, "consumer_batches_keep_key_order_and_apply_once", 4).await
}

async fn concurrent<H: Harness>(h: &H, case: &'static str, per_commit: usize) -> Result<CaseResult> {
    const KEYS: usize = 3;
    const PER_KEY: usize = 10;
    let fx = h.fixture(case, ManualClock::default()).await?;
    fx.broker.declare(&fx.destination, &[suite_group()]).await?;
    let wait = h.capabilities().delivery_wait.max(Duration::from_millis(50));
    let tag = crate::world::unique_tag();
    // Publish order: position by position, the keys interleaved, each event twice in a row.
    let mut events = Vec::new();
    for i in 0..PER_KEY {
        for k in 0..KEYS {
            let id = EventId::new(format!("{case}.{tag}.k{k}.e{i}"))?;
            let payload = format!("credit:acct-{tag}-{k}:{i}");
            events.push(Event::new(id, fx.destination.clone(), payload).with_key(format!("{tag}-k{k}")));
        }
    }
    fx.store.enqueue(&events).await?;
    for e in &events {
        fx.broker.publish(e).await?;
        fx.broker.publish(e).await?;
    }
    let consumer = Consumer::new(
        (fx.restart_inbox)(),
        Staggered { effects: fx.effects.clone(), per_key: PER_KEY },
        ConsumerConfig::new(CONSUMER).with_max_attempts(1000).with_max_in_flight(8).with_max_per_commit(per_commit),
    );
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    // Drain until every copy was handled: a fresh member may first have to join its group, so a
    // drain can end before the first delivery; each round is bounded, and so is their number.
    let mut handled: Vec<Handled> = Vec::new();
    let deadline = Instant::now() + wait * 20 + Duration::from_secs(30);
    while handled.len() < 2 * events.len() && Instant::now() < deadline {
        let limit = wait * 10 + Duration::from_secs(60);
        let round = tokio::time::timeout(limit, consumer.drain(sub.as_mut(), wait)).await;
        let Ok(round) = round else {
            return Ok(CaseResult::fail(case, "", format!("Consumer::drain did not end within {limit:?}")));
        };
        handled.extend(round?);
        ensure!(case, handled.len() <= MAX_DELIVERIES, "still receiving after {} deliveries", handled.len());
    }
    ensure!(
        case,
        handled.len() >= 2 * events.len(),
        "{} of {} copies handled before the deadline: {handled:?}",
        handled.len(),
        2 * events.len()
    );

    let ids: BTreeSet<&EventId> = events.iter().map(|e| &e.id).collect();
    let effects: Vec<EffectRow> = fx.effects.rows().await?.into_iter().filter(|r| ids.contains(&r.event_id)).collect();
    let mut per_event: BTreeMap<&EventId, usize> = BTreeMap::new();
    for r in &effects {
        *per_event.entry(&r.event_id).or_default() += 1;
    }
    let twice: Vec<_> = per_event.iter().filter(|(_, n)| **n > 1).collect();
    ensure!(case, twice.is_empty(), "events applied more than once: {twice:?}");
    let missing: Vec<_> = ids.iter().filter(|id| !per_event.contains_key(*id)).collect();
    ensure!(case, missing.is_empty(), "events never applied: {missing:?}");
    let markers: BTreeSet<EventId> =
        fx.inbox.markers(CONSUMER).await?.into_iter().map(|m| m.event_id).filter(|id| ids.contains(id)).collect();
    ensure!(case, markers.len() == events.len(), "{} markers for {} distinct events", markers.len(), events.len());
    // Per key (subject), the effects in commit order must be the key's events in publish order.
    let mut by_key: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for r in &effects {
        by_key.entry(r.subject.as_str()).or_default().push(r.value);
    }
    let in_order: Vec<i64> = (0..PER_KEY as i64).collect();
    for (key, values) in &by_key {
        ensure!(case, *values == in_order, "key {key}: effects committed in order {values:?}, published {in_order:?}");
    }
    // Nothing unacknowledged: a new member of the group receives nothing.
    drop(sub);
    let broker = (fx.restart_broker)();
    let mut again = broker.subscribe(&fx.destination, &suite_group()).await?;
    if let Some(d) = next_bounded(again.as_mut(), wait * 3).await? {
        return Ok(CaseResult::fail(
            case,
            "",
            format!("{} came back after a full drain: a delivery was left unacknowledged", d.event.id),
        ));
    }
    Ok(CaseResult::Passed(format!(
        "{} deliveries, {} applied, {} duplicates",
        handled.len(),
        handled.iter().filter(|h| matches!(h, Handled::Applied)).count(),
        handled.iter().filter(|h| matches!(h, Handled::Duplicate)).count()
    )))
}
