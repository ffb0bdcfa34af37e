//! The table and the JSON file: one row per measured subject, the same figures in both.

use std::fmt::Write as _;
use std::time::Duration;

use super::{Outcome, Settings, Subject};
use crate::json::Json;

/// One line of the table.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    /// `P1` … `P7/8`.
    pub(crate) id: String,
    /// What was measured.
    pub(crate) subject: String,
    /// What it is compared with.
    pub(crate) baseline: String,
    /// Events per second of the subject.
    pub(crate) measured: f64,
    /// Events per second of the baseline (`None`: no baseline).
    pub(crate) baseline_rate: Option<f64>,
    /// The ratio must be at least this.
    pub(crate) goal: Option<f64>,
    /// The row's own settings (the run's shared ones are in the header).
    pub(crate) configuration: String,
    /// The raw figures a `min(…)` baseline was made of, named.
    pub(crate) components: Vec<(String, f64)>,
    /// The run's seed.
    pub(crate) seed: u64,
    /// `Some(true)` ratio ≥ goal, `Some(false)` below, `None` nothing to judge.
    pub(crate) pass: Option<bool>,
    /// With `--repeat`: the ratio of every run, in run order (this row is the median one).
    pub(crate) runs: Vec<f64>,
}

impl Row {
    /// A row; `pass` follows from the figures.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        id: impl Into<String>,
        subject: impl Into<String>,
        baseline: impl Into<String>,
        measured: f64,
        baseline_rate: Option<f64>,
        goal: Option<f64>,
        configuration: impl Into<String>,
        components: Vec<(String, f64)>,
        seed: u64,
    ) -> Self {
        let mut row = Self {
            id: id.into(),
            subject: subject.into(),
            baseline: baseline.into(),
            measured,
            baseline_rate,
            goal,
            configuration: configuration.into(),
            components,
            seed,
            pass: None,
            runs: Vec::new(),
        };
        row.pass = match (row.ratio(), row.goal) {
            (Some(r), Some(g)) => Some(r >= g),
            _ => None,
        };
        row
    }

    /// measured / baseline.
    pub(crate) fn ratio(&self) -> Option<f64> {
        self.baseline_rate.filter(|b| *b > 0.0).map(|b| self.measured / b)
    }
}

/// The rows of `runs` (each run one `Vec` of rows, the same ids in the same order), one per id:
/// the run whose ratio is the median of that id's ratios (the lower of the two middle ones for
/// an even count, so that a tie never flatters), with every run's ratio in [`Row::runs`] and in
/// the configuration column. One run comes back as it is. A row without a ratio keeps the first
/// run's figures.
pub(crate) fn median(runs: Vec<Vec<Row>>) -> Vec<Row> {
    if runs.len() < 2 {
        return runs.into_iter().next().unwrap_or_default();
    }
    let ids: Vec<String> = runs[0].iter().map(|r| r.id.clone()).collect();
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        let same: Vec<&Row> = runs.iter().filter_map(|run| run.iter().find(|r| r.id == id)).collect();
        let ratios: Vec<f64> = same.iter().filter_map(|r| r.ratio()).collect();
        let mut ranked: Vec<&Row> = same.iter().copied().filter(|r| r.ratio().is_some()).collect();
        ranked.sort_by(|a, b| a.ratio().partial_cmp(&b.ratio()).unwrap_or(std::cmp::Ordering::Equal));
        let Some(chosen) = ranked.get((ranked.len().max(1) - 1) / 2).or(same.first()) else { continue };
        let mut row = (*chosen).clone();
        if !ratios.is_empty() {
            let list: Vec<String> = ratios.iter().map(|r| shown_ratio(*r, row.goal)).collect();
            row.configuration =
                format!("{}; ratios of {} runs: {} (median shown)", row.configuration, ratios.len(), list.join(", "));
        }
        row.runs = ratios;
        out.push(row);
    }
    out
}

/// `47.1k`, `782k`, `950`.
pub(crate) fn rate(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v >= 100_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 1_000.0 {
        format!("{:.1}k", v / 1000.0)
    } else {
        format!("{v:.0}")
    }
}

/// A ratio as the table shows it: two decimals, or as many more (up to four) as it takes for
/// the figure not to contradict its verdict. A ratio just below its goal rounds up to the goal
/// (0.998 against 1.00 would read `1.00 FAIL`); it is shown as `0.998`.
fn shown_ratio(ratio: f64, goal: Option<f64>) -> String {
    let below = goal.is_some_and(|g| ratio < g);
    for places in 2..4 {
        let shown = format!("{ratio:.places$}");
        let reads_below = goal.is_some_and(|g| shown.parse::<f64>().is_ok_and(|s| s < g));
        if reads_below == below {
            return shown;
        }
    }
    format!("{ratio:.4}")
}

/// The table as printed (Markdown, so that `docs/bench.md` can hold it as it is).
pub(crate) fn table(outcomes: &[(Subject, Outcome)]) -> String {
    let mut out = String::new();
    out.push_str(
        "| P | subject | baseline | measured ev/s | baseline ev/s | ratio | goal | result | configuration | seed |\n",
    );
    out.push_str("|---|---|---|---:|---:|---:|---|---|---|---|\n");
    for (subject, outcome) in outcomes {
        match outcome {
            Outcome::Rows(rows) => {
                for r in rows {
                    let ratio = r.ratio().map_or("-".to_string(), |x| shown_ratio(x, r.goal));
                    let goal = r.goal.map_or("-".to_string(), |g| format!(">= {g:.2}"));
                    let verdict = match r.pass {
                        Some(true) => "pass",
                        Some(false) => "FAIL",
                        None => "-",
                    };
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {} | {ratio} | {goal} | {verdict} | {} | {} |",
                        r.id,
                        r.subject,
                        r.baseline,
                        rate(r.measured),
                        r.baseline_rate.map_or("-".to_string(), rate),
                        r.configuration,
                        r.seed
                    );
                }
            }
            Outcome::Skipped(why) => {
                let _ = writeln!(out, "| {} | SKIPPED: {} | | | | | | | | |", subject.name(), why.replace('|', "/"));
            }
            Outcome::Failed(why) => {
                let _ = writeln!(out, "| {} | ERROR: {} | | | | | | | | |", subject.name(), why.replace('|', "/"));
            }
        }
    }
    out
}

/// CPUs, memory and kernel of this machine, one line.
pub(crate) fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().and_then(|l| l.split_whitespace().nth(1)).and_then(|kb| kb.parse::<u64>().ok()))
        .map_or("? GiB".to_string(), |kb| format!("{:.1} GiB", kb as f64 / 1024.0 / 1024.0));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").map_or("?".into(), |k| k.trim().to_string());
    let build = if cfg!(debug_assertions) { "debug build" } else { "release build" };
    format!("{cpus} CPUs ({model}), {mem} RAM, Linux {kernel}, {build}")
}

fn s(v: impl Into<String>) -> Json {
    Json::Str(v.into())
}

fn opt(v: Option<f64>) -> Json {
    v.map_or(Json::Null, Json::Float)
}

fn row_json(r: &Row) -> Json {
    Json::obj(vec![
        ("id", s(&r.id)),
        ("subject", s(&r.subject)),
        ("baseline", s(&r.baseline)),
        ("measured_eps", Json::Float(r.measured)),
        ("baseline_eps", opt(r.baseline_rate)),
        ("ratio", opt(r.ratio())),
        ("goal", opt(r.goal)),
        ("pass", r.pass.map_or(Json::Null, Json::Bool)),
        ("configuration", s(&r.configuration)),
        ("components", Json::Obj(r.components.iter().map(|(k, v)| (k.clone(), Json::Float(*v))).collect())),
        ("seed", Json::Num(r.seed.into())),
        ("run_ratios", Json::Arr(r.runs.iter().map(|x| Json::Float(*x)).collect())),
    ])
}

/// The whole run as JSON.
pub(crate) fn json(settings: &Settings, machine: &str, outcomes: &[(Subject, Outcome)], elapsed: Duration) -> Json {
    let mut rows = Vec::new();
    let mut subjects = Vec::new();
    for (subject, outcome) in outcomes {
        let (status, why) = match outcome {
            Outcome::Rows(r) => {
                rows.extend(r.iter().map(row_json));
                ("ran", None)
            }
            Outcome::Skipped(why) => ("skipped", Some(why.clone())),
            Outcome::Failed(why) => ("error", Some(why.clone())),
        };
        subjects.push(Json::obj(vec![
            ("subject", s(subject.name())),
            ("status", s(status)),
            ("reason", why.map_or(Json::Null, Json::Str)),
        ]));
    }
    Json::obj(vec![
        ("seed", Json::Num(settings.seed.into())),
        (
            "settings",
            Json::obj(vec![
                ("events", Json::Num(settings.events as i128)),
                ("batch", Json::Num(settings.batch as i128)),
                ("payload", Json::Num(settings.payload as i128)),
                ("keys", Json::Num(settings.keys.into())),
                ("pipeline_depth", settings.pipeline_depth.map_or(Json::Null, |d| Json::Num(d as i128))),
                ("in_flight", Json::Num(settings.in_flight as i128)),
                ("per_commit", Json::Num(settings.per_commit as i128)),
                ("p7_broker_latency_ms", Json::Num(settings.p7_broker_latency.as_millis() as i128)),
                ("repeat", Json::Num(settings.repeat as i128)),
            ]),
        ),
        ("machine", s(machine)),
        ("elapsed_s", Json::Float(elapsed.as_secs_f64())),
        ("subjects", Json::Arr(subjects)),
        ("rows", Json::Arr(rows)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ratio_just_below_its_goal_is_shown_with_the_places_that_tell() {
        assert_eq!(shown_ratio(0.8449, Some(0.8)), "0.84");
        assert_eq!(shown_ratio(0.998, Some(1.0)), "0.998");
        assert_eq!(shown_ratio(0.9996, Some(1.0)), "0.9996");
        assert_eq!(shown_ratio(0.99999, Some(1.0)), "1.0000", "past four places the verdict says it");
        assert_eq!(shown_ratio(1.0, Some(1.0)), "1.00");
        assert_eq!(shown_ratio(0.796, None), "0.80");
        let table = table(&[(
            Subject::P7,
            Outcome::Rows(vec![Row::new("P7/2", "2 relays", "best", 99.8, Some(100.0), Some(1.0), "", vec![], 1)]),
        )]);
        assert!(table.contains("| 0.998 | >= 1.00 | FAIL |"), "{table}");
    }

    #[test]
    fn ratio_and_verdict_follow_from_the_figures() {
        let r = Row::new("P4", "relay", "raw SQL", 90.0, Some(100.0), Some(0.9), "", vec![], 1);
        assert_eq!(r.pass, Some(true));
        let r = Row::new("P4", "relay", "raw SQL", 89.0, Some(100.0), Some(0.9), "", vec![], 1);
        assert_eq!(r.pass, Some(false));
        let r = Row::new("P7/1", "relay", "-", 89.0, None, None, "", vec![], 1);
        assert_eq!(r.pass, None);
        assert!(row_json(&r).render().contains("\"ratio\": null"));
    }

    #[test]
    fn repeated_runs_report_the_median_ratio_and_list_every_run() {
        let run = |p4: f64, p7: f64| {
            vec![
                Row::new("P4", "relay", "raw SQL", p4, Some(100.0), Some(0.9), "cfg", vec![], 1),
                Row::new("P7/1", "relay", "-", p7, None, None, "cfg", vec![], 1),
            ]
        };
        let rows = median(vec![run(95.0, 10.0), run(80.0, 11.0), run(88.0, 12.0)]);
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].id.as_str(), rows[0].measured, rows[0].pass), ("P4", 88.0, Some(false)));
        assert_eq!(rows[0].runs, vec![0.95, 0.80, 0.88]);
        assert!(
            rows[0].configuration.ends_with("ratios of 3 runs: 0.95, 0.80, 0.88 (median shown)"),
            "{}",
            rows[0].configuration
        );
        assert_eq!((rows[1].measured, rows[1].runs.len()), (10.0, 0), "no ratio: the first run, nothing listed");
        // Two runs: the lower one, not the better one.
        assert_eq!(median(vec![run(95.0, 1.0), run(80.0, 1.0)])[0].measured, 80.0);
        // One run: as it is.
        assert_eq!(median(vec![run(95.0, 1.0)])[0].configuration, "cfg");
    }

    #[test]
    fn strings_are_escaped() {
        assert_eq!(s("a\"b\\c\n").render(), "\"a\\\"b\\\\c\\n\"\n");
    }
}
