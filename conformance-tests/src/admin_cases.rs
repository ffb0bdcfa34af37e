//! The operator's calls that change rows: [`OutboxAdmin::requeue_parked`](outbox_core::OutboxAdmin::requeue_parked).
//! It runs from tools, on ids an operator picked (perhaps from a stale list), beside relays at
//! work; a call that reaches past what it names breaks a live lease or republishes a row. The
//! case asks it to do more than it may and reads back what it must have left alone.

use std::time::Duration;

use outbox_core::store::all_rows;
use outbox_core::{Completion, Event, EventId, ManualClock, Outcome, RowStatus};

use crate::cases::{CaseResult, describe};
use crate::harness::Harness;
use crate::world::{LEASE, unique_tag};

/// [`OutboxAdmin::requeue_parked`](outbox_core::OutboxAdmin::requeue_parked): "ids that are not
/// parked are ignored; returns how many rows were requeued", and "make parked rows pending again
/// (attempts reset to 0)". Asked to requeue a published row, a leased one, a failed one backing
/// off and a parked one, it must requeue the parked one alone.
pub(crate) async fn requeue_parked_ignores_rows_that_are_not_parked<H: Harness>(
    h: &H,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_requeue_parked_ignores_rows_that_are_not_parked";
    const BACKOFF: Duration = Duration::from_secs(10);
    let clock = ManualClock::default();
    let fx = h.fixture(CASE, clock.clone()).await?;
    let tag = unique_tag();
    let events: Vec<Event> = (0..4)
        .map(|i| Ok(Event::new(EventId::new(format!("{CASE}.{tag}.{i}"))?, fx.destination.clone(), vec![i as u8])))
        .collect::<outbox_core::Result<_>>()?;
    let rows = fx.store.enqueue(&events).await?;
    let (published, leased, failed, parked) = (rows[0], rows[1], rows[2], rows[3]);
    let c = fx.store.claim("relay-A", 4, LEASE).await?;
    ensure!(CASE, c.len() == 4, "a claim of 4 returned {} rows", c.len());
    let o = fx.store.complete(published, &c[0].lease).await?;
    ensure!(CASE, o == Completion::Published, "complete was {o:?}");
    let o = fx.store.fail(failed, &c[2].lease, BACKOFF, "broker down").await?;
    ensure!(CASE, o == Outcome::Applied, "fail was {o:?}");
    // The parked row failed once first: requeueing must reset its attempts.
    let o = fx.store.fail(parked, &c[3].lease, Duration::ZERO, "broker down").await?;
    ensure!(CASE, o == Outcome::Applied, "fail was {o:?}");
    let again = fx.store.claim("relay-A", 4, LEASE).await?;
    ensure!(
        CASE,
        again.len() == 1 && again[0].record.row_id == parked,
        "after the failure without backoff a claim returned {:?}, expected [{parked}]",
        again.iter().map(|c| c.record.row_id).collect::<Vec<_>>()
    );
    let o = fx.store.park(parked, &again[0].lease, "rejected by the broker").await?;
    ensure!(CASE, o == Outcome::Applied, "park was {o:?}");
    let before = all_rows(fx.store.as_ref()).await?;

    let n = fx.store.requeue_parked(&[published, leased, failed, parked]).await?;
    ensure!(
        CASE,
        n == 1,
        "requeue_parked of a published, a leased, a backing-off and a parked row answered {n}, expected 1"
    );
    let after = all_rows(fx.store.as_ref()).await?;
    for id in [published, leased, failed] {
        let (Some(b), Some(a)) = (before.iter().find(|r| r.row_id == id), after.iter().find(|r| r.row_id == id)) else {
            return Ok(CaseResult::fail(CASE, "", format!("row {id} is missing after requeue_parked")));
        };
        ensure!(
            CASE,
            (a.status, a.token, &a.owner, a.attempts, a.available_at, a.lease_expires_at, a.published_token)
                == (b.status, b.token, &b.owner, b.attempts, b.available_at, b.lease_expires_at, b.published_token),
            "requeue_parked changed a row that was not parked: before {} available at {:?}, after {} available at {:?}",
            describe(b),
            b.available_at,
            describe(a),
            a.available_at
        );
    }
    let r = after.iter().find(|r| r.row_id == parked);
    ensure!(
        CASE,
        r.is_some_and(|r| r.status == RowStatus::Pending && r.attempts == 0),
        "the parked row reads back as {} after requeue_parked, expected pending with attempts reset to 0",
        r.map_or("missing".to_string(), describe)
    );
    let next = fx.store.claim("relay-B", 4, LEASE).await?;
    ensure!(
        CASE,
        next.len() == 1 && next[0].record.row_id == parked,
        "after requeue_parked a claim returned {:?}, expected only the requeued row {parked} (the leased row's \
         lease is live, the failed row backs off, the published row is done)",
        next.iter().map(|c| c.record.row_id).collect::<Vec<_>>()
    );
    let o = fx.store.complete(leased, &c[1].lease).await?;
    ensure!(CASE, o == Completion::Published, "the leased row's owner completed it after requeue_parked: {o:?}");
    Ok(CaseResult::Passed("of four ids only the parked row was requeued, attempts reset; the rest unchanged".into()))
}
