//! The whole conformance suite against SQLite: outbox store and inbox on real SQLite files (see
//! `outbox_store_sqlite::conformance`), with the in-process reference broker.

use outbox_conformance_tests::{Combined, MemoryBrokerHarness};
use outbox_store_sqlite::conformance::SqliteStoreHarness;

fn main() -> std::process::ExitCode {
    let store = SqliteStoreHarness::temporary().unwrap_or_else(|e| panic!("{e}"));
    outbox_conformance_tests::main(Combined::new(store, MemoryBrokerHarness))
}
