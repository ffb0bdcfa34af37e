//! The named cases. Scenario cases are data — events, an action script, expectations — run by
//! one interpreter; the few that need real concurrency or talk to one component directly are
//! functions. Names follow the failure classes (F1–F11) and the trait `# Behavior` bullets.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_consumer_inbox::{ConsumerConfig, EffectKind, Handled};
use outbox_core::store::all_rows;
use outbox_core::{
    Acknowledge, Backoff, Completion, ConsumerGroup, DeadLetter, DeadLetterReason, Delivery, Destination, ErrorKind,
    Event, EventId, InboxAdmin, Lease, Malformed, ManualClock, Outcome, RelayConfig, Retry, RowSnapshot, RowStatus,
};

use crate::engines::Engines;
use crate::faults::{EffectsThrough, FailingCommit, Faulty};
use crate::harness::{Capability, Foreign, ForeignKind, Harness};
use crate::invariants::{Violation, judge};
use crate::script::{Action, parse_path};
use crate::world::{
    CONSUMER, DurableState, LEASE, MAX_DELIVERIES, World, drain_bounded, next_bounded, suite_consumer,
    suite_consumer_with, suite_group,
};

/// What a case checks after the full drain, beyond the generic invariants.
#[derive(Debug, Clone)]
pub enum Expect {
    /// Sum of effect values for a subject (account balance).
    Balance(&'static str, i64),
    /// Number of inbox markers of the suite's consumer.
    Markers(usize),
    /// Number of dead letters with this reason.
    DeadLetters(&'static str, usize),
    /// At least this many copies of the event at this index on the broker.
    OffersAtLeast(usize, usize),
    /// The effect values in commit order (projections).
    EffectValues(&'static [i64]),
    /// The recovery consumer saw at least one duplicate (the redelivery was a no-op).
    RecoverySawDuplicate,
}

/// How a case runs.
#[derive(Debug, Clone)]
pub enum Body {
    /// An action script over the interpreter.
    Script {
        /// Event payloads, committed in one producer transaction, in row order.
        payloads: &'static [&'static str],
        /// The consumer's named effect.
        kind: EffectKind,
        /// The actions, in text form.
        script: &'static str,
        /// Extra expectations after the drain.
        expect: &'static [Expect],
    },
    /// A function of the suite.
    Function,
}

/// A named case.
#[derive(Debug, Clone)]
pub struct Case {
    /// Test name.
    pub name: &'static str,
    /// Failure class or trait it belongs to.
    pub class: &'static str,
    /// The property it checks, as the design states it.
    pub property: &'static str,
    /// Capabilities it needs.
    pub needs: &'static [Capability],
    /// How it runs.
    pub body: Body,
}

const CREDIT: &str = "credit:acct-1:7";

/// Every case of the suite, in report order.
pub fn all_cases() -> Vec<Case> {
    use Body::{Function, Script};
    use EffectKind::{Additive, Projection};
    vec![
        Case {
            name: "f1_send_crash_expire_resend",
            class: "F1",
            property: "send, crash, lease expiry, resend: one business effect",
            needs: &[],
            body: Script {
                payloads: &[CREDIT],
                kind: Additive,
                script: "claim(A) send(A) crash(A) expire claim(B) send(B) complete(B) check-completed(B,true) \
                         consume commit ack consume commit ack check-effects(0,1)",
                expect: &[Expect::OffersAtLeast(0, 2), Expect::Balance("acct-1", 7), Expect::Markers(1)],
            },
        },
        Case {
            name: "f2_stale_completion_rejected",
            class: "F2",
            property: "claim A, expire, claim B, A completes: stale completion rejected; B's completion accepted",
            needs: &[],
            body: Script {
                payloads: &[CREDIT],
                kind: Additive,
                script: "claim(A) expire claim(B) send(A) complete(A) check-completed(A,false) send(B) complete(B) \
                         check-completed(B,true)",
                expect: &[Expect::OffersAtLeast(0, 2), Expect::Balance("acct-1", 7)],
            },
        },
        Case {
            name: "f3_broker_ack_lost",
            class: "F3",
            property: "broker acknowledgement lost: resend allowed; one effect",
            needs: &[],
            body: Script {
                payloads: &[CREDIT],
                kind: Additive,
                script: "claim(A) lose-confirm(A) claim(A) send(A) complete(A) check-completed(A,true) \
                         consume commit ack consume commit ack",
                expect: &[Expect::OffersAtLeast(0, 2), Expect::Balance("acct-1", 7), Expect::Markers(1)],
            },
        },
        Case {
            name: "f4_consumer_ack_lost",
            class: "F4",
            property: "consumer commits effect, acknowledgement lost: redelivery causes no second effect",
            needs: &[],
            body: Script {
                payloads: &[CREDIT],
                kind: Additive,
                script: "claim(A) send(A) complete(A) receive guard apply commit lose-ack crash(C) check-effects(0,1)",
                expect: &[Expect::Balance("acct-1", 7), Expect::RecoverySawDuplicate],
            },
        },
        Case {
            name: "f5_concurrent_duplicates",
            class: "F5",
            property: "duplicate arrives concurrently: the uniqueness constraint serializes the effect; one effect",
            needs: &[],
            body: Function,
        },
        Case {
            name: "f6_projection_never_regresses",
            class: "F6",
            property: "event arrives after a newer version: projection does not move backward",
            needs: &[],
            body: Script {
                payloads: &["proj:order-1:1", "proj:order-1:3", "proj:order-1:2"],
                kind: Projection,
                script: "claim(A) send(A) send(A) complete(A) claim(A) send(A) complete(A) \
                         consume commit ack consume commit ack consume commit ack",
                expect: &[Expect::EffectValues(&[1, 3])],
            },
        },
        Case {
            name: "f7_crash_after_marker_before_effect",
            class: "F7",
            property: "crash after the marker, before the effect: neither marker nor effect; redelivery applies once",
            needs: &[],
            body: Script {
                payloads: &[CREDIT],
                kind: Additive,
                script: "claim(A) send(A) complete(A) receive guard crash(C) check-marker(0,false) check-effects(0,0)",
                expect: &[Expect::Balance("acct-1", 7), Expect::Markers(1)],
            },
        },
        Case {
            name: "f8_crash_after_effect_before_commit",
            class: "F8",
            property: "crash after the effect, before commit: neither marker nor effect; redelivery applies once",
            needs: &[],
            body: Script {
                payloads: &[CREDIT],
                kind: Additive,
                script: "claim(A) send(A) complete(A) receive guard apply crash(C) check-marker(0,false) \
                         check-effects(0,0)",
                expect: &[Expect::Balance("acct-1", 7), Expect::Markers(1)],
            },
        },
        Case {
            name: "f9_crash_after_commit_before_ack",
            class: "F9",
            property: "crash after commit, before ack: both marker and effect; redelivery is a no-op",
            needs: &[],
            body: Script {
                payloads: &[CREDIT],
                kind: Additive,
                script: "claim(A) send(A) complete(A) receive guard apply commit crash(C) check-marker(0,true) \
                         check-effects(0,1)",
                expect: &[Expect::Balance("acct-1", 7), Expect::Markers(1), Expect::RecoverySawDuplicate],
            },
        },
        Case {
            name: "f10_same_id_different_payload",
            class: "F10",
            property: "same event id, different payload: conflict reported; no second effect",
            needs: &[],
            body: Script {
                payloads: &[CREDIT],
                kind: Additive,
                script: "claim(A) send(A) complete(A) consume commit ack inject(0,credit:acct-1:9) consume commit ack",
                expect: &[Expect::Balance("acct-1", 7), Expect::Markers(1), Expect::DeadLetters("conflict", 1)],
            },
        },
        Case {
            name: "f10_conflict_dead_letter_keeps_the_event",
            class: "F10",
            property: "the conflict's dead letter keeps destination, key, headers (binary values) and payload \
                       byte-for-byte",
            needs: &[],
            body: Function,
        },
        Case {
            name: "f11_a7_b7_a7_c0",
            class: "F11",
            property: "deliver a:7, b:7, a:7, c:0: balance 14, three markers",
            needs: &[],
            body: Script {
                payloads: &["credit:acct-1:7", "credit:acct-1:7", "credit:acct-1:0"],
                kind: Additive,
                script: "claim(A) send(A) send(A) complete(A) inject(0) claim(A) send(A) complete(A) \
                         consume commit ack consume commit ack consume commit ack consume commit ack",
                expect: &[Expect::Balance("acct-1", 14), Expect::Markers(3)],
            },
        },
        Case {
            name: "f11_c0_a7_b7_a7",
            class: "F11",
            property: "deliver c:0, a:7, b:7, a:7 (the other order): balance 14, three markers",
            needs: &[],
            body: Script {
                payloads: &["credit:acct-1:7", "credit:acct-1:7", "credit:acct-1:0"],
                kind: Additive,
                script: "inject(2) inject(0) inject(1) inject(0) consume commit ack consume commit ack \
                         consume commit ack consume commit ack",
                expect: &[Expect::Balance("acct-1", 14), Expect::Markers(3)],
            },
        },
        Case {
            name: "broker_roundtrip_bytes",
            class: "Broker::publish",
            property: "event id, key, headers and payload arrive byte-for-byte (NUL, non-UTF-8)",
            needs: &[],
            body: Function,
        },
        Case {
            name: "broker_unacked_redelivered_after_consumer_goes_away",
            class: "Broker::subscribe",
            property: "an unacknowledged delivery comes back after its subscription is dropped",
            needs: &[],
            body: Function,
        },
        Case {
            name: "broker_held_delivery_is_not_handed_to_another_live_member",
            class: "Subscription::receive",
            property: "a member that joins the group while another holds a delivery unacknowledged never \
                       receives it; the holder then acknowledges it",
            needs: &[Capability::HeldWhileLive],
            body: Function,
        },
        Case {
            name: "broker_acked_not_redelivered",
            class: "Broker::subscribe",
            property: "an acknowledged delivery is not delivered to the group again",
            needs: &[],
            body: Function,
        },
        Case {
            name: "broker_declare_twice_loses_nothing",
            class: "Broker::declare",
            property: "declaring a destination and its group again, with one delivery acknowledged and one held, \
                       is not an error and loses nothing: the held one and a later one still reach the group, the \
                       acknowledged one does not",
            needs: &[],
            body: Function,
        },
        Case {
            name: "broker_nack_redelivers",
            class: "Acknowledge::nack",
            property: "a negative acknowledgement makes the message come back",
            needs: &[Capability::Nack],
            body: Function,
        },
        Case {
            name: "broker_redelivery_is_flagged",
            class: "Broker::subscribe",
            property: "a redelivery carries the redelivered flag or a delivery count above 1",
            needs: &[Capability::RedeliveryInfo],
            body: Function,
        },
        Case {
            name: "broker_unroutable_is_error",
            class: "Broker::publish",
            property: "publishing to a destination that cannot route is an Unroutable error",
            needs: &[Capability::DetectsUnroutable],
            body: Function,
        },
        Case {
            name: "broker_unbound_destination_is_unroutable_or_retained",
            class: "Broker::publish",
            property: "a publish to a declared destination no group is bound to is an Unroutable error (the row \
                       stays unpublished) or is kept for a group that joins later; never accepted and dropped",
            needs: &[],
            body: Function,
        },
        Case {
            name: "broker_groups_receive_only_their_destination",
            class: "Broker::subscribe",
            property: "a group receives only its own destination's events, also when destination and group \
                       names joined with '.' are equal: (d.eu, billing) and (d, eu.billing)",
            needs: &[],
            body: Function,
        },
        Case {
            name: "broker_oversized_message_is_permanent_and_harmless",
            class: "Broker::publish",
            property: "an event with a 2 MiB header value or a 2 MiB payload is refused with a permanent TooLarge \
                       error, and the broker keeps working: an ordinary event published right after is received",
            needs: &[],
            body: Function,
        },
        Case {
            name: "broker_publish_batch_keeps_key_order_and_delivers_each_once",
            class: "Broker::publish_batch",
            property: "a batch of keyed and keyless events, all accepted: each received once, byte-for-byte, \
                       each key's events in slice order",
            needs: &[],
            body: Function,
        },
        Case {
            name: "broker_publish_batch_failed_event_skips_later_of_its_key",
            class: "Broker::publish_batch",
            property: "an event that cannot be sent fails alone with its own error; the later events of its key \
                       are transient Skipped errors and never delivered; other keys and keyless events are delivered",
            needs: &[],
            body: Function,
        },
        Case {
            name: "broker_publish_batch_unroutable_event_fails_alone",
            class: "Broker::publish_batch",
            property: "events to a destination that cannot route fail Unroutable each; the other events of the \
                       batch are accepted and delivered once in key order",
            needs: &[Capability::DetectsUnroutable],
            body: Function,
        },
        Case {
            name: "broker_publish_batch_empty_is_empty",
            class: "Broker::publish_batch",
            property: "an empty slice returns an empty vector",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_claim_skips_live_leases",
            class: "OutboxStore::claim",
            property: "concurrent claims never return a row while its lease is valid; every claim increments the token",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_concurrent_claims_never_share_a_row",
            class: "OutboxStore::claim",
            property: "claimers running at once never get a row while its lease is valid, and each of them \
                       stops once nothing is claimable",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_token_fences_same_owner",
            class: "OutboxStore::complete",
            property: "the token, not the owner name, fences: an older claim by the same owner is rejected",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_complete_many_answers_each_row_as_complete_would",
            class: "OutboxStore::complete_many",
            property: "each row of a batch is published or fenced by its own lease (owner and token), as \
                       complete would answer it; fenced rows change nothing",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_complete_many_takes_rows_of_several_batches",
            class: "OutboxStore::complete_many",
            property: "one call with the rows of fifteen claims of 100 (1,500 rows, each batch its own \
                       token) publishes every row on its own lease, as a relay settling several \
                       batches together passes them",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_transitions_are_token_conditional",
            class: "OutboxStore::fail/park/extend/release",
            property: "a stale token changes nothing",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_fail_backoff_park_requeue_purge",
            class: "OutboxStore::fail/park",
            property: "fail counts an attempt and delays; parked rows are never claimed until requeued",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_purge_published_keeps_open_rows",
            class: "OutboxAdmin::purge_published",
            property: "only published rows older than the age go, oldest publication first, at most `limit` per call; pending, leased and parked rows stay",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_enqueue_is_durable_when_it_returns_under_concurrent_callers",
            class: "OutboxStore::enqueue",
            property: "with several enqueues through one store at once, each returned id reads back through inspect, with its event, pending and never claimed, the moment its enqueue returns",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_enqueue_rejects_bad_batches",
            class: "OutboxStore::enqueue",
            property: "an oversized or duplicate event rejects the whole batch and writes nothing",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_enqueue_rejects_a_bad_batch_beside_other_enqueues",
            class: "OutboxStore::enqueue",
            property: "a batch with a duplicate event, sent at the same moment as another enqueue through the same store (a bad one or a good one), is rejected with Conflict and writes nothing; the good one is written",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_stats",
            class: "OutboxStore::stats",
            property: "counts by status and the age of the oldest pending row",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_extend_moves_the_lease_and_keeps_the_token",
            class: "OutboxStore::extend",
            property: "extended halfway, a lease reads back as now + by with its token, holds off another claim \
                       past the claim's expiry, and completes with the lease the row was claimed with",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_release_keeps_the_attempts_of_a_row_that_failed",
            class: "OutboxStore::release",
            property: "a row released after two failed publishes is pending and claimable at once with attempts \
                       still 2",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_complete_fences_a_parked_row",
            class: "OutboxStore::complete",
            property: "complete and complete_many with the lease that parked a row are fenced and leave it parked \
                       (so do fail, park, extend and release); requeued, it is claimed and published under a new \
                       token",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_admin_reads_at_most_limit_in_row_id_order",
            class: "OutboxAdmin::list_parked, OutboxAdmin::inspect",
            property: "list_parked and inspect return at most their limit, in row-id order (inspect after the id \
                       given), whatever order rows were parked in; each parked row keeps its reason and park time",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_requeue_parked_ignores_rows_that_are_not_parked",
            class: "OutboxAdmin::requeue_parked",
            property: "of a published, a leased, a backing-off and a parked row only the parked one is requeued \
                       (attempts reset, counted); the others read back unchanged and the lease still completes",
            needs: &[],
            body: Function,
        },
        Case {
            name: "inbox_markers_and_dead_letters_read_back_in_their_order",
            class: "InboxAdmin::markers, InboxAdmin::dead_letters, Inbox::dead_letter",
            property: "markers read back in event-id order whatever order they were committed in; dead letters \
                       oldest first, with ids increasing in write order and the store's clock at commit, whatever id \
                       and time the record carried",
            needs: &[],
            body: Function,
        },
        Case {
            name: "inbox_ledger_reads_back_the_last_committed_state",
            class: "Inbox::ledger_state/set_ledger_state",
            property: "Fresh when absent; each committed state overwrites the last (Attempted, Done, Fresh, \
                       Attempted); per consumer; a dropped transaction's state is not kept",
            needs: &[],
            body: Function,
        },
        Case {
            name: "inbox_advance_version_is_stale_for_an_equal_version",
            class: "Inbox::advance_version",
            property: "Advanced when absent or older, Stale when equal or newer (a redelivered projection event), \
                       per consumer",
            needs: &[],
            body: Function,
        },
        Case {
            name: "inbox_prune_markers_deletes_only_old_markers_of_its_consumer",
            class: "InboxAdmin::prune_markers",
            property: "deletes the named consumer's markers older than the age, not one a millisecond younger \
                       and not another consumer's; answers how many",
            needs: &[],
            body: Function,
        },
        Case {
            name: "store_wakeup_signals_an_enqueue_once_a_claim_can_find_it",
            class: "OutboxStore::wakeup",
            property: "an idle subscriber that marked the signals seen is signalled for an enqueue beside it, and \
                       a claim after the signal finds the rows (a spurious signal is allowed, a missing or early \
                       one is not)",
            needs: &[],
            body: Function,
        },
        Case {
            name: "inbox_remove_dead_letters_only_given_ids_and_resets_failures",
            class: "InboxAdmin::remove_dead_letters",
            property: "removes exactly the given ids of the given consumer; a later failure of the event counts \
                       from 1 again",
            needs: &[],
            body: Function,
        },
        Case {
            name: "relay_transient_failure_is_retried_not_completed",
            class: "Relay",
            property: "a row whose publish failed transiently goes back to pending with attempts + 1 and is not \
                       marked published; later rows of its key wait for it",
            needs: &[],
            body: Function,
        },
        Case {
            name: "relay_refused_credentials_release_the_row",
            class: "Relay",
            property: "a publish refused for the relay's credentials (ErrorKind::Auth) releases the row: no attempt \
                       counted, not parked, published once the broker accepts again",
            needs: &[],
            body: Function,
        },
        Case {
            name: "relay_one_key_is_published_one_at_a_time_in_row_order",
            class: "Relay",
            property: "rows of one key are never published concurrently and reach the broker in row order",
            needs: &[],
            body: Function,
        },
        Case {
            name: "relay_batch_that_outlasted_its_lease_halves_the_next_claim",
            class: "Relay",
            property: "after another relay re-claimed a batch whose publish outlasted its lease (its completions \
                       fenced), the next claim asks for at most half as many rows, so two relays cannot take one \
                       batch from each other forever; every row is then published once by the relay's token",
            needs: &[],
            body: Function,
        },
        Case {
            name: "relay_shutdown_releases_unpublished_rows",
            class: "Relay::run",
            property: "on shutdown the publish in flight finishes and is completed; claimed rows not yet \
                       published are released: none stays leased, no attempt is counted",
            needs: &[],
            body: Function,
        },
        Case {
            name: "relay_run_completes_every_row_of_batches_that_end_together",
            class: "Relay::run",
            property: "three batches of 1,500 rows at pipeline depth 2, completions lagging so that two wait \
                       for the completion stage at once: every row ends published by the relay under its claim's \
                       token (a relay bounding the rows of one completion completes the rest, never drops them)",
            needs: &[],
            body: Function,
        },
        Case {
            name: "relay_run_drains_a_backlog_back_to_back_while_completions_lag",
            class: "Relay::run",
            property: "run claims again as long as rows are due: a backlog of many batches at pipeline depth 2, \
                       whose outcomes are recorded late, is published in full with nothing from outside to wake \
                       the relay; each row recorded published once, under its claim's token, each key in row order",
            needs: &[],
            body: Function,
        },
        Case {
            name: "inbox_commit_failure_is_not_acknowledged",
            class: "Inbox::commit / Delivery::ack",
            property: "when the inbox commit fails after the effect, nothing is acknowledged: the delivery comes \
                       back and its effect commits exactly once",
            needs: &[],
            body: Function,
        },
        Case {
            name: "consumer_concurrent_keeps_key_order_and_applies_once",
            class: "Consumer::drain",
            property: "many deliveries in flight: one key's events take effect one at a time in receive order, two \
                       copies of an event apply once, and a full drain leaves nothing unacknowledged",
            needs: &[],
            body: Function,
        },
        Case {
            name: "consumer_batches_keep_key_order_and_apply_once",
            class: "Consumer::drain (max_per_commit)",
            property: "deliveries committed in batches of up to four: one key's events take effect in receive order, \
                       two copies of an event apply once, and a full drain leaves nothing unacknowledged",
            needs: &[],
            body: Function,
        },
        Case {
            name: "consumer_batch_failure_rolls_back_and_each_is_handled_alone",
            class: "Consumer::process_batch",
            property: "a handler error or a conflicting copy inside a batch rolls the whole batch back and \
                       acknowledges none of it; each delivery is then handled alone: the others apply once, the \
                       failing one comes back and is dead-lettered after its attempts, the conflict is dead-lettered",
            needs: &[],
            body: Function,
        },
        Case {
            name: "foreign_message_is_handed_out_not_an_error",
            class: "Subscription::receive",
            property: "messages that are not outbox events (no or bad id, unknown format, bad header name, \
                       duplicate id header, oversized headers, bad key), mixed between events, are received as \
                       foreign: each becomes a malformed dead letter with its raw payload and a reason naming the \
                       problem, every event is effected once, the drain does not stop, and all is acknowledged",
            needs: &[Capability::ForeignMessages],
            body: Function,
        },
        Case {
            name: "foreign_message_is_unacknowledged_until_settled",
            class: "Subscription::receive / Consumer::process_foreign",
            property: "a foreign message whose dead letter fails to commit is not acknowledged: it comes back and \
                       is recorded exactly once",
            needs: &[Capability::ForeignMessages],
            body: Function,
        },
        Case {
            name: "subscription_next_rejects_a_foreign_message_and_goes_on",
            class: "Subscription::next",
            property: "a foreign message before an event is reported by next as a permanent Corrupt error and \
                       rejected: the next call returns the event, and a new member of the group receives neither",
            needs: &[Capability::ForeignMessages],
            body: Function,
        },
        Case {
            name: "foreign_message_redelivered_is_recorded_once",
            class: "Subscription::receive / Consumer::process_foreign",
            property: "a foreign message recorded and then redelivered (the acknowledgement was lost) is \
                       acknowledged without a second dead letter",
            needs: &[Capability::ForeignMessages],
            body: Function,
        },
        Case {
            name: "claim_key_order_takes_a_prefix_per_key",
            class: "OutboxStore::claim",
            property: "key order: a keyed row is claimed only with every earlier unpublished row of its key; a row \
                       that backs off or is leased by another relay holds back only the later rows of its key, \
                       other keys and rows without a key keep flowing",
            needs: &[],
            body: Function,
        },
        Case {
            name: "claim_key_order_blocked_middle_row_holds_back_the_rest_of_its_key",
            class: "OutboxStore::claim",
            property: "key order: a keyed row is claimed only with every earlier unpublished row of its key, also \
                       when the blocked earlier row is neither the key's head nor the row's predecessor",
            needs: &[],
            body: Function,
        },
        Case {
            name: "claim_key_order_held_key_does_not_crowd_out_other_keys",
            class: "OutboxStore::claim",
            property: "key order: rows held back behind a leased, backing-off or parked row do not take a claim's \
                       places, however many wait: other keys and rows without a key are claimed, the held rows \
                       stay untouched",
            needs: &[],
            body: Function,
        },
        Case {
            name: "claim_key_order_holds_under_concurrent_claims",
            class: "OutboxStore::claim",
            property: "key order under claimers running at once (leases held): the rows of a key are taken by one \
                       claim, as a prefix starting at the key's oldest row",
            needs: &[],
            body: Function,
        },
        Case {
            name: "claim_key_order_failed_head_holds_back_its_key_across_batches",
            class: "OutboxStore::claim",
            property: "a failed publish of a key's head (backing off) holds back the key's later rows in the next \
                       batches while another key flows; after a full drain the broker has each key in row order",
            needs: &[],
            body: Function,
        },
        Case {
            name: "claim_key_order_two_relays_first_offers_follow_row_order",
            class: "OutboxStore::claim",
            property: "two relays with small batches over many keys, one holding a publish while the other runs: \
                       per key, the first offers on the broker follow row order",
            needs: &[],
            body: Function,
        },
        Case {
            name: "claim_parked_head_blocks_its_key_by_default",
            class: "OutboxStore::claim",
            property: "a parked head row holds back the later rows of its key (ParkedHead::Block, the default) \
                       while other keys flow; requeued, it is the head again and the key drains in row order",
            needs: &[],
            body: Function,
        },
        Case {
            name: "claim_parked_head_is_skipped_when_configured",
            class: "OutboxStore::claim",
            property: "with ParkedHead::Skip a parked row is passed over and its key flows on; requeued, it is its \
                       key's head again and holds back the rows after it",
            needs: &[Capability::ParkedHeadSkip],
            body: Function,
        },
        Case {
            name: "permutations",
            class: "permutations",
            property: "interleavings with crashes, expiries and lost acks: no lost, duplicated, ghost or stale",
            needs: &[],
            body: Function,
        },
    ]
}

/// A failure, with everything needed to understand and replay it.
#[derive(Debug, Clone)]
pub struct Counterexample {
    /// The case.
    pub case: String,
    /// Seed of a randomized run.
    pub seed: Option<u64>,
    /// The action path (text form; replay with [`crate::replay`]).
    pub path: String,
    /// What broke.
    pub violations: Vec<String>,
    /// What each action did.
    pub trace: Vec<String>,
    /// Durable state after the run.
    pub state: String,
}

impl std::fmt::Display for Counterexample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "counterexample in {}", self.case)?;
        if let Some(seed) = self.seed {
            writeln!(f, "  seed: {seed} (replay: OUTBOX_TEST_SEED={seed})")?;
        }
        writeln!(f, "  path: {}", self.path)?;
        for v in &self.violations {
            writeln!(f, "  violated: {v}")?;
        }
        writeln!(f, "  trace:")?;
        for t in &self.trace {
            writeln!(f, "    {t}")?;
        }
        write!(f, "  durable state:\n{}", self.state)
    }
}

/// The result of one case.
#[derive(Debug, Clone)]
pub enum CaseResult {
    /// Passed, with a note (counts, sizes).
    Passed(String),
    /// Failed.
    Failed(Box<Counterexample>),
    /// Not run: the backend lacks a capability.
    Skipped(Capability),
}

impl CaseResult {
    pub(crate) fn fail(case: &str, path: &str, msg: impl Into<String>) -> Self {
        Self::Failed(Box::new(Counterexample {
            case: case.into(),
            seed: None,
            path: path.into(),
            violations: vec![msg.into()],
            trace: vec![],
            state: String::new(),
        }))
    }
}

fn expectations(state: &DurableState, expect: &[Expect]) -> Vec<Violation> {
    let mut v = Vec::new();
    for e in expect {
        let problem = match e {
            Expect::Balance(acct, total) => {
                let got: i64 = state.effects.iter().filter(|r| r.subject == *acct).map(|r| r.value).sum();
                (got != *total).then(|| format!("balance of {acct} is {got}, expected {total}"))
            }
            Expect::Markers(n) => {
                (state.markers.len() != *n).then(|| format!("{} markers, expected {n}", state.markers.len()))
            }
            Expect::DeadLetters(reason, n) => {
                let got = state.dead_letters.iter().filter(|(_, r)| r == reason).count();
                (got != *n).then(|| format!("{got} dead letters with reason {reason}, expected {n}"))
            }
            Expect::OffersAtLeast(i, n) => {
                let id = &state.events[*i].id;
                let got = state.offers.get(id).copied().unwrap_or(0);
                (got < *n).then(|| format!("{id} is on the broker {got} times, expected at least {n}"))
            }
            Expect::EffectValues(values) => {
                let got: Vec<i64> = state.effects.iter().map(|r| r.value).collect();
                (got != *values).then(|| format!("effect values {got:?}, expected {values:?}"))
            }
            Expect::RecoverySawDuplicate => (!state.recovery.contains(&Handled::Duplicate))
                .then(|| format!("the redelivery was not seen as a duplicate: {:?}", state.recovery)),
        };
        v.extend(problem.map(Violation::Expectation));
    }
    v
}

/// Run a script on a fresh fixture and judge the durable state.
///
/// # Errors
/// Never for contract violations (those are in the result); `Err` only for setup failures.
pub async fn run_script<H: Harness>(
    harness: &H,
    case: &str,
    payloads: &[&str],
    kind: EffectKind,
    path: &[Action],
    expect: &[Expect],
    seed: Option<u64>,
) -> outbox_core::Result<CaseResult> {
    let mut world = World::new(harness, case, payloads, kind).await?;
    let text = crate::script::path_to_string(path);
    let mut violations = Vec::new();
    for a in path {
        if let Err(e) = world.step(a).await {
            if crate::world::is_no_op(&e) {
                world.trace.push(format!("{a} → {e}"));
                continue;
            }
            violations.push(Violation::Expectation(format!("{a}: {e}")));
            break;
        }
    }
    let trace = std::mem::take(&mut world.trace);
    let state = world.finish().await?;
    let judgement = judge(&state, kind);
    violations.extend(judgement.violations);
    violations.extend(expectations(&state, expect));
    if violations.is_empty() {
        return Ok(CaseResult::Passed(format!("duplicates offered: {}", judgement.duplicates_offered)));
    }
    Ok(CaseResult::Failed(Box::new(Counterexample {
        case: case.into(),
        seed,
        path: text,
        violations: violations.iter().map(ToString::to_string).collect(),
        trace,
        state: state.to_string(),
    })))
}

/// Run one case by name, with the reference relay and consumer runtime.
///
/// # Errors
/// Setup failures (server unreachable, fixture could not be built).
pub async fn run_case<H: Harness>(harness: &H, case: &Case) -> outbox_core::Result<CaseResult> {
    run_case_with(harness, case, &Engines::default()).await
}

/// Run one case by name, driving the backend with `engines` (the teeth test passes wrong ones).
///
/// # Errors
/// Setup failures (server unreachable, fixture could not be built).
pub async fn run_case_with<H: Harness>(harness: &H, case: &Case, engines: &Engines) -> outbox_core::Result<CaseResult> {
    let caps = harness.capabilities();
    if let Some(missing) = case.needs.iter().find(|c| !caps.has(**c)) {
        return Ok(CaseResult::Skipped(*missing));
    }
    match &case.body {
        Body::Script { payloads, kind, script, expect } => {
            let path = parse_path(script).map_err(|e| outbox_core::Error::invalid_input("suite", e))?;
            run_script(harness, case.name, payloads, *kind, &path, expect, None).await
        }
        Body::Function => match case.name {
            "f5_concurrent_duplicates" => f5_concurrent_duplicates(harness).await,
            "f10_conflict_dead_letter_keeps_the_event" => f10_conflict_dead_letter_keeps_the_event(harness).await,
            "inbox_remove_dead_letters_only_given_ids_and_resets_failures" => inbox_remove_dead_letters(harness).await,
            "broker_roundtrip_bytes" => broker_roundtrip_bytes(harness).await,
            "broker_unacked_redelivered_after_consumer_goes_away" => broker_unacked_redelivered(harness, false).await,
            "broker_redelivery_is_flagged" => broker_unacked_redelivered(harness, true).await,
            "broker_held_delivery_is_not_handed_to_another_live_member" => {
                broker_held_delivery_is_not_handed_to_another_live_member(harness).await
            }
            "broker_acked_not_redelivered" => broker_acked_not_redelivered(harness, false).await,
            "broker_declare_twice_loses_nothing" => broker_acked_not_redelivered(harness, true).await,
            "broker_nack_redelivers" => broker_nack_redelivers(harness).await,
            "broker_unroutable_is_error" => broker_unroutable_is_error(harness).await,
            "broker_unbound_destination_is_unroutable_or_retained" => {
                broker_unbound_destination(harness, engines).await
            }
            "broker_groups_receive_only_their_destination" => {
                broker_groups_receive_only_their_destination(harness).await
            }
            "broker_oversized_message_is_permanent_and_harmless" => broker_oversized_message(harness).await,
            "broker_publish_batch_keeps_key_order_and_delivers_each_once" => {
                crate::batch_cases::keeps_key_order_and_delivers_each_once(harness).await
            }
            "broker_publish_batch_failed_event_skips_later_of_its_key" => {
                crate::batch_cases::failed_event_skips_later_of_its_key(harness).await
            }
            "broker_publish_batch_unroutable_event_fails_alone" => {
                crate::batch_cases::unroutable_event_fails_alone(harness).await
            }
            "broker_publish_batch_empty_is_empty" => crate::batch_cases::empty_is_empty(harness).await,
            "store_concurrent_claims_never_share_a_row" => store_concurrent_claims(harness).await,
            "store_complete_many_answers_each_row_as_complete_would" => store_complete_many(harness).await,
            "store_complete_many_takes_rows_of_several_batches" => store_complete_many_batches(harness).await,
            "relay_transient_failure_is_retried_not_completed" => relay_transient_failure(harness, engines).await,
            "relay_refused_credentials_release_the_row" => relay_refused_credentials(harness, engines).await,
            "relay_one_key_is_published_one_at_a_time_in_row_order" => relay_key_order(harness, engines).await,
            "relay_batch_that_outlasted_its_lease_halves_the_next_claim" => {
                relay_lease_outlasted(harness, engines).await
            }
            "relay_shutdown_releases_unpublished_rows" => relay_shutdown_releases(harness, engines).await,
            "relay_run_completes_every_row_of_batches_that_end_together" => {
                crate::relay_cases::completes_every_row_of_batches_ending_together(harness, engines).await
            }
            "relay_run_drains_a_backlog_back_to_back_while_completions_lag" => {
                crate::relay_cases::run_drains_a_backlog_while_completions_lag(harness, engines).await
            }
            "inbox_commit_failure_is_not_acknowledged" => inbox_commit_failure(harness, engines).await,
            "consumer_concurrent_keeps_key_order_and_applies_once" => {
                crate::consumer_cases::consumer_concurrent_keeps_key_order_and_applies_once(harness).await
            }
            "consumer_batches_keep_key_order_and_apply_once" => {
                crate::consumer_cases::consumer_batches_keep_key_order_and_apply_once(harness).await
            }
            "consumer_batch_failure_rolls_back_and_each_is_handled_alone" => {
                consumer_batch_failure(harness, engines).await
            }
            "store_claim_skips_live_leases" => store_claim_skips_live_leases(harness).await,
            "store_token_fences_same_owner" => store_token_fences_same_owner(harness).await,
            "store_transitions_are_token_conditional" => store_transitions_are_token_conditional(harness).await,
            "store_fail_backoff_park_requeue_purge" => store_fail_backoff_park_requeue_purge(harness).await,
            "store_purge_published_keeps_open_rows" => store_purge_published_keeps_open_rows(harness).await,
            "store_enqueue_is_durable_when_it_returns_under_concurrent_callers" => {
                store_enqueue_is_durable_when_it_returns(harness).await
            }
            "store_enqueue_rejects_bad_batches" => store_enqueue_rejects_bad_batches(harness).await,
            "store_enqueue_rejects_a_bad_batch_beside_other_enqueues" => {
                store_enqueue_rejects_a_bad_batch_beside_other_enqueues(harness).await
            }
            "store_stats" => store_stats(harness).await,
            "store_extend_moves_the_lease_and_keeps_the_token" => {
                crate::admin_cases::extend_moves_the_lease_and_keeps_the_token(harness).await
            }
            "store_release_keeps_the_attempts_of_a_row_that_failed" => {
                crate::admin_cases::release_keeps_the_attempts_of_a_row_that_failed(harness).await
            }
            "store_complete_fences_a_parked_row" => crate::admin_cases::complete_fences_a_parked_row(harness).await,
            "store_admin_reads_at_most_limit_in_row_id_order" => {
                crate::admin_cases::admin_reads_at_most_limit_in_row_id_order(harness).await
            }
            "store_requeue_parked_ignores_rows_that_are_not_parked" => {
                crate::admin_cases::requeue_parked_ignores_rows_that_are_not_parked(harness).await
            }
            "inbox_markers_and_dead_letters_read_back_in_their_order" => {
                crate::inbox_cases::markers_and_dead_letters_read_back_in_their_order(harness).await
            }
            "inbox_ledger_reads_back_the_last_committed_state" => {
                crate::inbox_cases::ledger_reads_back_the_last_committed_state(harness).await
            }
            "inbox_advance_version_is_stale_for_an_equal_version" => {
                crate::inbox_cases::advance_version_is_stale_for_an_equal_version(harness).await
            }
            "inbox_prune_markers_deletes_only_old_markers_of_its_consumer" => {
                crate::inbox_cases::prune_markers_deletes_only_old_markers_of_its_consumer(harness).await
            }
            "store_wakeup_signals_an_enqueue_once_a_claim_can_find_it" => {
                crate::store_cases::wakeup_signals_an_enqueue_once_a_claim_can_find_it(harness).await
            }
            "claim_key_order_takes_a_prefix_per_key" => crate::order::takes_a_prefix_per_key(harness).await,
            "claim_key_order_blocked_middle_row_holds_back_the_rest_of_its_key" => {
                crate::store_cases::blocked_middle_row_holds_back_the_rest_of_its_key(harness).await
            }
            "claim_key_order_held_key_does_not_crowd_out_other_keys" => {
                crate::store_cases::held_key_does_not_crowd_out_other_keys(harness).await
            }
            "claim_key_order_holds_under_concurrent_claims" => {
                crate::order::holds_under_concurrent_claims(harness).await
            }
            "claim_key_order_failed_head_holds_back_its_key_across_batches" => {
                crate::order::failed_head_holds_back_its_key(harness, engines).await
            }
            "claim_key_order_two_relays_first_offers_follow_row_order" => {
                crate::order::two_relays_first_offers_follow_row_order(harness, engines).await
            }
            "claim_parked_head_blocks_its_key_by_default" => crate::order::parked_head_blocks(harness, engines).await,
            "claim_parked_head_is_skipped_when_configured" => crate::order::parked_head_skipped(harness, engines).await,
            "foreign_message_is_handed_out_not_an_error" => foreign_messages_mixed(harness, engines).await,
            "foreign_message_is_unacknowledged_until_settled" => {
                foreign_message_unacknowledged_until_recorded(harness, engines).await
            }
            "subscription_next_rejects_a_foreign_message_and_goes_on" => {
                subscription_next_rejects_a_foreign_message_and_goes_on(harness).await
            }
            "foreign_message_redelivered_is_recorded_once" => {
                foreign_message_redelivered_recorded_once(harness, engines).await
            }
            "permutations" => crate::explore::permutations_case(harness).await,
            other => Err(outbox_core::Error::invalid_input("suite", format!("unknown case {other}"))),
        },
    }
}

async fn f5_concurrent_duplicates<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "f5_concurrent_duplicates";
    const ROUNDS: usize = 10;
    // No World here: its consumer would be a second live member of the group, and on brokers
    // that assign partitions (Kafka) an idle member can hold the only partition.
    let fx = h.fixture(CASE, ManualClock::default()).await?;
    fx.broker.declare(&fx.destination, &[suite_group()]).await?;
    let wait = h.capabilities().delivery_wait;
    let tag = crate::world::unique_tag();
    let events: Vec<Event> = (0..ROUNDS)
        .map(|i| Ok(Event::new(EventId::new(format!("{CASE}.{tag}.e{i}"))?, fx.destination.clone(), CREDIT)))
        .collect::<outbox_core::Result<_>>()?;
    fx.store.enqueue(&events).await?;
    let consumer = suite_consumer((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive);
    let other = suite_consumer((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive);
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    for e in &events {
        // Two copies of each event on the broker: the consumer sees them back to back.
        fx.broker.publish(e).await?;
        fx.broker.publish(e).await?;
        let mut pair = Vec::new();
        let deadline = Instant::now() + wait.max(Duration::from_secs(5)) * 2;
        while pair.len() < 2 && Instant::now() < deadline {
            if let Some(d) = next_bounded(sub.as_mut(), wait.max(Duration::from_millis(50))).await? {
                pair.push(d);
            }
        }
        ensure!(CASE, pair.len() == 2, "expected two copies of {} on the broker, got {}", e.id, pair.len());
        // Both start guarding at once; each then waits (bounded) for the other to have guarded
        // too, so that both transactions are open together. A store whose guard blocks the
        // second transaction (row lock, single writer) releases it when the first commits after
        // the bounded wait.
        let start = Arc::new(tokio::sync::Barrier::new(2));
        let guarded = Arc::new(tokio::sync::Barrier::new(2));
        let mut tasks = Vec::new();
        for (d, c) in pair.into_iter().zip([consumer.clone(), other.clone()]) {
            let (start, guarded) = (start.clone(), guarded.clone());
            let mut f = c.receive(d);
            tasks.push(tokio::spawn(async move {
                start.wait().await;
                let ok = f.guard().await.is_ok();
                let _ = tokio::time::timeout(Duration::from_millis(250), guarded.wait()).await;
                if ok && f.apply().await.is_ok() {
                    let _ = f.commit().await;
                }
                f.acknowledge().await
            }));
        }
        for t in tasks {
            if joined_within(t, "handling task").await?.is_none() {
                return Ok(CaseResult::fail(
                    CASE,
                    "",
                    format!(
                        "handling a copy of {} did not finish within {RELAY_WAIT:?}: a guard or commit blocked",
                        e.id
                    ),
                ));
            }
        }
    }
    // Losers were negatively acknowledged: their redeliveries must be duplicates.
    let (_, quiet) = drain_bounded(&consumer, sub.as_mut(), wait, MAX_DELIVERIES).await?;
    ensure!(CASE, quiet, "the group was still receiving after {MAX_DELIVERIES} deliveries");
    drop(sub);
    let effects = fx.effects.rows().await?;
    let mut counts: BTreeMap<&EventId, usize> = BTreeMap::new();
    for r in &effects {
        *counts.entry(&r.event_id).or_default() += 1;
    }
    for e in &events {
        let n = counts.get(&e.id).copied().unwrap_or(0);
        ensure!(CASE, n == 1, "duplicated or lost effect under concurrency: {} effects for {}", n, e.id);
    }
    let markers = fx.inbox.markers(CONSUMER).await?.len();
    ensure!(CASE, markers == ROUNDS, "{markers} markers, expected {ROUNDS}");
    Ok(CaseResult::Passed(format!("{ROUNDS} rounds of two concurrent copies: one effect each")))
}

async fn f10_conflict_dead_letter_keeps_the_event<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "f10_conflict_dead_letter_keeps_the_event";
    let (fx, wait) = fresh_broker(h, CASE).await?;
    let tag = crate::world::unique_tag();
    // Same id, key and headers; only the payload differs (with NUL and non-UTF-8 bytes).
    let first = Event::new(EventId::new(format!("{CASE}.{tag}"))?, fx.destination.clone(), CREDIT)
        .with_key("acct-1 ünïcode/with:separators")
        .with_header("bin", vec![0u8, 1, 2, 255, 0])
        .with_header("empty", Vec::new())
        .with_header("utf8", "héllo".as_bytes().to_vec());
    let conflicting =
        Event { payload: [&b"credit:acct-1:9"[..], &[0, 0xff, 0xc3, 0x28, b'\n', 0]].concat(), ..first.clone() };
    let consumer = suite_consumer((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive);
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let mut handled = Vec::new();
    for e in [&first, &conflicting] {
        fx.broker.publish(e).await?;
        let Some(d) = receive_within(sub.as_mut(), wait).await? else {
            return Ok(CaseResult::fail(CASE, "", format!("{} was not delivered", e.id)));
        };
        ensure!(CASE, d.event == *e, "the broker changed the event (see broker_roundtrip_bytes): {:?}", d.event);
        handled.push(consumer.process(d).await?);
    }
    drop(sub);
    ensure!(
        CASE,
        handled == [Handled::Applied, Handled::Conflict],
        "handled {handled:?}, expected Applied then Conflict"
    );
    let dead: Vec<DeadLetter> =
        fx.inbox.dead_letters(CONSUMER).await?.into_iter().filter(|d| d.event.id == first.id).collect();
    ensure!(CASE, dead.len() == 1, "{} dead letters for {}, expected 1: {dead:?}", dead.len(), first.id);
    let d = &dead[0];
    ensure!(CASE, d.reason == DeadLetterReason::Conflict, "reason {:?}", d.reason);
    ensure!(CASE, d.consumer == CONSUMER, "consumer {:?}", d.consumer);
    let (got, want) = (&d.event, &conflicting);
    ensure!(
        CASE,
        got.destination == want.destination,
        "destination {:?}, expected {:?}",
        got.destination,
        want.destination
    );
    ensure!(CASE, got.key == want.key, "key {:?}, expected {:?}", got.key, want.key);
    ensure!(CASE, got.headers == want.headers, "headers {:?}, expected {:?}", got.headers, want.headers);
    ensure!(CASE, got.payload == want.payload, "payload {:?}, expected {:?}", got.payload, want.payload);
    ensure!(CASE, got == want, "dead-lettered event {got:?} differs from the delivered {want:?}");
    let effects = fx.effects.rows().await?.into_iter().filter(|r| r.event_id == first.id).collect::<Vec<_>>();
    ensure!(CASE, effects.len() == 1 && effects[0].value == 7, "effects {effects:?}, expected one credit of 7");
    Ok(CaseResult::Passed(format!("dead letter {} keeps the conflicting event byte-for-byte", d.id)))
}

/// An acknowledger for deliveries the suite hands to the consumer runtime itself.
struct Unacknowledged;

#[async_trait]
impl Acknowledge for Unacknowledged {
    async fn ack(self: Box<Self>) -> outbox_core::Result<()> {
        Ok(())
    }
    async fn nack(self: Box<Self>) -> outbox_core::Result<()> {
        Ok(())
    }
}

async fn inbox_remove_dead_letters<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "inbox_remove_dead_letters_only_given_ids_and_resets_failures";
    const OTHER: &str = "suite-other-consumer";
    // The inbox on its own: deliveries go straight to the consumer runtime, no broker.
    let fx = h.fixture(CASE, ManualClock::default()).await?;
    let tag = crate::world::unique_tag();
    // Payloads the suite's handler cannot parse: every attempt fails.
    let events: Vec<Event> = (0..3)
        .map(|i| {
            let id = EventId::new(format!("{CASE}.{tag}.e{i}"))?;
            Ok(Event::new(id, fx.destination.clone(), vec![b'x', 0, 0xff, i]).with_header("h", vec![0u8, i]))
        })
        .collect::<outbox_core::Result<_>>()?;
    let consumer_named = |name: &str| {
        let config = ConsumerConfig::new(name).with_max_attempts(2);
        suite_consumer_with((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive, config)
    };
    let (ours, other) = (consumer_named(CONSUMER), consumer_named(OTHER));
    let deliver = |e: &Event| Delivery::new(e.clone(), false, None, Box::new(Unacknowledged));
    let ids: std::collections::BTreeSet<&EventId> = events.iter().map(|e| &e.id).collect();
    let records = |consumer: &'static str| {
        let inbox = &fx.inbox;
        let ids = &ids;
        async move {
            Ok::<_, outbox_core::Error>(
                inbox
                    .dead_letters(consumer)
                    .await?
                    .into_iter()
                    .filter(|d| ids.contains(&d.event.id))
                    .collect::<Vec<_>>(),
            )
        }
    };
    let dead_lettered = |h: &Handled, n: u32| *h == Handled::DeadLettered { attempts: n };
    let retried = |h: &Handled, n: u32| matches!(h, Handled::Retry { attempts, .. } if *attempts == n);

    for e in &events {
        let a = ours.process(deliver(e)).await?;
        let b = ours.process(deliver(e)).await?;
        ensure!(CASE, retried(&a, 1) && dead_lettered(&b, 2), "{}: {a:?} then {b:?}", e.id);
    }
    let b = other.process(deliver(&events[0])).await?;
    let b2 = other.process(deliver(&events[0])).await?;
    ensure!(CASE, retried(&b, 1) && dead_lettered(&b2, 2), "{OTHER}: {b:?} then {b2:?}");
    let before = records(CONSUMER).await?;
    let other_before = records(OTHER).await?;
    ensure!(
        CASE,
        before.len() == 3 && other_before.len() == 1,
        "{} and {} dead letters",
        before.len(),
        other_before.len()
    );
    let all_ids: Vec<i64> = before.iter().chain(&other_before).map(|d| d.id).collect();
    ensure!(
        CASE,
        all_ids.iter().collect::<std::collections::BTreeSet<_>>().len() == 4,
        "store-assigned ids are not distinct: {all_ids:?}"
    );
    ensure!(CASE, fx.inbox.remove_dead_letters(CONSUMER, &[]).await? == 0, "removing no ids removed something");

    // e0 and e2 of ours, plus the other consumer's id and one that does not exist.
    let missing = all_ids.iter().max().copied().unwrap_or(0) + 1_000_000;
    let asked = [before[0].id, before[2].id, other_before[0].id, missing];
    let n = fx.inbox.remove_dead_letters(CONSUMER, &asked).await?;
    ensure!(CASE, n == 2, "remove_dead_letters({CONSUMER}, {asked:?}) returned {n}, expected 2");
    let after = records(CONSUMER).await?;
    ensure!(CASE, after == [before[1].clone()], "left for {CONSUMER}: {after:?}, expected only {:?}", before[1]);
    let other_after = records(OTHER).await?;
    ensure!(CASE, other_after == other_before, "the other consumer's records changed: {other_after:?}");
    ensure!(CASE, fx.inbox.remove_dead_letters(CONSUMER, &asked).await? == 0, "a second removal removed something");

    // e0's count was cleared: it fails once (retry) before being dead-lettered again.
    let a = ours.process(deliver(&events[0])).await?;
    ensure!(CASE, retried(&a, 1), "after removal e0's next failure was {a:?}, expected Retry with attempts 1");
    ensure!(CASE, records(CONSUMER).await?.len() == 1, "a first failure wrote a dead letter");
    let b = ours.process(deliver(&events[0])).await?;
    ensure!(CASE, dead_lettered(&b, 2), "e0's second failure after removal was {b:?}");
    let fresh = records(CONSUMER).await?;
    let new_id = fresh.iter().find(|d| d.event.id == events[0].id).map(|d| d.id);
    ensure!(
        CASE,
        new_id.is_some_and(|id| !all_ids.contains(&id)),
        "e0's new record has id {new_id:?}, seen {all_ids:?}"
    );
    // Counts of records that were not removed stay.
    let c = ours.process(deliver(&events[1])).await?;
    ensure!(CASE, dead_lettered(&c, 3), "e1 (not removed) was {c:?}, expected DeadLettered after 3 attempts");
    let o = other.process(deliver(&events[0])).await?;
    ensure!(CASE, dead_lettered(&o, 3), "{OTHER}'s count of e0 changed: {o:?}");
    Ok(CaseResult::Passed(format!("removed 2 of {asked:?}; e0 counted from 1 again")))
}

fn tricky_event(destination: &Destination, tag: &str) -> outbox_core::Result<Event> {
    let payload: Vec<u8> = vec![0, 159, 146, 150, 0, 255, b'\n', 0xc3, 0x28, 0];
    Ok(Event::new(EventId::new(format!("rt.{tag}:id!~#%&*"))?, destination.clone(), payload)
        .with_key("key ünïcode/with:separators")
        .with_header("bin", vec![0u8, 1, 2, 255, 0])
        .with_header("empty", Vec::new())
        .with_header("utf8", "héllo".as_bytes().to_vec()))
}

async fn fresh_broker<H: Harness>(
    h: &H,
    case: &str,
) -> outbox_core::Result<(crate::harness::Fixture<H::Inbox>, Duration)> {
    let fx = h.fixture(case, ManualClock::default()).await?;
    fx.broker.declare(&fx.destination, &[suite_group()]).await?;
    Ok((fx, h.capabilities().delivery_wait))
}

/// [`receive_within`] for [`Subscription::receive`](outbox_core::Subscription::receive): the
/// first event or foreign message, or `None` after the same bounded wait.
async fn first_received(
    sub: &mut dyn outbox_core::Subscription,
    wait: Duration,
) -> outbox_core::Result<Option<outbox_core::Received>> {
    let deadline = Instant::now() + wait.max(Duration::from_millis(200)) * 3;
    loop {
        if let Some(r) = receive_bounded(sub, wait.max(Duration::from_millis(10))).await? {
            return Ok(Some(r));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
    }
}

async fn receive_within(
    sub: &mut dyn outbox_core::Subscription,
    wait: Duration,
) -> outbox_core::Result<Option<outbox_core::Delivery>> {
    // Wait for a condition with a deadline: several polls within the backend's delivery wait.
    let deadline = Instant::now() + wait.max(Duration::from_millis(200)) * 3;
    loop {
        if let Some(d) = next_bounded(sub, wait.max(Duration::from_millis(10))).await? {
            return Ok(Some(d));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
    }
}

async fn broker_roundtrip_bytes<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_roundtrip_bytes";
    let (fx, wait) = fresh_broker(h, CASE).await?;
    let tag = crate::world::unique_tag();
    let with_key = tricky_event(&fx.destination, &tag)?;
    let mut no_key = Event::new(EventId::new(format!("rt.{tag}.nokey"))?, fx.destination.clone(), Vec::new());
    no_key.key = None;
    fx.broker.publish(&with_key).await?;
    fx.broker.publish(&no_key).await?;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let mut got = Vec::new();
    while got.len() < 2 {
        let Some(d) = receive_within(sub.as_mut(), wait).await? else { break };
        got.push(d.event.clone());
        d.ack().await?;
    }
    got.sort_by(|a, b| a.id.cmp(&b.id));
    let mut want = vec![with_key, no_key];
    want.sort_by(|a, b| a.id.cmp(&b.id));
    for (g, w) in got.iter().zip(&want) {
        ensure!(CASE, g.id == w.id, "event id changed: {:?} != {:?}", g.id, w.id);
        ensure!(CASE, g.payload == w.payload, "payload of {} changed: {:?} != {:?}", w.id, g.payload, w.payload);
        ensure!(CASE, g.key == w.key, "key of {} changed: {:?} != {:?}", w.id, g.key, w.key);
        ensure!(CASE, g.headers == w.headers, "headers of {} changed: {:?} != {:?}", w.id, g.headers, w.headers);
        ensure!(CASE, g.destination == w.destination, "destination changed");
    }
    ensure!(CASE, got.len() == 2, "received {} of 2 events", got.len());
    Ok(CaseResult::Passed("2 events byte-for-byte".into()))
}

async fn broker_unacked_redelivered<H: Harness>(h: &H, flagged: bool) -> outbox_core::Result<CaseResult> {
    let case =
        if flagged { "broker_redelivery_is_flagged" } else { "broker_unacked_redelivered_after_consumer_goes_away" };
    let (fx, wait) = fresh_broker(h, case).await?;
    let e =
        Event::new(EventId::new(format!("u.{}", crate::world::unique_tag()))?, fx.destination.clone(), b"x".to_vec());
    fx.broker.publish(&e).await?;
    let mut first = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let d = receive_within(first.as_mut(), wait).await?;
    ensure!(case, d.as_ref().is_some_and(|d| d.event.id == e.id), "first delivery missing");
    drop(d); // never acknowledged
    drop(first); // the consumer goes away
    let broker = (fx.restart_broker)();
    let mut second = broker.subscribe(&fx.destination, &suite_group()).await?;
    let again = receive_within(second.as_mut(), wait).await?;
    let Some(again) = again else {
        return Ok(CaseResult::fail(case, "", format!("{} was not redelivered after its consumer went away", e.id)));
    };
    ensure!(case, again.event == e, "redelivered a different message");
    if flagged {
        ensure!(
            case,
            again.redelivered || again.attempt.is_some_and(|a| a >= 2),
            "redelivery not flagged: redelivered={} attempt={:?}",
            again.redelivered,
            again.attempt
        );
    }
    let note = format!("redelivered={} attempt={:?}", again.redelivered, again.attempt);
    again.ack().await?;
    Ok(CaseResult::Passed(note))
}

/// `Subscription::receive`: "a delivery not yet acknowledged is not handed to another member of
/// the group while this subscription lives" (rebalances and the broker's idle timeout aside: the
/// case needs [`Capability::HeldWhileLive`]). A member that joins while the first holds a
/// delivery, reading until nothing comes, must not receive it nor anything else the first holds
/// (the first keeps receiving meanwhile, as a live consumer does); the first then acknowledges
/// it.
async fn broker_held_delivery_is_not_handed_to_another_live_member<H: Harness>(
    h: &H,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_held_delivery_is_not_handed_to_another_live_member";
    let fx = h.fixture_holding(CASE, ManualClock::default()).await?;
    fx.broker.declare(&fx.destination, &[suite_group()]).await?;
    let wait = h.capabilities().delivery_wait;
    let tag = crate::world::unique_tag();
    let events = [
        Event::new(EventId::new(format!("{CASE}.{tag}.a"))?, fx.destination.clone(), b"a".to_vec()),
        Event::new(EventId::new(format!("{CASE}.{tag}.b"))?, fx.destination.clone(), b"b".to_vec()),
    ];
    for e in &events {
        fx.broker.publish(e).await?;
    }
    let mut first = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let Some(held) = receive_within(first.as_mut(), wait).await? else {
        return Ok(CaseResult::fail(CASE, "", "the first member received nothing"));
    };
    // Another member, as another process would join: its own connection.
    let broker = (fx.restart_broker)();
    let mut second = broker.subscribe(&fx.destination, &suite_group()).await?;
    let done = std::sync::atomic::AtomicBool::new(false);
    let (seen, also_held) = tokio::join!(
        async {
            let mut seen = Vec::new();
            let read = async {
                while let Some(d) = receive_within(second.as_mut(), wait).await? {
                    seen.push(d.event.id.as_str().to_owned());
                    d.ack().await?;
                    if seen.len() >= MAX_DELIVERIES {
                        break;
                    }
                }
                Ok::<_, outbox_core::Error>(())
            }
            .await;
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            read.map(|()| seen)
        },
        // Meanwhile the first member stays live as a consumer at work does: it keeps receiving
        // (a Kafka member that stops polling stalls its group's rebalance, so the join would
        // never reach it) and holds what it gets.
        async {
            let mut held = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) && held.len() < MAX_DELIVERIES {
                if let Some(outbox_core::Received::Event(d)) =
                    receive_bounded(first.as_mut(), Duration::from_millis(50)).await?
                {
                    held.push(d);
                }
                tokio::task::yield_now().await;
            }
            Ok::<_, outbox_core::Error>(held)
        }
    );
    let (seen, also_held) = (seen?, also_held?);
    for d in std::iter::once(&held).chain(&also_held) {
        ensure!(
            CASE,
            !seen.iter().any(|s| s == d.event.id.as_str()),
            "{} was handed to a second member ({seen:?}) while the first member, still subscribed, held it \
             unacknowledged",
            d.event.id
        );
    }
    let id = held.event.id.clone();
    if let Err(e) = held.ack().await {
        return Ok(CaseResult::fail(CASE, "", format!("the first member could not acknowledge {id} it held: {e}")));
    }
    Ok(CaseResult::Passed(format!(
        "{id} and {} more stayed with the first member; the second received {seen:?}",
        also_held.len()
    )))
}

/// `Broker::subscribe`: an acknowledged delivery is not delivered to the group again. With
/// `redeclare`, `Broker::declare`'s "idempotent: declaring twice is not an error and loses
/// nothing": between the two subscriptions the destination and its group are declared twice
/// more (a relay or consumer restarting declares them again), and an event published after that
/// must reach the group as well as the held one.
async fn broker_acked_not_redelivered<H: Harness>(h: &H, redeclare: bool) -> outbox_core::Result<CaseResult> {
    let case = if redeclare { "broker_declare_twice_loses_nothing" } else { "broker_acked_not_redelivered" };
    let (fx, wait) = fresh_broker(h, case).await?;
    let tag = crate::world::unique_tag();
    let a = Event::new(EventId::new(format!("a.{tag}"))?, fx.destination.clone(), b"a".to_vec());
    let b = Event::new(EventId::new(format!("b.{tag}"))?, fx.destination.clone(), b"b".to_vec());
    fx.broker.publish(&a).await?;
    fx.broker.publish(&b).await?;
    let mut first = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let mut acked = None;
    let mut held = Vec::new();
    while acked.is_none() && held.len() < MAX_DELIVERIES {
        let Some(d) = receive_within(first.as_mut(), wait).await? else { break };
        if d.event.id == a.id {
            acked = Some(d.event.id.clone());
            d.ack().await?;
        } else {
            held.push(d); // b stays unacknowledged
        }
    }
    ensure!(case, acked.is_some(), "{} never arrived", a.id);
    drop(held);
    drop(first);
    let broker = (fx.restart_broker)();
    let mut expected = vec![b.id.clone()];
    if redeclare {
        for round in ["again", "a third time"] {
            if let Err(e) = broker.declare(&fx.destination, &[suite_group()]).await {
                return Ok(CaseResult::fail(case, "", format!("declaring the destination and group {round}: {e}")));
            }
        }
        let c = Event::new(EventId::new(format!("c.{tag}"))?, fx.destination.clone(), b"c".to_vec());
        broker.publish(&c).await?;
        expected.push(c.id);
    }
    let mut second = broker.subscribe(&fx.destination, &suite_group()).await?;
    let mut seen = Vec::new();
    while let Some(d) = receive_within(second.as_mut(), wait).await? {
        seen.push(d.event.id.clone());
        d.ack().await?;
        if seen.len() > 4 {
            break;
        }
    }
    ensure!(case, !seen.contains(&a.id), "acknowledged {} was delivered again: {seen:?}", a.id);
    let missing: Vec<&EventId> = expected.iter().filter(|id| !seen.contains(id)).collect();
    ensure!(
        case,
        missing.is_empty(),
        "{missing:?} never reached the group{} (it saw {seen:?}); {} was held unacknowledged when the first \
         subscription went away{}",
        if redeclare { " after the destination and group were declared twice more" } else { "" },
        b.id,
        if redeclare { ", the other was published after the declarations" } else { "" }
    );
    Ok(CaseResult::Passed(format!("after restart the group saw {seen:?}")))
}

async fn broker_nack_redelivers<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_nack_redelivers";
    let (fx, wait) = fresh_broker(h, CASE).await?;
    let e =
        Event::new(EventId::new(format!("n.{}", crate::world::unique_tag()))?, fx.destination.clone(), b"x".to_vec());
    fx.broker.publish(&e).await?;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let Some(d) = receive_within(sub.as_mut(), wait).await? else {
        return Ok(CaseResult::fail(CASE, "", "first delivery missing"));
    };
    d.nack().await?;
    let again = receive_within(sub.as_mut(), wait).await?;
    ensure!(CASE, again.as_ref().is_some_and(|d| d.event == e), "nacked {} did not come back", e.id);
    if let Some(d) = again {
        d.ack().await?;
    }
    Ok(CaseResult::Passed("nacked message came back".into()))
}

async fn broker_unroutable_is_error<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_unroutable_is_error";
    let fx = h.fixture(CASE, ManualClock::default()).await?;
    let nowhere = Destination::new(format!("{}-nowhere", fx.destination))?;
    let e = Event::new(EventId::new(format!("x.{}", crate::world::unique_tag()))?, nowhere.clone(), b"x".to_vec());
    match fx.broker.publish(&e).await {
        Ok(()) => Ok(CaseResult::fail(CASE, "", format!("publishing to undeclared {nowhere} succeeded"))),
        Err(err) if err.kind() == ErrorKind::Unroutable => Ok(CaseResult::Passed(format!("{err}"))),
        Err(err) => {
            Ok(CaseResult::fail(CASE, "", format!("expected an Unroutable error, got {:?}: {err}", err.kind())))
        }
    }
}

async fn broker_oversized_message<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_oversized_message_is_permanent_and_harmless";
    const BIG: usize = 2 * 1024 * 1024;
    let (fx, wait) = fresh_broker(h, CASE).await?;
    let tag = crate::world::unique_tag();
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    // Built field by field: `Event` does not validate on construction, so this is what a
    // producer that skips the store (or a store with looser limits) could hand a broker.
    let big_header = Event::new(EventId::new(format!("big-h.{tag}"))?, fx.destination.clone(), b"h".to_vec())
        .with_header("trace", vec![b't'; BIG]);
    let big_payload = Event::new(EventId::new(format!("big-p.{tag}"))?, fx.destination.clone(), vec![b'p'; BIG]);
    let mut notes = Vec::new();
    for big in [&big_header, &big_payload] {
        match fx.broker.publish(big).await {
            Ok(()) => return Ok(CaseResult::fail(CASE, "", format!("the broker accepted oversized {}", big.id))),
            Err(err) => {
                ensure!(
                    CASE,
                    err.kind() == ErrorKind::TooLarge && err.retry() == Retry::Permanent,
                    "publishing oversized {} failed with {:?}/{:?} instead of a permanent TooLarge: {err}",
                    big.id,
                    err.kind(),
                    err.retry()
                );
                notes.push(format!("{}: {err}", big.id));
            }
        }
    }
    // The same broker handle, right after: whatever connection it shares must still work.
    let normal = Event::new(EventId::new(format!("after.{tag}"))?, fx.destination.clone(), b"ok".to_vec());
    if let Err(err) = fx.broker.publish(&normal).await {
        return Ok(CaseResult::fail(
            CASE,
            "",
            format!("publishing {} after the oversized ones failed: {err}", normal.id),
        ));
    }
    let mut received = false;
    let mut others = Vec::new();
    while !received && others.len() <= MAX_DELIVERIES {
        let Some(d) = receive_within(sub.as_mut(), wait).await? else { break };
        let id = d.event.id.clone();
        d.ack().await?;
        if id == normal.id {
            received = true;
        } else {
            others.push(id);
        }
    }
    ensure!(CASE, others.is_empty(), "an oversized event reached the subscriber: {others:?}");
    ensure!(CASE, received, "{} published after the oversized events never arrived", normal.id);
    Ok(CaseResult::Passed(format!("{}; {} received after", notes.join("; "), normal.id)))
}

/// The first element of `$v`; an empty `$v` fails the case (a backend that lost a row must
/// fail the suite with a message, not panic it).
macro_rules! first {
    ($case:expr, $v:expr, $what:expr) => {{
        let mut v = $v;
        if v.is_empty() {
            return Ok(CaseResult::fail($case, "", format!("{} returned nothing", $what)));
        }
        v.remove(0)
    }};
}

/// `n` keyless events for `destination`, ids `<case>.<unique tag>.<i>`, payload byte `i`.
pub(crate) fn numbered_events(case: &str, destination: &Destination, n: usize) -> outbox_core::Result<Vec<Event>> {
    let tag = crate::world::unique_tag();
    (0..n)
        .map(|i| Ok(Event::new(EventId::new(format!("{case}.{tag}.{i}"))?, destination.clone(), vec![i as u8])))
        .collect()
}

/// A fixture on a fresh clock with `n` numbered events enqueued.
pub(crate) async fn store_fixture<H: Harness>(
    h: &H,
    case: &str,
    n: usize,
) -> outbox_core::Result<(crate::harness::Fixture<H::Inbox>, ManualClock, Vec<Event>)> {
    let clock = ManualClock::default();
    let fx = h.fixture(case, clock.clone()).await?;
    let events = numbered_events(case, &fx.destination, n)?;
    fx.store.enqueue(&events).await?;
    Ok((fx, clock, events))
}

async fn store_claim_skips_live_leases<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_claim_skips_live_leases";
    let (fx, clock, _) = store_fixture(h, CASE, 1).await?;
    let a = fx.store.claim("relay-A", 10, LEASE).await?;
    ensure!(CASE, a.len() == 1, "first claim returned {} rows", a.len());
    let b = fx.store.claim("relay-B", 10, LEASE).await?;
    ensure!(CASE, b.is_empty(), "a row under a live lease was claimed again (token {})", b[0].lease.token);
    clock.advance(LEASE / 2);
    ensure!(CASE, fx.store.claim("relay-B", 10, LEASE).await?.is_empty(), "claimed before the lease expired");
    clock.advance(LEASE);
    let b = fx.store.claim("relay-B", 10, LEASE).await?;
    ensure!(CASE, b.len() == 1, "expired lease not claimable");
    ensure!(
        CASE,
        b[0].lease.token > a[0].lease.token,
        "token did not increase: {} then {}",
        a[0].lease.token,
        b[0].lease.token
    );
    let rows = all_rows(fx.store.as_ref()).await?;
    ensure!(CASE, rows.len() == 1, "the store reads back {} rows, expected the one enqueued: {rows:?}", rows.len());
    ensure!(
        CASE,
        rows[0].token == b[0].lease.token && rows[0].owner.as_deref() == Some("relay-B"),
        "row {:?}",
        rows[0]
    );
    Ok(CaseResult::Passed(format!("tokens {} then {}", a[0].lease.token, b[0].lease.token)))
}

async fn store_token_fences_same_owner<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_token_fences_same_owner";
    let (fx, clock, _) = store_fixture(h, CASE, 1).await?;
    let first = first!(CASE, fx.store.claim("relay-A", 1, LEASE).await?, "a claim of the one pending row");
    clock.advance(LEASE * 2);
    let second = fx.store.claim("relay-A", 1, LEASE).await?;
    ensure!(CASE, second.len() == 1, "expired row not claimable by its old owner");
    let second = &second[0];
    ensure!(CASE, second.lease.token > first.lease.token, "token not incremented on re-claim");
    let stale = fx.store.complete(first.record.row_id, &first.lease).await?;
    ensure!(CASE, stale == Completion::Fenced, "completion with the older token was {stale:?}");
    let row = first!(CASE, all_rows(fx.store.as_ref()).await?, "reading the rows back");
    ensure!(CASE, row.published_token.is_none(), "fenced completion changed the row: {row:?}");
    let ok = fx.store.complete(second.record.row_id, &second.lease).await?;
    ensure!(CASE, ok == Completion::Published, "latest token's completion was {ok:?}");
    let row = first!(CASE, all_rows(fx.store.as_ref()).await?, "reading the rows back");
    ensure!(CASE, row.status == RowStatus::Published && row.published_token == Some(second.lease.token), "{row:?}");
    let again = fx.store.complete(second.record.row_id, &second.lease).await?;
    ensure!(CASE, again == Completion::Fenced, "completing a published row again was {again:?}");
    Ok(CaseResult::Passed("older token fenced, latest published".into()))
}

async fn store_transitions_are_token_conditional<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_transitions_are_token_conditional";
    let (fx, _clock, _) = store_fixture(h, CASE, 1).await?;
    let c = first!(CASE, fx.store.claim("relay-A", 1, LEASE).await?, "a claim of the one pending row");
    let before = first!(CASE, all_rows(fx.store.as_ref()).await?, "reading the rows back");
    let stale = outbox_core::Lease { token: c.lease.token + 1, ..c.lease.clone() };
    let other = outbox_core::Lease { owner: "relay-B".into(), ..c.lease.clone() };
    for lease in [&stale, &other] {
        let outcomes = [
            ("fail", fx.store.fail(c.record.row_id, lease, Duration::ZERO, "x").await?),
            ("park", fx.store.park(c.record.row_id, lease, "x").await?),
            ("extend", fx.store.extend(c.record.row_id, lease, LEASE).await?),
            ("release", fx.store.release(c.record.row_id, lease).await?),
        ];
        for (op, o) in outcomes {
            ensure!(CASE, o == Outcome::Fenced, "{op} with a lease that is not the row's ({lease:?}) was {o:?}");
        }
        let done = fx.store.complete(c.record.row_id, lease).await?;
        ensure!(CASE, done == Completion::Fenced, "complete with a foreign lease was {done:?}");
    }
    let after = first!(CASE, all_rows(fx.store.as_ref()).await?, "reading the rows back");
    ensure!(CASE, after == before, "fenced calls changed the row:\n before {before:?}\n after {after:?}");
    ensure!(
        CASE,
        fx.store.release(c.record.row_id, &c.lease).await? == Outcome::Applied,
        "release with the right lease"
    );
    let r = first!(CASE, all_rows(fx.store.as_ref()).await?, "reading the rows back");
    ensure!(CASE, r.status == RowStatus::Pending && r.attempts == 0, "released row: {r:?}");
    ensure!(CASE, fx.store.claim("relay-B", 1, LEASE).await?.len() == 1, "released row is claimable at once");
    Ok(CaseResult::Passed("8 fenced calls changed nothing".into()))
}

/// `OutboxAdmin::purge_published`: retention deletes only what it may, in bounded batches.
async fn store_purge_published_keeps_open_rows<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_purge_published_keeps_open_rows";
    let (fx, clock, events) = store_fixture(h, CASE, 7).await?;
    // A store written before retention keeps the trait's default: skipped, not failed.
    match fx.store.purge_published(Duration::from_secs(365 * 86_400), 1).await {
        Err(e) if e.kind() == outbox_core::ErrorKind::Rejected && e.is_permanent() => {
            return Ok(CaseResult::Skipped(crate::harness::Capability::Retention));
        }
        Err(e) => return Err(e),
        Ok(n) => ensure!(CASE, n == 0, "a purge of rows older than a year deleted {n} rows of a fresh fixture"),
    }
    // Rows 0..2 published at t+1s, t, t+2s; row 3 parked; row 4 leased; row 5 failed (pending,
    // one attempt); row 6 never claimed.
    let c = fx.store.claim("relay-A", 6, Duration::from_secs(3600)).await?;
    ensure!(CASE, c.len() == 6, "claimed {}", c.len());
    ensure!(
        CASE,
        fx.store.fail(c[5].record.row_id, &c[5].lease, Duration::ZERO, "down").await? == Outcome::Applied,
        "fail"
    );
    for i in [1usize, 0, 2] {
        ensure!(
            CASE,
            fx.store.complete(c[i].record.row_id, &c[i].lease).await? == Completion::Published,
            "complete {i}"
        );
        clock.advance(Duration::from_secs(1));
    }
    ensure!(CASE, fx.store.park(c[3].record.row_id, &c[3].lease, "poison").await? == Outcome::Applied, "park");
    // now = t+3s: "older than 2s" = published before t+1s: row 1 only (published first).
    ensure!(CASE, fx.store.purge_published(Duration::from_secs(2), 0).await? == 0, "limit 0 deleted rows");
    ensure!(CASE, fx.store.purge_published(Duration::from_secs(2), 10).await? == 1, "older than 2s");
    let ids: Vec<outbox_core::RowId> = all_rows(fx.store.as_ref()).await?.iter().map(|r| r.row_id).collect();
    ensure!(CASE, !ids.contains(&c[1].record.row_id), "the oldest publication was not purged first: {ids:?}");
    ensure!(CASE, fx.store.purge_published(Duration::from_millis(1), 1).await? == 1, "batch of 1");
    ensure!(CASE, fx.store.purge_published(Duration::from_millis(1), 1).await? == 1, "batch of 1 again");
    ensure!(CASE, fx.store.purge_published(Duration::from_millis(1), 10).await? == 0, "nothing published left");
    clock.advance(Duration::from_secs(7200)); // the lease of row 4 has expired: pending now
    ensure!(CASE, fx.store.purge_published(Duration::from_millis(1), 10).await? == 0, "purged an open row");
    // Which events are left (by their index), and in what state.
    let left: Vec<(Option<usize>, RowStatus)> = all_rows(fx.store.as_ref())
        .await?
        .iter()
        .map(|r| (events.iter().position(|e| e.id == r.event.id), r.status))
        .collect();
    ensure!(
        CASE,
        left == [
            (Some(3), RowStatus::Parked),
            (Some(4), RowStatus::Pending),
            (Some(5), RowStatus::Pending),
            (Some(6), RowStatus::Pending)
        ],
        "left (event index, status): {left:?}"
    );
    let s = fx.store.stats().await?;
    ensure!(CASE, (s.published, s.pending, s.parked) == (0, 3, 1), "stats after the purge: {s:?}");
    // A purged row is gone, not hidden: its event id can be enqueued again.
    ensure!(CASE, fx.store.enqueue(&events[1..2]).await?.len() == 1, "re-enqueue of a purged event id");
    Ok(CaseResult::Passed("old published rows purged oldest first, in batches; open rows kept".into()))
}

async fn store_fail_backoff_park_requeue_purge<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_fail_backoff_park_requeue_purge";
    let (fx, clock, _) = store_fixture(h, CASE, 2).await?;
    let c = fx.store.claim("relay-A", 2, LEASE).await?;
    ensure!(CASE, c.len() == 2, "claimed {}", c.len());
    let o = fx.store.fail(c[0].record.row_id, &c[0].lease, Duration::from_secs(5), "broker down").await?;
    ensure!(CASE, o == Outcome::Applied, "fail was {o:?}");
    let o = fx.store.park(c[1].record.row_id, &c[1].lease, "too large").await?;
    ensure!(CASE, o == Outcome::Applied, "park was {o:?}");
    let rows = all_rows(fx.store.as_ref()).await?;
    ensure!(CASE, rows.len() == 2, "the store reads back {} rows, expected the two enqueued: {rows:?}", rows.len());
    ensure!(CASE, rows[0].attempts == 1 && rows[0].last_error.as_deref() == Some("broker down"), "{:?}", rows[0]);
    ensure!(CASE, rows[1].status == RowStatus::Parked, "{:?}", rows[1]);
    clock.advance(Duration::from_secs(4));
    ensure!(CASE, fx.store.claim("relay-B", 10, LEASE).await?.is_empty(), "claimed before retry time or a parked row");
    clock.advance(Duration::from_secs(1));
    let again = fx.store.claim("relay-B", 10, LEASE).await?;
    ensure!(CASE, again.len() == 1 && again[0].record.row_id == c[0].record.row_id, "after backoff: {again:?}");
    ensure!(CASE, again[0].record.attempts == 1, "attempts not carried: {}", again[0].record.attempts);
    let parked = fx.store.list_parked(10).await?;
    ensure!(CASE, parked.len() == 1 && parked[0].reason == "too large", "parked list {parked:?}");
    ensure!(CASE, fx.store.requeue_parked(&[c[1].record.row_id]).await? == 1, "requeue");
    let re = fx.store.claim("relay-B", 10, LEASE).await?;
    ensure!(CASE, re.len() == 1 && re[0].record.row_id == c[1].record.row_id, "requeued row not claimable: {re:?}");
    let o = fx.store.park(re[0].record.row_id, &re[0].lease, "again").await?;
    ensure!(CASE, o == Outcome::Applied, "second park was {o:?}");
    ensure!(CASE, fx.store.purge_parked(&[c[0].record.row_id]).await? == 0, "purged a row that is not parked");
    ensure!(CASE, fx.store.purge_parked(&[c[1].record.row_id]).await? == 1, "purge of a parked row");
    let rows = all_rows(fx.store.as_ref()).await?;
    ensure!(CASE, rows.len() == 1 && rows[0].row_id == c[0].record.row_id, "after purge: {rows:?}");
    Ok(CaseResult::Passed("backoff, park, requeue and purge".into()))
}

/// Enqueue: "the rows are durable and visible when `enqueue` returns" — also when several
/// callers enqueue through one store at once, which is when a store that commits waiting writes
/// together (as the SQLite store does) could answer a caller before the commit that makes its
/// row durable. Each caller reads its own row back through `inspect` as soon as its `enqueue`
/// returns, and the table afterwards holds exactly the events given.
async fn store_enqueue_is_durable_when_it_returns<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_enqueue_is_durable_when_it_returns_under_concurrent_callers";
    /// Callers at once, and rounds of them (each round starts together behind a barrier).
    const CALLERS: usize = 8;
    const ROUNDS: usize = 4;
    let fx = h.fixture(CASE, ManualClock::default()).await?;
    let tag = crate::world::unique_tag();
    let mut given = Vec::with_capacity(CALLERS * ROUNDS);
    for round in 0..ROUNDS {
        let barrier = Arc::new(tokio::sync::Barrier::new(CALLERS));
        let mut callers = Vec::with_capacity(CALLERS);
        for i in 0..CALLERS {
            let n = round * CALLERS + i;
            // Two events for every third caller: a batch of more than one row in a group too.
            let events: Vec<Event> = (0..1 + usize::from(i % 3 == 0))
                .map(|j| {
                    Ok(Event::new(
                        EventId::new(format!("{CASE}.{tag}.{n}.{j}"))?,
                        fx.destination.clone(),
                        format!("payload {n}.{j}").into_bytes(),
                    ))
                })
                .collect::<outbox_core::Result<_>>()?;
            given.extend(events.iter().cloned());
            let (store, barrier) = (Arc::clone(&fx.store), Arc::clone(&barrier));
            callers.push(tokio::spawn(async move {
                barrier.wait().await;
                let ids = store.enqueue(&events).await?;
                // Read back at once, before anything else happens: what a caller that goes on
                // to tell someone "saved" relies on.
                let mut missing = Vec::new();
                if ids.len() != events.len() {
                    missing.push(format!("{} ids returned for {} events", ids.len(), events.len()));
                }
                for (id, e) in ids.iter().zip(&events) {
                    let row = store.inspect(*id - 1, 1).await?.into_iter().find(|r| r.row_id == *id);
                    match row {
                        Some(r)
                            if r.event == *e && r.status == RowStatus::Pending && r.token == 0 && r.attempts == 0 => {}
                        Some(r) => missing.push(format!("row {id} read back as {} for event {}", describe(&r), e.id)),
                        None => missing.push(format!(
                            "row {id} (event {}) was not visible through inspect when its enqueue returned",
                            e.id
                        )),
                    }
                }
                Ok(missing)
            }));
        }
        for caller in callers {
            match joined_within(caller, "a concurrent enqueue").await? {
                Some(missing) => ensure!(CASE, missing.is_empty(), "round {round}: {}", missing.join("; ")),
                None => {
                    return Ok(CaseResult::fail(
                        CASE,
                        "",
                        format!("round {round}: an enqueue did not return within {RELAY_WAIT:?}"),
                    ));
                }
            }
        }
    }
    let rows = all_rows(fx.store.as_ref()).await?;
    let mut stored: Vec<&Event> = rows.iter().map(|r| &r.event).collect();
    let mut want: Vec<&Event> = given.iter().collect();
    stored.sort_by(|a, b| a.id.cmp(&b.id));
    want.sort_by(|a, b| a.id.cmp(&b.id));
    ensure!(
        CASE,
        stored == want,
        "after {ROUNDS} rounds of {CALLERS} concurrent enqueues the store holds {} rows, expected exactly the {} events given",
        rows.len(),
        given.len()
    );
    Ok(CaseResult::Passed(format!(
        "{ROUNDS} rounds of {CALLERS} concurrent enqueues: {} rows, each readable the moment its enqueue returned",
        given.len()
    )))
}

async fn store_enqueue_rejects_bad_batches<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_enqueue_rejects_bad_batches";
    let (fx, _clock, existing) = store_fixture(h, CASE, 1).await?;
    let tag = crate::world::unique_tag();
    let ok = Event::new(EventId::new(format!("ok.{tag}"))?, fx.destination.clone(), b"fine".to_vec());
    let big = Event::new(
        EventId::new(format!("big.{tag}"))?,
        fx.destination.clone(),
        vec![7u8; outbox_core::event::DEFAULT_MAX_PAYLOAD + 1],
    );
    let err = fx.store.enqueue(&[ok.clone(), big]).await;
    ensure!(CASE, matches!(&err, Err(e) if e.kind() == ErrorKind::TooLarge), "oversized payload: {err:?}");
    let err = fx.store.enqueue(&[ok.clone(), existing[0].clone()]).await;
    ensure!(CASE, matches!(&err, Err(e) if e.kind() == ErrorKind::Conflict), "duplicate id: {err:?}");
    let rows = all_rows(fx.store.as_ref()).await?;
    ensure!(CASE, rows.len() == 1 && rows[0].event == existing[0], "a rejected batch wrote rows: {rows:?}");
    Ok(CaseResult::Passed("TooLarge and Conflict, nothing written".into()))
}

/// Two enqueues at once, `ROUNDS` times: in even rounds two bad batches (a fresh event, then an
/// id already stored), in odd rounds a bad one beside a good one. A store that commits writes
/// waiting together (SQLite's group commit) runs one of the two alone after the other, so each
/// round puts a bad batch in each of its paths: it must be rejected whole on both.
async fn store_enqueue_rejects_a_bad_batch_beside_other_enqueues<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_enqueue_rejects_a_bad_batch_beside_other_enqueues";
    const ROUNDS: usize = 8;
    let (fx, _clock, existing) = store_fixture(h, CASE, 1).await?;
    let tag = crate::world::unique_tag();
    let bad = |round: usize, caller: usize| caller == 0 || round.is_multiple_of(2);
    let mut want: Vec<Event> = existing.clone();
    for round in 0..ROUNDS {
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let mut callers = Vec::with_capacity(2);
        for caller in 0..2 {
            let fresh = Event::new(
                EventId::new(format!("{CASE}.{tag}.{round}.{caller}"))?,
                fx.destination.clone(),
                format!("payload {round}.{caller}").into_bytes(),
            );
            let batch = if bad(round, caller) {
                vec![fresh, existing[0].clone()]
            } else {
                want.push(fresh.clone());
                vec![fresh]
            };
            let (store, barrier) = (Arc::clone(&fx.store), Arc::clone(&barrier));
            callers.push(tokio::spawn(async move {
                barrier.wait().await;
                Ok(store.enqueue(&batch).await.map(|ids| ids.len()).map_err(|e| e.kind()))
            }));
        }
        for (caller, task) in callers.into_iter().enumerate() {
            let what = if bad(round, caller) { "a bad batch" } else { "a good batch" };
            match joined_within(task, "a concurrent enqueue").await? {
                Some(Err(ErrorKind::Conflict)) if bad(round, caller) => {}
                Some(Ok(1)) if !bad(round, caller) => {}
                Some(out) => {
                    return Ok(CaseResult::fail(CASE, "", format!("round {round}: {what} returned {out:?}")));
                }
                None => {
                    return Ok(CaseResult::fail(
                        CASE,
                        "",
                        format!("round {round}: {what} did not return within {RELAY_WAIT:?}"),
                    ));
                }
            }
        }
    }
    let rows = all_rows(fx.store.as_ref()).await?;
    let wanted: BTreeSet<&EventId> = want.iter().map(|e| &e.id).collect();
    let extra: Vec<String> =
        rows.iter().filter(|r| !wanted.contains(&r.event.id)).map(|r| r.event.id.to_string()).collect();
    ensure!(
        CASE,
        extra.is_empty() && rows.len() == want.len(),
        "after {ROUNDS} rounds the store holds {} rows, expected the {} good ones; written from rejected batches: {}",
        rows.len(),
        want.len(),
        extra.join(", ")
    );
    Ok(CaseResult::Passed(format!(
        "{ROUNDS} rounds of a bad batch beside another enqueue: every bad one Conflict and unwritten, {} rows",
        want.len()
    )))
}

async fn store_stats<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_stats";
    let (fx, clock, _) = store_fixture(h, CASE, 4).await?;
    clock.advance(Duration::from_secs(3));
    let c = fx.store.claim("relay-A", 3, LEASE).await?;
    let _ = fx.store.complete(c[0].record.row_id, &c[0].lease).await?;
    let _ = fx.store.park(c[1].record.row_id, &c[1].lease, "bad").await?;
    let s = fx.store.stats().await?;
    ensure!(
        CASE,
        (s.pending, s.leased, s.parked, s.published) == (1, 1, 1, 1),
        "pending/leased/parked/published = {}/{}/{}/{}",
        s.pending,
        s.leased,
        s.parked,
        s.published
    );
    ensure!(
        CASE,
        s.oldest_pending_age == Some(Duration::from_secs(3)),
        "oldest pending age {:?}",
        s.oldest_pending_age
    );
    Ok(CaseResult::Passed(format!("{s:?}")))
}

/// How long a case waits for a relay to do what it was asked (start a publish, stop after
/// shutdown) before failing with a message.
pub(crate) const RELAY_WAIT: Duration = Duration::from_secs(30);

/// `task`'s own result if it ends within [`RELAY_WAIT`]; `None` if it does not, so that the
/// caller fails the case saying what did not finish. A task that panicked is an error of the
/// suite, named `what`.
pub(crate) async fn joined_within<T>(
    task: tokio::task::JoinHandle<outbox_core::Result<T>>,
    what: &str,
) -> outbox_core::Result<Option<T>> {
    match tokio::time::timeout(RELAY_WAIT, task).await {
        Ok(joined) => joined.map_err(|e| outbox_core::Error::invalid_input("suite", format!("{what}: {e}")))?.map(Some),
        Err(_) => Ok(None),
    }
}

/// The relay configuration of the relay cases: no backoff (a failed row is due again at once),
/// several lanes in flight, the suite's lease.
pub(crate) fn relay_config(owner: &str) -> RelayConfig {
    RelayConfig::default()
        .with_owner(owner)
        .with_batch_size(64)
        .with_lease(LEASE)
        .with_max_attempts(10)
        .with_backoff(Backoff::none())
        .with_idle_poll(Duration::from_millis(20))
        .with_seed(Some(1))
}

/// A fixture, its clock, and `keys.len()` events enqueued (in one transaction) with those keys,
/// after the suite's group was declared (so that it receives all of them).
pub(crate) async fn keyed_fixture<H: Harness>(
    h: &H,
    case: &str,
    keys: &[&str],
) -> outbox_core::Result<(crate::harness::Fixture<H::Inbox>, ManualClock, Vec<Event>)> {
    keyed_fixture_with(h, case, keys, outbox_core::ParkedHead::Block).await
}

/// [`keyed_fixture`] on a store configured with `parked_head`.
pub(crate) async fn keyed_fixture_with<H: Harness>(
    h: &H,
    case: &str,
    keys: &[&str],
    parked_head: outbox_core::ParkedHead,
) -> outbox_core::Result<(crate::harness::Fixture<H::Inbox>, ManualClock, Vec<Event>)> {
    let clock = ManualClock::default();
    let fx = h.fixture_with_parked_head(case, clock.clone(), parked_head).await?;
    fx.broker.declare(&fx.destination, &[suite_group()]).await?;
    let tag = crate::world::unique_tag();
    let events: Vec<Event> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let id = EventId::new(format!("{case}.{tag}.e{i}"))?;
            Ok(Event::new(id, fx.destination.clone(), format!("credit:{k}:{i}")).with_key(*k))
        })
        .collect::<outbox_core::Result<_>>()?;
    fx.store.enqueue(&events).await?;
    Ok((fx, clock, events))
}

pub(crate) fn row_of<'a>(rows: &'a [RowSnapshot], e: &Event) -> Option<&'a RowSnapshot> {
    rows.iter().find(|r| r.event.id == e.id)
}

/// The first of `events` whose row is not published by `owner` under its latest token,
/// described; `None` when every one is.
pub(crate) fn not_published_by(rows: &[RowSnapshot], events: &[Event], owner: &str) -> Option<String> {
    events.iter().find_map(|e| {
        let r = row_of(rows, e);
        let ok = r.is_some_and(|r| {
            r.status == RowStatus::Published && r.published_token == Some(r.token) && r.owner.as_deref() == Some(owner)
        });
        (!ok).then(|| {
            format!("{} is {} (expected published by {owner}'s token)", e.id, r.map_or("missing".into(), describe))
        })
    })
}

pub(crate) fn describe(r: &RowSnapshot) -> String {
    format!(
        "{} {:?} attempts={} token={} owner={:?} published_token={:?}",
        r.event.id, r.status, r.attempts, r.token, r.owner, r.published_token
    )
}

/// Receive and acknowledge until every id of `want` arrived (or nothing more comes within the
/// backend's delivery wait); returns everything received, in order.
pub(crate) async fn receive_ids(
    sub: &mut dyn outbox_core::Subscription,
    want: &[EventId],
    wait: Duration,
) -> outbox_core::Result<Vec<Event>> {
    let mut missing: BTreeSet<&EventId> = want.iter().collect();
    let mut got = Vec::new();
    while !missing.is_empty() && got.len() < want.len() * 4 + 8 {
        let Some(d) = receive_within(sub, wait).await? else { break };
        missing.remove(&d.event.id);
        got.push(d.event.clone());
        d.ack().await?;
    }
    Ok(got)
}

/// Where each key's events first appear in `received` is out of row order: `(key, expected,
/// received)` for the first such key.
pub(crate) fn key_order_broken(events: &[Event], received: &[Event]) -> Option<(String, Vec<EventId>, Vec<EventId>)> {
    let mut keys: Vec<&String> = events.iter().filter_map(|e| e.key.as_ref()).collect();
    keys.dedup();
    let keys: BTreeSet<&String> = keys.into_iter().collect();
    for key in keys {
        let want: Vec<EventId> = events.iter().filter(|e| e.key.as_ref() == Some(key)).map(|e| e.id.clone()).collect();
        let mut got: Vec<EventId> = Vec::new();
        for e in received.iter().filter(|e| e.key.as_ref() == Some(key)) {
            if !got.contains(&e.id) {
                got.push(e.id.clone());
            }
        }
        if got != want {
            return Some((key.clone(), want, got));
        }
    }
    None
}

async fn store_complete_many_batches<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_complete_many_takes_rows_of_several_batches";
    const BATCHES: usize = 15;
    const BATCH: usize = 100;
    let (fx, _clock, _) = store_fixture(h, CASE, BATCHES * BATCH).await?;
    let mut claimed = Vec::with_capacity(BATCHES * BATCH);
    for i in 0..BATCHES {
        let batch = fx.store.claim("relay-A", BATCH, LEASE).await?;
        ensure!(CASE, batch.len() == BATCH, "claim {i} returned {} of {BATCH} rows", batch.len());
        claimed.extend(batch);
    }
    let input: Vec<(i64, Lease)> = claimed.iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
    let answers = fx.store.complete_many(&input).await?;
    ensure!(
        CASE,
        answers.len() == input.len(),
        "complete_many answered {} results for {} rows",
        answers.len(),
        input.len()
    );
    let fenced: Vec<usize> = (0..answers.len()).filter(|i| answers[*i] != Completion::Published).collect();
    ensure!(
        CASE,
        fenced.is_empty(),
        "{} of {} rows answered fenced under their own leases, the first at position {:?}",
        fenced.len(),
        answers.len(),
        fenced.first()
    );
    let rows = all_rows(fx.store.as_ref()).await?;
    ensure!(CASE, rows.len() == claimed.len(), "{} rows read back, {} claimed", rows.len(), claimed.len());
    for (r, c) in rows.iter().zip(&claimed) {
        ensure!(
            CASE,
            r.status == RowStatus::Published && r.published_token == Some(c.lease.token),
            "after complete_many the row claimed with token {} is {}",
            c.lease.token,
            describe(r)
        );
    }
    Ok(CaseResult::Passed(format!("{} rows of {BATCHES} claims published by one call", input.len())))
}

async fn store_complete_many<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_complete_many_answers_each_row_as_complete_would";
    let (fx, clock, _) = store_fixture(h, CASE, 6).await?;
    let a = fx.store.claim("relay-A", 6, LEASE).await?;
    ensure!(CASE, a.len() == 6, "claimed {} of 6 rows", a.len());
    // Row 4 is published before the batch: completing it again is fenced.
    let done = fx.store.complete(a[4].record.row_id, &a[4].lease).await?;
    ensure!(CASE, done == Completion::Published, "completing row 4 with its own lease was {done:?}");
    // A's leases expire; B re-claims rows 0 and 1: A's tokens for them are stale now. Rows 2, 3
    // and 5 are expired but not re-claimed: A's tokens are still the latest.
    clock.advance(LEASE + Duration::from_millis(1));
    let b = fx.store.claim("relay-B", 2, LEASE).await?;
    ensure!(
        CASE,
        b.len() == 2 && b[0].record.row_id == a[0].record.row_id && b[1].record.row_id == a[1].record.row_id,
        "B's claim of 2 should return rows 0 and 1, got {:?}",
        b.iter().map(|c| c.record.row_id).collect::<Vec<_>>()
    );
    let foreign = Lease { owner: "relay-X".into(), ..a[3].lease.clone() };
    let batch: Vec<(&str, (i64, Lease), Completion)> = vec![
        ("row 2, A's latest token", (a[2].record.row_id, a[2].lease.clone()), Completion::Published),
        ("row 0, A's stale token", (a[0].record.row_id, a[0].lease.clone()), Completion::Fenced),
        ("row 3, right token, another owner", (a[3].record.row_id, foreign), Completion::Fenced),
        ("row 5, A's latest token", (a[5].record.row_id, a[5].lease.clone()), Completion::Published),
        ("row 1, A's stale token", (a[1].record.row_id, a[1].lease.clone()), Completion::Fenced),
        ("row 4, already published", (a[4].record.row_id, a[4].lease.clone()), Completion::Fenced),
    ];
    let input: Vec<(i64, Lease)> = batch.iter().map(|(_, r, _)| r.clone()).collect();
    let answers = fx.store.complete_many(&input).await?;
    ensure!(
        CASE,
        answers.len() == input.len(),
        "complete_many answered {} results for {} rows",
        answers.len(),
        input.len()
    );
    for ((what, _, want), got) in batch.iter().zip(&answers) {
        ensure!(CASE, got == want, "complete_many for {what}: {got:?}, expected {want:?} (all answers: {answers:?})");
    }
    let rows = all_rows(fx.store.as_ref()).await?;
    ensure!(CASE, rows.len() == 6, "{} rows", rows.len());
    for (i, claim) in a.iter().enumerate() {
        let r = &rows[i];
        let ok = match i {
            2 | 4 | 5 => r.status == RowStatus::Published && r.published_token == Some(claim.lease.token),
            0 | 1 => {
                r.published_token.is_none() && r.owner.as_deref() == Some("relay-B") && r.token == b[i].lease.token
            }
            _ => r.published_token.is_none() && r.status == RowStatus::Pending && r.token == claim.lease.token,
        };
        ensure!(CASE, ok, "after complete_many row {i} is {}", describe(r));
    }
    let again = fx
        .store
        .complete_many(&[(b[0].record.row_id, b[0].lease.clone()), (b[1].record.row_id, b[1].lease.clone())])
        .await?;
    ensure!(CASE, again == [Completion::Published; 2], "B's complete_many of its rows: {again:?}");
    ensure!(CASE, fx.store.complete_many(&[]).await?.is_empty(), "complete_many of nothing answered something");
    let rows = all_rows(fx.store.as_ref()).await?;
    ensure!(
        CASE,
        rows.len() >= 2,
        "the store reads back {} rows, expected at least rows 0 and 1: {rows:?}",
        rows.len()
    );
    ensure!(
        CASE,
        rows[0].published_token == Some(b[0].lease.token) && rows[1].published_token == Some(b[1].lease.token),
        "rows 0 and 1 after B's completion: {} / {}",
        describe(&rows[0]),
        describe(&rows[1])
    );
    Ok(CaseResult::Passed(format!("answers {answers:?}")))
}

async fn store_concurrent_claims<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "store_concurrent_claims_never_share_a_row";
    const ROWS: usize = 24;
    const CLAIMERS: usize = 4;
    let (fx, _clock, _) = store_fixture(h, CASE, ROWS).await?;
    let tasks: Vec<_> = (0..CLAIMERS)
        .map(|i| {
            let store = fx.store.clone();
            tokio::spawn(async move {
                let owner = format!("relay-{i}");
                let mut got = Vec::new();
                // Every non-empty claim takes at least one of ROWS rows: more non-empty claims
                // than rows means rows are handed out again while their leases are valid.
                for _ in 0..=ROWS {
                    let batch = store.claim(&owner, 3, LEASE).await?;
                    if batch.is_empty() {
                        return Ok::<_, outbox_core::Error>((owner, got, true));
                    }
                    got.extend(batch.into_iter().map(|c| (c.record.row_id, c.lease.token)));
                }
                Ok((owner, got, false))
            })
        })
        .collect();
    let mut all: Vec<(i64, u64, String)> = Vec::new();
    for t in tasks {
        let Some((owner, got, finished)) = joined_within(t, "claimer task").await? else {
            return Ok(CaseResult::fail(CASE, "", format!("a claimer did not finish within {RELAY_WAIT:?}")));
        };
        ensure!(
            CASE,
            finished,
            "{owner} was still getting rows after {} claims ({} rows for {ROWS} enqueued): rows are claimed again \
             while their leases are valid",
            ROWS + 1,
            got.len()
        );
        all.extend(got.into_iter().map(|(row, token)| (row, token, owner.clone())));
    }
    let mut by_row: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    for (row, _, owner) in &all {
        by_row.entry(*row).or_default().push(owner.clone());
    }
    if let Some((row, owners)) = by_row.iter().find(|(_, o)| o.len() > 1) {
        return Ok(CaseResult::fail(CASE, "", format!("row {row} was claimed by {owners:?} under one live lease")));
    }
    ensure!(CASE, by_row.len() == ROWS, "{} of {ROWS} rows were claimed", by_row.len());
    ensure!(CASE, all.iter().all(|(_, t, _)| *t == 1), "a row claimed once has a token other than 1: {all:?}");
    Ok(CaseResult::Passed(format!("{CLAIMERS} claimers took {ROWS} rows, each once")))
}

async fn relay_refused_credentials<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "relay_refused_credentials_release_the_row";
    let (fx, _clock, events) = keyed_fixture(h, CASE, &["k1"]).await?;
    let wait = h.capabilities().delivery_wait;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let faulty = Faulty::new(fx.broker.clone());
    faulty.fail_next(&events[0].id, ErrorKind::Auth, Retry::Permanent);
    let relay = engines.relay(fx.store.clone(), faulty.shared(), relay_config("relay-A"));
    let first = relay.run_once().await?;
    let rows = all_rows(fx.store.as_ref()).await?;
    let Some(r0) = row_of(&rows, &events[0]) else {
        return Ok(CaseResult::fail(CASE, "", format!("row missing: {rows:?}")));
    };
    ensure!(
        CASE,
        r0.status == RowStatus::Pending && r0.attempts == 0 && r0.published_token.is_none(),
        "after refused credentials the row is {}: it must be pending again with no attempt counted (batch: {first:?})",
        describe(r0)
    );
    // The broker accepts again: the next batch publishes the row.
    relay.run_once().await?;
    let rows = all_rows(fx.store.as_ref()).await?;
    let r0 = row_of(&rows, &events[0]);
    ensure!(
        CASE,
        r0.is_some_and(|r| r.status == RowStatus::Published && r.attempts == 0),
        "once the broker accepted, the row is {}",
        r0.map_or("missing".into(), describe)
    );
    let received = receive_ids(sub.as_mut(), std::slice::from_ref(&events[0].id), wait).await?;
    ensure!(CASE, received.iter().any(|e| e.id == events[0].id), "{} never reached the broker", events[0].id);
    Ok(CaseResult::Passed(format!("refused, released, then published (first batch: {first:?})")))
}

async fn relay_transient_failure<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "relay_transient_failure_is_retried_not_completed";
    let (fx, _clock, events) = keyed_fixture(h, CASE, &["k1", "k1", "k2"]).await?;
    let wait = h.capabilities().delivery_wait;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let faulty = Faulty::new(fx.broker.clone());
    faulty.fail_next(&events[0].id, ErrorKind::Connection, Retry::Transient);
    let relay = engines.relay(fx.store.clone(), faulty.shared(), relay_config("relay-A"));
    let first = relay.run_once().await?;
    let rows = all_rows(fx.store.as_ref()).await?;
    let (Some(r0), Some(r1), Some(r2)) =
        (row_of(&rows, &events[0]), row_of(&rows, &events[1]), row_of(&rows, &events[2]))
    else {
        return Ok(CaseResult::fail(CASE, "", format!("rows missing: {rows:?}")));
    };
    ensure!(
        CASE,
        r0.status == RowStatus::Pending && r0.attempts == 1 && r0.published_token.is_none(),
        "the row whose publish failed transiently is {}: it must go back to pending with attempts 1 and never be \
         completed (batch: {first:?})",
        describe(r0)
    );
    ensure!(
        CASE,
        r1.status != RowStatus::Published && !faulty.log().accepted.contains(&events[1].id),
        "{} was published in the batch where {}, earlier in its key, failed: key order broken ({})",
        events[1].id,
        events[0].id,
        describe(r1)
    );
    ensure!(
        CASE,
        r2.status == RowStatus::Published && r2.published_token == Some(r2.token),
        "the row of another key was not published: {}",
        describe(r2)
    );
    // The failed row is due again at once (no backoff): the next batches publish the rest.
    for _ in 0..3 {
        if relay.run_once().await?.claimed == 0 {
            break;
        }
    }
    let rows = all_rows(fx.store.as_ref()).await?;
    for e in &events {
        let r = row_of(&rows, e);
        ensure!(
            CASE,
            r.is_some_and(|r| r.status == RowStatus::Published && r.published_token == Some(r.token)),
            "after the retry {} is {}",
            e.id,
            r.map_or("missing".into(), describe)
        );
    }
    ensure!(CASE, row_of(&rows, &events[0]).is_some_and(|r| r.attempts == 1), "attempts of the retried row changed");
    let ids: Vec<EventId> = events.iter().map(|e| e.id.clone()).collect();
    let received = receive_ids(sub.as_mut(), &ids, wait).await?;
    for id in &ids {
        ensure!(CASE, received.iter().any(|e| &e.id == id), "{id} never reached the broker");
    }
    if let Some((key, want, got)) = key_order_broken(&events, &received) {
        return Ok(CaseResult::fail(
            CASE,
            "",
            format!("key {key} reached the broker as {got:?}, row order is {want:?}"),
        ));
    }
    Ok(CaseResult::Passed(format!("first batch {first:?}; retried row published after its failure")))
}

async fn relay_key_order<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "relay_one_key_is_published_one_at_a_time_in_row_order";
    let keys: Vec<&str> = (0..4).flat_map(|_| ["ka", "kb", "kc"]).collect();
    let (fx, _clock, events) = keyed_fixture(h, CASE, &keys).await?;
    let wait = h.capabilities().delivery_wait;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let faulty = Faulty::new(fx.broker.clone());
    let relay = engines.relay(fx.store.clone(), faulty.shared(), relay_config("relay-A"));
    for _ in 0..4 {
        if relay.run_once().await?.claimed == 0 {
            break;
        }
    }
    let log = faulty.log();
    if let Some(overlap) = log.overlap() {
        return Ok(CaseResult::fail(CASE, "", overlap));
    }
    let rows = all_rows(fx.store.as_ref()).await?;
    for e in &events {
        let r = row_of(&rows, e);
        ensure!(
            CASE,
            r.is_some_and(|r| r.status == RowStatus::Published),
            "{} is {}",
            e.id,
            r.map_or("missing".into(), describe)
        );
    }
    let ids: Vec<EventId> = events.iter().map(|e| e.id.clone()).collect();
    let received = receive_ids(sub.as_mut(), &ids, wait).await?;
    ensure!(CASE, ids.iter().all(|id| received.iter().any(|e| &e.id == id)), "not every event reached the broker");
    if let Some((key, want, got)) = key_order_broken(&events, &received) {
        return Ok(CaseResult::fail(
            CASE,
            "",
            format!("key {key} reached the broker as {got:?}, row order is {want:?}"),
        ));
    }
    Ok(CaseResult::Passed(format!("{} rows of 3 keys, one publish per key at a time, in row order", events.len())))
}

async fn relay_lease_outlasted<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "relay_batch_that_outlasted_its_lease_halves_the_next_claim";
    const BATCH: usize = 8;
    let keys: Vec<String> = (0..BATCH).map(|i| format!("k{i}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let (fx, clock, events) = keyed_fixture(h, CASE, &keys).await?;
    let faulty = Faulty::new(fx.broker.clone());
    let hold = faulty.hold_next();
    let config = relay_config("relay-A").with_batch_size(BATCH).with_pipeline_depth(1);
    let relay = engines.relay(fx.store.clone(), faulty.shared(), config);
    let first = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run_once().await }
    });
    if !hold.started.wait(RELAY_WAIT).await {
        first.abort();
        return Ok(CaseResult::fail(CASE, "", format!("the relay started no publish within {RELAY_WAIT:?}")));
    }
    // The publish outlasts the lease; another relay claims the batch meanwhile.
    clock.advance(LEASE + Duration::from_millis(1));
    let stolen = fx.store.claim("relay-B", BATCH, LEASE).await?;
    hold.release.open();
    let Some(first) = joined_within(first, "relay task").await? else {
        return Ok(CaseResult::fail(CASE, "", format!("the first batch did not settle within {RELAY_WAIT:?}")));
    };
    ensure!(
        CASE,
        stolen.len() == BATCH && first.claimed == BATCH as u64 && first.fenced > 0 && first.published == 0,
        "setup: relay-B re-claimed {} rows after the lease ran out; the first batch was {first:?}",
        stolen.len()
    );
    // relay-B never completes; once its lease is gone too, relay-A claims again.
    clock.advance(LEASE + Duration::from_millis(1));
    let next = relay.run_once().await?;
    ensure!(
        CASE,
        next.claimed > 0 && next.claimed <= (BATCH / 2) as u64,
        "after a batch of {BATCH} outlasted its lease the next claim took {} rows (at most {} expected): the same \
         batch again outlasts the next lease, and two relays take it from each other forever",
        next.claimed,
        BATCH / 2
    );
    for _ in 0..BATCH {
        if relay.run_once().await?.claimed == 0 {
            break;
        }
    }
    let rows = all_rows(fx.store.as_ref()).await?;
    if let Some(row) = not_published_by(&rows, &events, "relay-A") {
        return Ok(CaseResult::fail(CASE, "", row));
    }
    Ok(CaseResult::Passed(format!("first batch {first:?}; next claim {} rows", next.claimed)))
}

async fn relay_shutdown_releases<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "relay_shutdown_releases_unpublished_rows";
    let (fx, _clock, events) = keyed_fixture(h, CASE, &["k", "k", "k"]).await?;
    let faulty = Faulty::new(fx.broker.clone());
    let hold = faulty.hold_next();
    let relay = engines.relay(fx.store.clone(), faulty.shared(), relay_config("relay-A"));
    let running = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await }
    });
    if !hold.started.wait(RELAY_WAIT).await {
        running.abort();
        return Ok(CaseResult::fail(CASE, "", format!("the relay started no publish within {RELAY_WAIT:?}")));
    }
    relay.shutdown();
    hold.release.open();
    let Some(totals) = joined_within(running, "relay task").await? else {
        return Ok(CaseResult::fail(
            CASE,
            "",
            format!("the relay did not stop within {RELAY_WAIT:?} of the shutdown (its held publish was released)"),
        ));
    };
    let rows = all_rows(fx.store.as_ref()).await?;
    let held = faulty.log().started.first().cloned();
    let mut released = 0;
    for e in &events {
        let Some(r) = row_of(&rows, e) else { return Ok(CaseResult::fail(CASE, "", format!("{} has no row", e.id))) };
        ensure!(CASE, r.status != RowStatus::Leased, "after shutdown {} is still leased: {}", e.id, describe(r));
        if Some(&e.id) == held.as_ref() {
            ensure!(
                CASE,
                r.status == RowStatus::Published && r.published_token == Some(r.token),
                "the publish in flight at shutdown finished but its row was not completed: {}",
                describe(r)
            );
        } else if r.status != RowStatus::Published {
            ensure!(CASE, r.attempts == 0, "a row released at shutdown counted an attempt: {}", describe(r));
            released += 1;
        }
    }
    ensure!(
        CASE,
        released > 0,
        "no row was left to release: every row of the key was published although the shutdown came while the first \
         was in flight ({totals:?})"
    );
    Ok(CaseResult::Passed(format!("{released} rows released; totals {totals:?}")))
}

async fn inbox_commit_failure<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "inbox_commit_failure_is_not_acknowledged";
    let (fx, wait) = fresh_broker(h, CASE).await?;
    let e = Event::new(EventId::new(format!("{CASE}.{}", crate::world::unique_tag()))?, fx.destination.clone(), CREDIT);
    fx.broker.publish(&e).await?;
    let failing = FailingCommit::new((fx.restart_inbox)(), 1);
    let consumer = suite_consumer(failing, Arc::new(EffectsThrough(fx.effects.clone())), EffectKind::Additive);
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let Some(d) = receive_within(sub.as_mut(), wait).await? else {
        return Ok(CaseResult::fail(CASE, "", format!("{} was not delivered", e.id)));
    };
    let handled = engines.process(&consumer, d).await?;
    ensure!(CASE, consumer.inbox().failed() == 1, "the consumer never committed ({handled:?})");
    ensure!(CASE, matches!(handled, Handled::Retry { .. }), "a failed commit was reported as {handled:?}");
    let effects = |rows: Vec<crate::harness::EffectRow>| rows.into_iter().filter(|r| r.event_id == e.id).count();
    ensure!(CASE, effects(fx.effects.rows().await?) == 0, "the failed commit left an effect");
    ensure!(
        CASE,
        !fx.inbox.markers(CONSUMER).await?.iter().any(|m| m.event_id == e.id),
        "the failed commit left a marker"
    );
    drop(sub); // the consumer goes away: whatever it left unacknowledged comes back
    let broker = (fx.restart_broker)();
    let fresh = suite_consumer((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive);
    let mut sub = broker.subscribe(&fx.destination, &suite_group()).await?;
    let mut handled = Vec::new();
    if let Some(d) = receive_within(sub.as_mut(), wait).await? {
        handled.push(fresh.process(d).await?);
        let (more, _) = drain_bounded(&fresh, sub.as_mut(), wait, MAX_DELIVERIES).await?;
        handled.extend(more);
    }
    drop(sub);
    let n = effects(fx.effects.rows().await?);
    ensure!(
        CASE,
        n != 0,
        "{} was acknowledged although its commit failed: it never came back and its effect is lost",
        e.id
    );
    ensure!(CASE, n == 1, "{n} effects for {} after the redelivery", e.id);
    ensure!(
        CASE,
        fx.inbox.markers(CONSUMER).await?.iter().any(|m| m.event_id == e.id),
        "no marker after the redelivery applied the effect"
    );
    Ok(CaseResult::Passed(format!("commit failed, not acknowledged; redelivery: {handled:?}")))
}

/// A batch of four (two credits, an unparseable payload, a credit) through
/// [`Engines::process_batch`]; then, as after a restart, a fresh consumer drains what came
/// back. Every credit applies once, the failing delivery is dead-lettered (never lost), and
/// nothing is left on the broker.
async fn consumer_batch_failure<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "consumer_batch_failure_rolls_back_and_each_is_handled_alone";
    let (fx, wait) = fresh_broker(h, CASE).await?;
    let tag = crate::world::unique_tag();
    let event = |i: usize, payload: &str| -> outbox_core::Result<Event> {
        Ok(Event::new(EventId::new(format!("{CASE}.{tag}.e{i}"))?, fx.destination.clone(), payload.to_string()))
    };
    let events =
        vec![event(0, "credit:a:1")?, event(1, "credit:b:2")?, event(2, "not a credit")?, event(3, "credit:c:4")?];
    for e in &events {
        fx.broker.publish(e).await?;
    }
    let config = || outbox_consumer_inbox::ConsumerConfig::new(CONSUMER).with_max_attempts(2);
    let consumer =
        crate::world::suite_consumer_with((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive, config());
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let mut batch = Vec::new();
    while batch.len() < events.len() {
        let Some(d) = receive_within(sub.as_mut(), wait).await? else { break };
        batch.push(d);
    }
    ensure!(CASE, batch.len() == events.len(), "{} of {} events delivered", batch.len(), events.len());
    let handled: Vec<Handled> = engines.process_batch(&consumer, batch).await.into_iter().collect::<Result<_, _>>()?;
    drop(sub); // whatever was left unacknowledged comes back to the next member
    let broker = (fx.restart_broker)();
    let fresh =
        crate::world::suite_consumer_with((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive, config());
    let mut sub = broker.subscribe(&fx.destination, &suite_group()).await?;
    let mut again = Vec::new();
    if let Some(d) = receive_within(sub.as_mut(), wait).await? {
        again.push(fresh.process(d).await?);
        let (more, _) = drain_bounded(&fresh, sub.as_mut(), wait, MAX_DELIVERIES).await?;
        again.extend(more);
    }
    // A second batch: a copy of the first credit with other content (its marker is committed),
    // and a new credit. The conflict must be dead-lettered, not taken for a duplicate.
    let conflicting = Event::new(events[0].id.clone(), fx.destination.clone(), "credit:a:100".to_string());
    let last = event(4, "credit:d:8")?;
    broker.publish(&conflicting).await?;
    broker.publish(&last).await?;
    let mut second = Vec::new();
    while second.len() < 2 {
        let Some(d) = receive_within(sub.as_mut(), wait).await? else { break };
        second.push(d);
    }
    ensure!(CASE, second.len() == 2, "{} of 2 events of the second batch delivered", second.len());
    let handled_second: Vec<Handled> =
        engines.process_batch(&fresh, second).await.into_iter().collect::<Result<_, _>>()?;
    drop(sub);
    let mut events = events;
    events.push(last);

    let rows = fx.effects.rows().await?;
    for (i, e) in events.iter().enumerate() {
        let n = rows.iter().filter(|r| r.event_id == e.id).count();
        let want = usize::from(i != 2);
        ensure!(
            CASE,
            n == want,
            "{} has {n} effects, expected {want} (batch: {handled:?}; afterwards: {again:?}){}",
            e.id,
            if n == 0 && want == 1 { ": acknowledged although its batch rolled back, its effect is lost" } else { "" }
        );
    }
    let marked: Vec<EventId> = fx.inbox.markers(CONSUMER).await?.into_iter().map(|m| m.event_id).collect();
    let ours: Vec<&EventId> = events.iter().map(|e| &e.id).filter(|id| marked.contains(id)).collect();
    ensure!(CASE, ours.len() == 4, "markers for {ours:?}, expected the four credits");
    let dead = fx.inbox.dead_letters(CONSUMER).await?;
    ensure!(
        CASE,
        dead.iter().any(|d| d.event.id == events[0].id && d.reason == DeadLetterReason::Conflict),
        "a copy of {} with other content in a batch was not dead-lettered as a conflict (second batch: \
         {handled_second:?})",
        events[0].id
    );
    ensure!(
        CASE,
        dead.iter().any(|d| d.event.id == events[2].id && d.reason == DeadLetterReason::HandlerFailed),
        "the failing delivery was not dead-lettered after its attempts (batch: {handled:?}; afterwards: {again:?})"
    );
    let broker = (fx.restart_broker)();
    let mut sub = broker.subscribe(&fx.destination, &suite_group()).await?;
    if let Some(d) = next_bounded(sub.as_mut(), wait).await? {
        return Ok(CaseResult::fail(CASE, "", format!("{} came back after a full drain", d.event.id)));
    }
    Ok(CaseResult::Passed(format!("batch: {handled:?}; afterwards: {again:?}; second batch: {handled_second:?}")))
}

async fn broker_unbound_destination<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_unbound_destination_is_unroutable_or_retained";
    let fx = h.fixture(CASE, ManualClock::default()).await?;
    let wait = h.capabilities().delivery_wait;
    fx.broker.declare(&fx.destination, &[]).await?;
    let e = Event::new(EventId::new(format!("{CASE}.{}", crate::world::unique_tag()))?, fx.destination.clone(), CREDIT);
    fx.store.enqueue(std::slice::from_ref(&e)).await?;
    let faulty = Faulty::new(fx.broker.clone());
    let relay = engines.relay(fx.store.clone(), faulty.shared(), relay_config("relay-A"));
    let report = relay.run_once().await?;
    let rows = all_rows(fx.store.as_ref()).await?;
    let Some(row) = row_of(&rows, &e) else { return Ok(CaseResult::fail(CASE, "", "the row is gone")) };
    let log = faulty.log();
    if let Some((_, kind, _, message)) = log.failed.first() {
        ensure!(
            CASE,
            *kind == ErrorKind::Unroutable,
            "publishing to a declared destination without groups failed with {kind:?} ({message}); expected success \
             or Unroutable"
        );
        ensure!(
            CASE,
            row.status != RowStatus::Published && row.published_token.is_none(),
            "the row whose publish was unroutable is marked published: {}",
            describe(row)
        );
        ensure!(
            CASE,
            h.capabilities().has(Capability::DetectsUnroutable),
            "the broker reports Unroutable but the harness does not declare the capability"
        );
        return Ok(CaseResult::Passed(format!("Unroutable ({message}); the row stays {}", describe(row))));
    }
    ensure!(
        CASE,
        log.accepted.contains(&e.id) && row.status == RowStatus::Published,
        "the publish neither failed nor was completed: {} (batch {report:?})",
        describe(row)
    );
    // Accepted: it must be kept for a group that joins now.
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let got = receive_within(sub.as_mut(), wait).await?;
    let kept = got.as_ref().is_some_and(|d| d.event == e);
    if let Some(d) = got {
        d.ack().await?;
    }
    ensure!(
        CASE,
        kept,
        "the broker accepted {} for a destination no group was bound to, and a group that joined afterwards never \
         received it: the message was dropped (as an AMQP publish without `mandatory` is)",
        e.id
    );
    Ok(CaseResult::Passed("accepted and kept for a group that joined later".into()))
}

async fn broker_groups_receive_only_their_destination<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "broker_groups_receive_only_their_destination";
    let fx = h.fixture(CASE, ManualClock::default()).await?;
    let wait = h.capabilities().delivery_wait;
    // (d.eu, billing) and (d, eu.billing): equal when joined with '.'.
    let pairs = [
        (Destination::new(format!("{}.eu", fx.destination))?, ConsumerGroup::new("billing")?),
        (fx.destination.clone(), ConsumerGroup::new("eu.billing")?),
    ];
    let tag = crate::world::unique_tag();
    let mut events = Vec::new();
    for (i, (d, g)) in pairs.iter().enumerate() {
        fx.broker.declare(d, std::slice::from_ref(g)).await?;
        events.push(Event::new(EventId::new(format!("{CASE}.{tag}.e{i}"))?, d.clone(), CREDIT));
    }
    for e in &events {
        fx.broker.publish(e).await?;
    }
    let mut notes = Vec::new();
    for (i, (d, g)) in pairs.iter().enumerate() {
        let (own, other) = (&events[i], &events[1 - i]);
        let mut sub = fx.broker.subscribe(d, g).await?;
        let mut seen = Vec::new();
        if let Some(first) = receive_within(sub.as_mut(), wait).await? {
            seen.push(first.event.id.clone());
            first.ack().await?;
            // Whatever else is there arrives within the delivery wait.
            while seen.len() < MAX_DELIVERIES {
                let Some(d) = next_bounded(sub.as_mut(), wait).await? else { break };
                seen.push(d.event.id.clone());
                d.ack().await?;
            }
        }
        drop(sub);
        ensure!(
            CASE,
            !seen.contains(&other.id),
            "group {g} of {d} received {}, published to {}: the two (destination, group) pairs share a queue \
             (their names joined with '.' are equal); it saw {seen:?}",
            other.id,
            other.destination
        );
        ensure!(CASE, seen.contains(&own.id), "group {g} of {d} never received its own {} (saw {seen:?})", own.id);
        notes.push(format!("({d}, {g}) got {} message(s)", seen.len()));
    }
    Ok(CaseResult::Passed(notes.join("; ")))
}

/// [`Subscription::receive`](outbox_core::Subscription::receive) with a bound, as
/// [`next_bounded`] for events.
async fn receive_bounded(
    sub: &mut dyn outbox_core::Subscription,
    wait: Duration,
) -> outbox_core::Result<Option<outbox_core::Received>> {
    let limit = wait * 3 + Duration::from_secs(30);
    tokio::time::timeout(limit, sub.receive(wait)).await.map_err(|_| {
        outbox_core::Error::permanent(
            ErrorKind::Timeout,
            "suite",
            format!("Subscription::receive({wait:?}) did not return within {limit:?}"),
        )
    })?
}

/// Handle everything received through `engines` until nothing arrives within `wait` (the first
/// within `3 × wait`), at most `max`; returns what happened and whether it went quiet.
async fn drain_received<I: outbox_core::Inbox>(
    engines: &Engines,
    consumer: &crate::world::SuiteConsumer<I>,
    sub: &mut dyn outbox_core::Subscription,
    wait: Duration,
    max: usize,
) -> outbox_core::Result<(Vec<Handled>, bool)> {
    let mut out = Vec::new();
    while out.len() < max {
        let this_wait = if out.is_empty() { wait.max(Duration::from_millis(50)) * 3 } else { wait };
        let Some(r) = receive_bounded(sub, this_wait).await? else { return Ok((out, true)) };
        out.push(engines.handle(consumer, r).await?);
    }
    Ok((out, false))
}

/// A payload no event has: the tag, the index and bytes that are not UTF-8.
fn foreign_payload(tag: &str, i: usize) -> Vec<u8> {
    [format!("foreign {tag} {i} ").as_bytes(), &[0, 0xff, 0xfe, b'\n', 0]].concat()
}

async fn foreign_messages_mixed<H: Harness>(h: &H, engines: &Engines) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "foreign_message_is_handed_out_not_an_error";
    let (fx, wait) = fresh_broker(h, CASE).await?;
    let Some(writer) = fx.foreign.clone() else {
        return Ok(CaseResult::fail(CASE, "", "the harness declares foreign-messages but its fixture has no writer"));
    };
    let tag = crate::world::unique_tag();
    let event = |i: usize| -> outbox_core::Result<Event> {
        Ok(Event::new(EventId::new(format!("{CASE}.{tag}.e{i}"))?, fx.destination.clone(), CREDIT))
    };
    let mut events = vec![event(0)?];
    fx.broker.publish(&events[0]).await?;
    let mut written = Vec::new();
    let mut unsupported = Vec::new();
    for (i, kind) in ForeignKind::ALL.into_iter().enumerate() {
        let payload = foreign_payload(&tag, i);
        match writer.write(&fx.destination, kind, &format!("{CASE}.{tag}.f{i}"), &payload).await? {
            Foreign::Written => written.push((kind, payload)),
            Foreign::Unsupported(why) => unsupported.push(format!("{kind} ({why})")),
        }
        let e = event(i + 1)?;
        fx.broker.publish(&e).await?;
        events.push(e);
    }
    ensure!(CASE, !written.is_empty(), "the harness could write no kind of foreign message: {unsupported:?}");
    let consumer = suite_consumer((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive);
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let (handled, quiet) = drain_received(engines, &consumer, sub.as_mut(), wait, MAX_DELIVERIES).await?;
    drop(sub);
    ensure!(CASE, quiet, "the group was still receiving after {MAX_DELIVERIES} deliveries");
    let malformed: Vec<Malformed> = handled
        .iter()
        .filter_map(|h| if let Handled::Malformed { problem } = h { Some(*problem) } else { None })
        .collect();
    let applied = handled.iter().filter(|h| **h == Handled::Applied).count();
    ensure!(
        CASE,
        applied == events.len() && malformed.len() == written.len(),
        "the drain handled {handled:?}: expected {} events applied and {} foreign messages recorded, in one drain \
         (it must not stop at a foreign message)",
        events.len(),
        written.len()
    );
    // Everything was acknowledged: a new member of the group gets nothing.
    let broker = (fx.restart_broker)();
    let fresh = suite_consumer((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive);
    let mut sub = broker.subscribe(&fx.destination, &suite_group()).await?;
    let (again, _) = drain_received(engines, &fresh, sub.as_mut(), wait, MAX_DELIVERIES).await?;
    drop(sub);
    ensure!(CASE, again.is_empty(), "a second drain received {again:?}: not everything was acknowledged");
    // Every event effected exactly once.
    let effects = fx.effects.rows().await?;
    for e in &events {
        let n = effects.iter().filter(|r| r.event_id == e.id).count();
        ensure!(CASE, n == 1, "{n} effects for {}, expected 1", e.id);
    }
    // Every foreign message is a malformed dead letter with its raw payload and problem.
    let letters = fx.inbox.dead_letters(CONSUMER).await?;
    let mut notes = Vec::new();
    for (kind, payload) in &written {
        let found: Vec<&DeadLetter> = letters.iter().filter(|d| d.event.payload == *payload).collect();
        ensure!(
            CASE,
            found.len() == 1,
            "{} dead letters keep the payload of the {kind} message, expected 1 (dead letters: {:?})",
            found.len(),
            letters.iter().map(|d| (&d.event.id, d.reason, &d.error)).collect::<Vec<_>>()
        );
        let d = found[0];
        ensure!(
            CASE,
            d.reason == DeadLetterReason::Malformed,
            "the {kind} message's dead letter has reason {:?}",
            d.reason
        );
        let want = kind.expected().as_str();
        ensure!(CASE, d.error.contains(want), "the {kind} message's dead letter does not name {want:?}: {:?}", d.error);
        ensure!(
            CASE,
            d.event.destination == fx.destination,
            "the {kind} message's dead letter names destination {}, expected {}",
            d.event.destination,
            fx.destination
        );
        notes.push(format!("{kind} → {}", d.event.id));
    }
    let skipped =
        if unsupported.is_empty() { String::new() } else { format!("; cannot write: {}", unsupported.join(", ")) };
    Ok(CaseResult::Passed(format!("{} events applied once; {}{skipped}", events.len(), notes.join(", "))))
}

/// A fresh fixture with one foreign message on its destination (the first kind the harness can
/// write), and its payload and kind; or the failed case when the harness can write none.
async fn with_one_foreign<H: Harness>(
    h: &H,
    case: &str,
) -> outbox_core::Result<
    std::result::Result<(crate::harness::Fixture<H::Inbox>, Duration, Vec<u8>, ForeignKind), CaseResult>,
> {
    let (fx, wait) = fresh_broker(h, case).await?;
    let Some(writer) = fx.foreign.clone() else {
        return Ok(Err(CaseResult::fail(
            case,
            "",
            "the harness declares foreign-messages but its fixture has no writer",
        )));
    };
    let tag = crate::world::unique_tag();
    let payload = foreign_payload(&tag, 0);
    for k in ForeignKind::ALL {
        if writer.write(&fx.destination, k, &format!("{case}.{tag}"), &payload).await? == Foreign::Written {
            return Ok(Ok((fx, wait, payload, k)));
        }
    }
    Ok(Err(CaseResult::fail(case, "", "the harness could write no foreign message")))
}

/// `Subscription::next`: "a foreign message is rejected (acknowledged, or sent to the broker's
/// own dead-letter route) without any record, and reported as a permanent `Corrupt` error naming
/// its position and problem; the next call goes on after it". A caller that only wants events
/// (its own loop, not the consumer runtime) must hear of the message it loses, must not meet it
/// again, and must not be stopped by it.
async fn subscription_next_rejects_a_foreign_message_and_goes_on<H: Harness>(h: &H) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "subscription_next_rejects_a_foreign_message_and_goes_on";
    let (fx, wait, _payload, kind) = match with_one_foreign(h, CASE).await? {
        Ok(setup) => setup,
        Err(failed) => return Ok(failed),
    };
    let e = Event::new(
        EventId::new(format!("{CASE}.{}", crate::world::unique_tag()))?,
        fx.destination.clone(),
        b"after the foreign one".to_vec(),
    );
    fx.broker.publish(&e).await?;
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    // A fresh member may have to join its group first: several calls within a deadline.
    let deadline = Instant::now() + wait.max(Duration::from_millis(200)) * 3;
    let reported = loop {
        match crate::world::next_bounded(sub.as_mut(), wait.max(Duration::from_millis(10))).await {
            Err(err) if err.kind() == ErrorKind::Timeout && err.backend() == "suite" => return Err(err),
            Err(err) => break err,
            Ok(Some(d)) => {
                return Ok(CaseResult::fail(
                    CASE,
                    "",
                    format!(
                        "next returned {} first, without reporting the {kind} message written before it (it is lost \
                         and nobody hears of it)",
                        d.event.id
                    ),
                ));
            }
            Ok(None) if Instant::now() >= deadline => {
                return Ok(CaseResult::fail(CASE, "", format!("next returned nothing: the {kind} message never came")));
            }
            Ok(None) => {}
        }
    };
    ensure!(
        CASE,
        reported.kind() == ErrorKind::Corrupt && reported.is_permanent(),
        "next reported the {kind} message as {:?} ({:?}): {reported}; expected a permanent Corrupt error",
        reported.kind(),
        reported.retry()
    );
    let after = receive_within(sub.as_mut(), wait).await?;
    let Some(after) = after else {
        return Ok(CaseResult::fail(
            CASE,
            "",
            format!("after reporting the {kind} message next returned nothing; {} was published after it", e.id),
        ));
    };
    ensure!(CASE, after.event == e, "after the {kind} message next returned {}, expected {}", after.event.id, e.id);
    after.ack().await?;
    drop(sub);
    let broker = (fx.restart_broker)();
    let mut again = broker.subscribe(&fx.destination, &suite_group()).await?;
    let back = first_received(again.as_mut(), wait).await?;
    let back = back.map(|r| match r {
        outbox_core::Received::Event(d) => format!("event {}", d.event.id),
        outbox_core::Received::Foreign(f) => format!("the foreign message at {} ({:?})", f.message.position, f.problem),
    });
    ensure!(
        CASE,
        back.is_none(),
        "after next reported the {kind} message and the event was acknowledged, a new member of the group \
         received {}: next did not reject what it reported",
        back.unwrap_or_default()
    );
    Ok(CaseResult::Passed(format!("{kind}: reported as {reported}; the event after it received; nothing came back")))
}

async fn foreign_message_unacknowledged_until_recorded<H: Harness>(
    h: &H,
    engines: &Engines,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "foreign_message_is_unacknowledged_until_settled";
    let (fx, wait, payload, kind) = match with_one_foreign(h, CASE).await? {
        Ok(setup) => setup,
        Err(failed) => return Ok(failed),
    };
    let keeps = |letters: &[DeadLetter]| letters.iter().filter(|d| d.event.payload == payload).count();
    let failing = FailingCommit::new((fx.restart_inbox)(), 1);
    let consumer = suite_consumer(failing, Arc::new(EffectsThrough(fx.effects.clone())), EffectKind::Additive);
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let Some(received) = first_received(sub.as_mut(), wait).await? else {
        return Ok(CaseResult::fail(CASE, "", format!("the {kind} message was not received")));
    };
    ensure!(
        CASE,
        matches!(received, outbox_core::Received::Foreign(_)),
        "the {kind} message was received as {received:?}"
    );
    let handled = engines.handle(&consumer, received).await?;
    ensure!(CASE, consumer.inbox().failed() == 1, "the dead letter was never committed ({handled:?})");
    ensure!(CASE, matches!(handled, Handled::Retry { .. }), "a failed dead-letter commit was reported as {handled:?}");
    ensure!(CASE, keeps(&fx.inbox.dead_letters(CONSUMER).await?) == 0, "the failed commit left a dead letter");
    drop(sub); // the consumer goes away: whatever it left unacknowledged comes back
    let broker = (fx.restart_broker)();
    let fresh = suite_consumer((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive);
    let mut sub = broker.subscribe(&fx.destination, &suite_group()).await?;
    let (again, _) = drain_received(engines, &fresh, sub.as_mut(), wait, MAX_DELIVERIES).await?;
    drop(sub);
    let n = keeps(&fx.inbox.dead_letters(CONSUMER).await?);
    ensure!(
        CASE,
        n != 0,
        "the {kind} message was acknowledged although its dead letter did not commit: it never came back and \
         nothing records it (redelivery: {again:?})"
    );
    ensure!(CASE, n == 1, "{n} dead letters for the {kind} message after the redelivery");
    Ok(CaseResult::Passed(format!("{kind}: commit failed, not acknowledged; redelivery: {again:?}")))
}

/// An acknowledger that does nothing: the acknowledgement "got lost" on its way to the broker.
struct LostAck;

#[async_trait]
impl Acknowledge for LostAck {
    async fn ack(self: Box<Self>) -> outbox_core::Result<()> {
        Ok(())
    }
    async fn nack(self: Box<Self>) -> outbox_core::Result<()> {
        Ok(())
    }
}

async fn foreign_message_redelivered_recorded_once<H: Harness>(
    h: &H,
    engines: &Engines,
) -> outbox_core::Result<CaseResult> {
    const CASE: &str = "foreign_message_redelivered_is_recorded_once";
    let (fx, wait, payload, kind) = match with_one_foreign(h, CASE).await? {
        Ok(setup) => setup,
        Err(failed) => return Ok(failed),
    };
    let keeps = |letters: &[DeadLetter]| letters.iter().filter(|d| d.event.payload == payload).count();
    let consumer = suite_consumer((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive);
    let mut sub = fx.broker.subscribe(&fx.destination, &suite_group()).await?;
    let Some(received) = first_received(sub.as_mut(), wait).await? else {
        return Ok(CaseResult::fail(CASE, "", format!("the {kind} message was not received")));
    };
    let outbox_core::Received::Foreign(original) = received else {
        return Ok(CaseResult::fail(CASE, "", format!("the {kind} message was received as {received:?}")));
    };
    // The consumer records the message and acknowledges; the acknowledgement never reaches the
    // broker (the original delivery stays unacknowledged and comes back).
    let lost = outbox_core::ForeignDelivery::new(
        original.message.clone(),
        original.problem,
        original.detail.clone(),
        original.redelivered,
        Box::new(LostAck),
    );
    let first = engines.handle(&consumer, outbox_core::Received::Foreign(lost)).await?;
    ensure!(
        CASE,
        keeps(&fx.inbox.dead_letters(CONSUMER).await?) == 1,
        "the first delivery was not recorded ({first:?})"
    );
    drop(original);
    drop(sub); // the consumer goes away: its unacknowledged delivery comes back
    let broker = (fx.restart_broker)();
    let fresh = suite_consumer((fx.restart_inbox)(), fx.effects.clone(), EffectKind::Additive);
    let mut sub = broker.subscribe(&fx.destination, &suite_group()).await?;
    let (again, _) = drain_received(engines, &fresh, sub.as_mut(), wait, MAX_DELIVERIES).await?;
    drop(sub);
    ensure!(CASE, !again.is_empty(), "the unacknowledged {kind} message never came back");
    let n = keeps(&fx.inbox.dead_letters(CONSUMER).await?);
    ensure!(CASE, n == 1, "{n} dead letters for one {kind} message after its redelivery ({again:?})");
    Ok(CaseResult::Passed(format!("{kind}: recorded once; redelivery: {again:?}")))
}

/// Replay a path printed by a counterexample on `harness`.
///
/// # Errors
/// A path that does not parse, or setup failures.
pub async fn replay<H: Harness>(
    harness: &H,
    payloads: &[&str],
    kind: EffectKind,
    path: &str,
) -> outbox_core::Result<CaseResult> {
    let actions = parse_path(path).map_err(|e| outbox_core::Error::invalid_input("suite", e))?;
    run_script(harness, "replay", payloads, kind, &actions, &[], None).await
}
