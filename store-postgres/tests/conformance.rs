//! The whole conformance suite against the real PostgreSQL server: outbox store and inbox in a
//! fresh schema per fixture (see `outbox_store_postgres::conformance`), with the in-process
//! reference broker. Permutations are sampled by seed (`OUTBOX_TEST_SEED` replays a run).

mod common;

use outbox_conformance_tests::{Combined, MemoryBrokerHarness};
use outbox_store_postgres::conformance::PgStoreHarness;

fn main() -> std::process::ExitCode {
    if !common::pg_available() {
        return std::process::ExitCode::SUCCESS;
    }
    outbox_conformance_tests::main(Combined::new(PgStoreHarness::new(common::base_config()), MemoryBrokerHarness))
}
