//! The inbox's own calls, driven directly on committed state: the notification ledger
//! ([`Inbox::ledger_state`], [`Inbox::set_ledger_state`]), projection versions
//! ([`Inbox::advance_version`]) and marker pruning ([`InboxAdmin::prune_markers`]). The consumer runtime trusts both blindly: a ledger that does
//! not read back the last committed state repeats an external call (an email, a charge) or
//! dead-letters one that was done; a version that advances on an equal one applies a redelivered
//! projection event again; a prune that reaches past its consumer or its age lets a
//! redelivery apply an effect again.

use std::time::Duration;

use outbox_core::{Event, EventId, Inbox, InboxAdmin, LedgerState, ManualClock, MarkOutcome, VersionOutcome};

use crate::cases::CaseResult;
use crate::harness::Harness;
use crate::world::{CONSUMER, unique_tag};

/// [`Inbox::ledger_state`]: "`Fresh` when absent"; [`Inbox::set_ledger_state`]: "overwrites the
/// previous state"; with [`Inbox::begin`]'s "nothing written on it is visible to others before
/// `commit`". The runtime's path for a notification (Fresh, Attempted committed before the call,
/// Done with the effect), its path after a failed call (back to Fresh), a dropped transaction, and
/// another consumer's entry for the same event; each state read back in a transaction of its own.
pub(crate) async fn ledger_reads_back_the_last_committed_state<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "inbox_ledger_reads_back_the_last_committed_state";
    const OTHER: &str = "suite-other-consumer";
    let fx = h.fixture(CASE, ManualClock::default()).await?;
    let inbox = &fx.inbox;
    let tag = unique_tag();
    let (e0, e1) = (EventId::new(format!("{CASE}.{tag}.e0"))?, EventId::new(format!("{CASE}.{tag}.e1"))?);
    let read = |consumer: &'static str, id: EventId| async move {
        let mut tx = inbox.begin().await?;
        let state = inbox.ledger_state(&mut tx, consumer, &id).await?;
        drop(tx);
        Ok::<_, outbox_core::Error>(state)
    };
    let write = |id: EventId, state: LedgerState, commit: bool| async move {
        let mut tx = inbox.begin().await?;
        inbox.set_ledger_state(&mut tx, CONSUMER, &id, state).await?;
        if commit {
            inbox.commit(tx).await?;
        }
        Ok::<_, outbox_core::Error>(())
    };
    let s = read(CONSUMER, e0.clone()).await?;
    ensure!(CASE, s == LedgerState::Fresh, "a notification never attempted reads back as {s:?}, expected Fresh");
    // The runtime's steps for one notification, then a failed call that makes it possible again.
    for state in [LedgerState::Attempted, LedgerState::Done, LedgerState::Fresh, LedgerState::Attempted] {
        write(e0.clone(), state, true).await?;
        let s = read(CONSUMER, e0.clone()).await?;
        ensure!(CASE, s == state, "after {state:?} was committed over the previous state the ledger reads {s:?}");
    }
    let s = read(OTHER, e0.clone()).await?;
    ensure!(CASE, s == LedgerState::Fresh, "another consumer's entry for the same event reads {s:?}, expected Fresh");
    // Written and dropped: nothing of it is durable.
    write(e1.clone(), LedgerState::Done, false).await?;
    let s = read(CONSUMER, e1.clone()).await?;
    ensure!(CASE, s == LedgerState::Fresh, "a Done written in a transaction that was dropped reads back as {s:?}");
    write(e0.clone(), LedgerState::Done, false).await?;
    let s = read(CONSUMER, e0).await?;
    ensure!(CASE, s == LedgerState::Attempted, "a Done dropped over a committed Attempted reads back as {s:?}");
    Ok(CaseResult::Passed(
        "Fresh, Attempted, Done, Fresh, Attempted read back in turn; per consumer; drops not kept".into(),
    ))
}

/// [`InboxAdmin::prune_markers`]: "delete markers of
/// `consumer` committed more than `older_than` ago (store clock)" and "deletes nothing younger
/// than `older_than`; returns how many were deleted". Markers of two consumers, one young
/// marker a millisecond on each side of the age; read back after each prune.
pub(crate) async fn prune_markers_deletes_only_old_markers_of_its_consumer<H: Harness>(
    h: &H,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "inbox_prune_markers_deletes_only_old_markers_of_its_consumer";
    const OTHER: &str = "suite-other-consumer";
    const AGE: Duration = Duration::from_secs(5);
    const MS: Duration = Duration::from_millis(1);
    let clock = ManualClock::default();
    let fx = h.fixture(CASE, clock.clone()).await?;
    let tag = unique_tag();
    let event = |i: usize| -> outbox_core::Result<Event> {
        Ok(Event::new(EventId::new(format!("{CASE}.{tag}.e{i}"))?, fx.destination.clone(), vec![i as u8]))
    };
    let (e0, e1) = (event(0)?, event(1)?);
    let inbox = &fx.inbox;
    let commit_markers = |marks: Vec<(&'static str, Event)>| async move {
        let mut tx = inbox.begin().await?;
        for (consumer, e) in &marks {
            let o = inbox.mark(&mut tx, consumer, &e.id, &e.fingerprint()).await?;
            if o != MarkOutcome::New {
                return Ok(Some(format!("marking {} for {consumer} answered {o:?}", e.id)));
            }
        }
        inbox.commit(tx).await?;
        Ok::<_, outbox_core::Error>(None)
    };
    let ids = |consumer: &'static str| async move {
        Ok::<Vec<String>, outbox_core::Error>(
            inbox.markers(consumer).await?.into_iter().map(|m| m.event_id.as_str().to_owned()).collect(),
        )
    };
    if let Some(why) = commit_markers(vec![(CONSUMER, e0.clone()), (OTHER, e0.clone())]).await? {
        return Ok(CaseResult::fail(CASE, "", why));
    }
    clock.advance(Duration::from_secs(10));
    if let Some(why) = commit_markers(vec![(CONSUMER, e1.clone())]).await? {
        return Ok(CaseResult::fail(CASE, "", why));
    }
    // e0's markers are 15 s old less a millisecond, e1's a millisecond younger than AGE.
    clock.advance(AGE - MS);
    let n = inbox.prune_markers(CONSUMER, AGE).await?;
    let (ours, others) = (ids(CONSUMER).await?, ids(OTHER).await?);
    ensure!(
        CASE,
        n == 1 && ours == [e1.id.as_str()] && others == [e0.id.as_str()],
        "prune_markers({CONSUMER}, {AGE:?}) answered {n} and left {CONSUMER} with {ours:?}, {OTHER} with {others:?}; \
         expected 1, [{}] (its marker younger by 1 ms kept) and [{}] (another consumer's markers are not pruned)",
        e1.id,
        e0.id
    );
    clock.advance(2 * MS);
    let n = inbox.prune_markers(CONSUMER, AGE).await?;
    let (ours, others) = (ids(CONSUMER).await?, ids(OTHER).await?);
    ensure!(
        CASE,
        n == 1 && ours.is_empty() && others == [e0.id.as_str()],
        "a millisecond past {AGE:?}, prune_markers answered {n} and left {CONSUMER} with {ours:?}, {OTHER} with \
         {others:?}; expected 1, [] and [{}]",
        e0.id
    );
    let n = inbox.prune_markers(CONSUMER, AGE).await?;
    ensure!(CASE, n == 0, "a prune with nothing left to delete answered {n}");
    Ok(CaseResult::Passed("only the consumer's markers older than the age were pruned, each counted".into()))
}

/// [`Inbox::advance_version`]: "`Advanced` when absent or older (the new version is written in
/// `tx`)" and "`Stale` when the stored version is equal or newer: nothing is written". A
/// projection event redelivered carries the version it had: only `Stale` keeps the runtime from
/// applying it again.
pub(crate) async fn advance_version_is_stale_for_an_equal_version<H: Harness>(
    h: &H,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "inbox_advance_version_is_stale_for_an_equal_version";
    const OTHER: &str = "suite-other-consumer";
    let fx = h.fixture(CASE, ManualClock::default()).await?;
    let inbox = &fx.inbox;
    let subject = format!("{CASE}.{}", unique_tag());
    let subject = subject.as_str();
    // Each offer in a transaction of its own, committed: what one delivery's guard does.
    let offer = |consumer: &'static str, version: u64| async move {
        let mut tx = inbox.begin().await?;
        let o = inbox.advance_version(&mut tx, consumer, subject, version).await?;
        inbox.commit(tx).await?;
        Ok::<_, outbox_core::Error>(o)
    };
    let steps: [(&'static str, u64, VersionOutcome); 6] = [
        (CONSUMER, 5, VersionOutcome::Advanced { previous: None }),
        (CONSUMER, 5, VersionOutcome::Stale { current: 5 }),
        (CONSUMER, 4, VersionOutcome::Stale { current: 5 }),
        (OTHER, 5, VersionOutcome::Advanced { previous: None }),
        (CONSUMER, 6, VersionOutcome::Advanced { previous: Some(5) }),
        (CONSUMER, 6, VersionOutcome::Stale { current: 6 }),
    ];
    for (i, (consumer, version, expected)) in steps.into_iter().enumerate() {
        let got = offer(consumer, version).await?;
        ensure!(
            CASE,
            got == expected,
            "offer {} ({consumer} at version {version}) answered {got:?}, expected {expected:?}",
            i + 1
        );
    }
    Ok(CaseResult::Passed("5 advanced, 5 and 4 stale, another consumer's 5 advanced, 6 advanced, 6 stale".into()))
}
