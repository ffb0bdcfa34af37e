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

async fn every_wrong_variant_is_caught() -> bool {
    let mut escaped = Vec::new();
    let mut hung = Vec::new();
    for mutant in Mutant::ALL {
        let h = MutantHarness(mutant);
        let engines = mutant.engines();
        let mut caught = Vec::new();
        let mut first = None;
        let mut why = Vec::new();
        for case in all_cases() {
            let started = Instant::now();
            let Ok(result) = tokio::time::timeout(CASE_BUDGET, run_case_with(&h, &case, &engines)).await else {
                println!("HUNG: {} did not finish within {CASE_BUDGET:?} on {mutant}", case.name);
                hung.push((mutant, case.name));
                continue;
            };
            if started.elapsed() > CASE_BUDGET / 4 {
                println!("  slow: {} took {:.1?} on {mutant}", case.name, started.elapsed());
            }
            match result {
                Ok(CaseResult::Failed(c)) => {
                    caught.push(case.name);
                    why.push(format!("  {}: {}", case.name, c.violations.first().map_or("", String::as_str)));
                    first.get_or_insert(c);
                }
                Ok(CaseResult::Passed(_)) => {}
                Ok(CaseResult::Skipped(cap)) => {
                    eprintln!("{} skipped on the reference backends ({cap})", case.name);
                    escaped.push(mutant);
                }
                Err(e) => {
                    caught.push(case.name);
                    eprintln!("  {} errored on {mutant}: {e}", case.name);
                }
            }
        }
        if caught.is_empty() {
            escaped.push(mutant);
            println!("NOT CAUGHT: {mutant}");
        } else {
            println!("caught: {mutant} — by {}", caught.join(", "));
            for line in &why {
                println!("{line}");
            }
            if let Some(c) = first {
                println!("{c}\n");
            }
        }
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
    let teeth = rt.block_on(every_wrong_variant_is_caught());
    let deep = rt.block_on(reference_backends_survive_a_deeper_exploration());
    println!(
        "teeth: {}; deep exploration: {}",
        if teeth { "ok" } else { "FAILED" },
        if deep { "ok" } else { "FAILED" }
    );
    if teeth && deep { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
