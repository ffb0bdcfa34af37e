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
