//! The suite has teeth: every deliberately wrong variant of the reference backends is caught by
//! at least one case, with its counterexample printed; and the reference backends survive an
//! exploration deeper than the default bound. A plain `main` (`harness = false`) so that what
//! caught each variant is always printed, not captured.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use outbox_conformance_tests::MemoryHarness;
use outbox_conformance_tests::explore::{Bounds, exhaustive};
use outbox_conformance_tests::mutants::{Mutant, MutantHarness};
use outbox_conformance_tests::{CaseResult, all_cases, run_case_with};

/// A case on the reference backends takes well under a second (the exhaustive exploration a few
/// seconds); one that runs out this budget is stuck on a wait without bound, which is a failure
/// of the suite in itself, not a catch.
const CASE_BUDGET: Duration = Duration::from_secs(60);

/// Wrong variants judged at once: a case on the reference backends mostly waits out its
/// delivery windows, so one variant at a time left the CPU idle four fifths of the run.
const MUTANTS_AT_ONCE: usize = 8;

/// What the suite did to one wrong variant.
struct Verdict {
    mutant: Mutant,
    /// Cases that failed (or errored) on it.
    caught: Vec<&'static str>,
    /// Cases that did not finish within [`CASE_BUDGET`].
    hung: Vec<&'static str>,
    /// Whether a case skipped on the reference backends (which have every capability).
    skipped: bool,
    /// Its report, printed in `Mutant::ALL` order once it is judged.
    text: String,
}

async fn judge_mutant(mutant: Mutant) -> Verdict {
    use std::fmt::Write as _;
    let h = MutantHarness(mutant);
    let engines = mutant.engines();
    let mut v = Verdict { mutant, caught: Vec::new(), hung: Vec::new(), skipped: false, text: String::new() };
    let mut first = None;
    let mut why = Vec::new();
    for case in all_cases() {
        let started = Instant::now();
        let Ok(result) = tokio::time::timeout(CASE_BUDGET, run_case_with(&h, &case, &engines)).await else {
            let _ = writeln!(v.text, "HUNG: {} did not finish within {CASE_BUDGET:?} on {mutant}", case.name);
            v.hung.push(case.name);
            continue;
        };
        if started.elapsed() > CASE_BUDGET / 4 {
            let _ = writeln!(v.text, "  slow: {} took {:.1?} on {mutant}", case.name, started.elapsed());
        }
        match result {
            Ok(CaseResult::Failed(c)) => {
                v.caught.push(case.name);
                why.push(format!("  {}: {}", case.name, c.violations.first().map_or("", String::as_str)));
                first.get_or_insert(c);
            }
            Ok(CaseResult::Passed(_)) => {}
            Ok(CaseResult::Skipped(cap)) => {
                let _ = writeln!(v.text, "{} skipped on the reference backends ({cap})", case.name);
                v.skipped = true;
            }
            Err(e) => {
                v.caught.push(case.name);
                let _ = writeln!(v.text, "  {} errored on {mutant}: {e}", case.name);
            }
        }
    }
    if v.caught.is_empty() {
        let _ = writeln!(v.text, "NOT CAUGHT: {mutant}");
    } else {
        let _ = writeln!(v.text, "caught: {mutant} — by {}", v.caught.join(", "));
        for line in &why {
            let _ = writeln!(v.text, "{line}");
        }
        if let Some(c) = first {
            let _ = writeln!(v.text, "{c}\n");
        }
    }
    v
}

/// Run `f`'s future on a blocking thread of the current runtime; a panic in it is re-raised.
async fn on_own_thread<F, T>(f: impl FnOnce() -> F + Send + 'static) -> T
where
    F: std::future::Future<Output = T>,
    T: Send + 'static,
{
    let handle = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || handle.block_on(f()))
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

async fn every_wrong_variant_is_caught() -> bool {
    use futures::StreamExt as _;
    let mut escaped = Vec::new();
    let mut hung = Vec::new();
    // Each variant on a blocking thread of its own, driven by the runtime's timers (a case's
    // future is not `Send`); results are taken in `Mutant::ALL` order, so the output reads the
    // same on every run.
    let mut verdicts =
        futures::stream::iter(Mutant::ALL).map(|m| on_own_thread(move || judge_mutant(m))).buffered(MUTANTS_AT_ONCE);
    while let Some(v) = verdicts.next().await {
        print!("{}", v.text);
        if v.caught.is_empty() || v.skipped {
            escaped.push(v.mutant);
        }
        hung.extend(v.hung.iter().map(|case| (v.mutant, *case)));
    }
    if !escaped.is_empty() {
        println!("wrong variants that passed the whole suite: {escaped:?}");
    }
    if !hung.is_empty() {
        println!("cases that hung instead of failing: {hung:?}");
    }
    escaped.is_empty() && hung.is_empty()
}

async fn reference_backends_survive_a_deeper_exploration() -> bool {
    let bounds = Bounds { max_depth: 10, ..Bounds::default() };
    let r = match exhaustive(&MemoryHarness, bounds).await {
        Ok(r) => r,
        Err(e) => {
            println!("deep exploration failed to run: {e}");
            return false;
        }
    };
    println!(
        "deep exploration of the reference backends: {} paths judged, {} pruned, {} actions executed, depth {}, \
         {} duplicate offers counted, {:.2?}",
        r.paths, r.pruned, r.states, r.deepest, r.duplicates_offered, r.elapsed
    );
    if let Some(c) = &r.counterexample {
        println!("{c}");
        return false;
    }
    r.deepest == 10 && r.paths > 100_000
}

fn main() -> ExitCode {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    // The deep exploration is CPU work and the variants mostly wait: run them side by side.
    let (teeth, deep) = rt.block_on(async {
        let deep = on_own_thread(reference_backends_survive_a_deeper_exploration);
        let deep = tokio::spawn(deep);
        let teeth = every_wrong_variant_is_caught().await;
        (teeth, deep.await.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())))
    });
    println!(
        "teeth: {}; deep exploration: {}",
        if teeth { "ok" } else { "FAILED" },
        if deep { "ok" } else { "FAILED" }
    );
    if teeth && deep { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
