//! The whole suite against the in-memory reference backends: one named test per case.

fn main() -> std::process::ExitCode {
    outbox_conformance_tests::main(outbox_conformance_tests::MemoryHarness)
}
