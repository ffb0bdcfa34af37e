//! Key-order bullets of [`OutboxStore::claim`](outbox_core::OutboxStore::claim) that only show
//! in the middle of a key, driven on the store directly and judged from the rows a claim returns;
//! and the wake-up signal of [`OutboxStore::wakeup`](outbox_core::OutboxStore::wakeup), judged
//! the way a relay uses it: mark the signals seen, claim, wait.
//!
//! A claim can check a keyed row against its key's head and its direct predecessor in one probe
//! each, and the order cases pass with only that: their blocked row is always a key's head or
//! the row right before the one tested. A row blocked further down a key is different: the row
//! two places after it has an unblocked predecessor and an unblocked head, and only the whole
//! prefix rule ("every earlier unpublished row of its key is claimed in the same call") holds it
//! back.
//!
//! A claim can also apply the key-order rule after it has picked its `limit` rows: key order
//! holds, and every case with fewer rows behind a held row than a claim takes passes. With more,
//! the rows waiting behind the held row fill the pick, all are dropped, and the claim comes back
//! empty while another key's row is claimable, for as long as the row is held (a parked head:
//! until an operator acts).

use std::time::{Duration, Instant};

use outbox_core::store::all_rows;
use outbox_core::{Event, EventId, ManualClock, Outcome, RowId, RowStatus};

use crate::cases::{CaseResult, describe, row_of};
use crate::harness::{Capability, Harness};
use crate::world::{LEASE, unique_tag};

/// How long the blocked middle row backs off (the clock is advanced past it by hand).
const BACKOFF: Duration = Duration::from_secs(10);

fn ids(claimed: &[outbox_core::Claimed]) -> Vec<RowId> {
    claimed.iter().map(|c| c.record.row_id).collect()
}

/// Key order: "a row with a key is claimed only if every earlier unpublished row of its key is
/// claimed in the same call" — also when the blocked earlier row is neither the key's head nor
/// the row's direct predecessor.
pub(crate) async fn blocked_middle_row_holds_back_the_rest_of_its_key<H: Harness>(
    h: &H,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "claim_key_order_blocked_middle_row_holds_back_the_rest_of_its_key";
    let clock = ManualClock::default();
    let fx = h.fixture(CASE, clock.clone()).await?;
    let tag = unique_tag();
    // k0 k1 k2 k3 of key k, then a row without a key.
    let events: Vec<Event> = (0..5)
        .map(|i| {
            let e = Event::new(EventId::new(format!("{CASE}.{tag}.{i}"))?, fx.destination.clone(), vec![i as u8]);
            Ok(if i < 4 { e.with_key("k") } else { e })
        })
        .collect::<outbox_core::Result<_>>()?;
    let r = fx.store.enqueue(&events).await?;
    let (k0, k1, k2, k3, n) = (r[0], r[1], r[2], r[3], r[4]);
    let first = fx.store.claim("relay-A", 2, LEASE).await?;
    ensure!(CASE, ids(&first) == [k0, k1], "a claim of 2 returned {:?}, expected [{k0}, {k1}]", ids(&first));
    // The head goes back as it was (due at once); the row after it backs off: k is blocked in
    // its middle, at k1.
    let o = fx.store.release(k0, &first[0].lease).await?;
    ensure!(CASE, o == Outcome::Applied, "release was {o:?}");
    let o = fx.store.fail(k1, &first[1].lease, BACKOFF, "broker down").await?;
    ensure!(CASE, o == Outcome::Applied, "fail was {o:?}");
    let second = fx.store.claim("relay-B", 10, LEASE).await?;
    ensure!(
        CASE,
        ids(&second) == [k0, n],
        "while {k1} of key k backs off, a claim returned {:?}; expected [{k0}, {n}]: {k2} and {k3} come after \
         {k1} and must wait for it ({k3}'s head {k0} and predecessor {k2} are not blocked, but {k1} is)",
        ids(&second)
    );
    let o = fx.store.complete(k0, &second[0].lease).await?;
    ensure!(CASE, o == outbox_core::Completion::Published, "complete of the head was {o:?}");
    clock.advance(BACKOFF);
    let third = fx.store.claim("relay-C", 10, LEASE).await?;
    ensure!(CASE, ids(&third) == [k1, k2, k3], "after the backoff a claim returned {:?}", ids(&third));
    Ok(CaseResult::Passed("a row backing off in the middle of its key held back every later row of the key".into()))
}

/// Key order: "a row that backs off or is leased by another relay holds back only the later rows
/// of its own key; other keys, and rows without a key, keep flowing", a parked head likewise
/// under `ParkedHead::Block`, and "an empty result means nothing is claimable" — also when more
/// rows wait behind each held row than the claim's limit.
pub(crate) async fn held_key_does_not_crowd_out_other_keys<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "claim_key_order_held_key_does_not_crowd_out_other_keys";
    const LIMIT: usize = 4;
    /// Rows behind each held head: more than one claim takes.
    const BEHIND: usize = LIMIT + 5;
    const HELD: [&str; 3] = ["leased", "backing-off", "parked"];
    let clock = ManualClock::default();
    let fx = h.fixture(CASE, clock.clone()).await?;
    let tag = unique_tag();
    let event = |i: usize, key: Option<&str>| -> outbox_core::Result<Event> {
        let e = Event::new(EventId::new(format!("{CASE}.{tag}.{i}"))?, fx.destination.clone(), vec![i as u8]);
        Ok(match key {
            Some(k) => e.with_key(k),
            None => e,
        })
    };
    // The heads of three keys: one stays leased by another relay, one backs off, one is parked.
    let heads: Vec<Event> =
        HELD.iter().enumerate().map(|(i, k)| event(i, Some(k))).collect::<outbox_core::Result<_>>()?;
    let head_rows = fx.store.enqueue(&heads).await?;
    let first = fx.store.claim("relay-A", HELD.len(), LEASE).await?;
    ensure!(CASE, ids(&first) == head_rows, "a claim of 3 returned {:?}, expected {head_rows:?}", ids(&first));
    let o = fx.store.fail(head_rows[1], &first[1].lease, BACKOFF, "broker down").await?;
    ensure!(CASE, o == Outcome::Applied, "fail was {o:?}");
    let o = fx.store.park(head_rows[2], &first[2].lease, "rejected by the broker").await?;
    ensure!(CASE, o == Outcome::Applied, "park was {o:?}");
    // Behind each held head more rows than a claim of LIMIT takes; then a row of another key and
    // a row without a key.
    let mut later: Vec<Event> = Vec::new();
    for k in HELD {
        for _ in 0..BEHIND {
            later.push(event(HELD.len() + later.len(), Some(k))?);
        }
    }
    later.push(event(HELD.len() + later.len(), Some("other"))?);
    later.push(event(HELD.len() + later.len(), None)?);
    let later_rows = fx.store.enqueue(&later).await?;
    let flowing = &later_rows[later_rows.len() - 2..];
    let claimed = fx.store.claim("relay-B", LIMIT, LEASE).await?;
    ensure!(
        CASE,
        ids(&claimed) == flowing,
        "behind a leased, a backing-off and a parked head wait {BEHIND} rows each; a claim of {LIMIT} returned {:?}, \
         expected {flowing:?} (the row of key other and the row without a key): the rows held back by their key \
         must not take the claim's places",
        ids(&claimed)
    );
    // Read back: the two rows leased to relay-B, every held row and every row behind one as it was.
    let rows = all_rows(fx.store.as_ref()).await?;
    macro_rules! found {
        ($e:expr) => {
            match row_of(&rows, $e) {
                Some(r) => r,
                None => return Ok(CaseResult::fail(CASE, "", format!("{} is missing from the store", $e.id))),
            }
        };
    }
    for (e, c) in later[later.len() - 2..].iter().zip(&claimed) {
        let r = found!(e);
        ensure!(
            CASE,
            r.status == RowStatus::Leased && r.owner.as_deref() == Some("relay-B") && r.token == c.lease.token,
            "the claimed row reads back as {}, expected leased to relay-B with token {}",
            describe(r),
            c.lease.token
        );
    }
    for e in &later[..later.len() - 2] {
        let r = found!(e);
        ensure!(
            CASE,
            r.status == RowStatus::Pending && r.owner.is_none() && r.token == 0,
            "a row behind a held head reads back as {}, expected pending, never claimed (token 0)",
            describe(r)
        );
    }
    let want = [RowStatus::Leased, RowStatus::Pending, RowStatus::Parked];
    for ((e, want), c) in heads.iter().zip(want).zip(&first) {
        let r = found!(e);
        ensure!(
            CASE,
            r.status == want && r.token == c.lease.token,
            "a held head reads back as {}, expected {want:?} with relay-A's token {}",
            describe(r),
            c.lease.token
        );
    }
    Ok(CaseResult::Passed(format!(
        "{BEHIND} rows behind each of a leased, a backing-off and a parked head did not crowd out the other rows"
    )))
}

/// How long a correct store may take to signal an enqueue it has committed (PostgreSQL delivers a
/// notification on its listening connection; the in-process stores at once).
pub(crate) const SIGNAL_WAIT: Duration = Duration::from_secs(10);

/// [`OutboxStore::wakeup`](outbox_core::OutboxStore::wakeup): "rows enqueued through this store
/// trigger a signal no earlier than a claim can find them", with "a signal is a hint: it may be
/// spurious". Driven as a relay drives it: mark the signals seen, claim, and after a claim that
/// missed the rows wait for a signal; the enqueue runs beside the waiting subscriber. A store
/// that never signals, or signals before its rows can be claimed and not again, leaves the
/// subscriber waiting after its last claim missed the rows: an idle relay would publish them
/// only at its next poll. A store without a signal (the trait's default `None`) is reported
/// skipped for capability `wakeup`.
pub(crate) async fn wakeup_signals_an_enqueue_once_a_claim_can_find_it<H: Harness>(
    h: &H,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_wakeup_signals_an_enqueue_once_a_claim_can_find_it";
    const ROWS: usize = 3;
    let fx = h.fixture(CASE, ManualClock::default()).await?;
    let Some(mut wakeup) = fx.store.wakeup() else {
        return Ok(CaseResult::Skipped(Capability::Wakeup));
    };
    let events = crate::cases::numbered_events(CASE, &fx.destination, ROWS)?;
    // An idle relay: it marked the signals seen and its claim found nothing.
    wakeup.mark_seen();
    let none = fx.store.claim("relay-A", ROWS, LEASE).await?;
    ensure!(CASE, none.is_empty(), "a claim on a fresh fixture returned {:?}", ids(&none));
    let store = fx.store.clone();
    let enqueue = tokio::spawn(async move { store.enqueue(&events).await });
    let started = Instant::now();
    let mut claimed = Vec::new();
    let mut signals = 0_usize;
    while claimed.len() < ROWS {
        let left = SIGNAL_WAIT.saturating_sub(started.elapsed());
        if tokio::time::timeout(left, wakeup.wait()).await.is_err() {
            let enqueued = if enqueue.is_finished() { "returned" } else { "not returned" };
            enqueue.abort();
            return Ok(CaseResult::fail(
                CASE,
                "",
                format!(
                    "after {signals} signal(s) the relay's claims had found {} of the {ROWS} rows enqueued; no \
                     signal followed its last claim within {SIGNAL_WAIT:?} (the enqueue had {enqueued}): a relay \
                     would wait for its poll. A signal must come no earlier than a claim can find the rows",
                    claimed.len()
                ),
            ));
        }
        signals += 1;
        wakeup.mark_seen();
        claimed.extend(fx.store.claim("relay-A", ROWS, LEASE).await?);
    }
    let rows = match tokio::time::timeout(SIGNAL_WAIT, enqueue).await {
        Ok(Ok(rows)) => rows?,
        Ok(Err(e)) => return Ok(CaseResult::fail(CASE, "", format!("the enqueue task did not finish: {e}"))),
        Err(_) => {
            return Ok(CaseResult::fail(
                CASE,
                "",
                format!("its rows were claimed but the enqueue had not returned {SIGNAL_WAIT:?} later"),
            ));
        }
    };
    ensure!(
        CASE,
        ids(&claimed) == rows,
        "the claims after the signals returned {:?}, enqueued {rows:?}",
        ids(&claimed)
    );
    // Read back: the rows are leased to the relay that was woken, with the claims' tokens.
    let read = all_rows(fx.store.as_ref()).await?;
    for c in &claimed {
        let r = read.iter().find(|r| r.row_id == c.record.row_id);
        ensure!(
            CASE,
            r.is_some_and(|r| r.status == RowStatus::Leased
                && r.owner.as_deref() == Some("relay-A")
                && r.token == c.lease.token),
            "row {} reads back as {}, expected leased to relay-A with token {}",
            c.record.row_id,
            r.map_or("missing".to_string(), describe),
            c.lease.token
        );
    }
    Ok(CaseResult::Passed(format!(
        "{ROWS} rows claimed after {signals} signal(s), every one leased to the woken relay"
    )))
}
