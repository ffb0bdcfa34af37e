//! This crate's half of the conformance suite, so the suite can judge Redis Streams with any
//! store: the crate's own run pairs it with the in-memory store and inbox, the store × broker
//! matrix and `outbox conformance --broker redis://…` with real ones.
//!
//! Each fixture connects a broker of its own (a case runs on a runtime of its own, and a
//! connection lives on the runtime that opened it) and gets a destination of its own under a
//! key prefix unique to the harness; everything under that prefix is deleted when the harness is
//! dropped, so a re-run on a dirty server starts clean.
//!
//! The claim idle time is short so that what a dropped subscription held is reclaimed by the
//! next member of the group well within the suite's delivery wait; the one case that needs a
//! delivery to stay with a live member gets a long one ([`HOLD_IDLE`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use outbox_conformance_tests::world::unique_tag;
use outbox_conformance_tests::{
    BrokerFixture, BrokerHarness, Capabilities, Capability, Foreign, ForeignKind, ForeignWriter, stream_fields,
};
use outbox_core::{Destination, Result};

use crate::{RedisBroker, RedisConfig};

/// An entry left unacknowledged this long by a consumer that went away is reclaimed by another
/// member (subscriptions look for such entries every `CLAIM_IDLE / 2`).
pub const CLAIM_IDLE: Duration = Duration::from_millis(200);

/// The claim idle time of a fixture for a case that needs a delivery held while its member
/// lives ([`Capability::HeldWhileLive`]): longer than such a case runs (a few delivery waits).
pub const HOLD_IDLE: Duration = Duration::from_secs(30);

/// How long the suite waits for a delivery: the worst reclaim after a dropped subscription is
/// `CLAIM_IDLE` plus one claim interval (300 ms) plus round trips; this leaves more than twice
/// that.
pub const DELIVERY_WAIT: Duration = Duration::from_millis(750);

/// Sampled permutation paths per run (each costs a few delivery waits: the drain and the audit
/// read end on an empty wait).
pub const SAMPLED_ITERATIONS: u32 = 40;

/// Redis Streams under a key prefix of this harness, deleted when it is dropped.
pub struct RedisBrokerHarness {
    config: RedisConfig,
    /// Whether a fixture ever connected: a harness whose server was never reached has no keys
    /// to delete, and a second "connection refused" after the first error only confuses.
    connected: AtomicBool,
}

impl std::fmt::Debug for RedisBrokerHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBrokerHarness")
            .field("server", &self.config.redacted_url())
            .field("prefix", &self.config.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisBrokerHarness {
    /// Fixtures on the server of `config`, under a key prefix unique to this harness (appended
    /// to the config's), with the suite's [`CLAIM_IDLE`].
    pub fn new(config: RedisConfig) -> Self {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let prefix = format!("{}outbox-conformance:{}-{nanos:x}:", config.prefix, std::process::id());
        Self { config: config.with_prefix(prefix).with_claim_idle(CLAIM_IDLE), connected: AtomicBool::new(false) }
    }

    /// The configuration every fixture's broker uses.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// A fixture whose broker has `config` (the harness's, or with another claim idle time).
    async fn fixture_with(&self, case: &str, config: RedisConfig) -> Result<BrokerFixture> {
        let broker = RedisBroker::connect(config).await?;
        self.connected.store(true, Ordering::Relaxed);
        let destination = Destination::new(format!("{case}-{}", unique_tag()))?;
        let mut fx = BrokerFixture::new(Arc::new(broker.clone()), destination);
        fx.foreign = Some(Arc::new(RedisForeign { broker, url: self.config.url.clone() }));
        Ok(fx)
    }

    fn clean_up(&self) -> redis::RedisResult<()> {
        let client = redis::Client::open(self.config.url.as_str())?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(5))?;
        let mut keys = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", self.config.prefix))
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

impl Drop for RedisBrokerHarness {
    fn drop(&mut self) {
        if !self.connected.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = self.clean_up() {
            eprintln!("could not delete the keys under {:?}: {e}", self.config.prefix);
        }
    }
}

#[async_trait]
impl BrokerHarness for RedisBrokerHarness {
    fn name(&self) -> String {
        "redis streams broker".into()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // Not `DetectsUnroutable`: an XADD to a stream nobody declared creates the stream and
            // succeeds. A redelivery (own pending entry or XAUTOCLAIM) carries the group's
            // delivery count, and a nack makes the entry reclaimable at once.
            present: {
                let mut present = Capability::present_in(&self.config.capabilities());
                // Raw entries are written with XADD ([`RedisForeign`]).
                present.push(Capability::ForeignMessages);
                // Members reclaim entries idle for CLAIM_IDLE (200 ms, so that redelivery cases
                // are quick); the case that needs a delivery held gets HOLD_IDLE instead.
                present.push(Capability::HeldWhileLive);
                present
            },
            delivery_wait: DELIVERY_WAIT,
            sampled_iterations: SAMPLED_ITERATIONS,
            exhaustive: false,
        }
    }

    async fn fixture(&self, case: &str) -> Result<BrokerFixture> {
        self.fixture_with(case, self.config.clone()).await
    }

    async fn fixture_holding(&self, case: &str) -> Result<BrokerFixture> {
        self.fixture_with(case, self.config.clone().with_claim_idle(HOLD_IDLE)).await
    }
}

/// Writes raw stream entries ([`stream_fields`]) with `XADD`, as another program sharing the
/// stream would. Every [`ForeignKind`] is supported: a stream entry may repeat a field.
pub struct RedisForeign {
    broker: RedisBroker,
    url: String,
}

impl std::fmt::Debug for RedisForeign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisForeign").finish_non_exhaustive()
    }
}

#[async_trait]
impl ForeignWriter for RedisForeign {
    async fn write(&self, destination: &Destination, kind: ForeignKind, id: &str, payload: &[u8]) -> Result<Foreign> {
        let failed = |e: redis::RedisError| {
            outbox_core::Error::transient(outbox_core::ErrorKind::Connection, crate::BACKEND, "XADD of a raw entry")
                .with_source(e)
        };
        let client = redis::Client::open(self.url.as_str()).map_err(failed)?;
        let mut conn = client.get_multiplexed_async_connection().await.map_err(failed)?;
        let mut cmd = redis::cmd("XADD");
        cmd.arg(self.broker.stream_key(destination)).arg("*");
        for (field, value) in stream_fields(kind, id, payload) {
            cmd.arg(field).arg(value);
        }
        let _: String = cmd.query_async(&mut conn).await.map_err(failed)?;
        Ok(Foreign::Written)
    }
}
