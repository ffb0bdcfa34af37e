//! Permutations: interleavings of claim / send / complete / consume / commit / ack by two relays
//! and one consumer, with at most a bounded number of crashes, lease expiries and lost
//! acknowledgements, each judged by durable state after a full drain.
//!
//! On cheap backends the space is enumerated exhaustively, breadth first, so the first
//! counterexample found is a shortest one. On real servers paths are sampled from a seed that is
//! printed and can be replayed (`OUTBOX_TEST_SEED`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use outbox_consumer_inbox::EffectKind;
use outbox_core::rng::SplitMix64;
use outbox_core::{Inbox, Result};

use crate::cases::{CaseResult, Counterexample};
use crate::harness::Harness;
use crate::invariants::judge;
use crate::script::{Action, path_to_string};
use crate::world::{World, is_no_op};

/// Limits of an exploration.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Events committed before the first action.
    pub events: usize,
    /// Crashes (relay or consumer) per path.
    pub crashes: u32,
    /// Lease expiries per path.
    pub expiries: u32,
    /// Lost acknowledgements (broker confirm or consumer ack) per path.
    pub lost_acks: u32,
    /// Longest path; recovery runs everything after it to the end.
    pub max_depth: usize,
}

impl Default for Bounds {
    /// 2 relays × 2 events × 1 consumer, ≤ 1 crash, ≤ 1 expiry, ≤ 1 lost ack, paths up to
    /// `OUTBOX_EXPLORE_DEPTH` (default 7) actions.
    fn default() -> Self {
        let max_depth = std::env::var("OUTBOX_EXPLORE_DEPTH").ok().and_then(|v| v.parse().ok()).unwrap_or(7);
        Self { events: 2, crashes: 1, expiries: 1, lost_acks: 1, max_depth }
    }
}

/// What an exploration did.
#[derive(Debug, Clone, Default)]
pub struct ExploreReport {
    /// Paths executed and judged.
    pub paths: u64,
    /// Prefixes cut because an action did nothing (equivalent to a shorter path).
    pub pruned: u64,
    /// Actions executed in total (states visited).
    pub states: u64,
    /// Longest path judged.
    pub deepest: usize,
    /// Extra broker copies summed over all paths (expected; counted, not failures).
    pub duplicates_offered: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// The first (shortest, when exhaustive) failure.
    pub counterexample: Option<Box<Counterexample>>,
}

const PAYLOADS: [&str; 3] = ["credit:acct-1:7", "credit:acct-1:5", "credit:acct-2:3"];

fn budgets(path: &[Action], b: &Bounds) -> (u32, u32, u32) {
    let count = |f: fn(&Action) -> bool| path.iter().filter(|a| f(a)).count() as u32;
    let crashes = count(|a| matches!(a, Action::CrashRelay(_) | Action::CrashConsumer));
    let expiries = count(|a| matches!(a, Action::Expire));
    let lost = count(|a| matches!(a, Action::LoseConfirm(_) | Action::LoseAck));
    (b.crashes.saturating_sub(crashes), b.expiries.saturating_sub(expiries), b.lost_acks.saturating_sub(lost))
}

/// Relays are symmetric: B may act only after A has (halves the space, loses nothing).
fn canonical(path: &[Action], next: &Action) -> bool {
    use crate::script::RelayId::{A, B};
    let relay_of = |a: &Action| match a {
        Action::Claim(r) | Action::Send(r) | Action::Complete(r) | Action::LoseConfirm(r) | Action::CrashRelay(r) => {
            Some(*r)
        }
        _ => None,
    };
    relay_of(next) != Some(B) || path.iter().any(|a| relay_of(a) == Some(A))
}

enum Run {
    Pruned,
    Judged { enabled: Vec<Action>, failure: Option<Box<Counterexample>>, duplicates: usize },
}

async fn run_path<H: Harness>(h: &H, path: &[Action], bounds: &Bounds, seed: Option<u64>) -> Result<Run> {
    let mut world: World<H::Inbox> = World::new(h, "perm", &PAYLOADS[..bounds.events], EffectKind::Additive).await?;
    for a in path {
        if let Err(e) = world.step(a).await {
            if is_no_op(&e) {
                return Ok(Run::Pruned);
            }
            return Err(e);
        }
    }
    let (c, e, l) = budgets(path, bounds);
    let enabled = world.enabled(c, e, l).into_iter().filter(|a| canonical(path, a)).collect();
    judged(world, path, seed, enabled).await
}

async fn judged<I: Inbox>(
    mut world: World<I>,
    path: &[Action],
    seed: Option<u64>,
    enabled: Vec<Action>,
) -> Result<Run> {
    let trace = std::mem::take(&mut world.trace);
    let state = world.finish().await?;
    let j = judge(&state, EffectKind::Additive);
    let failure = (!j.violations.is_empty()).then(|| {
        Box::new(Counterexample {
            case: "permutations".into(),
            seed,
            path: path_to_string(path),
            violations: j.violations.iter().map(ToString::to_string).collect(),
            trace,
            state: state.to_string(),
        })
    });
    Ok(Run::Judged { enabled, failure, duplicates: j.duplicates_offered })
}

/// Enumerate every path up to `bounds.max_depth`, breadth first (shortest counterexample first).
///
/// # Errors
/// Backend errors (not contract violations: those are in the report).
pub async fn exhaustive<H: Harness>(h: &H, bounds: Bounds) -> Result<ExploreReport> {
    let start = Instant::now();
    let mut report = ExploreReport::default();
    let mut queue: VecDeque<Vec<Action>> = VecDeque::from([Vec::new()]);
    while let Some(path) = queue.pop_front() {
        report.states += path.len() as u64;
        match run_path(h, &path, &bounds, None).await? {
            Run::Pruned => report.pruned += 1,
            Run::Judged { enabled, failure, duplicates } => {
                report.paths += 1;
                report.deepest = report.deepest.max(path.len());
                report.duplicates_offered += duplicates as u64;
                if failure.is_some() {
                    report.counterexample = failure;
                    break;
                }
                if path.len() < bounds.max_depth {
                    for a in enabled {
                        let mut next = path.clone();
                        next.push(a);
                        queue.push_back(next);
                    }
                }
            }
        }
    }
    report.elapsed = start.elapsed();
    Ok(report)
}

/// Sampled paths run at once. Each path is its own world (fresh fixtures, its own generator),
/// and on a real server nearly all of a path's time is spent waiting on deliveries, so running
/// a few together shortens the case without changing any path.
pub const SAMPLED_PATHS_AT_ONCE: usize = 4;

/// Sample `iterations` random paths from `seed`; iteration `i` uses a generator seeded from
/// `seed` and `i`, so any run replays exactly. Up to [`SAMPLED_PATHS_AT_ONCE`] paths run
/// together; results are taken in iteration order and the first failing iteration is reported
/// (later ones still running are dropped), as a one-at-a-time run would report it.
///
/// # Errors
/// Backend errors.
pub async fn sampled<H: Harness>(h: &H, bounds: Bounds, seed: u64, iterations: u32) -> Result<ExploreReport> {
    use futures::StreamExt as _;
    let start = Instant::now();
    let mut report = ExploreReport::default();
    let mut paths = futures::stream::iter(0..iterations)
        .map(|i| async move { (i, sample_path(h, &bounds, seed, i).await) })
        .buffered(SAMPLED_PATHS_AT_ONCE);
    while let Some((i, result)) = paths.next().await {
        let (path, run) = result?;
        report.states += path.len() as u64;
        report.paths += 1;
        report.deepest = report.deepest.max(path.len());
        if let Run::Judged { failure, duplicates, .. } = run {
            report.duplicates_offered += duplicates as u64;
            if let Some(mut f) = failure {
                f.violations.insert(0, format!("iteration {i} of seed {seed}"));
                report.counterexample = Some(f);
                break;
            }
        }
    }
    report.elapsed = start.elapsed();
    Ok(report)
}

/// Iteration `i` of a sampled run: draw a path from its generator, step a fresh world along it
/// and judge the drained state.
async fn sample_path<H: Harness>(h: &H, bounds: &Bounds, seed: u64, i: u32) -> Result<(Vec<Action>, Run)> {
    let mut rng = SplitMix64::new(seed ^ u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut world: World<H::Inbox> = World::new(h, "perm", &PAYLOADS[..bounds.events], EffectKind::Additive).await?;
    let mut path = Vec::new();
    // Actions that did nothing in the current state (a no-op changes nothing, so the state
    // is the same and another action can be drawn instead).
    let mut idle: Vec<Action> = Vec::new();
    while path.len() < bounds.max_depth {
        let (c, e, l) = budgets(&path, bounds);
        let enabled: Vec<Action> =
            world.enabled(c, e, l).into_iter().filter(|a| canonical(&path, a) && !idle.contains(a)).collect();
        if enabled.is_empty() {
            break;
        }
        let a = enabled[rng.below(enabled.len() as u64) as usize].clone();
        match world.step(&a).await {
            Ok(()) => {
                path.push(a);
                idle.clear();
            }
            Err(e) if is_no_op(&e) => idle.push(a),
            Err(e) => return Err(e),
        }
    }
    let run = judged(world, &path, Some(seed), Vec::new()).await?;
    Ok((path, run))
}

/// The seed for sampled runs: `OUTBOX_TEST_SEED` if set, else from the clock.
pub fn seed_from_env() -> u64 {
    std::env::var("OUTBOX_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    })
}

/// The `permutations` case: exhaustive where the backend allows it, sampled otherwise.
///
/// # Errors
/// Backend errors.
pub async fn permutations_case<H: Harness>(h: &H) -> Result<CaseResult> {
    let caps = h.capabilities();
    let bounds = Bounds::default();
    let (mode, report) = if caps.exhaustive && std::env::var("OUTBOX_TEST_SEED").is_err() {
        ("exhaustive".to_string(), exhaustive(h, bounds).await?)
    } else {
        let seed = seed_from_env();
        let iterations = std::env::var("OUTBOX_TEST_ITERATIONS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(caps.sampled_iterations);
        eprintln!(
            "permutations on {}: seed {seed} (replay with OUTBOX_TEST_SEED={seed}), {iterations} iterations",
            h.name()
        );
        (format!("sampled, seed {seed}"), sampled(h, bounds, seed, iterations).await?)
    };
    let summary = format!(
        "{mode}: {} paths judged, {} pruned, {} actions executed, deepest {} (bound {}), {} duplicate offers counted, {:.2?}",
        report.paths,
        report.pruned,
        report.states,
        report.deepest,
        bounds.max_depth,
        report.duplicates_offered,
        report.elapsed
    );
    eprintln!("permutations on {}: {summary}", h.name());
    Ok(match report.counterexample {
        Some(c) => CaseResult::Failed(c),
        None => CaseResult::Passed(summary),
    })
}
