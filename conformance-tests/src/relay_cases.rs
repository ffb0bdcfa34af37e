//! [`Relay::run`](outbox_core::Relay::run)'s promise to run batches back to back while there is
//! work, judged over a backlog of many batches.
//!
//! The other relay cases drive one batch at a time (`run_once`) or stop `run` at its first
//! publish. A relay that, with several batches in flight, waits for a signal nobody sends passes
//! them all: seen in the reference relay itself, when on a store with one writer its claim stage
//! waited for a busy broker or a recorded outcome and the completion stage no longer announced
//! the outcomes it recorded (store-sqlite's relay tests hung; all 57 cases passed). Here `run`
//! drains a backlog of twelve batches at pipeline depth 2 through a store whose completions lag
//! ([`LaggingCompletions`]), with nothing from outside to wake it (no enqueue, no shutdown, no
//! clock advance), and every row and the broker's contents are read back.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::{RowSnapshot, all_rows};
use outbox_core::{BatchReport, Event, EventId, RowStatus};

use crate::cases::{
    CaseResult, RELAY_WAIT, describe, joined_within, key_order_broken, keyed_fixture, not_published_by, receive_ids,
    relay_config, row_of,
};
use crate::engines::{Engines, RelayUnderTest};
use crate::faults::{Faulty, LaggingCompletions};
use crate::harness::Harness;
use crate::world::suite_group;

/// Rows per claim: small, so that the backlog is many batches.
const BATCH: usize = 3;
/// Keys, each with [`ROWS_PER_KEY`] rows interleaved in row order, so that every key's later
/// rows wait for its earlier ones in other batches.
const KEYS: usize = 12;
const ROWS_PER_KEY: usize = 3;
/// How long the drain may take: twelve small batches take milliseconds in memory and well under
/// a second on the real servers; a relay that stops claiming is failed after this, not hung.
const DRAIN_WAIT: Duration = Duration::from_secs(10);
/// Unpublished rows named in a failure (the rest are counted).
const NAMED: usize = 4;

/// `Relay::run` of `relay` until `lagging` has `n` rows completed as published (at most
/// [`DRAIN_WAIT`]), then its shutdown: whether all `n` were, how many were, and the run's
/// totals; or the case's failure when the relay does not stop within [`RELAY_WAIT`].
async fn run_until_published(
    case: &str,
    relay: Arc<dyn RelayUnderTest>,
    lagging: &LaggingCompletions,
    n: usize,
) -> outbox_core::Result<Result<(bool, usize, BatchReport), CaseResult>> {
    let running = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await }
    });
    let drained = lagging.wait_published(n, DRAIN_WAIT).await;
    let published = lagging.published();
    relay.shutdown();
    Ok(match joined_within(running, "relay task").await? {
        Some(totals) => Ok((drained, published, totals)),
        None => Err(CaseResult::fail(
            case,
            "",
            format!("the relay did not stop within {RELAY_WAIT:?} of the shutdown ({published} of {n} rows published)"),
        )),
    })
}

/// The rows of `events` not published, described.
fn unpublished(rows: &[RowSnapshot], events: &[Event]) -> Vec<String> {
    events.iter().filter_map(|e| row_of(rows, e).filter(|r| r.status != RowStatus::Published).map(describe)).collect()
}

/// `relay_run_drains_a_backlog_back_to_back_while_completions_lag`.
pub(crate) async fn run_drains_a_backlog_while_completions_lag<H: Harness>(
    h: &H,
    engines: &Engines,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "relay_run_drains_a_backlog_back_to_back_while_completions_lag";
    let names: Vec<String> = (0..KEYS).map(|k| format!("k{k:02}")).collect();
    let keys: Vec<&str> = (0..ROWS_PER_KEY).flat_map(|_| names.iter().map(String::as_str)).collect();
    let (fx, _clock, events) = keyed_fixture(h, CASE, &keys).await?;
    let wait = h.capabilities().delivery_wait;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let lagging = Arc::new(LaggingCompletions::new(fx.store.clone()));
    let faulty = Faulty::new(fx.broker.clone());
    let config = relay_config("relay-A").with_batch_size(BATCH).with_pipeline_depth(2);
    let relay = engines.relay(lagging.clone(), faulty.shared(), config);
    let (drained, published, totals) = match run_until_published(CASE, relay, &lagging, events.len()).await? {
        Ok(ran) => ran,
        Err(failed) => return Ok(failed),
    };
    let rows = all_rows(fx.store.as_ref()).await?;
    if !drained {
        let pending = unpublished(&rows, &events);
        return Ok(CaseResult::fail(
            CASE,
            "",
            format!(
                "Relay::run had {published} of {} rows completed as published within {DRAIN_WAIT:?} while rows \
                 were due (nothing from outside woke it, as nothing needs to); {} unpublished at the shutdown, \
                 first {:?}; totals {totals:?}",
                events.len(),
                pending.len(),
                &pending[..pending.len().min(NAMED)]
            ),
        ));
    }
    if let Some(row) = not_published_by(&rows, &events, "relay-A") {
        return Ok(CaseResult::fail(CASE, "", row));
    }
    ensure!(
        CASE,
        totals.published == events.len() as u64 && totals.fenced == 0,
        "run reported {totals:?} for {} rows published once each",
        events.len()
    );
    let log = faulty.log();
    if let Some(overlap) = log.overlap() {
        return Ok(CaseResult::fail(CASE, "", overlap));
    }
    let ids: Vec<EventId> = events.iter().map(|e| e.id.clone()).collect();
    let received = receive_ids(sub.as_mut(), &ids, wait).await?;
    let missing: Vec<&EventId> = ids.iter().filter(|id| !received.iter().any(|e| &e.id == *id)).collect();
    ensure!(CASE, missing.is_empty(), "published but never received: {missing:?}");
    if let Some((key, want, got)) = key_order_broken(&events, &received) {
        return Ok(CaseResult::fail(
            CASE,
            "",
            format!("key {key} reached the broker as {got:?}, row order is {want:?}"),
        ));
    }
    Ok(CaseResult::Passed(format!(
        "{} rows of {KEYS} keys in batches of {BATCH} at depth 2, completions lagging: all published; totals {totals:?}",
        events.len()
    )))
}

/// Rows per claim in [`completes_every_row_of_batches_ending_together`]: more than a relay
/// would sensibly complete in one call, so that the batches that end together are completed in
/// parts.
const BIG_BATCH: usize = 1_500;
/// Batches of [`BIG_BATCH`] in that case's backlog: as many as a relay at depth 2 holds between
/// claim and outcome, all of them waiting for the completion stage at once.
const BIG_BATCHES: usize = 3;

/// How long that case's first completion waits for every row to reach the broker: well within
/// [`DRAIN_WAIT`], so that a relay that does not publish ahead of its completions still drains.
const HOLD_FIRST: Duration = Duration::from_secs(2);

/// `relay_run_completes_every_row_of_batches_that_end_together`: a backlog of three batches of
/// 1,500 rows (each row its own key, so the claims overlap) at depth 2, completions lagging, so
/// that the later batches wait for the completion stage together. Every row must end published
/// by the relay under its claim's token: a relay that bounds how many rows one completion takes
/// must complete the rest in another call, not drop them.
pub(crate) async fn completes_every_row_of_batches_ending_together<H: Harness>(
    h: &H,
    engines: &Engines,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "relay_run_completes_every_row_of_batches_that_end_together";
    let names: Vec<String> = (0..BIG_BATCH * BIG_BATCHES).map(|k| format!("k{k}")).collect();
    let keys: Vec<&str> = names.iter().map(String::as_str).collect();
    let (fx, _clock, events) = keyed_fixture(h, CASE, &keys).await?;
    let faulty = Faulty::new(fx.broker.clone());
    // The first batch's completion waits until every row is at the broker: the other two
    // batches then wait for the completion stage together.
    let total = events.len();
    let at_broker = faulty.clone();
    let lagging = Arc::new(
        LaggingCompletions::new(fx.store.clone())
            .with_first_held_until(move || at_broker.accepted() >= total, HOLD_FIRST),
    );
    let config = relay_config("relay-A").with_batch_size(BIG_BATCH).with_pipeline_depth(2);
    let relay = engines.relay(lagging.clone(), faulty.shared(), config);
    let (drained, published, totals) = match run_until_published(CASE, relay, &lagging, events.len()).await? {
        Ok(ran) => ran,
        Err(failed) => return Ok(failed),
    };
    let rows = all_rows(fx.store.as_ref()).await?;
    let open = unpublished(&rows, &events);
    ensure!(
        CASE,
        drained && open.is_empty(),
        "{published} of {} rows completed as published within {DRAIN_WAIT:?}; {} not published at the shutdown \
         ({} publishes accepted by the broker), first {:?}; totals {totals:?}",
        events.len(),
        open.len(),
        faulty.accepted(),
        &open[..open.len().min(NAMED)]
    );
    if let Some(row) = not_published_by(&rows, &events, "relay-A") {
        return Ok(CaseResult::fail(CASE, "", row));
    }
    ensure!(
        CASE,
        totals.published == events.len() as u64 && totals.fenced == 0,
        "run reported {totals:?} for {} rows published once each",
        events.len()
    );
    let accepted = faulty.log().accepted;
    let once: std::collections::HashSet<&EventId> = accepted.iter().collect();
    ensure!(
        CASE,
        accepted.len() == events.len() && once.len() == events.len(),
        "the broker accepted {} publishes of {} distinct events for {} rows (each once expected)",
        accepted.len(),
        once.len(),
        events.len()
    );
    Ok(CaseResult::Passed(format!(
        "{} rows in {BIG_BATCHES} batches of {BIG_BATCH} at depth 2, completions lagging: all published; totals {totals:?}",
        events.len()
    )))
}
