//! Key order across batches, retries and relays (the key-order bullets of
//! [`OutboxStore::claim`](outbox_core::OutboxStore::claim)), judged from the rows a claim returns
//! and from the broker's contents after a full drain.
//!
//! Order is a property of the claim, not of one relay: a relay keeps a key in row order within
//! its batch, but only the store can stop the next batch, a retry or another relay from taking a
//! key's later row while an earlier one is backing off, leased elsewhere or parked. So these
//! cases drive the store directly where the claim alone decides, and drive relays (over the
//! [`Faulty`] broker decorator) where the promise is about what reaches the broker.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox_core::store::all_rows;
use outbox_core::{Backoff, ErrorKind, Event, EventId, ParkedHead, Retry, RowId, RowStatus};

use crate::cases::{
    CaseResult, RELAY_WAIT, describe, joined_within, key_order_broken, keyed_fixture, keyed_fixture_with, receive_ids,
    relay_config, row_of,
};
use crate::engines::Engines;
use crate::faults::Faulty;
use crate::harness::Harness;
use crate::world::{LEASE, suite_group, unique_tag};

/// How long a failed row backs off in these cases (the clock is advanced past it by hand).
const BACKOFF: Duration = Duration::from_secs(10);

fn backing_off(owner: &str) -> outbox_core::RelayConfig {
    relay_config(owner).with_backoff(Backoff::new(BACKOFF, BACKOFF).with_jitter(0.0))
}

fn ids(claimed: &[outbox_core::Claimed]) -> Vec<RowId> {
    claimed.iter().map(|c| c.record.row_id).collect()
}

/// Run the relay until a batch claims nothing (bounded).
async fn drain(relay: &dyn crate::engines::RelayUnderTest) -> outbox_core::Result<bool> {
    for _ in 0..20 {
        if relay.run_once().await?.claimed == 0 {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Events with ids unique to this run, keyed as given (`None`: no key), enqueued in one call.
async fn enqueue<H: Harness>(
    fx: &crate::harness::Fixture<H::Inbox>,
    case: &str,
    keys: &[Option<&str>],
) -> outbox_core::Result<(Vec<Event>, Vec<RowId>)> {
    let tag = unique_tag();
    let events: Vec<Event> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let e = Event::new(EventId::new(format!("{case}.{tag}.{i}"))?, fx.destination.clone(), vec![i as u8]);
            Ok(match k {
                Some(k) => e.with_key(*k),
                None => e,
            })
        })
        .collect::<outbox_core::Result<_>>()?;
    let rows = fx.store.enqueue(&events).await?;
    Ok((events, rows))
}

pub(crate) async fn takes_a_prefix_per_key<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "claim_key_order_takes_a_prefix_per_key";
    let clock = outbox_core::ManualClock::default();
    let fx = h.fixture(CASE, clock.clone()).await?;
    // a0 a1 b0 n0 b1 a2 (n0 has no key)
    let (_, r) = enqueue::<H>(&fx, CASE, &[Some("ka"), Some("ka"), Some("kb"), None, Some("kb"), Some("ka")]).await?;
    let (a0, a1, b0, n0, b1, a2) = (r[0], r[1], r[2], r[3], r[4], r[5]);
    let first = fx.store.claim("relay-A", 2, LEASE).await?;
    ensure!(CASE, ids(&first) == [a0, a1], "a claim of 2 returned rows {:?}, expected [{a0}, {a1}]", ids(&first));
    // ka's head is leased by relay-A: its later row a2 waits; kb and the keyless row flow.
    let second = fx.store.claim("relay-B", 10, LEASE).await?;
    ensure!(
        CASE,
        ids(&second) == [b0, n0, b1],
        "while {a0} and {a1} of key ka are leased by relay-A, relay-B claimed {:?}; expected [{b0}, {n0}, {b1}] \
         ({a2} of ka must wait for its earlier rows)",
        ids(&second)
    );
    // relay-A's head fails (backs off) and its second row is released: all of ka waits.
    let o = fx.store.fail(a0, &first[0].lease, BACKOFF, "broker down").await?;
    ensure!(CASE, o == outbox_core::Outcome::Applied, "fail was {o:?}");
    let o = fx.store.release(a1, &first[1].lease).await?;
    ensure!(CASE, o == outbox_core::Outcome::Applied, "release was {o:?}");
    let third = fx.store.claim("relay-C", 10, LEASE).await?;
    ensure!(
        CASE,
        third.is_empty(),
        "while {a0}, the head of ka, backs off, a claim returned {:?}: ka's later rows overtook it",
        ids(&third)
    );
    clock.advance(BACKOFF);
    let fourth = fx.store.claim("relay-C", 10, LEASE).await?;
    ensure!(CASE, ids(&fourth) == [a0, a1, a2], "after the backoff a claim returned {:?}", ids(&fourth));
    Ok(CaseResult::Passed("leased and backing-off heads held back only their key".into()))
}

pub(crate) async fn holds_under_concurrent_claims<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "claim_key_order_holds_under_concurrent_claims";
    const KEYS: usize = 6;
    const PER_KEY: usize = 4;
    const CLAIMERS: usize = 4;
    let fx = h.fixture(CASE, outbox_core::ManualClock::default()).await?;
    let names: Vec<String> = (0..KEYS).map(|k| format!("k{k}")).collect();
    let mut keys: Vec<Option<&str>> = Vec::new();
    for _ in 0..PER_KEY {
        keys.extend(names.iter().map(|n| Some(n.as_str())));
        keys.push(None);
    }
    let (events, rows) = enqueue::<H>(&fx, CASE, &keys).await?;
    let key_of: BTreeMap<RowId, Option<String>> = rows.iter().zip(&events).map(|(r, e)| (*r, e.key.clone())).collect();
    let tasks: Vec<_> = (0..CLAIMERS)
        .map(|i| {
            let store = fx.store.clone();
            tokio::spawn(async move {
                let owner = format!("relay-{i}");
                let mut claims = Vec::new();
                for _ in 0..=rows_total(KEYS, PER_KEY) {
                    let batch = store.claim(&owner, 5, LEASE).await?;
                    if batch.is_empty() {
                        return Ok::<_, outbox_core::Error>((claims, true));
                    }
                    claims.push(ids(&batch));
                }
                Ok((claims, false))
            })
        })
        .collect();
    let mut claims: Vec<Vec<RowId>> = Vec::new();
    for t in tasks {
        let Some((mine, finished)) = joined_within(t, "claimer task").await? else {
            return Ok(CaseResult::fail(CASE, "", format!("a claimer did not finish within {RELAY_WAIT:?}")));
        };
        ensure!(CASE, finished, "a claimer was still getting rows after {} claims", rows_total(KEYS, PER_KEY) + 1);
        claims.extend(mine);
    }
    // Nobody completes: once a claim took a key's first rows, the rest of the key stays behind
    // their live leases. So one claim per key, and it took a prefix of the key.
    let mut taken_by: BTreeMap<String, Vec<(usize, RowId)>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for (i, claim) in claims.iter().enumerate() {
        for row in claim {
            ensure!(CASE, seen.insert(*row), "row {row} was claimed twice under live leases: claims {claims:?}");
            if let Some(Some(k)) = key_of.get(row) {
                taken_by.entry(k.clone()).or_default().push((i, *row));
            }
        }
    }
    for (key, taken) in &taken_by {
        let claims_of_key: BTreeSet<usize> = taken.iter().map(|(i, _)| *i).collect();
        let want: Vec<RowId> =
            rows.iter().filter(|r| key_of[r].as_deref() == Some(key.as_str())).take(taken.len()).copied().collect();
        let got: Vec<RowId> = taken.iter().map(|(_, r)| *r).collect();
        ensure!(
            CASE,
            claims_of_key.len() == 1 && got == want,
            "key {key}: rows {got:?} were taken by claims {claims_of_key:?}; key order allows one claim taking a \
             prefix {want:?} while those leases live (all claims: {claims:?})"
        );
    }
    ensure!(CASE, taken_by.len() == KEYS, "only {} of {KEYS} keys got a claim: {claims:?}", taken_by.len());
    Ok(CaseResult::Passed(format!("{CLAIMERS} claimers, {} claims, every key taken once as a prefix", claims.len())))
}

fn rows_total(keys: usize, per_key: usize) -> usize {
    (keys + 1) * per_key
}

pub(crate) async fn failed_head_holds_back_its_key<H: Harness>(
    h: &H,
    engines: &Engines,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "claim_key_order_failed_head_holds_back_its_key_across_batches";
    let (fx, clock, mut events) = keyed_fixture(h, CASE, &["k1", "k1", "k2"]).await?;
    let wait = h.capabilities().delivery_wait;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let faulty = Faulty::new(fx.broker.clone());
    faulty.fail_next(&events[0].id, ErrorKind::Connection, Retry::Transient);
    let relay = engines.relay(fx.store.clone(), faulty.shared(), backing_off("relay-A"));
    let first = relay.run_once().await?;
    // Later rows of both keys arrive while k1's head backs off.
    let tag = unique_tag();
    let later: Vec<Event> = [("k2", 3), ("k1", 4)]
        .iter()
        .map(|(k, i)| {
            Ok(Event::new(
                EventId::new(format!("{CASE}.{tag}.e{i}"))?,
                fx.destination.clone(),
                format!("credit:{k}:{i}"),
            )
            .with_key(*k))
        })
        .collect::<outbox_core::Result<_>>()?;
    fx.store.enqueue(&later).await?;
    events.extend(later);
    // The next batches, by this relay and by another, while the head backs off.
    let other = engines.relay(fx.store.clone(), faulty.shared(), backing_off("relay-B"));
    relay.run_once().await?;
    other.run_once().await?;
    let rows = all_rows(fx.store.as_ref()).await?;
    let status = |i: usize| row_of(&rows, &events[i]).map(|r| (r.status, describe(r)));
    for i in [1, 4] {
        let Some((st, d)) = status(i) else { return Ok(CaseResult::fail(CASE, "", format!("row {i} missing"))) };
        ensure!(
            CASE,
            st != RowStatus::Published && !faulty.log().accepted.contains(&events[i].id),
            "{} of k1 was published while {}, k1's head, was backing off after a failed publish: {d} (first batch \
             {first:?})",
            events[i].id,
            events[0].id
        );
    }
    for i in [2, 3] {
        let Some((st, d)) = status(i) else { return Ok(CaseResult::fail(CASE, "", format!("row {i} missing"))) };
        ensure!(CASE, st == RowStatus::Published, "k2 did not flow while k1 backed off: {d}");
    }
    clock.advance(BACKOFF);
    ensure!(CASE, drain(relay.as_ref()).await?, "the relay kept claiming rows");
    let rows = all_rows(fx.store.as_ref()).await?;
    for e in &events {
        let r = row_of(&rows, e);
        ensure!(
            CASE,
            r.is_some_and(|r| r.status == RowStatus::Published),
            "after the backoff {} is {}",
            e.id,
            r.map_or("missing".into(), describe)
        );
    }
    let want: Vec<EventId> = events.iter().map(|e| e.id.clone()).collect();
    let received = receive_ids(sub.as_mut(), &want, wait).await?;
    ensure!(CASE, want.iter().all(|id| received.iter().any(|e| &e.id == id)), "not every event reached the broker");
    if let Some((key, want, got)) = key_order_broken(&events, &received) {
        return Ok(CaseResult::fail(
            CASE,
            "",
            format!("key {key} reached the broker as {got:?}, row order is {want:?}"),
        ));
    }
    Ok(CaseResult::Passed(format!("k1 held back behind its failed head, k2 flowed (first batch {first:?})")))
}

pub(crate) async fn two_relays_first_offers_follow_row_order<H: Harness>(
    h: &H,
    engines: &Engines,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "claim_key_order_two_relays_first_offers_follow_row_order";
    const KEYS: usize = 8;
    let names: Vec<String> = (0..KEYS).map(|k| format!("k{k}")).collect();
    let keys: Vec<&str> = (0..3).flat_map(|_| names.iter().map(String::as_str)).collect();
    let (fx, _clock, events) = keyed_fixture(h, CASE, &keys).await?;
    let wait = h.capabilities().delivery_wait;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let faulty = Faulty::new(fx.broker.clone());
    // A takes a round of the first keys; B's batch reaches past the keys A holds.
    let a = engines.relay(fx.store.clone(), faulty.shared(), relay_config("relay-A").with_batch_size(4));
    let b = engines.relay(fx.store.clone(), faulty.shared(), relay_config("relay-B").with_batch_size(12));
    // Relay A claims the first rows and holds its first publish; relay B runs meanwhile.
    let hold = faulty.hold_next();
    let running = tokio::spawn({
        let a = a.clone();
        async move { a.run_once().await }
    });
    if !hold.started.wait(RELAY_WAIT).await {
        running.abort();
        return Ok(CaseResult::fail(CASE, "", format!("relay A started no publish within {RELAY_WAIT:?}")));
    }
    let b_first = b.run_once().await;
    hold.release.open();
    let Some(a_first) = joined_within(running, "relay task").await? else {
        return Ok(CaseResult::fail(CASE, "", format!("relay A did not finish within {RELAY_WAIT:?}")));
    };
    let b_first = b_first?;
    ensure!(CASE, b_first.published > 0, "relay B published nothing while A held one publish: other keys must flow");
    // Then both, alternately, until nothing is left.
    let mut quiet = false;
    for _ in 0..40 {
        let (x, y) = (a.run_once().await?, b.run_once().await?);
        if x.claimed == 0 && y.claimed == 0 {
            quiet = true;
            break;
        }
    }
    ensure!(CASE, quiet, "the relays kept claiming rows");
    let want: Vec<EventId> = events.iter().map(|e| e.id.clone()).collect();
    let received = receive_ids(sub.as_mut(), &want, wait).await?;
    ensure!(CASE, want.iter().all(|id| received.iter().any(|e| &e.id == id)), "not every event reached the broker");
    if let Some((key, want, got)) = key_order_broken(&events, &received) {
        return Ok(CaseResult::fail(
            CASE,
            "",
            format!(
                "key {key} was first offered as {got:?}, row order is {want:?} (publish order {:?})",
                faulty.log().started
            ),
        ));
    }
    Ok(CaseResult::Passed(format!(
        "{} rows of {KEYS} keys; A's held batch {a_first:?}, B meanwhile {b_first:?}",
        events.len()
    )))
}

pub(crate) async fn parked_head_blocks<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "claim_parked_head_blocks_its_key_by_default";
    let (fx, _clock, mut events) = keyed_fixture(h, CASE, &["k1", "k1", "k2"]).await?;
    let wait = h.capabilities().delivery_wait;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let faulty = Faulty::new(fx.broker.clone());
    faulty.fail_next(&events[0].id, ErrorKind::Rejected, Retry::Permanent);
    let relay = engines.relay(fx.store.clone(), faulty.shared(), relay_config("relay-A"));
    ensure!(CASE, drain(relay.as_ref()).await?, "the relay kept claiming rows");
    let tag = unique_tag();
    let later =
        Event::new(EventId::new(format!("{CASE}.{tag}.e3"))?, fx.destination.clone(), "credit:k2:3").with_key("k2");
    fx.store.enqueue(std::slice::from_ref(&later)).await?;
    events.push(later);
    ensure!(CASE, drain(relay.as_ref()).await?, "the relay kept claiming rows");
    let rows = all_rows(fx.store.as_ref()).await?;
    let (Some(r0), Some(r1)) = (row_of(&rows, &events[0]), row_of(&rows, &events[1])) else {
        return Ok(CaseResult::fail(CASE, "", format!("rows missing: {rows:?}")));
    };
    ensure!(CASE, r0.status == RowStatus::Parked, "the permanently failed head is {}", describe(r0));
    ensure!(
        CASE,
        r1.status != RowStatus::Published && !faulty.log().accepted.contains(&events[1].id),
        "{} of k1 was published while {}, k1's head, is parked (ParkedHead::Block is the default): {}",
        events[1].id,
        events[0].id,
        describe(r1)
    );
    for e in [&events[2], &events[3]] {
        let r = row_of(&rows, e);
        ensure!(
            CASE,
            r.is_some_and(|r| r.status == RowStatus::Published),
            "k2 did not flow while k1 was blocked: {}",
            r.map_or("missing".into(), describe)
        );
    }
    // Requeued, the parked row is k1's head again: k1 drains in row order.
    ensure!(CASE, fx.store.requeue_parked(&[r0.row_id]).await? == 1, "requeue of the parked head");
    ensure!(CASE, drain(relay.as_ref()).await?, "the relay kept claiming rows");
    let rows = all_rows(fx.store.as_ref()).await?;
    for e in &events {
        let r = row_of(&rows, e);
        ensure!(
            CASE,
            r.is_some_and(|r| r.status == RowStatus::Published),
            "after the requeue {} is {}",
            e.id,
            r.map_or("missing".into(), describe)
        );
    }
    let want: Vec<EventId> = events.iter().map(|e| e.id.clone()).collect();
    let received = receive_ids(sub.as_mut(), &want, wait).await?;
    ensure!(CASE, want.iter().all(|id| received.iter().any(|e| &e.id == id)), "not every event reached the broker");
    if let Some((key, want, got)) = key_order_broken(&events, &received) {
        return Ok(CaseResult::fail(
            CASE,
            "",
            format!("key {key} reached the broker as {got:?}, row order is {want:?}"),
        ));
    }
    Ok(CaseResult::Passed("parked head blocked k1, k2 flowed; requeued, k1 drained in order".into()))
}

pub(crate) async fn parked_head_skipped<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "claim_parked_head_is_skipped_when_configured";
    let (fx, clock, mut events) = keyed_fixture_with(h, CASE, &["k1", "k1"], ParkedHead::Skip).await?;
    let wait = h.capabilities().delivery_wait;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let faulty = Faulty::new(fx.broker.clone());
    faulty.fail_next(&events[0].id, ErrorKind::Rejected, Retry::Permanent);
    let relay = engines.relay(fx.store.clone(), faulty.shared(), backing_off("relay-A"));
    ensure!(CASE, drain(relay.as_ref()).await?, "the relay kept claiming rows");
    let rows = all_rows(fx.store.as_ref()).await?;
    let (Some(r0), Some(r1)) = (row_of(&rows, &events[0]), row_of(&rows, &events[1])) else {
        return Ok(CaseResult::fail(CASE, "", format!("rows missing: {rows:?}")));
    };
    ensure!(CASE, r0.status == RowStatus::Parked, "the permanently failed head is {}", describe(r0));
    ensure!(
        CASE,
        r1.status == RowStatus::Published,
        "with ParkedHead::Skip, {} of k1 must be published past its parked head: {}",
        events[1].id,
        describe(r1)
    );
    // A later row of k1, then the requeue: the requeued row is k1's head again, so when its
    // publish fails (and backs off) the later row waits for it.
    let tag = unique_tag();
    let later =
        Event::new(EventId::new(format!("{CASE}.{tag}.e2"))?, fx.destination.clone(), "credit:k1:2").with_key("k1");
    fx.store.enqueue(std::slice::from_ref(&later)).await?;
    events.push(later);
    ensure!(CASE, fx.store.requeue_parked(&[r0.row_id]).await? == 1, "requeue of the parked row");
    faulty.fail_next(&events[0].id, ErrorKind::Connection, Retry::Transient);
    ensure!(CASE, drain(relay.as_ref()).await?, "the relay kept claiming rows");
    let rows = all_rows(fx.store.as_ref()).await?;
    let r2 = row_of(&rows, &events[2]);
    ensure!(
        CASE,
        r2.is_some_and(|r| r.status != RowStatus::Published) && !faulty.log().accepted.contains(&events[2].id),
        "{} was published while the requeued {} (k1's head again) backed off: {}",
        events[2].id,
        events[0].id,
        r2.map_or("missing".into(), describe)
    );
    clock.advance(BACKOFF);
    ensure!(CASE, drain(relay.as_ref()).await?, "the relay kept claiming rows");
    let rows = all_rows(fx.store.as_ref()).await?;
    for e in &events {
        let r = row_of(&rows, e);
        ensure!(
            CASE,
            r.is_some_and(|r| r.status == RowStatus::Published),
            "at the end {} is {}",
            e.id,
            r.map_or("missing".into(), describe)
        );
    }
    let want: Vec<EventId> = events.iter().map(|e| e.id.clone()).collect();
    let received = receive_ids(sub.as_mut(), &want, wait).await?;
    ensure!(CASE, want.iter().all(|id| received.iter().any(|e| &e.id == id)), "not every event reached the broker");
    // Skip trades order for availability: e1 overtook the parked e0; e0 still precedes e2.
    let first = |id: &EventId| received.iter().position(|e| &e.id == id);
    ensure!(
        CASE,
        first(&events[0].id) < first(&events[2].id),
        "the requeued head {} reached the broker after the later {}",
        events[0].id,
        events[2].id
    );
    Ok(CaseResult::Passed("parked row passed over; requeued, it was the head again".into()))
}
