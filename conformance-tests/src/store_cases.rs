//! Key-order bullets of [`OutboxStore::claim`](outbox_core::OutboxStore::claim) that only show
//! in the middle of a key, driven on the store directly and judged from the rows a claim returns.
//!
//! A claim can check a keyed row against its key's head and its direct predecessor in one probe
//! each, and the order cases pass with only that: their blocked row is always a key's head or
//! the row right before the one tested. A row blocked further down a key is different: the row
//! two places after it has an unblocked predecessor and an unblocked head, and only the whole
//! prefix rule ("every earlier unpublished row of its key is claimed in the same call") holds it
//! back.

use std::time::Duration;

use outbox_core::{Event, EventId, ManualClock, Outcome, RowId};

use crate::cases::CaseResult;
use crate::harness::Harness;
use crate::world::{LEASE, unique_tag};

macro_rules! ensure {
    ($case:expr, $cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Ok(CaseResult::fail($case, "", format!($($msg)+)));
        }
    };
}

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
