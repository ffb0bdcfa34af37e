//! A failure found by seeded sampling replays from its printed seed, and from its printed path.

use outbox_conformance_tests::explore::{Bounds, sampled};
use outbox_conformance_tests::mutants::{Mutant, MutantHarness};
use outbox_conformance_tests::{CaseResult, replay};
use outbox_consumer_inbox::EffectKind;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_failure_replays_from_its_seed_and_its_path() {
    let h = MutantHarness(Mutant::ProcessLocalDedupe);
    let bounds = Bounds { max_depth: 12, ..Bounds::default() };
    let seed = 20_261_130;
    let first = sampled(&h, bounds, seed, 500).await.unwrap();
    let c = first.counterexample.expect("sampling should find the process-local set's duplicate");
    eprintln!("{c}");
    assert_eq!(c.seed, Some(seed));

    // Event ids carry a per-run tag; compare violations by kind.
    let kinds = |v: &[String]| v.iter().map(|s| s.split(':').next().unwrap_or("").to_string()).collect::<Vec<_>>();

    // Same seed → the same failing path.
    let again = sampled(&h, bounds, seed, 500).await.unwrap().counterexample.unwrap();
    assert_eq!(again.path, c.path);
    assert_eq!(kinds(&again.violations), kinds(&c.violations));

    // The printed path alone reproduces it.
    let payloads = ["credit:acct-1:7", "credit:acct-1:5"];
    match replay(&h, &payloads, EffectKind::Additive, &c.path).await.unwrap() {
        CaseResult::Failed(r) => {
            let kinds =
                |v: &[String]| v.iter().map(|s| s.split(':').next().unwrap_or("").to_string()).collect::<Vec<_>>();
            assert_eq!(kinds(&r.violations), kinds(&c.violations[1..]), "{r}");
        }
        other => panic!("replaying {} did not fail: {other:?}", c.path),
    }
}
