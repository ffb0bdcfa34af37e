//! Row transitions outside a relay's claim–publish–complete loop, and the operator's reads: the
//! operator's [`OutboxAdmin::requeue_parked`](outbox_core::OutboxAdmin::requeue_parked), run from
//! tools on ids an operator picked (perhaps from a stale list) beside relays at work, and
//! [`OutboxStore::extend`](outbox_core::OutboxStore::extend), which a relay with a slow publish
//! calls to keep its lease. A requeue that reaches past what it names breaks a live lease or
//! republishes a row; an extend that answers `Applied` without moving the lease lets another relay
//! take a row that is still being published; a release (a relay shutting down) that resets the
//! attempts gives a row that keeps failing a fresh set of retries at every restart, so it is
//! never dead-lettered. [`OutboxAdmin::list_parked`] and
//! [`OutboxAdmin::inspect`] are what those tools page through: a page that ignores its limit
//! reads a whole table into a tool's memory, and one out of row-id order makes a tool that pages
//! by the last id it saw skip rows.
//!
//! [`OutboxAdmin::list_parked`]: outbox_core::OutboxAdmin::list_parked
//! [`OutboxAdmin::inspect`]: outbox_core::OutboxAdmin::inspect

use std::time::Duration;

use outbox_core::store::all_rows;
use outbox_core::{Clock, Completion, Event, EventId, ManualClock, Outcome, RowId, RowStatus};

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
    let events = crate::cases::numbered_events(CASE, &fx.destination, 4)?;
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

/// [`OutboxStore::extend`](outbox_core::OutboxStore::extend): "extend a lease to `now + by`
/// (store clock)" and "the token does not change". Extended halfway through its lease, a row is
/// not claimable past the original expiry, reads back with the new expiry and its token, and
/// completes with the lease it was claimed with.
pub(crate) async fn extend_moves_the_lease_and_keeps_the_token<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_extend_moves_the_lease_and_keeps_the_token";
    let clock = ManualClock::default();
    let fx = h.fixture(CASE, clock.clone()).await?;
    let e = Event::new(EventId::new(format!("{CASE}.{}", unique_tag()))?, fx.destination.clone(), b"x".to_vec());
    let row = fx.store.enqueue(std::slice::from_ref(&e)).await?[0];
    let c = fx.store.claim("relay-A", 1, LEASE).await?;
    ensure!(CASE, c.len() == 1, "a claim returned {} rows", c.len());
    clock.advance(LEASE / 2);
    let o = fx.store.extend(row, &c[0].lease, LEASE).await?;
    ensure!(CASE, o == Outcome::Applied, "extend with the live lease was {o:?}");
    let expected = clock.now().plus(LEASE);
    let rows = all_rows(fx.store.as_ref()).await?;
    let r = rows.iter().find(|r| r.row_id == row);
    ensure!(
        CASE,
        r.is_some_and(|r| r.status == RowStatus::Leased
            && r.owner.as_deref() == Some("relay-A")
            && r.token == c[0].lease.token
            && r.lease_expires_at == Some(expected)),
        "after extend by {LEASE:?} halfway through the lease the row reads back as {} expiring at {:?}; expected \
         leased to relay-A with token {} expiring at {expected:?}",
        r.map_or("missing".to_string(), describe),
        r.and_then(|r| r.lease_expires_at),
        c[0].lease.token
    );
    // Past the expiry the claim gave, before the extended one.
    clock.advance(LEASE * 3 / 4);
    let taken = fx.store.claim("relay-B", 1, LEASE).await?;
    ensure!(
        CASE,
        taken.is_empty(),
        "past the claim's expiry but inside the extended lease, relay-B claimed {:?} (token {:?})",
        taken.iter().map(|c| c.record.row_id).collect::<Vec<_>>(),
        taken.iter().map(|c| c.lease.token).collect::<Vec<_>>()
    );
    let o = fx.store.complete(row, &c[0].lease).await?;
    ensure!(CASE, o == Completion::Published, "completing with the lease the row was claimed with: {o:?}");
    Ok(CaseResult::Passed("the extended lease held past the claim's expiry; same token, completed".into()))
}

/// [`OutboxAdmin::list_parked`](outbox_core::OutboxAdmin::list_parked): "at most `limit` rows, in
/// row-id order", each with its reason and park time (store clock); and
/// [`OutboxAdmin::inspect`](outbox_core::OutboxAdmin::inspect): "at most `limit` rows with
/// `row_id > after`", in row-id order. Three of five rows are parked newest row first, a second
/// apart; both reads are asked for fewer rows than there are.
pub(crate) async fn admin_reads_at_most_limit_in_row_id_order<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_admin_reads_at_most_limit_in_row_id_order";
    let clock = ManualClock::default();
    let fx = h.fixture(CASE, clock.clone()).await?;
    let events = crate::cases::numbered_events(CASE, &fx.destination, 5)?;
    let rows = fx.store.enqueue(&events).await?;
    let c = fx.store.claim("relay-A", 5, LEASE).await?;
    ensure!(CASE, c.len() == 5, "a claim of 5 returned {} rows", c.len());
    let mut parked_at = Vec::new();
    for i in [4, 3, 1] {
        clock.advance(Duration::from_secs(1));
        let Some(claimed) = c.iter().find(|c| c.record.row_id == rows[i]) else {
            return Ok(CaseResult::fail(
                CASE,
                "",
                format!("the claim of all five rows did not return row {}", rows[i]),
            ));
        };
        let o = fx.store.park(rows[i], &claimed.lease, &format!("reason {i}")).await?;
        ensure!(CASE, o == Outcome::Applied, "park of row {} was {o:?}", rows[i]);
        parked_at.push((rows[i], clock.now()));
    }
    let ids = |p: &[outbox_core::ParkedRow]| p.iter().map(|p| p.record.row_id).collect::<Vec<RowId>>();
    let two = fx.store.list_parked(2).await?;
    ensure!(
        CASE,
        ids(&two) == [rows[1], rows[3]],
        "list_parked(2) returned rows {:?}; expected the first two parked rows by row id, {:?} (rows {:?} were \
         parked, the last first)",
        ids(&two),
        [rows[1], rows[3]],
        [rows[4], rows[3], rows[1]]
    );
    let all = fx.store.list_parked(10).await?;
    ensure!(
        CASE,
        ids(&all) == [rows[1], rows[3], rows[4]],
        "list_parked(10) returned rows {:?}, expected {:?}",
        ids(&all),
        [rows[1], rows[3], rows[4]]
    );
    for p in &all {
        let i = rows.iter().position(|r| *r == p.record.row_id).expect("checked above");
        let at = parked_at.iter().find(|(r, _)| *r == p.record.row_id).map(|(_, at)| *at);
        ensure!(
            CASE,
            p.reason == format!("reason {i}") && Some(p.parked_at) == at && p.record.event == events[i],
            "parked row {} reads back with reason {:?} parked at {:?} and event {}; expected reason {:?}, parked at \
             {at:?} (the store clock when it was parked) and event {}",
            p.record.row_id,
            p.reason,
            p.parked_at,
            p.record.event.id,
            format!("reason {i}"),
            events[i].id
        );
    }
    let page = fx.store.inspect(rows[0], 2).await?;
    let page_ids: Vec<RowId> = page.iter().map(|r| r.row_id).collect();
    ensure!(
        CASE,
        page_ids == [rows[1], rows[2]],
        "inspect(after {}, limit 2) returned rows {page_ids:?}; expected the next two by row id, {:?}",
        rows[0],
        [rows[1], rows[2]]
    );
    ensure!(
        CASE,
        page[0].status == RowStatus::Parked && page[1].status == RowStatus::Leased && page[1].event == events[2],
        "inspect's page reads back as [{}, {}], expected the parked row {} and the leased row {}",
        describe(&page[0]),
        describe(&page[1]),
        rows[1],
        rows[2]
    );
    let last = fx.store.inspect(rows[3], 10).await?;
    let last_ids: Vec<RowId> = last.iter().map(|r| r.row_id).collect();
    ensure!(CASE, last_ids == [rows[4]], "inspect(after {}, limit 10) returned rows {last_ids:?}", rows[3]);
    Ok(CaseResult::Passed(
        "list_parked and inspect kept their limits and row-id order; park times and reasons kept".into(),
    ))
}

/// [`OutboxStore::release`](outbox_core::OutboxStore::release): "the row becomes claimable at
/// once, attempts unchanged" — for a row that has failed before (every other case releases a
/// fresh row, whose attempts are 0 either way).
pub(crate) async fn release_keeps_the_attempts_of_a_row_that_failed<H: Harness>(
    h: &H,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_release_keeps_the_attempts_of_a_row_that_failed";
    let (fx, clock, _) = crate::cases::store_fixture(h, CASE, 1).await?;
    for attempt in 1..=2 {
        let c = fx.store.claim("relay-A", 1, LEASE).await?;
        ensure!(CASE, c.len() == 1, "claim {attempt} returned {} rows", c.len());
        let o = fx.store.fail(c[0].record.row_id, &c[0].lease, Duration::from_secs(1), "broker down").await?;
        ensure!(CASE, o == Outcome::Applied, "fail {attempt} was {o:?}");
        clock.advance(Duration::from_secs(1));
    }
    let c = fx.store.claim("relay-A", 1, LEASE).await?;
    ensure!(CASE, c.len() == 1, "the claim after two failures returned {} rows", c.len());
    ensure!(CASE, c[0].record.attempts == 2, "the claim after two failures reads attempts {}", c[0].record.attempts);
    let row = c[0].record.row_id;
    let o = fx.store.release(row, &c[0].lease).await?;
    ensure!(CASE, o == Outcome::Applied, "release with the claim's lease was {o:?}");
    let rows = all_rows(fx.store.as_ref()).await?;
    let r = rows.iter().find(|r| r.row_id == row);
    ensure!(
        CASE,
        r.is_some_and(|r| r.status == RowStatus::Pending && r.attempts == 2 && r.owner.is_none()),
        "after release the row reads back as {}; expected pending, no owner, attempts still 2",
        r.map_or("missing".to_string(), describe)
    );
    let again = fx.store.claim("relay-B", 1, LEASE).await?;
    ensure!(
        CASE,
        again.len() == 1 && again[0].record.attempts == 2,
        "a claim right after the release returned {:?} (attempts {:?}); expected the row at once, attempts 2",
        again.iter().map(|c| c.record.row_id).collect::<Vec<_>>(),
        again.iter().map(|c| c.record.attempts).collect::<Vec<_>>()
    );
    Ok(CaseResult::Passed("released after two failures: pending at once, attempts still 2".into()))
}

/// [`OutboxStore::complete`](outbox_core::OutboxStore::complete): "publishes only if the row's
/// owner and token equal the lease's and the row is neither published nor parked". A relay that
/// parked a row still holds the lease it parked it with; a publish confirmed late, or a batch
/// completed together with others (`complete_many`), must not turn that dead letter into a
/// published row that the operator's list no longer shows. The other token-conditional calls
/// with that lease change nothing either, and the row stays deliverable: requeued, it is claimed
/// and published under a new token.
pub(crate) async fn complete_fences_a_parked_row<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_complete_fences_a_parked_row";
    const REASON: &str = "rejected by the broker";
    let (fx, clock, _) = crate::cases::store_fixture(h, CASE, 1).await?;
    let c = fx.store.claim("relay-A", 1, LEASE).await?;
    ensure!(CASE, c.len() == 1, "the claim of the one pending row returned {} rows", c.len());
    let (row, lease) = (c[0].record.row_id, c[0].lease.clone());
    let o = fx.store.park(row, &lease, REASON).await?;
    ensure!(CASE, o == Outcome::Applied, "park with the claim's lease was {o:?}");
    let done = fx.store.complete(row, &lease).await?;
    ensure!(CASE, done == Completion::Fenced, "complete of the parked row with the lease that parked it was {done:?}");
    let many = fx.store.complete_many(&[(row, lease.clone())]).await?;
    ensure!(CASE, many == [Completion::Fenced], "complete_many of the parked row with its lease was {many:?}");
    let outcomes = [
        ("fail", fx.store.fail(row, &lease, Duration::ZERO, "late failure").await?),
        ("park", fx.store.park(row, &lease, "parked again").await?),
        ("extend", fx.store.extend(row, &lease, LEASE).await?),
        ("release", fx.store.release(row, &lease).await?),
    ];
    for (op, o) in outcomes {
        ensure!(CASE, o == Outcome::Fenced, "{op} of the parked row with the lease that parked it was {o:?}");
    }
    let rows = all_rows(fx.store.as_ref()).await?;
    let r = rows.iter().find(|r| r.row_id == row);
    ensure!(
        CASE,
        r.is_some_and(|r| r.status == RowStatus::Parked
            && r.published_token.is_none()
            && r.last_error.as_deref() == Some(REASON)),
        "after the calls with the parking lease the row reads back as {}; expected parked, unpublished, reason \
         {REASON:?}",
        r.map_or("missing".to_string(), describe)
    );
    let parked = fx.store.list_parked(10).await?;
    ensure!(
        CASE,
        parked.len() == 1 && parked[0].record.row_id == row && parked[0].reason == REASON,
        "list_parked reads {:?}; expected the one row with its reason {REASON:?}",
        parked.iter().map(|p| (p.record.row_id, p.reason.as_str())).collect::<Vec<_>>()
    );
    clock.advance(LEASE * 2);
    let none = fx.store.claim("relay-B", 10, LEASE).await?;
    ensure!(
        CASE,
        none.is_empty(),
        "a claim took the parked row: {:?}",
        none.iter().map(|c| c.record.row_id).collect::<Vec<_>>()
    );
    ensure!(CASE, fx.store.requeue_parked(&[row]).await? == 1, "requeue of the parked row did not count it");
    let again = fx.store.claim("relay-B", 1, LEASE).await?;
    ensure!(
        CASE,
        again.len() == 1 && again[0].record.row_id == row && again[0].lease.token > lease.token,
        "the claim after the requeue returned {:?}; expected the row under a token above {}",
        again.iter().map(|c| (c.record.row_id, c.lease.token)).collect::<Vec<_>>(),
        lease.token
    );
    let done = fx.store.complete(row, &again[0].lease).await?;
    ensure!(CASE, done == Completion::Published, "complete after the requeue and a new claim was {done:?}");
    let r = all_rows(fx.store.as_ref()).await?.into_iter().find(|r| r.row_id == row);
    ensure!(
        CASE,
        r.as_ref().is_some_and(|r| r.status == RowStatus::Published && r.published_token == Some(again[0].lease.token)),
        "the requeued row reads back as {}; expected published by token {}",
        r.as_ref().map_or("missing".to_string(), describe),
        again[0].lease.token
    );
    Ok(CaseResult::Passed("six calls with the parking lease fenced; requeued, published under a new token".into()))
}
