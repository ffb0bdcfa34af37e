//! The suite has teeth: every deliberately wrong variant of the reference backends is caught by
//! at least one case, and the counterexample is printed.

use outbox_conformance_tests::mutants::{Mutant, MutantHarness};
use outbox_conformance_tests::{CaseResult, all_cases, run_case};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_wrong_variant_is_caught() {
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
                Ok(CaseResult::Skipped(cap)) => panic!("{} skipped on the reference backends ({cap})", case.name),
                Err(e) => {
                    caught.push(case.name);
                    eprintln!("  {} errored on {mutant}: {e}", case.name);
                }
            }
        }
        if caught.is_empty() {
            escaped.push(mutant);
            eprintln!("NOT CAUGHT: {mutant}");
        } else {
            eprintln!("caught: {mutant} — by {}", caught.join(", "));
            if let Some(c) = first {
                eprintln!("{c}\n");
            }
        }
    }
    assert!(escaped.is_empty(), "wrong variants that passed the whole suite: {escaped:?}");
}

/// The reference backends explored deeper than the default bound (10 actions), exhaustively.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_backends_survive_a_deeper_exploration() {
    use outbox_conformance_tests::MemoryHarness;
    use outbox_conformance_tests::explore::{Bounds, exhaustive};
    let bounds = Bounds { max_depth: 10, ..Bounds::default() };
    let r = exhaustive(&MemoryHarness, bounds).await.unwrap();
    eprintln!(
        "deep exploration of the reference backends: {} paths judged, {} pruned, {} actions executed, depth {}, {} duplicate offers counted, {:.2?}",
        r.paths, r.pruned, r.states, r.deepest, r.duplicates_offered, r.elapsed
    );
    if let Some(c) = &r.counterexample {
        panic!("{c}");
    }
    assert_eq!(r.deepest, 10);
    assert!(r.paths > 100_000, "the exploration shrank: {} paths", r.paths);
}
