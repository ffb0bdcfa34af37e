//! The whole conformance suite with the Redis Streams broker (see
//! `outbox_broker_redis::conformance`) between the in-memory reference outbox and inbox: every
//! case publishes to, subscribes to and drains a real Redis server.

use outbox_broker_redis::RedisConfig;
use outbox_broker_redis::conformance::RedisBrokerHarness;
use outbox_conformance_tests::{Combined, MemoryStoreHarness, redis_url, require_service, service_addr};

fn main() -> std::process::ExitCode {
    if !require_service("Redis", "redis", &service_addr(&redis_url())) {
        return std::process::ExitCode::SUCCESS;
    }
    let config = RedisConfig::from_url(&redis_url()).unwrap_or_else(|e| panic!("OUTBOX_REDIS_URL: {e}"));
    outbox_conformance_tests::main(Combined::new(MemoryStoreHarness, RedisBrokerHarness::new(config)))
}
