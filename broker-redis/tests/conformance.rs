//! The whole conformance suite with the Redis Streams broker between the in-memory reference
//! outbox and inbox: every case publishes to, subscribes to and drains a real Redis server.
//!
//! Each fixture connects a broker of its own (a case runs on a runtime of its own, and a
//! connection lives on the runtime that opened it) and gets a destination of its own under a key
//! prefix unique to this run; everything under that prefix is deleted when the run ends, so a
//! re-run on a dirty server starts clean.
//!
//! The claim idle time is short so that what a dropped subscription held is reclaimed by the next
//! member of the group well within the suite's delivery wait.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use outbox_broker_redis::{RedisBroker, RedisConfig};
use outbox_conformance_tests::reference::MemoryEffects;
use outbox_conformance_tests::world::unique_tag;
use outbox_conformance_tests::{Capabilities, Capability, Fixture, Harness};
use outbox_core::memory::{MemoryInbox, MemoryOutbox};
use outbox_core::{Destination, ManualClock, Result};

/// An entry left unacknowledged this long by a consumer that went away is reclaimed by another
/// member (subscriptions look for such entries every `CLAIM_IDLE / 2`).
const CLAIM_IDLE: Duration = Duration::from_millis(200);

/// How long the suite waits for a delivery: the worst reclaim after a dropped subscription is
/// `CLAIM_IDLE` plus one claim interval (300 ms) plus round trips; this leaves more than twice that.
const DELIVERY_WAIT: Duration = Duration::from_millis(750);

/// Sampled permutation paths per run (each costs a few delivery waits: the drain and the audit
/// read end on an empty wait).
const SAMPLED_ITERATIONS: u32 = 40;

struct RedisHarness {
    config: RedisConfig,
}

impl RedisHarness {
    fn new(prefix: &str) -> Self {
        let config = RedisConfig::from_url(&outbox_conformance_tests::redis_url())
            .unwrap_or_else(|e| panic!("OUTBOX_REDIS_URL: {e}"))
            .with_prefix(prefix)
            .with_claim_idle(CLAIM_IDLE);
        Self { config }
    }
}

#[async_trait]
impl Harness for RedisHarness {
    type Inbox = MemoryInbox;

    fn name(&self) -> String {
        "memory store + redis streams broker + memory inbox".into()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // Not `DetectsUnroutable`: an XADD to a stream nobody declared creates the stream and
            // succeeds. A redelivery (own pending entry or XAUTOCLAIM) carries the group's delivery
            // count, and a nack makes the entry reclaimable at once.
            present: vec![Capability::RedeliveryInfo, Capability::Nack],
            delivery_wait: DELIVERY_WAIT,
            sampled_iterations: SAMPLED_ITERATIONS,
            exhaustive: false,
        }
    }

    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<Fixture<MemoryInbox>> {
        let broker = RedisBroker::connect(self.config.clone()).await?;
        let destination = Destination::new(format!("{case}-{}", unique_tag()))?;
        let inbox = MemoryInbox::new(Arc::new(clock.clone()));
        Ok(Fixture::new(
            Arc::new(MemoryOutbox::new(Arc::new(clock))),
            Arc::new(broker),
            inbox.clone(),
            Arc::new(MemoryEffects(inbox)),
            destination,
        ))
    }
}

/// Deletes every key under the run's prefix (streams with their groups and pending lists) when
/// dropped, after the suite has finished.
struct Cleanup {
    url: String,
    prefix: String,
}

impl Cleanup {
    fn run(&self) -> redis::RedisResult<()> {
        let client = redis::Client::open(self.url.as_str())?;
        let mut conn = client.get_connection()?;
        let mut keys = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", self.prefix))
                .arg("COUNT")
                .arg(1000)
                .query(&mut conn)?;
            keys.extend(found);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        for chunk in keys.chunks(500) {
            let _: i64 = redis::cmd("DEL").arg(chunk).query(&mut conn)?;
        }
        Ok(())
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Err(e) = self.run() {
            eprintln!("could not delete the keys under {:?}: {e}", self.prefix);
        }
    }
}

fn main() -> std::process::ExitCode {
    let addr = outbox_conformance_tests::service_addr(&outbox_conformance_tests::redis_url());
    if !outbox_conformance_tests::require_service("Redis", "redis", &addr) {
        return std::process::ExitCode::SUCCESS;
    }
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let prefix = format!("outbox-conformance:{}-{nanos:x}:", std::process::id());
    let harness = RedisHarness::new(&prefix);
    let cleanup = Cleanup { url: harness.config.url.clone(), prefix };
    let code = outbox_conformance_tests::main(harness);
    drop(cleanup);
    code
}
