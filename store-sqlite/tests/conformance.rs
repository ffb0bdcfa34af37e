//! The whole conformance suite against SQLite: outbox store and inbox on real SQLite files,
//! with the in-process reference broker. Each fixture gets its own pair of files (the producer's
//! database and the consumer's), so cases run in parallel and nothing leaks between them.

#[path = "support/harness.rs"]
mod harness;

fn main() -> std::process::ExitCode {
    outbox_conformance_tests::main(harness::SqliteHarness::new())
}
