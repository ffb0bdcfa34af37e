//! The `# Behavior` bullets of [`Broker::publish_batch`](outbox_core::Broker::publish_batch),
//! called on the broker directly and judged from what a subscription then receives.
//!
//! The relay cases reach `publish_batch` only through the relay, which releases every row after
//! a failed one of its key whatever the broker answered; so a broker that reports later events
//! of a failed key `Ok` (and sends them), or that sends a key's events out of slice order
//! within one call, passes those cases. These call it themselves and read the broker's contents
//! back.

use std::collections::BTreeMap;

use outbox_core::{Error, ErrorKind, Event, EventId, ManualClock, Retry};

use crate::cases::{CaseResult, key_order_broken, receive_ids};
use crate::harness::{Fixture, Harness};
use crate::world::{next_bounded, suite_group, unique_tag};

/// A fresh fixture whose destination the suite's group receives, and that backend's delivery
/// wait.
async fn fixture<H: Harness>(h: &H, case: &str) -> outbox_core::Result<(Fixture<H::Inbox>, std::time::Duration)> {
    let fx = h.fixture(case, ManualClock::default()).await?;
    fx.broker.declare(&fx.destination, &[suite_group()]).await?;
    Ok((fx, h.capabilities().delivery_wait))
}

/// Events `0..keys.len()` on the fixture's destination, keyed as given (`None`: no key), with
/// binary payloads (NUL, non-UTF-8) distinct per event and a binary header on every third.
fn events(fx: &Fixture<impl outbox_core::Inbox>, case: &str, keys: &[Option<&str>]) -> outbox_core::Result<Vec<Event>> {
    let tag = unique_tag();
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            let payload = vec![0, 0xff, i as u8, 0xc3, 0x28, 0, b'\n'];
            let mut e = Event::new(EventId::new(format!("{case}.{tag}.e{i}"))?, fx.destination.clone(), payload);
            if i % 3 == 0 {
                e = e.with_header("bin", vec![0, 1, i as u8, 255]);
            }
            Ok(match k {
                Some(k) => e.with_key(*k),
                None => e,
            })
        })
        .collect()
}

/// Receive everything of `want` (bounded), then poll once more for what should not be there;
/// returns every event received, in order.
async fn read_back<I: outbox_core::Inbox>(
    fx: &Fixture<I>,
    want: &[&Event],
    wait: std::time::Duration,
) -> outbox_core::Result<Vec<Event>> {
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let ids: Vec<EventId> = want.iter().map(|e| e.id.clone()).collect();
    let mut got = receive_ids(sub.as_mut(), &ids, wait).await?;
    while let Some(d) = next_bounded(sub.as_mut(), wait).await? {
        got.push(d.event.clone());
        d.ack().await?;
        if got.len() > want.len() * 4 + 8 {
            break;
        }
    }
    Ok(got)
}

/// Each of `want` received exactly once, byte-for-byte, nothing else, and each key's events in
/// slice order; else what is wrong.
fn judge(want: &[&Event], got: &[Event]) -> Option<String> {
    let mut count: BTreeMap<&EventId, usize> = BTreeMap::new();
    for e in got {
        *count.entry(&e.id).or_default() += 1;
    }
    for w in want {
        match count.get(&w.id) {
            None => return Some(format!("{} was never received", w.id)),
            Some(1) => {}
            Some(n) => return Some(format!("{} was received {n} times", w.id)),
        }
        if let Some(g) = got.iter().find(|g| g.id == w.id)
            && g != *w
        {
            return Some(format!("{} did not arrive byte-for-byte: sent {w:?}, received {g:?}", w.id));
        }
    }
    if let Some(extra) = got.iter().find(|g| !want.iter().any(|w| w.id == g.id)) {
        return Some(format!("{} was received but must not have been sent", extra.id));
    }
    let want: Vec<Event> = want.iter().map(|e| (*e).clone()).collect();
    key_order_broken(&want, got).map(|(key, sent, received)| {
        format!("key {key}: sent in the order {sent:?}, received in the order {received:?}")
    })
}

pub(crate) async fn keeps_key_order_and_delivers_each_once<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_publish_batch_keeps_key_order_and_delivers_each_once";
    let (fx, wait) = fixture(h, CASE).await?;
    let (a, b, c) = (Some("a"), Some("b"), Some("c"));
    // Keyed and keyless interleaved; each key's events spread over the whole batch.
    let keys = [a, None, b, a, c, None, b, a, None, c, a, b, None, a, c, b, a, None, b, a, c, a, None, b];
    let events = events(&fx, CASE, &keys)?;
    let results = fx.broker.publish_batch(&events).await;
    ensure!(CASE, results.len() == events.len(), "{} results for {} events", results.len(), events.len());
    for (e, r) in events.iter().zip(&results) {
        ensure!(CASE, r.is_ok(), "{} of a batch without a bad event failed: {r:?}", e.id);
    }
    let want: Vec<&Event> = events.iter().collect();
    let got = read_back(&fx, &want, wait).await?;
    if let Some(problem) = judge(&want, &got) {
        return Ok(CaseResult::fail(CASE, "", problem));
    }
    Ok(CaseResult::Passed(format!("{} events, 3 keys and keyless, each once in key order", events.len())))
}

pub(crate) async fn failed_event_skips_later_of_its_key<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_publish_batch_failed_event_skips_later_of_its_key";
    let (fx, wait) = fixture(h, CASE).await?;
    let (a, b, c) = (Some("a"), Some("b"), Some("c"));
    let keys = [a, b, a, None, a, b, c, a, None, b, c];
    let mut events = events(&fx, CASE, &keys)?;
    // Event 2 (key a) cannot be sent: headers over the limit every broker keeps.
    const BAD: usize = 2;
    events[BAD] =
        events[BAD].clone().with_header("oversized", vec![b'h'; outbox_core::event::DEFAULT_MAX_HEADER_BYTES * 2]);
    let results = fx.broker.publish_batch(&events).await;
    ensure!(CASE, results.len() == events.len(), "{} results for {} events", results.len(), events.len());
    let mut delivered = Vec::new();
    for (i, (e, r)) in events.iter().zip(&results).enumerate() {
        let later_of_a = e.key.as_deref() == Some("a") && i > BAD;
        match r {
            Err(err) if i == BAD => ensure!(
                CASE,
                err.kind() != ErrorKind::Skipped && err.retry() == Retry::Permanent,
                "the oversized {} failed with {:?}/{:?} instead of its own permanent error: {err}",
                e.id,
                err.kind(),
                err.retry()
            ),
            Ok(()) if i == BAD => {
                return Ok(CaseResult::fail(CASE, "", format!("the oversized {} was accepted", e.id)));
            }
            Err(err) if later_of_a => ensure!(
                CASE,
                err.kind() == ErrorKind::Skipped && err.retry() == Retry::Transient,
                "{}, after {} of its key failed, is {:?}/{:?} instead of a transient Skipped: {err}",
                e.id,
                events[BAD].id,
                err.kind(),
                err.retry()
            ),
            Ok(()) if later_of_a => {
                return Ok(CaseResult::fail(
                    CASE,
                    "",
                    format!(
                        "{} was reported Ok although {} of its key failed earlier in the batch",
                        e.id, events[BAD].id
                    ),
                ));
            }
            Err(err) => {
                return Ok(CaseResult::fail(
                    CASE,
                    "",
                    format!("{} of another key (or none) failed: {}", e.id, err_text(err)),
                ));
            }
            Ok(()) => delivered.push(e),
        }
    }
    // The failure was known before anything was sent: the skipped events were never sent.
    let got = read_back(&fx, &delivered, wait).await?;
    if let Some(problem) = judge(&delivered, &got) {
        return Ok(CaseResult::fail(CASE, "", problem));
    }
    Ok(CaseResult::Passed(format!(
        "{}: {:?}; {} others delivered once in key order",
        events[BAD].id,
        results[BAD],
        delivered.len()
    )))
}

pub(crate) async fn unroutable_event_fails_alone<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_publish_batch_unroutable_event_fails_alone";
    let (fx, wait) = fixture(h, CASE).await?;
    let (a, b, z) = (Some("a"), Some("b"), Some("z"));
    let keys = [a, None, b, a, z, None, b, a, None, b, a, None];
    let mut events = events(&fx, CASE, &keys)?;
    // Events 1, 4 and 8 go to a destination nobody declared: each is unroutable on its own,
    // and nothing else of the batch may fail with it (key z has no later event).
    const NOWHERE: [usize; 3] = [1, 4, 8];
    let nowhere = outbox_core::Destination::new(format!("{}-nowhere", fx.destination))?;
    for i in NOWHERE {
        events[i].destination = nowhere.clone();
    }
    let results = fx.broker.publish_batch(&events).await;
    ensure!(CASE, results.len() == events.len(), "{} results for {} events", results.len(), events.len());
    let mut delivered = Vec::new();
    for (i, (e, r)) in events.iter().zip(&results).enumerate() {
        match r {
            Err(err) if NOWHERE.contains(&i) => ensure!(
                CASE,
                err.kind() == ErrorKind::Unroutable,
                "{} to undeclared {nowhere} failed with {} instead of Unroutable",
                e.id,
                err_text(err)
            ),
            Ok(()) if NOWHERE.contains(&i) => {
                return Ok(CaseResult::fail(CASE, "", format!("{} to undeclared {nowhere} was reported Ok", e.id)));
            }
            Err(err) => {
                return Ok(CaseResult::fail(
                    CASE,
                    "",
                    format!(
                        "{} to the declared destination failed beside the unroutable ones: {}",
                        e.id,
                        err_text(err)
                    ),
                ));
            }
            Ok(()) => delivered.push(e),
        }
    }
    let got = read_back(&fx, &delivered, wait).await?;
    if let Some(problem) = judge(&delivered, &got) {
        return Ok(CaseResult::fail(CASE, "", problem));
    }
    Ok(CaseResult::Passed(format!(
        "{} unroutable ({:?}); {} others delivered once in key order",
        NOWHERE.len(),
        results[NOWHERE[0]],
        delivered.len()
    )))
}

pub(crate) async fn empty_is_empty<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_publish_batch_empty_is_empty";
    let (fx, _) = fixture(h, CASE).await?;
    let results = fx.broker.publish_batch(&[]).await;
    ensure!(CASE, results.is_empty(), "an empty batch returned {} results: {results:?}", results.len());
    Ok(CaseResult::Passed("no results".into()))
}

fn err_text(err: &Error) -> String {
    format!("{:?}/{:?}: {err}", err.kind(), err.retry())
}
