#![doc = include_str!("../README.md")]

/// Fail the case (`return Ok(CaseResult::fail(..))`) with a formatted message unless `$cond`
/// holds; every case module uses it (`CaseResult` must be in scope).
macro_rules! ensure {
    ($case:expr, $cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Ok(CaseResult::fail($case, "", format!($($msg)+)));
        }
    };
}

mod admin_cases;
mod batch_cases;
pub mod cases;
mod consumer_cases;
pub mod docs;
pub mod engines;
pub mod explore;
pub mod faults;
pub mod harness;
mod inbox_cases;
pub mod invariants;
pub mod mutants;
mod order;
pub mod reference;
mod relay_cases;
pub mod runner;
pub mod script;
pub mod service;
mod store_cases;
pub mod world;

pub use cases::{Case, CaseResult, Counterexample, all_cases, replay, run_case, run_case_with};
pub use engines::{Engines, RelayFactory, RelayUnderTest};
pub use harness::{
    BrokerFixture, BrokerHarness, Capabilities, Capability, Combined, EffectRow, EffectTable, Fixture, Foreign,
    ForeignKind, ForeignWriter, Harness, MemoryBrokerHarness, MemoryForeign, MemoryStoreHarness, StoreFixture,
    StoreHarness, stream_fields,
};
pub use reference::MemoryHarness;
pub use runner::{DEFAULT_TEST_THREADS, arguments, main, run_all, table};
pub use service::{amqp_url, in_ci, kafka_url, pg_url, redis_url, require_service, service_addr};
