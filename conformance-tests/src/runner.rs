//! The entry point for backend authors: one named test per case, skipped cases reported as
//! ignored with the capability they need — never as passed.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Failed, Trial};

use crate::cases::{Case, CaseResult, all_cases, run_case};
use crate::harness::Harness;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("cannot build a tokio runtime: {e}"))
}

/// Cases run at once when neither `--test-threads` nor `RUST_TEST_THREADS` says otherwise.
///
/// A case spends nearly all its time waiting on the servers, not computing: proving that
/// nothing more arrives takes a broker's whole delivery wait, and a Kafka consumer waits for its
/// group. With two at a time (the machine's parallelism on two cores) the store × broker matrix
/// kept the CPU 90–97% idle; eight at a time keeps a PostgreSQL backend within its default 100
/// connections (a fixture's pool holds four).
pub const DEFAULT_TEST_THREADS: usize = 8;

/// The test-harness arguments of this process, with the number of cases run at once filled
/// in: `--test-threads N` if given, else `RUST_TEST_THREADS` (which `libtest` reads and
/// `libtest-mimic` does not), else [`DEFAULT_TEST_THREADS`].
pub fn arguments() -> Arguments {
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        let from_env = std::env::var("RUST_TEST_THREADS").ok().and_then(|v| v.trim().parse::<usize>().ok());
        args.test_threads = Some(from_env.filter(|n| *n > 0).unwrap_or(DEFAULT_TEST_THREADS));
    }
    args
}

/// Run every case against `harness` as a test binary (`harness = false` in the backend's
/// `[[test]]` section). Accepts the usual test-harness arguments (filters, `--list`,
/// `--test-threads`); cases run [`DEFAULT_TEST_THREADS`] at a time unless told otherwise
/// ([`arguments`]).
pub fn main<H: Harness>(harness: H) -> ExitCode {
    let args = arguments();
    let harness = Arc::new(harness);
    let caps = harness.capabilities();
    eprintln!("conformance suite against {}", harness.name());
    let trials = all_cases()
        .into_iter()
        .map(|case| {
            let missing = case.needs.iter().copied().find(|c| !caps.has(*c));
            if let Some(cap) = missing {
                eprintln!("SKIPPED {}: the backend lacks the capability `{cap}`", case.name);
            }
            let h = harness.clone();
            let c = case.clone();
            let trial = Trial::test(case.name, move || run_trial(h.as_ref(), &c)).with_kind(case.class);
            trial.with_ignored_flag(missing.is_some())
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// Longest one case may run (`OUTBOX_CASE_TIMEOUT_SECS`, default 600): every wait inside the
/// suite is bounded on its own, this is the net under them, so a backend call that never
/// returns fails its case with a message instead of hanging the run.
pub fn case_timeout() -> Duration {
    let secs = std::env::var("OUTBOX_CASE_TIMEOUT_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(600);
    Duration::from_secs(secs)
}

fn run_trial<H: Harness>(harness: &H, case: &Case) -> Result<(), Failed> {
    let started = Instant::now();
    let limit = case_timeout();
    let Ok(result) = runtime().block_on(async { tokio::time::timeout(limit, run_case(harness, case)).await }) else {
        return Err(format!(
            "{}: did not finish within {limit:?} (OUTBOX_CASE_TIMEOUT_SECS): a backend call never returned",
            case.name
        )
        .into());
    };
    match result {
        Ok(CaseResult::Passed(note)) => {
            eprintln!("{} passed in {:.2?}: {note}", case.name, started.elapsed());
            Ok(())
        }
        Ok(CaseResult::Failed(c)) => Err(format!("{}\nproperty: {}\n{c}", case.class, case.property).into()),
        Ok(CaseResult::Skipped(cap)) => Err(format!("skipped: the backend lacks the capability `{cap}`").into()),
        Err(e) => Err(format!("{}: setup failed: {e}", case.name).into()),
    }
}

/// Run every case and return the results in report order (for programs that print a table).
pub async fn run_all<H: Harness>(harness: &H) -> Vec<(Case, Result<CaseResult, outbox_core::Error>)> {
    let mut out = Vec::new();
    let limit = case_timeout();
    for case in all_cases() {
        let r = tokio::time::timeout(limit, run_case(harness, &case)).await.unwrap_or_else(|_| {
            Err(outbox_core::Error::permanent(
                outbox_core::ErrorKind::Timeout,
                "suite",
                format!("{} did not finish within {limit:?} (OUTBOX_CASE_TIMEOUT_SECS)", case.name),
            ))
        });
        out.push((case, r));
    }
    out
}

/// A plain-text table of results: case, class, property, verdict (with why for skips and
/// failures), and counterexamples after it. Returns the text and whether everything that ran
/// passed.
pub fn table(results: &[(Case, Result<CaseResult, outbox_core::Error>)]) -> (String, bool) {
    let mut ok = true;
    let wc = results.iter().map(|(c, _)| c.class.len()).max().unwrap_or(5);
    let wn = results.iter().map(|(c, _)| c.name.len()).max().unwrap_or(4);
    let mut text = format!("{:<wn$} {:<wc$} {:<26} property\n", "case", "class", "verdict");
    let mut details = String::new();
    for (case, r) in results {
        let verdict = match r {
            Ok(CaseResult::Passed(_)) => "pass".to_string(),
            Ok(CaseResult::Skipped(cap)) => format!("skipped (needs {cap})"),
            Ok(CaseResult::Failed(c)) => {
                ok = false;
                details.push_str(&format!("\n{c}\n"));
                "FAIL".to_string()
            }
            Err(e) => {
                ok = false;
                details.push_str(&format!("\n{}: setup failed: {e}\n", case.name));
                "ERROR".to_string()
            }
        };
        text.push_str(&format!("{:<wn$} {:<wc$} {:<26} {}\n", case.name, case.class, verdict, case.property));
    }
    text.push_str(&details);
    (text, ok)
}
