//! `outbox conformance`: the suite's table, for people rather than test runners.

use std::time::Instant;

use outbox_conformance_tests::{MemoryHarness, run_all, table};

#[path = "../../store-sqlite/tests/support/harness.rs"]
mod sqlite_harness;

/// Run the suite and print the table; `Ok(false)` when any case failed.
pub(crate) async fn run(memory: bool) -> outbox_core::Result<bool> {
    let started = Instant::now();
    let (name, results) = if memory {
        ("memory store + memory broker + memory inbox".to_string(), run_all(&MemoryHarness).await)
    } else {
        let h = sqlite_harness::SqliteHarness::new();
        (outbox_conformance_tests::Harness::name(&h), run_all(&h).await)
    };
    let (text, ok) = table(&results);
    println!("conformance suite against {name}\n");
    println!("{text}");
    let passed =
        results.iter().filter(|(_, r)| matches!(r, Ok(outbox_conformance_tests::CaseResult::Passed(_)))).count();
    println!(
        "{passed} of {} cases passed in {:.1?}; verdict: {}",
        results.len(),
        started.elapsed(),
        if ok { "PASS" } else { "FAIL" }
    );
    Ok(ok)
}
