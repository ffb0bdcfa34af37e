//! `outbox conformance` as a user runs it: the built binary pairs the halves it is given (the
//! broker half chosen at run time, as a trait object) and prints one verdict line per case; a
//! server it cannot reach is one clear error before any case runs.

// `common` re-exports the service helpers other tests use; these runs need no server.
#[allow(unused_imports)]
mod common;

use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn every_case_of_the_suite_runs_and_passes_on_the_reference_halves() {
    let out = run(&["conformance", "--store", "memory", "--broker", "memory"], LIMIT);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("memory store + memory inbox + memory broker"), "names the pair:\n{stdout}");
    let cases = outbox_conformance_tests::all_cases();
    for case in &cases {
        let line = stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(case.name))
            .unwrap_or_else(|| panic!("no line for {}:\n{stdout}", case.name));
        assert!(line.split_whitespace().any(|w| w == "pass"), "{} did not pass: {line}", case.name);
    }
    let summary = format!("{n} of {n} cases passed, 0 skipped, 0 failed", n = cases.len());
    assert!(stdout.contains(&summary), "expected `{summary}`:\n{stdout}");
    assert!(stdout.contains("verdict: PASS"), "{stdout}");
}

#[test]
fn an_unreachable_broker_is_one_clear_error_before_any_case() {
    // Port 1 on the loopback: nothing listens there, the connection is refused at once. The
    // AMQP client connects on first use, so a fixture alone would not find it out: every case
    // used to fail on its own instead.
    for (url, named) in [("redis://127.0.0.1:1", "redis"), ("amqp://guest:guest@127.0.0.1:1/%2f", "amqp")] {
        let out = run(&["conformance", "--store", "memory", "--broker", url], LIMIT);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{url}\nstdout:\n{stdout}\nstderr:\n{stderr}");
        let error = stderr.lines().find(|l| l.starts_with("outbox: ")).unwrap_or_else(|| panic!("no error: {stderr}"));
        assert!(error.contains(named) && error.contains("127.0.0.1:1"), "the error names the broker: {error}");
        assert!(!error.contains("guest:guest"), "the password is not shown: {error}");
        assert!(!stdout.contains("permutations"), "no case ran for {url}:\n{stdout}");
        assert!(!stdout.contains("verdict"), "no verdict without a broker:\n{stdout}");
        // A harness that never reached its server has nothing to clean up, and says nothing more.
        assert_eq!(stderr.lines().filter(|l| !l.trim().is_empty()).count(), 1, "one error line:\n{stderr}");
    }
}
