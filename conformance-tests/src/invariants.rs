//! The contract as predicates over durable state. Nothing here reads logs or counters: only
//! outbox rows, broker contents after a full drain, inbox markers and effect rows.

use std::collections::BTreeMap;
use std::fmt;

use outbox_consumer_inbox::EffectKind;
use outbox_core::{EventId, RowStatus};

use crate::world::DurableState;

/// A broken promise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// A committed event that was never offered to the broker and is not parked.
    Lost {
        /// The event.
        event: EventId,
        /// What the row looks like.
        detail: String,
    },
    /// A committed, offered, additive event whose effect never committed (and that was not
    /// dead-lettered).
    LostEffect {
        /// The event.
        event: EventId,
    },
    /// More than one effect for one `(consumer, event_id)`.
    DuplicatedEffect {
        /// The event.
        event: EventId,
        /// Effects found.
        count: usize,
    },
    /// An effect or broker message with no committed source row, or an effect that does not
    /// match its source's content.
    Ghost {
        /// The id.
        event: EventId,
        /// Where it was found.
        detail: String,
    },
    /// A row marked published by a token that is not the row's latest.
    StaleCompletionAccepted {
        /// The event.
        event: EventId,
        /// The row's latest token.
        token: u64,
        /// The token that published it.
        published_token: Option<u64>,
    },
    /// A projection whose version went down.
    RegressedProjection {
        /// Projection subject.
        subject: String,
        /// Version before.
        from: i64,
        /// Version after.
        to: i64,
    },
    /// A case-specific expectation did not hold.
    Expectation(String),
    /// A step that must end (the recovery relay, a drain) was still going at its bound: the
    /// suite stops it and reports it instead of hanging.
    Unfinished(String),
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Lost { event, detail } => write!(f, "lost: {event} was committed but never offered ({detail})"),
            Self::LostEffect { event } => write!(f, "lost effect: {event} was offered but its effect never committed"),
            Self::DuplicatedEffect { event, count } => {
                write!(f, "duplicated effect: {count} effects for (suite-consumer, {event})")
            }
            Self::Ghost { event, detail } => write!(f, "ghost: {event}: {detail}"),
            Self::StaleCompletionAccepted { event, token, published_token } => write!(
                f,
                "stale completion accepted: {event} published by token {published_token:?} but its latest token is {token}"
            ),
            Self::RegressedProjection { subject, from, to } => {
                write!(f, "regressed projection: {subject} went from version {from} to {to}")
            }
            Self::Expectation(s) => write!(f, "expectation failed: {s}"),
            Self::Unfinished(s) => write!(f, "unfinished: {s}"),
        }
    }
}

/// The judgement of one run.
#[derive(Debug, Clone, Default)]
pub struct Judgement {
    /// Broken promises.
    pub violations: Vec<Violation>,
    /// Extra copies on the broker (expected under at-least-once; counted, not a failure).
    pub duplicates_offered: usize,
}

fn amount(payload: &[u8]) -> Option<(String, i64)> {
    let text = std::str::from_utf8(payload).ok()?;
    let mut p = text.splitn(3, ':');
    let (_, subject, value) = (p.next()?, p.next()?, p.next()?);
    Some((subject.to_string(), value.parse().ok()?))
}

/// Check every invariant of the contract on `state`.
pub fn judge(state: &DurableState, kind: EffectKind) -> Judgement {
    let mut v = Vec::new();
    let mut effects_by_event: BTreeMap<&EventId, Vec<&crate::harness::EffectRow>> = BTreeMap::new();
    for e in &state.effects {
        effects_by_event.entry(&e.event_id).or_default().push(e);
    }
    let dead: std::collections::BTreeSet<&EventId> = state.dead_letters.iter().map(|(id, _)| id).collect();
    for event in &state.events {
        let offered = state.offers.get(&event.id).copied().unwrap_or(0);
        let Some(row) = state.rows.iter().find(|r| r.event.id == event.id) else {
            v.push(Violation::Lost { event: event.id.clone(), detail: "its outbox row is gone".into() });
            continue;
        };
        let parked = row.status == RowStatus::Parked;
        if offered == 0 && !parked {
            v.push(Violation::Lost {
                event: event.id.clone(),
                detail: format!(
                    "row status {:?}, token {}, published_token {:?}",
                    row.status, row.token, row.published_token
                ),
            });
        }
        if row.status == RowStatus::Published && row.published_token != Some(row.token) {
            v.push(Violation::StaleCompletionAccepted {
                event: event.id.clone(),
                token: row.token,
                published_token: row.published_token,
            });
        }
        if offered > 0 && row.status != RowStatus::Published && !parked {
            v.push(Violation::Lost {
                event: event.id.clone(),
                detail: format!("after a full drain the row is still {:?}", row.status),
            });
        }
        let effects = effects_by_event.get(&event.id).map_or(&[][..], Vec::as_slice);
        if effects.len() > 1 {
            v.push(Violation::DuplicatedEffect { event: event.id.clone(), count: effects.len() });
        }
        if kind == EffectKind::Additive && effects.is_empty() && offered > 0 && !dead.contains(&event.id) {
            v.push(Violation::LostEffect { event: event.id.clone() });
        }
        if let (Some(e), Some((subject, value))) = (effects.first(), amount(&event.payload))
            && (e.subject != subject || e.value != value)
        {
            v.push(Violation::Ghost {
                event: event.id.clone(),
                detail: format!(
                    "effect {}:{} does not match the committed payload {subject}:{value}",
                    e.subject, e.value
                ),
            });
        }
    }
    let committed: std::collections::BTreeSet<&EventId> = state.events.iter().map(|e| &e.id).collect();
    for e in &state.effects {
        if !committed.contains(&e.event_id) {
            v.push(Violation::Ghost {
                event: e.event_id.clone(),
                detail: "effect without a committed source row".into(),
            });
        }
    }
    for id in state.offers.keys() {
        if !committed.contains(id) {
            v.push(Violation::Ghost {
                event: id.clone(),
                detail: "broker message without a committed source row".into(),
            });
        }
    }
    if kind == EffectKind::Projection {
        let mut last: BTreeMap<&str, i64> = BTreeMap::new();
        for e in &state.effects {
            if let Some(prev) = last.insert(&e.subject, e.value)
                && e.value <= prev
            {
                v.push(Violation::RegressedProjection { subject: e.subject.clone(), from: prev, to: e.value });
            }
        }
    }
    v.extend(state.unfinished.iter().cloned().map(Violation::Unfinished));
    let duplicates_offered = state.offers.values().map(|n| n.saturating_sub(1)).sum();
    Judgement { violations: v, duplicates_offered }
}
