//! The inbox's own calls, driven directly on committed state: the notification ledger
//! ([`Inbox::ledger_state`], [`Inbox::set_ledger_state`]), projection versions
//! ([`Inbox::advance_version`]) and marker pruning ([`InboxAdmin::prune_markers`]). The consumer runtime trusts them blindly: a ledger that does
//! not read back the last committed state repeats an external call (an email, a charge) or
//! dead-letters one that was done; a version that advances on an equal one applies a redelivered
//! projection event again; a prune that reaches past its consumer or its age lets a
//! redelivery apply an effect again. The operator's reads ([`InboxAdmin::markers`],
//! [`InboxAdmin::dead_letters`]) come in a documented order with the store's times: a tool that
//! replays dead letters oldest first, or pages markers by event id, relies on both.

use std::time::Duration;

use outbox_core::{
    Clock, DeadLetter, DeadLetterReason, Event, EventId, Inbox, InboxAdmin, LedgerState, ManualClock, MarkOutcome,
    Timestamp, VersionOutcome,
};

use crate::cases::CaseResult;
use crate::harness::Harness;
use crate::world::{CONSUMER, unique_tag};

/// Mark each `(consumer, event)` in one transaction and commit it; what went wrong when a mark
/// does not answer `New` (nothing is committed then).
async fn commit_marks<I: Inbox>(inbox: &I, marks: &[(&str, &Event)]) -> outbox_core::Result<Option<String>> {
    let mut tx = inbox.begin().await?;
    for (consumer, e) in marks {
        let o = inbox.mark(&mut tx, consumer, &e.id, &e.fingerprint()).await?;
        if o != MarkOutcome::New {
            return Ok(Some(format!("marking {} for {consumer} answered {o:?}", e.id)));
        }
    }
    inbox.commit(tx).await?;
    Ok(None)
}

/// The event ids of `consumer`'s committed markers, in the order `markers` returns them.
async fn marker_ids<I: Inbox>(inbox: &I, consumer: &str) -> outbox_core::Result<Vec<String>> {
    Ok(inbox.markers(consumer).await?.into_iter().map(|m| m.event_id.as_str().to_owned()).collect())
}

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
    let ids = |consumer: &'static str| marker_ids(inbox, consumer);
    if let Some(why) = commit_marks(inbox, &[(CONSUMER, &e0), (OTHER, &e0)]).await? {
        return Ok(CaseResult::fail(CASE, "", why));
    }
    clock.advance(Duration::from_secs(10));
    if let Some(why) = commit_marks(inbox, &[(CONSUMER, &e1)]).await? {
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

/// [`InboxAdmin::markers`]: "all markers of `consumer`, in event-id order"; [`InboxAdmin::dead_letters`]:
/// "oldest first (in [`DeadLetter::id`] order)"; [`Inbox::dead_letter`]: "the store assigns its `id`
/// and sets `at` to the commit time (the values in `record` are ignored)". Markers committed out
/// of event-id order, and dead letters whose event ids run against their write order, each
/// written with an `id` and `at` of its own that the store must not keep.
pub(crate) async fn markers_and_dead_letters_read_back_in_their_order<H: Harness>(
    h: &H,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "inbox_markers_and_dead_letters_read_back_in_their_order";
    let clock = ManualClock::default();
    let fx = h.fixture(CASE, clock.clone()).await?;
    let inbox = &fx.inbox;
    let events = crate::cases::numbered_events(CASE, &fx.destination, 5)?;
    // Marked 2 and 0 in one transaction, then 1: committed out of event-id order.
    for batch in [[(CONSUMER, &events[2]), (CONSUMER, &events[0])].as_slice(), &[(CONSUMER, &events[1])]] {
        clock.advance(Duration::from_secs(1));
        if let Some(why) = commit_marks(inbox, batch).await? {
            return Ok(CaseResult::fail(CASE, "", why));
        }
    }
    let marked = marker_ids(inbox, CONSUMER).await?;
    let want: Vec<&str> = events[..3].iter().map(|e| e.id.as_str()).collect();
    ensure!(
        CASE,
        marked == want,
        "markers read back as {marked:?}; expected event-id order {want:?} (committed 2 and 0, then 1)"
    );
    // Dead letters written for 4, then 3: their ids must follow the writes, not the event ids;
    // each record carries an id and a time the store must ignore.
    let mut written: Vec<(Event, Timestamp)> = Vec::new();
    for i in [4, 3] {
        clock.advance(Duration::from_secs(1));
        let e = events[i].clone();
        let mut record = DeadLetter::new(CONSUMER, e.clone(), DeadLetterReason::HandlerFailed, format!("failed {i}"));
        record.id = 7;
        record.at = Timestamp::from_millis(86_400_000);
        let mut tx = inbox.begin().await?;
        inbox.dead_letter(&mut tx, &record).await?;
        inbox.commit(tx).await?;
        written.push((e, clock.now()));
    }
    let letters = inbox.dead_letters(CONSUMER).await?;
    let got: Vec<(&str, i64, Timestamp)> = letters.iter().map(|d| (d.event.id.as_str(), d.id, d.at)).collect();
    let want: Vec<(&str, Timestamp)> = written.iter().map(|(e, at)| (e.id.as_str(), *at)).collect();
    ensure!(
        CASE,
        got.len() == 2 && got.iter().zip(&want).all(|(g, w)| (g.0, g.2) == *w),
        "dead letters read back as (event, id, at) {got:?}; expected the oldest first with the store's clock at each \
         commit: {want:?} (the records were written with id 7 and at {:?}, which the store must ignore)",
        Timestamp::from_millis(86_400_000)
    );
    ensure!(
        CASE,
        got[0].1 < got[1].1,
        "the dead letters' ids {} and {} do not increase in write order",
        got[0].1,
        got[1].1
    );
    ensure!(
        CASE,
        letters.iter().zip(&written).all(|(d, (e, _))| d.event == *e && d.error.starts_with("failed ")),
        "the dead letters do not keep their events and errors: {letters:?}"
    );
    Ok(CaseResult::Passed(format!(
        "markers 0, 1, 2 in event-id order; dead letters of 4 (id {}) and 3 (id {}) at their commit times",
        got[0].1, got[1].1
    )))
}
