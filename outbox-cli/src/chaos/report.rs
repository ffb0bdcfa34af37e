//! The checker and the figures: everything here is computed from durable state read back after
//! the drain (orders, outbox rows, effects, markers, dead letters, the audit group's drain) and
//! from the fault log; nothing from what processes said they did.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use super::procs::FleetStats;
use super::schedule::{Family, FamilyPlan};
use super::site::RowTimes;
pub(crate) use crate::json::Json;

/// One fault as it happened.
#[derive(Debug, Clone)]
pub(crate) struct FaultRecord {
    /// Family.
    pub(crate) family: Family,
    /// Wall-clock start, ms since the epoch.
    pub(crate) at_ms: i64,
    /// Offset from the start of the window.
    pub(crate) offset: Duration,
    /// What was hit.
    pub(crate) target: String,
    /// Downtime of a restart, connections cut, length of a stall…
    pub(crate) detail: String,
}

/// What the producers did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ProducerStats {
    /// Events committed (normal ones).
    pub(crate) committed: u64,
    /// Commits retried after an error.
    pub(crate) retries: u64,
    /// Commits whose outcome was unknown and that turned out committed (found by id).
    pub(crate) unknown_committed: u64,
}

/// The bad inputs and what became of them.
#[derive(Debug, Clone, Default)]
pub(crate) struct BadInput {
    /// The poison event's id.
    pub(crate) poison_id: String,
    /// Its consumer dead letter: reason and error, when there is one.
    pub(crate) poison_dead_letter: Option<(String, String)>,
    /// Whether the foreign message was written to the broker.
    pub(crate) foreign_written: bool,
    /// Foreign messages the audit group was offered.
    pub(crate) foreign_offers: u64,
    /// Dead letters with reason `malformed` (the consumers' record of the foreign message).
    pub(crate) foreign_dead_letters: u64,
    /// Whether this build's consumer runtime records foreign messages as dead letters.
    pub(crate) malformed_supported: bool,
    /// The oversized event's id.
    pub(crate) oversized_id: String,
    /// The error enqueue gave for the 10 MB header: kind and message.
    pub(crate) oversized_refused: Option<(String, String)>,
    /// Whether the refused enqueue left anything committed.
    pub(crate) oversized_committed_by_enqueue: bool,
    /// Whether the row inserted behind validation's back was inserted.
    pub(crate) oversized_inserted: bool,
    /// Its parked reason, when it is parked.
    pub(crate) oversized_parked: Option<String>,
}

/// One table-size sample of the long profile.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct WindowStat {
    /// Window number, from 0.
    pub(crate) index: u32,
    /// Length of the window.
    pub(crate) length: Duration,
    /// Rows committed in the window.
    pub(crate) committed: u64,
    /// Rows published in the window.
    pub(crate) published: u64,
    /// Effects applied in the window.
    pub(crate) effects: u64,
    /// Outbox rows at the end of the window.
    pub(crate) outbox_rows: u64,
    /// Inbox markers at the end of the window.
    pub(crate) markers: u64,
    /// Bytes of outbox + inbox at the end of the window.
    pub(crate) bytes: u64,
}

impl WindowStat {
    fn per_second(&self, n: u64) -> f64 {
        n as f64 / self.length.as_secs_f64().max(0.001)
    }
}

/// Figures of one combination.
#[derive(Debug, Clone, Default)]
pub(crate) struct Figures {
    pub(crate) orders: u64,
    pub(crate) rows: u64,
    pub(crate) published: u64,
    pub(crate) parked: u64,
    pub(crate) lost: u64,
    pub(crate) unexpected: u64,
    pub(crate) duplicate_effects: u64,
    pub(crate) offers: u64,
    pub(crate) duplicates_offered: u64,
    pub(crate) unoffered: u64,
    pub(crate) ghost_offers: u64,
    /// Distinct events with a consumer dead letter.
    pub(crate) dead_lettered: u64,
    /// Dead-letter records (more than `dead_lettered` when one event was recorded repeatedly).
    pub(crate) dead_letter_records: u64,
    pub(crate) dead_lettered_other: u64,
    pub(crate) stale_completions: u64,
    pub(crate) orders_without_row: u64,
    pub(crate) rows_without_order: u64,
    pub(crate) effected: u64,
    pub(crate) markers: u64,
    pub(crate) drained: bool,
    pub(crate) max_recovery_ms: Option<i64>,
}

/// One row of the table: a fault family in one combination.
#[derive(Debug, Clone)]
pub(crate) struct FamilyRow {
    pub(crate) family: Family,
    pub(crate) faults: u64,
    pub(crate) minimum: u32,
    pub(crate) lost: u64,
    pub(crate) unexpected: u64,
    pub(crate) duplicate_effects: u64,
    pub(crate) duplicates_offered: u64,
    /// Longest time from a fault of this family to the next published event.
    pub(crate) max_recovery_ms: Option<i64>,
    /// Faults after which nothing was published at all.
    pub(crate) unrecovered: u64,
}

/// Everything about one combination run.
#[derive(Debug, Clone, Default)]
pub(crate) struct ComboReport {
    pub(crate) name: String,
    pub(crate) seed: u64,
    pub(crate) schedule: String,
    pub(crate) skipped: Option<String>,
    pub(crate) error: Option<String>,
    pub(crate) duration: Duration,
    pub(crate) events: u64,
    pub(crate) figures: Figures,
    pub(crate) families: Vec<FamilyRow>,
    pub(crate) bad: BadInput,
    pub(crate) faults: Vec<FaultRecord>,
    pub(crate) fleet: FleetStats,
    pub(crate) producers: ProducerStats,
    pub(crate) windows: Vec<WindowStat>,
    /// Published rows the relays' retention deleted during the run (long profile); the judge
    /// read them from the runner's snapshots.
    pub(crate) purged: u64,
    /// Restarts of a broker that failed inside (a panicked task) and stopped serving, with the
    /// relays, made so the contract can be judged: when, what failed, and the restart.
    pub(crate) broker_heals: Vec<String>,
    pub(crate) problems: Vec<String>,
    pub(crate) logs: Option<String>,
}

impl ComboReport {
    /// Whether the combination passed (a skipped one neither passes nor fails).
    pub(crate) fn passed(&self) -> bool {
        self.skipped.is_some() || (self.error.is_none() && self.problems.is_empty())
    }
}

/// Durable state read back after the drain.
pub(crate) struct Durable {
    pub(crate) orders: Vec<String>,
    pub(crate) rows: BTreeMap<String, RowTimes>,
    pub(crate) effects: BTreeMap<String, u64>,
    pub(crate) markers: u64,
    /// (event id, reason, error) of every consumer dead letter.
    pub(crate) dead_letters: Vec<(String, String, String)>,
    /// Audit group: offers per event id.
    pub(crate) offers: BTreeMap<String, u64>,
}

/// More dead-letter records than this for one event is a loop, not the occasional repeat of a
/// consumer killed between recording the dead letter and acknowledging the delivery.
const MAX_DEAD_LETTER_RECORDS: u64 = 3;

/// Judge a run: figures, the per-family rows, and the problems that fail it.
pub(crate) fn judge(
    d: &Durable,
    faults: &[FaultRecord],
    plans: &[FamilyPlan],
    bad: &BadInput,
    drained: bool,
) -> (Figures, Vec<FamilyRow>, Vec<String>) {
    let orders: BTreeSet<&str> = d.orders.iter().map(String::as_str).collect();
    let dead: BTreeSet<&str> = d.dead_letters.iter().map(|(id, _, _)| id.as_str()).collect();
    let mut published: Vec<i64> = d.rows.values().filter_map(|r| r.published_ms).collect();
    published.sort_unstable();

    // The fault an anomaly is attributed to: the last one that started before the event was
    // (finally) published, or before it was committed if it never was.
    let mut by_time: Vec<&FaultRecord> = faults.iter().collect();
    by_time.sort_by_key(|f| f.at_ms);
    let blame = |row: Option<&RowTimes>| -> Option<Family> {
        let t = row.map(|r| r.published_ms.unwrap_or(r.created_ms))?;
        by_time.iter().rev().find(|f| f.at_ms <= t).map(|f| f.family)
    };
    #[derive(Default, Clone, Copy)]
    struct Counts {
        lost: u64,
        unexpected: u64,
        duplicate_effects: u64,
        duplicates_offered: u64,
    }
    let mut per: BTreeMap<Family, Counts> = BTreeMap::new();
    let mut f = Figures { orders: orders.len() as u64, rows: d.rows.len() as u64, drained, ..Figures::default() };
    f.markers = d.markers;
    for (id, row) in &d.rows {
        if row.published_ms.is_some() {
            f.published += 1;
        }
        if row.parked.is_some() {
            f.parked += 1;
        }
        if row.stale_completion {
            f.stale_completions += 1;
        }
        if !orders.contains(id.as_str()) {
            f.rows_without_order += 1;
        }
        let effected = d.effects.contains_key(id);
        if row.parked.is_none() && !effected && !dead.contains(id.as_str()) {
            f.lost += 1;
            if let Some(fam) = blame(Some(row)) {
                per.entry(fam).or_default().lost += 1;
            }
        }
        if row.published_ms.is_some() && !d.offers.contains_key(id) {
            f.unoffered += 1;
        }
    }
    f.orders_without_row = orders.iter().filter(|id| !d.rows.contains_key(**id)).count() as u64;
    for (id, n) in &d.effects {
        f.effected += 1;
        let row = d.rows.get(id);
        if row.is_none() {
            f.unexpected += 1;
        }
        if *n > 1 {
            f.duplicate_effects += n - 1;
            if let Some(fam) = blame(row) {
                per.entry(fam).or_default().duplicate_effects += n - 1;
            }
        }
    }
    for (id, n) in &d.offers {
        f.offers += n;
        let row = d.rows.get(id);
        if row.is_none() {
            f.ghost_offers += 1;
        }
        if *n > 1 {
            f.duplicates_offered += n - 1;
            if let Some(fam) = blame(row) {
                per.entry(fam).or_default().duplicates_offered += n - 1;
            }
        }
    }
    f.dead_letter_records = d.dead_letters.len() as u64;
    f.dead_lettered = d.dead_letters.iter().map(|(id, _, _)| id.as_str()).collect::<BTreeSet<_>>().len() as u64;
    f.dead_lettered_other =
        d.dead_letters.iter().filter(|(id, reason, _)| *id != bad.poison_id && reason != "malformed").count() as u64;

    let recovery = |at: i64| -> Option<i64> {
        let i = published.partition_point(|p| *p < at);
        published.get(i).map(|p| p - at)
    };
    let mut families = Vec::new();
    for plan in plans {
        let mine: Vec<&FaultRecord> = faults.iter().filter(|r| r.family == plan.family).collect();
        let gaps: Vec<Option<i64>> = mine.iter().map(|r| recovery(r.at_ms)).collect();
        let c = per.get(&plan.family).copied().unwrap_or_default();
        families.push(FamilyRow {
            family: plan.family,
            faults: mine.len() as u64,
            minimum: plan.minimum,
            lost: c.lost,
            unexpected: c.unexpected,
            duplicate_effects: c.duplicate_effects,
            duplicates_offered: c.duplicates_offered,
            max_recovery_ms: gaps.iter().flatten().copied().max(),
            unrecovered: gaps.iter().filter(|g| g.is_none()).count() as u64,
        });
    }
    f.max_recovery_ms = families.iter().filter_map(|r| r.max_recovery_ms).max();

    let mut problems = Vec::new();
    let mut bad_if = |cond: bool, what: String| {
        if cond {
            problems.push(what);
        }
    };
    bad_if(!drained, "the run did not drain within its deadline (see the figures for what was left)".into());
    bad_if(f.lost > 0, format!("{} committed events lost (not parked, not dead-lettered, never effected)", f.lost));
    bad_if(f.unexpected > 0, format!("{} effects without a committed row", f.unexpected));
    bad_if(f.duplicate_effects > 0, format!("{} duplicate effects", f.duplicate_effects));
    bad_if(f.unoffered > 0, format!("{} published rows the audit group was never offered", f.unoffered));
    bad_if(f.ghost_offers > 0, format!("{} offers of events no row committed", f.ghost_offers));
    bad_if(f.stale_completions > 0, format!("{} rows completed by a stale token", f.stale_completions));
    bad_if(
        f.orders_without_row + f.rows_without_order > 0,
        format!(
            "domain write and outbox row disagree: {} orders without a row, {} rows without an order",
            f.orders_without_row, f.rows_without_order
        ),
    );
    let mut records: BTreeMap<&str, u64> = BTreeMap::new();
    for (id, _, _) in &d.dead_letters {
        *records.entry(id.as_str()).or_default() += 1;
    }
    if let Some((id, n)) = records.iter().max_by_key(|(_, n)| **n) {
        bad_if(
            *n > MAX_DEAD_LETTER_RECORDS,
            format!(
                "event {id} was dead-lettered {n} times: its delivery is not settled after the dead letter is recorded (the stream loops on it)"
            ),
        );
    }
    for r in &families {
        bad_if(
            r.faults < u64::from(r.minimum),
            format!("{}: {} faults, fewer than the minimum {}", r.family, r.faults, r.minimum),
        );
    }
    bad_if(
        bad.poison_dead_letter.as_ref().is_none_or(|(reason, _)| reason != "handler_failed"),
        format!(
            "the poison event {} was not dead-lettered as handler_failed ({:?})",
            bad.poison_id, bad.poison_dead_letter
        ),
    );
    bad_if(!bad.foreign_written, "the foreign message could not be written to the broker".into());
    bad_if(bad.foreign_written && bad.foreign_offers == 0, "the audit group never saw the foreign message".into());
    bad_if(
        bad.malformed_supported && bad.foreign_written && bad.foreign_dead_letters == 0,
        "the foreign message was not recorded as a `malformed` dead letter".into(),
    );
    bad_if(
        bad.oversized_refused.as_ref().is_none_or(|(kind, _)| kind != "TooLarge"),
        format!("enqueue did not refuse the 10 MB header as TooLarge ({:?})", bad.oversized_refused),
    );
    bad_if(bad.oversized_committed_by_enqueue, "the refused oversized enqueue left something committed".into());
    bad_if(
        bad.oversized_inserted && bad.oversized_parked.is_none(),
        format!("the oversized row {} inserted behind validation's back was not parked", bad.oversized_id),
    );
    bad_if(!bad.oversized_inserted, "the oversized row could not be inserted behind validation's back".into());
    (f, families, problems)
}

fn ms(v: Option<i64>) -> String {
    match v {
        Some(ms) if ms >= 10_000 => format!("{:.1}s", ms as f64 / 1000.0),
        Some(ms) => format!("{ms}ms"),
        None => "-".into(),
    }
}

/// The table: one row per combination × fault family, then the combination's totals.
pub(crate) fn table(reports: &[ComboReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<13} {:<17} {:>7} {:>5} {:>5} {:>10} {:>11} {:>11} {:>6} {:>13} {:>13}",
        "combination",
        "family",
        "faults",
        "min",
        "lost",
        "unexpected",
        "dup-effects",
        "dup-offered",
        "parked",
        "dead-lettered",
        "max-recovery"
    );
    for r in reports {
        if let Some(why) = &r.skipped {
            let _ = writeln!(out, "{:<13} SKIPPED: {why}", r.name);
            continue;
        }
        if let Some(e) = &r.error {
            let _ = writeln!(out, "{:<13} ERROR: {e}", r.name);
            continue;
        }
        for f in &r.families {
            let recovery = if f.unrecovered > 0 { format!("{} never", f.unrecovered) } else { ms(f.max_recovery_ms) };
            let _ = writeln!(
                out,
                "{:<13} {:<17} {:>7} {:>5} {:>5} {:>10} {:>11} {:>11} {:>6} {:>13} {:>13}",
                r.name,
                f.family.name(),
                f.faults,
                f.minimum,
                f.lost,
                f.unexpected,
                f.duplicate_effects,
                f.duplicates_offered,
                "-",
                "-",
                recovery
            );
        }
        let g = &r.figures;
        let total: u64 = r.families.iter().map(|f| f.faults).sum();
        let _ = writeln!(
            out,
            "{:<13} {:<17} {:>7} {:>5} {:>5} {:>10} {:>11} {:>11} {:>6} {:>13} {:>13}",
            r.name,
            "ALL",
            total,
            "",
            g.lost,
            g.unexpected,
            g.duplicate_effects,
            g.duplicates_offered,
            g.parked,
            g.dead_lettered,
            ms(g.max_recovery_ms)
        );
    }
    out
}

/// The long profile's windows and their drift.
pub(crate) fn windows(r: &ComboReport) -> String {
    let mut out = String::new();
    if r.windows.is_empty() {
        return out;
    }
    let _ = writeln!(out, "{} — per window (table sizes at the end of each):", r.name);
    let _ = writeln!(
        out,
        "  {:>6} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11} {:>12}",
        "window", "length", "committed/s", "published/s", "effects/s", "outbox-rows", "markers", "bytes"
    );
    for w in &r.windows {
        let _ = writeln!(
            out,
            "  {:>6} {:>8.0}s {:>11.1} {:>11.1} {:>11.1} {:>11} {:>11} {:>12}",
            w.index,
            w.length.as_secs_f64(),
            w.per_second(w.committed),
            w.per_second(w.published),
            w.per_second(w.effects),
            w.outbox_rows,
            w.markers,
            w.bytes
        );
    }
    if let (Some(first), Some(last)) = (r.windows.first(), r.windows.last()) {
        let drift = |a: f64, b: f64| if a > 0.0 { format!("{:+.1}%", (b - a) / a * 100.0) } else { "-".into() };
        let growth = if r.windows.len() > 1 {
            (last.bytes as f64 - first.bytes as f64) / (r.windows.len() - 1) as f64
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "  drift: published/s {} (first → last window), effects/s {}, bytes {:+.0} per window",
            drift(first.per_second(first.published), last.per_second(last.published)),
            drift(first.per_second(first.effects), last.per_second(last.effects)),
            growth
        );
    }
    out
}

fn n(v: u64) -> Json {
    Json::Num(i128::from(v))
}

fn opt_ms(v: Option<i64>) -> Json {
    v.map_or(Json::Null, |v| Json::Num(i128::from(v)))
}

fn s(v: impl Into<String>) -> Json {
    Json::Str(v.into())
}

fn opt_s(v: Option<&String>) -> Json {
    v.map_or(Json::Null, |v| s(v.clone()))
}

/// One combination as JSON.
pub(crate) fn combo_json(r: &ComboReport) -> Json {
    let g = &r.figures;
    let b = &r.bad;
    Json::obj(vec![
        ("name", s(r.name.clone())),
        ("seed", Json::Num(i128::from(r.seed))),
        ("schedule", s(r.schedule.clone())),
        ("skipped", opt_s(r.skipped.as_ref())),
        ("error", opt_s(r.error.as_ref())),
        ("passed", Json::Bool(r.passed() && r.skipped.is_none())),
        ("problems", Json::Arr(r.problems.iter().map(|p| s(p.clone())).collect())),
        ("duration_ms", Json::Num(r.duration.as_millis() as i128)),
        ("events", n(r.events)),
        ("purged_by_retention", n(r.purged)),
        ("broker_heals", Json::Arr(r.broker_heals.iter().map(|h| s(h.clone())).collect())),
        (
            "figures",
            Json::obj(vec![
                ("orders", n(g.orders)),
                ("rows", n(g.rows)),
                ("published", n(g.published)),
                ("parked", n(g.parked)),
                ("lost", n(g.lost)),
                ("unexpected", n(g.unexpected)),
                ("duplicate_effects", n(g.duplicate_effects)),
                ("offers", n(g.offers)),
                ("duplicates_offered", n(g.duplicates_offered)),
                ("unoffered", n(g.unoffered)),
                ("ghost_offers", n(g.ghost_offers)),
                ("dead_lettered", n(g.dead_lettered)),
                ("dead_letter_records", n(g.dead_letter_records)),
                ("dead_lettered_other", n(g.dead_lettered_other)),
                ("stale_completions", n(g.stale_completions)),
                ("orders_without_row", n(g.orders_without_row)),
                ("rows_without_order", n(g.rows_without_order)),
                ("effected", n(g.effected)),
                ("markers", n(g.markers)),
                ("drained", Json::Bool(g.drained)),
                ("max_recovery_ms", opt_ms(g.max_recovery_ms)),
            ]),
        ),
        (
            "families",
            Json::Arr(
                r.families
                    .iter()
                    .map(|f| {
                        Json::obj(vec![
                            ("family", s(f.family.name())),
                            ("faults", n(f.faults)),
                            ("minimum", n(u64::from(f.minimum))),
                            ("lost", n(f.lost)),
                            ("unexpected", n(f.unexpected)),
                            ("duplicate_effects", n(f.duplicate_effects)),
                            ("duplicates_offered", n(f.duplicates_offered)),
                            ("max_recovery_ms", opt_ms(f.max_recovery_ms)),
                            ("unrecovered", n(f.unrecovered)),
                        ])
                    })
                    .collect(),
            ),
        ),
        (
            "bad_input",
            Json::obj(vec![
                (
                    "poison",
                    Json::obj(vec![
                        ("event_id", s(b.poison_id.clone())),
                        ("dead_letter_reason", opt_s(b.poison_dead_letter.as_ref().map(|p| &p.0))),
                        ("dead_letter_error", opt_s(b.poison_dead_letter.as_ref().map(|p| &p.1))),
                    ]),
                ),
                (
                    "foreign",
                    Json::obj(vec![
                        ("written", Json::Bool(b.foreign_written)),
                        ("offered_to_audit", n(b.foreign_offers)),
                        ("malformed_dead_letters", n(b.foreign_dead_letters)),
                        ("malformed_supported", Json::Bool(b.malformed_supported)),
                    ]),
                ),
                (
                    "oversized",
                    Json::obj(vec![
                        ("event_id", s(b.oversized_id.clone())),
                        ("enqueue_error_kind", opt_s(b.oversized_refused.as_ref().map(|p| &p.0))),
                        ("enqueue_error", opt_s(b.oversized_refused.as_ref().map(|p| &p.1))),
                        ("enqueue_committed", Json::Bool(b.oversized_committed_by_enqueue)),
                        ("inserted_unchecked", Json::Bool(b.oversized_inserted)),
                        ("parked", Json::Bool(b.oversized_parked.is_some())),
                        ("parked_reason", opt_s(b.oversized_parked.as_ref())),
                    ]),
                ),
            ]),
        ),
        (
            "processes",
            Json::obj(vec![
                ("started", n(r.fleet.started)),
                ("relay_exits", n(r.fleet.relay_exits)),
                ("consumer_exits", n(r.fleet.consumer_exits)),
            ]),
        ),
        (
            "producers",
            Json::obj(vec![
                ("committed", n(r.producers.committed)),
                ("retries", n(r.producers.retries)),
                ("unknown_outcome_committed", n(r.producers.unknown_committed)),
            ]),
        ),
        (
            "faults",
            Json::Arr(
                r.faults
                    .iter()
                    .map(|f| {
                        Json::obj(vec![
                            ("family", s(f.family.name())),
                            ("at_ms", Json::Num(i128::from(f.at_ms))),
                            ("offset_ms", Json::Num(f.offset.as_millis() as i128)),
                            ("target", s(f.target.clone())),
                            ("detail", s(f.detail.clone())),
                        ])
                    })
                    .collect(),
            ),
        ),
        (
            "windows",
            Json::Arr(
                r.windows
                    .iter()
                    .map(|w| {
                        Json::obj(vec![
                            ("index", n(u64::from(w.index))),
                            ("length_ms", Json::Num(w.length.as_millis() as i128)),
                            ("committed", n(w.committed)),
                            ("published", n(w.published)),
                            ("effects", n(w.effects)),
                            ("published_per_s", Json::Float(w.per_second(w.published))),
                            ("outbox_rows", n(w.outbox_rows)),
                            ("markers", n(w.markers)),
                            ("bytes", n(w.bytes)),
                        ])
                    })
                    .collect(),
            ),
        ),
        ("logs", opt_s(r.logs.as_ref())),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(created: i64, published: Option<i64>) -> RowTimes {
        RowTimes { created_ms: created, published_ms: published, parked: None, stale_completion: false }
    }

    #[test]
    fn judge_counts_lost_unexpected_duplicates_and_blames_the_last_fault() {
        let rows: BTreeMap<String, RowTimes> = [
            ("a".to_string(), row(10, Some(20))),
            ("b".to_string(), row(11, Some(40))),
            ("c".to_string(), row(12, None)),
        ]
        .into();
        let d = Durable {
            orders: vec!["a".into(), "b".into(), "c".into()],
            rows,
            effects: [("a".to_string(), 1), ("b".to_string(), 2), ("x".to_string(), 1)].into(),
            markers: 2,
            dead_letters: vec![],
            offers: [("a".to_string(), 1), ("b".to_string(), 3)].into(),
        };
        let faults = vec![
            FaultRecord {
                family: Family::RelayKill,
                at_ms: 5,
                offset: Duration::ZERO,
                target: "r".into(),
                detail: "".into(),
            },
            FaultRecord {
                family: Family::ProxyCut,
                at_ms: 30,
                offset: Duration::ZERO,
                target: "p".into(),
                detail: "".into(),
            },
        ];
        let plans = super::super::schedule::plans(false);
        let (f, fam, problems) = judge(&d, &faults, &plans, &BadInput::default(), true);
        assert_eq!((f.lost, f.unexpected, f.duplicate_effects, f.duplicates_offered), (1, 1, 1, 2));
        let get = |x: Family| fam.iter().find(|r| r.family == x).unwrap().clone();
        assert_eq!(get(Family::ProxyCut).duplicate_effects, 1);
        assert_eq!(get(Family::ProxyCut).duplicates_offered, 2);
        assert_eq!(get(Family::RelayKill).lost, 1);
        assert_eq!(get(Family::RelayKill).max_recovery_ms, Some(15));
        assert_eq!(get(Family::ProxyCut).max_recovery_ms, Some(10));
        assert!(problems.iter().any(|p| p.contains("lost")));
        let json = combo_json(&ComboReport { name: "x\"y".into(), ..ComboReport::default() }).render();
        assert!(json.contains("\"x\\\"y\""), "{json}");
    }
}
