//! The suite has teeth: every deliberately wrong variant of the reference backends is caught by
//! at least one case, with its counterexample printed; and the reference backends survive an
//! exploration deeper than the default bound. A plain `main` (`harness = false`) so that what
//! caught each variant is always printed, not captured.

use std::process::ExitCode;

use outbox_conformance_tests::MemoryHarness;
use outbox_conformance_tests::explore::{Bounds, exhaustive};
use outbox_conformance_tests::mutants::{Mutant, MutantHarness};
use outbox_conformance_tests::{CaseResult, all_cases, run_case};

async fn every_wrong_variant_is_caught() -> bool {
    let mut escaped = Vec::new();
    for mutant in Mutant::ALL {
        let h = MutantHarness(mutant);
        let mut caught = Vec::new();
        let mut first = None;
        for case in all_cases() {
            match run_case(&h, &case).await {
                Ok(CaseResult::Failed(c)) => {
                    caught.push(case.name);
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
            if let Some(c) = first {
                println!("{c}\n");
            }
        }
    }
    if !escaped.is_empty() {
        println!("wrong variants that passed the whole suite: {escaped:?}");
    }
    escaped.is_empty()
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
