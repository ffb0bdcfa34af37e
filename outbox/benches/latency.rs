//! Commit → broker acknowledgement latency, PostgreSQL → Redis Streams, with the relay woken by
//! LISTEN/NOTIFY, against the same run with the wake-up off (a relay polling every 500 ms) as
//! the baseline.
//!
//! `cargo bench -p outbox --features postgres,redis --bench latency`
//!
//! A producer enqueues one event per transaction (`enqueue_one` in its own transaction, then
//! commit) at `BENCH_RATE` events/s (default 500) for `BENCH_SECONDS` (default 10), each at a
//! random point of its slot (seeded: `BENCH_SEED`). One relay runs `Relay::run`. For every
//! event, latency is the time from the producer's `commit` returning to the relay's
//! `publish` to Redis returning (the broker acknowledged the `XADD`), measured by a broker
//! decorator keyed by event id. Goal: p50 ≤ 5 ms, p99 ≤ 20 ms.
//!
//! Servers: `OUTBOX_PG_URL` and `OUTBOX_REDIS_URL` (default: the local test servers). Each run
//! uses a fresh schema and stream key prefix and removes both at the end.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_broker_redis::{RedisBroker, RedisConfig};
use outbox_core::rng::SplitMix64;
use outbox_core::{
    Broker, ConsumerGroup, Destination, Event, EventId, OutboxAdmin, Relay, RelayConfig, Result, Subscription,
};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe, Connection, PgConnection};
use outbox_store_postgres::{PgConfig, PgStore, enqueue_one, map_error};

const IDLE_POLL: Duration = Duration::from_millis(500);
const PAYLOAD: usize = 256;
const WARMUP: usize = 100;
const DRAIN_DEADLINE: Duration = Duration::from_secs(30);

/// Redis, plus the instant each event's first publish was acknowledged.
struct Timed {
    inner: RedisBroker,
    acked: Mutex<HashMap<String, Instant>>,
}

#[async_trait]
impl Broker for Timed {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn preferred_pipeline_depth(&self) -> Option<usize> {
        self.inner.preferred_pipeline_depth()
    }
    async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        self.inner.declare(destination, groups).await
    }
    async fn publish(&self, event: &Event) -> Result<()> {
        self.inner.publish(event).await?;
        let now = Instant::now();
        self.acked.lock().unwrap().entry(event.id.as_str().to_owned()).or_insert(now);
        Ok(())
    }
    async fn subscribe(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        self.inner.subscribe(destination, group).await
    }
}

struct Settings {
    rate: u64,
    seconds: u64,
    seed: u64,
}

impl Settings {
    fn events(&self) -> usize {
        usize::try_from(self.rate * self.seconds).unwrap()
    }
}

struct Stats {
    count: usize,
    p50: Duration,
    p95: Duration,
    p99: Duration,
    max: Duration,
    over_20ms: usize,
    relay_claims: u64,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Enqueue `n` events named `<run>-<i>`, one transaction each, at `rate` events/s; returns
/// the instant each commit returned.
async fn produce(
    store: &PgStore,
    dest: &Destination,
    run: &str,
    n: usize,
    rate: u64,
    rng: &mut SplitMix64,
) -> HashMap<String, Instant> {
    let slot = Duration::from_secs(1) / u32::try_from(rate).unwrap();
    let start = tokio::time::Instant::now();
    let mut commits = HashMap::with_capacity(n);
    for i in 0..n {
        let at = start + slot * u32::try_from(i).unwrap() + slot.mul_f64(rng.next_f64());
        tokio::time::sleep_until(at).await;
        let mut payload = vec![0u8; PAYLOAD];
        for b in &mut payload {
            *b = rng.below(256) as u8;
        }
        let id = format!("{run}-{i:06}");
        let event = Event::new(EventId::new(id.clone()).unwrap(), dest.clone(), payload);
        let mut tx = store.pool().begin().await.map_err(map_error).unwrap();
        enqueue_one(&mut tx, store, &event).await.unwrap();
        tx.commit().await.map_err(map_error).unwrap();
        commits.insert(id, Instant::now());
    }
    commits
}

/// One relay (wake-up on or off) under the paced producer; latencies of the measured events.
async fn measure(store: &PgStore, broker: &Arc<Timed>, dest: &Destination, wakeup: bool, settings: &Settings) -> Stats {
    let run = if wakeup { "wake" } else { "poll" };
    let config = RelayConfig::new(format!("latency-{run}"))
        .with_idle_poll(IDLE_POLL)
        .with_wakeup(wakeup)
        .with_seed(Some(settings.seed));
    let relay = Arc::new(Relay::new(Arc::new(store.clone()), broker.clone(), config));
    let task = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await }
    });
    let mut rng = SplitMix64::new(settings.seed);
    // Warm-up: the relay's connections, prepared statements and the listener are set up.
    produce(store, dest, &format!("{run}-warmup"), WARMUP, settings.rate, &mut rng).await;
    let commits = produce(store, dest, run, settings.events(), settings.rate, &mut rng).await;

    let deadline = Instant::now() + DRAIN_DEADLINE;
    loop {
        let acked = broker.acked.lock().unwrap().iter().filter(|(id, _)| commits.contains_key(*id)).count();
        if acked == commits.len() {
            break;
        }
        assert!(Instant::now() < deadline, "{run}: only {acked} of {} events acknowledged", commits.len());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    relay.shutdown_handle().trigger();
    let totals = task.await.unwrap().unwrap();

    let acked = broker.acked.lock().unwrap();
    let mut latencies: Vec<Duration> =
        commits.iter().map(|(id, committed)| acked[id].saturating_duration_since(*committed)).collect();
    latencies.sort();
    Stats {
        count: latencies.len(),
        p50: percentile(&latencies, 50.0),
        p95: percentile(&latencies, 95.0),
        p99: percentile(&latencies, 99.0),
        max: *latencies.last().unwrap(),
        over_20ms: latencies.iter().filter(|l| **l > Duration::from_millis(20)).count(),
        relay_claims: totals.claimed,
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let seed = env_u64("BENCH_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    let settings =
        Settings { rate: env_u64("BENCH_RATE").unwrap_or(500), seconds: env_u64("BENCH_SECONDS").unwrap_or(10), seed };

    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let schema = format!("bench_latency_{}_{nanos}", std::process::id());
    let pg = PgConfig::from_url(&outbox_conformance_tests::pg_url())
        .unwrap()
        .with_schema(schema.clone())
        .with_application_name(schema.clone());
    let store = PgStore::connect(pg.clone()).await.unwrap_or_else(|e| panic!("PostgreSQL: {e}"));
    store.migrate().await.unwrap();
    let redis =
        RedisConfig::from_url(&outbox_conformance_tests::redis_url()).unwrap().with_prefix(format!("{schema}:"));
    let inner = RedisBroker::connect(redis.clone()).await.unwrap_or_else(|e| panic!("Redis: {e}"));
    let dest = Destination::new("latency").unwrap();
    inner.declare(&dest, &[]).await.unwrap();
    let broker = Arc::new(Timed { inner: inner.clone(), acked: Mutex::default() });
    let defaults = RelayConfig::default();

    println!("latency: commit returned -> Redis XADD acknowledged, PostgreSQL -> Redis, one relay");
    println!(
        "  producer {} events/s for {} s ({} events, one per transaction, {PAYLOAD} B payloads, {WARMUP} warm-up events not counted)",
        settings.rate,
        settings.seconds,
        settings.events()
    );
    println!(
        "  relay batch {} pipeline depth {} idle poll {IDLE_POLL:?}; seed {seed} (BENCH_SEED={seed} to repeat)",
        defaults.batch_size,
        defaults.pipeline_depth_for(broker.as_ref())
    );
    println!(
        "  PostgreSQL {} schema {schema} (channel {}); Redis {} stream {}",
        pg.redacted_url(),
        store.tables().notify_channel(),
        redis.redacted_url(),
        inner.stream_key(&dest)
    );

    let woken = measure(&store, &broker, &dest, true, &settings).await;
    let polled = measure(&store, &broker, &dest, false, &settings).await;

    // Durable check: every event is on the stream, nothing is left to publish.
    let expected = 2 * (settings.events() + WARMUP);
    let on_stream = inner.stream_len(&dest).await.unwrap();
    let stats = store.stats().await.unwrap();

    println!();
    println!(
        "{:<28} {:>7} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "relay", "events", "p50 ms", "p95 ms", "p99 ms", "max ms", ">20 ms", "claimed"
    );
    for (name, s) in [("wake-up (LISTEN/NOTIFY)", &woken), ("poll every 500 ms (baseline)", &polled)] {
        println!(
            "{name:<28} {:>7} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
            s.count,
            ms(s.p50),
            ms(s.p95),
            ms(s.p99),
            ms(s.max),
            s.over_20ms,
            s.relay_claims
        );
    }
    let met = woken.p50 <= Duration::from_millis(5) && woken.p99 <= Duration::from_millis(20);
    println!();
    println!("goal p50 <= 5 ms and p99 <= 20 ms with the wake-up: {}", if met { "met" } else { "NOT met" });
    println!(
        "durable: {on_stream} of {expected} events on the stream; outbox pending {} leased {} published {}",
        stats.pending, stats.leased, stats.published
    );

    inner.delete_destination(&dest).await.unwrap();
    store.close().await;
    let mut conn = PgConnection::connect_with(&pg.connect_options().unwrap()).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE"))).execute(&mut conn).await.unwrap();
    let _ = conn.close().await;
}
