//! P1–P9: each sets up its own schema, stream, queue or topic, prints its configuration, measures
//! its baseline(s) and its subject on the same backlog, checks durable state, and cleans up —
//! also when a measurement fails.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox::consumer::{Consumer, ConsumerConfig, EffectKind, Handler};
use outbox::core::{BatchReport, Received};
use outbox::postgres::sqlx::{self, AssertSqlSafe};
use outbox::postgres::{PgInbox, PgTx, map_error};
use outbox::{Broker, ConsumerGroup, Destination, Event, OutboxAdmin, OutboxStore, Relay, RelayConfig, Result};

use super::fixture::{self, AckCounter, DRAIN_LIMIT, InstantBroker, LEASE, PgFixture, fail, per_second};
use super::raw;
use super::report::{Row, rate};
use super::stages::{Cpu, Stages};
use super::{Settings, Subject};

/// Relay counts of P7.
const RELAY_COUNTS: [usize; 4] = [1, 2, 4, 8];
/// Pool size of each P7 relay's own store (a relay process of its own).
const P7_POOL: u32 = 4;

/// Run one subject.
pub(crate) async fn run(subject: Subject, s: &Settings) -> Result<Vec<Row>> {
    match subject {
        Subject::P1 => p1(s).await,
        Subject::P2 => p2(s).await,
        Subject::P3 => p3(s).await,
        Subject::P4 => p4(s).await,
        Subject::P5 => p5(s).await,
        Subject::P6 => p6(s).await,
        Subject::P7 => p7(s).await,
        Subject::P8 => p8(s).await,
        Subject::P9 => p9(s).await,
    }
}

fn relay_config(s: &Settings, owner: String) -> RelayConfig {
    let config = RelayConfig::new(owner).with_batch_size(s.batch).with_lease(LEASE).with_seed(Some(s.seed));
    match s.pipeline_depth {
        Some(depth) => config.with_pipeline_depth(depth),
        None => config,
    }
}

/// The depth of a relay publishing to `broker` with this run's settings (what its
/// `Relay::pipeline_depth` reports).
fn depth(s: &Settings, broker: &dyn Broker) -> usize {
    relay_config(s, String::new()).pipeline_depth_for(broker)
}

/// The relay settings a row shows, for a relay publishing to `broker`.
fn relay_settings(s: &Settings, broker: &dyn Broker) -> String {
    let depth = depth(s, broker);
    let whose = match s.pipeline_depth {
        Some(_) => "",
        None if broker.preferred_pipeline_depth().is_some() => " (the broker's)",
        None => " (the default)",
    };
    format!("batch {}, pipeline depth {depth}{whose}, lease {}s", s.batch, LEASE.as_secs())
}

/// One relay draining the backlog: events per second, after checking it published all `n`.
/// Prints, as `p`, where its batches spent their time ([`Stages`]).
async fn relay_drain(
    p: &str,
    store: Arc<dyn OutboxStore>,
    broker: Arc<dyn Broker>,
    s: &Settings,
    n: usize,
) -> Result<f64> {
    let stages = Stages::default();
    let relay =
        metrics::with_local_recorder(&stages, || Relay::new(store, broker, relay_config(s, "relay-bench1".into())));
    let (t, cpu) = (Instant::now(), Cpu::now());
    let report = tokio::time::timeout(DRAIN_LIMIT, relay.drain())
        .await
        .map_err(|_| fail(format!("the relay did not drain {n} rows within {DRAIN_LIMIT:?}")))??;
    let elapsed = t.elapsed();
    check_report(&report, n)?;
    say(p, format!("relay stages per call: {}; {}", stages.summary(), cpu.since(elapsed.as_secs_f64())));
    Ok(per_second(n, elapsed))
}

/// [`relay_drain`] to a real broker, then fail unless the broker holds exactly `n` messages:
/// `held` reads them back after the drain (a stream's length, a topic's offsets), `what` names
/// them in the error.
async fn drain_to_broker(
    p: &str,
    store: Arc<dyn OutboxStore>,
    broker: Arc<dyn Broker>,
    s: &Settings,
    n: usize,
    what: &str,
    held: impl std::future::Future<Output = Result<u64>>,
) -> Result<f64> {
    let measured = relay_drain(p, store, broker, s, n).await?;
    let held = held.await?;
    if held != n as u64 {
        return Err(fail(format!("{held} {what}, expected {n}")));
    }
    Ok(measured)
}

/// The messages on a Kafka topic, for [`drain_to_broker`].
async fn topic_len(config: &outbox::kafka::KafkaConfig, topic: &Destination, expected: usize) -> Result<u64> {
    let stored = raw::kafka_count(config, topic.as_str(), expected).await?;
    u64::try_from(stored).map_err(|_| fail(format!("a negative count of messages on {topic}: {stored}")))
}

fn check_report(report: &BatchReport, n: usize) -> Result<()> {
    if report.published != n as u64 || report.retried + report.parked + report.fenced + report.released > 0 {
        return Err(fail(format!("relay published {} of {n} rows ({report:?})", report.published)));
    }
    Ok(())
}

fn add(total: &mut BatchReport, r: &BatchReport) {
    total.claimed += r.claimed;
    total.published += r.published;
    total.fenced += r.fenced;
    total.retried += r.retried;
    total.parked += r.parked;
    total.released += r.released;
    total.refused += r.refused;
}

/// Empty `destination`'s queue for `group`: delete it and declare it again.
async fn empty_queue(
    broker: &outbox::amqp::AmqpBroker,
    destination: &Destination,
    group: &ConsumerGroup,
) -> Result<()> {
    broker.delete(destination, std::slice::from_ref(group)).await?;
    broker.declare(destination, std::slice::from_ref(group)).await
}

/// Fail unless `destination`'s queue for `group` (`what`, in the error) holds exactly `n`
/// messages.
async fn expect_depth(
    broker: &outbox::amqp::AmqpBroker,
    destination: &Destination,
    group: &ConsumerGroup,
    n: usize,
    what: &str,
) -> Result<()> {
    let depth = broker.queue_depth(destination, group).await?;
    if depth as usize != n {
        return Err(fail(format!("{depth} messages in {what}, expected {n}")));
    }
    Ok(())
}

fn destination(s: &Settings, tag: &str) -> Result<Destination> {
    Destination::new(format!("bench_{tag}_{}", s.run_id))
}

fn min_of(a: (&str, f64), b: (&str, f64)) -> (f64, Vec<(String, f64)>) {
    (a.1.min(b.1), vec![(a.0.to_string(), a.1), (b.0.to_string(), b.1)])
}

fn say(p: &str, line: impl std::fmt::Display) {
    println!("{p}: {line}");
}

// ---------------------------------------------------------------------------------------------
// P1–P3: PostgreSQL → a real broker.

/// P1: PostgreSQL → Redis.
async fn p1(s: &Settings) -> Result<Vec<Row>> {
    let fx = PgFixture::new(s, "p1").await?;
    let result = async {
        let dest = destination(s, "p1")?;
        let config = outbox::redis::RedisConfig::from_url(&s.redis)?.with_prefix(format!("bench_{}:", s.run_id));
        let broker = outbox::redis::RedisBroker::connect(config.clone()).await?;
        let raw_stream = format!("{}raw_{}", config.prefix, dest.as_str());
        say(
            "P1",
            format!(
                "PostgreSQL -> Redis. schema {}, stream {}, raw stream {raw_stream}; {} events; relay: {}; raw SQL: one \
                 connection, claim+complete per batch of {}; raw XADD: pipelines of {} entries, {} in flight",
                fx.schema,
                broker.stream_key(&dest),
                s.events,
                relay_settings(s, &broker),
                s.batch,
                s.batch,
                raw::REDIS_PIPELINES
            ),
        );
        let events = fixture::events(s, &dest, s.events);
        fx.fill(&events).await?;
        let sql = raw::pg_sql(&fx, s.events, s.batch).await?;
        say("P1", format!("raw SQL {} ev/s", rate(sql)));
        let xadd = raw::redis_xadd(&config.url, &raw_stream, &events, s.batch).await?;
        say("P1", format!("raw XADD {} ev/s", rate(xadd)));
        fx.fill(&events).await?;
        let measured = async {
            let held = broker.stream_len(&dest);
            let store = Arc::new(fx.store.clone());
            let r = drain_to_broker("P1", store, Arc::new(broker.clone()), s, s.events, "entries on the stream", held)
                .await?;
            fx.check_published(s.events, "relay").await?;
            Ok(r)
        }
        .await;
        let _ = broker.delete_destination(&dest).await;
        let measured = measured?;
        say("P1", format!("relay {} ev/s", rate(measured)));
        let (base, parts) = min_of(("raw SQL", sql), ("raw XADD", xadd));
        Ok(vec![Row::new(
            "P1",
            "PostgreSQL -> Redis relay",
            "min(raw SQL, raw pipelined XADD)",
            measured,
            Some(base),
            Some(0.8),
            format!(
                "1 relay, {}; raw SQL {}, raw XADD {} (pipelines of {}, {} in flight)",
                relay_settings(s, &broker),
                rate(sql),
                rate(xadd),
                s.batch,
                raw::REDIS_PIPELINES
            ),
            parts,
            s.seed,
        )])
    }
    .await;
    let _ = fx.drop().await;
    result
}

/// P2: PostgreSQL → RabbitMQ.
async fn p2(s: &Settings) -> Result<Vec<Row>> {
    let fx = PgFixture::new(s, "p2").await?;
    let config = outbox::amqp::AmqpConfig::from_url(&s.amqp)?;
    let broker = outbox::amqp::AmqpBroker::new(config.clone());
    let dest = destination(s, "p2")?;
    let raw_dest = destination(s, "p2raw")?;
    let group = ConsumerGroup::new("bench")?;
    let result = async {
        broker.connect().await?;
        broker.declare(&dest, std::slice::from_ref(&group)).await?;
        broker.declare(&raw_dest, std::slice::from_ref(&group)).await?;
        say(
            "P2",
            format!(
                "PostgreSQL -> RabbitMQ. schema {}, exchange {} -> queue {} ({} queue), raw exchange {}; {} events; relay: \
                 {}, {} publish channels, {} per batch; raw publish: one channel, confirms over a window of {}, mandatory, \
                 persistent",
                fx.schema,
                config.exchange_name(&dest)?,
                config.queue_name(&dest, &group)?,
                config.queue_type().as_str(),
                config.exchange_name(&raw_dest)?,
                s.events,
                relay_settings(s, &broker),
                config.publish_channels(),
                config.batch_channels(),
                raw::AMQP_WINDOW
            ),
        );
        let events = fixture::events(s, &dest, s.events);
        fx.fill(&events).await?;
        let sql = raw::pg_sql(&fx, s.events, s.batch).await?;
        say("P2", format!("raw SQL {} ev/s", rate(sql)));
        let publish = raw::amqp_publish(&s.amqp, &broker, &raw_dest, &group, &events).await?;
        say("P2", format!("raw publish with confirms {} ev/s", rate(publish)));
        // Both raw loops at once, as the relay runs them: PostgreSQL's commits and RabbitMQ's
        // persistence share the machine's disk, so each alone says little about what the pair
        // can do together. Reported beside the goal's baseline, not instead of it.
        empty_queue(&broker, &raw_dest, &group).await?;
        fx.fill(&events).await?;
        let (sql_along, publish_along) = tokio::join!(
            raw::pg_sql(&fx, s.events, s.batch),
            raw::amqp_publish(&s.amqp, &broker, &raw_dest, &group, &events)
        );
        let (sql_along, publish_along) = (sql_along?, publish_along?);
        say(
            "P2",
            format!("both raw loops at once: raw SQL {} ev/s, raw publish {} ev/s", rate(sql_along), rate(publish_along)),
        );
        // The adapter's publish_batch alone, as the relay calls it (batches of `batch`,
        // `pipeline_depth` at once), to a queue of its own.
        let raw_events = fixture::events(s, &raw_dest, s.events);
        empty_queue(&broker, &raw_dest, &group).await?;
        let depth = depth(s, &broker);
        let adapter = raw::adapter_batches(&broker, &raw_events, s.batch, depth).await?;
        expect_depth(&broker, &raw_dest, &group, s.events, "the adapter's queue").await?;
        say(
            "P2",
            format!(
                "the adapter's publish_batch alone (batches of {}, {} at once, no store): {} ev/s",
                s.batch,
                depth,
                rate(adapter)
            ),
        );
        // The same relay from the in-memory reference store (no database in its claims and
        // completions), to a queue of its own: what the relay and the adapter do together.
        empty_queue(&broker, &raw_dest, &group).await?;
        let memory = outbox::core::memory::MemoryOutbox::new(Arc::new(outbox::core::SystemClock));
        memory.enqueue(&raw_events).await?;
        let from_memory = relay_drain("P2 (memory store)", Arc::new(memory), Arc::new(broker.clone()), s, s.events).await?;
        expect_depth(&broker, &raw_dest, &group, s.events, "the memory relay's queue").await?;
        say("P2", format!("the relay from the in-memory store: {} ev/s", rate(from_memory)));
        fx.fill(&events).await?;
        let measured = relay_drain("P2", Arc::new(fx.store.clone()), Arc::new(broker.clone()), s, s.events).await?;
        expect_depth(&broker, &dest, &group, s.events, "the queue").await?;
        fx.check_published(s.events, "relay").await?;
        say("P2", format!("relay {} ev/s", rate(measured)));
        let (base, mut parts) = min_of(("raw SQL", sql), ("raw publish", publish));
        parts.push(("raw SQL beside raw publish".to_string(), sql_along));
        parts.push(("raw publish beside raw SQL".to_string(), publish_along));
        parts.push(("adapter publish_batch alone".to_string(), adapter));
        parts.push(("relay from the in-memory store".to_string(), from_memory));
        Ok(vec![Row::new(
            "P2",
            "PostgreSQL -> RabbitMQ relay",
            "min(raw SQL, raw publish with confirms)",
            measured,
            Some(base),
            Some(0.8),
            format!(
                "1 relay, {}, {} channels ({} per batch), {} queue; raw SQL {}, raw publish {} (window {}); both at \
                 once: {} / {}; the adapter's publish_batch alone ({} at once): {}; the relay from the in-memory \
                 store: {}",
                relay_settings(s, &broker),
                config.publish_channels(),
                config.batch_channels(),
                config.queue_type().as_str(),
                rate(sql),
                rate(publish),
                raw::AMQP_WINDOW,
                rate(sql_along),
                rate(publish_along),
                depth,
                rate(adapter),
                rate(from_memory)
            ),
            parts,
            s.seed,
        )])
    }
    .await;
    let _ = broker.delete(&dest, std::slice::from_ref(&group)).await;
    let _ = broker.delete(&raw_dest, std::slice::from_ref(&group)).await;
    broker.close().await;
    let _ = fx.drop().await;
    result
}

/// P3: PostgreSQL → Kafka.
async fn p3(s: &Settings) -> Result<Vec<Row>> {
    let fx = PgFixture::new(s, "p3").await?;
    let config = outbox::kafka::KafkaConfig::from_url(&s.kafka)?;
    let dest = destination(s, "p3")?;
    let raw_dest = destination(s, "p3raw")?;
    let broker = match outbox::kafka::KafkaBroker::connect(config.clone()).await {
        Ok(b) => b,
        Err(e) => {
            let _ = fx.drop().await;
            return Err(e);
        }
    };
    let result = async {
        broker.declare(&dest, &[]).await?;
        broker.declare(&raw_dest, &[]).await?;
        say(
            "P3",
            format!(
                "PostgreSQL -> Kafka. schema {}, topic {dest}, raw topic {raw_dest} ({} partition(s)); {} events; relay: {}; \
                 raw produce: FutureProducer, acks=all, idempotent, {} deliveries in flight",
                fx.schema,
                config.partitions,
                s.events,
                relay_settings(s, &broker),
                raw::KAFKA_IN_FLIGHT
            ),
        );
        let events = fixture::events(s, &dest, s.events);
        fx.fill(&events).await?;
        let sql = raw::pg_sql(&fx, s.events, s.batch).await?;
        say("P3", format!("raw SQL {} ev/s", rate(sql)));
        let produce = raw::kafka_produce(&config, raw_dest.as_str(), &events).await?;
        say("P3", format!("raw produce {} ev/s", rate(produce)));
        fx.fill(&events).await?;
        let held = topic_len(&config, &dest, s.events);
        let store = Arc::new(fx.store.clone());
        let measured =
            drain_to_broker("P3", store, Arc::new(broker.clone()), s, s.events, "messages on the topic", held).await?;
        fx.check_published(s.events, "relay").await?;
        say("P3", format!("relay {} ev/s", rate(measured)));
        let (base, parts) = min_of(("raw SQL", sql), ("raw produce", produce));
        Ok(vec![Row::new(
            "P3",
            "PostgreSQL -> Kafka relay",
            "min(raw SQL, raw FutureProducer)",
            measured,
            Some(base),
            Some(0.8),
            format!(
                "1 relay, {}, {} partition(s); raw SQL {}, raw produce {} ({} in flight)",
                relay_settings(s, &broker),
                config.partitions,
                rate(sql),
                rate(produce),
                raw::KAFKA_IN_FLIGHT
            ),
            parts,
            s.seed,
        )])
    }
    .await;
    let _ = broker.delete_topic(&dest).await;
    let _ = broker.delete_topic(&raw_dest).await;
    let _ = fx.drop().await;
    result
}

// ---------------------------------------------------------------------------------------------
// P4, P5: the store alone.

/// P4: PostgreSQL relay with the instant broker vs raw SQL.
async fn p4(s: &Settings) -> Result<Vec<Row>> {
    let fx = PgFixture::new(s, "p4").await?;
    let result = async {
        let dest = destination(s, "p4")?;
        say(
            "P4",
            format!(
                "PostgreSQL relay, broker that returns at once. schema {}; {} events; relay: {}; raw SQL: one connection, \
                 claim+complete per batch of {}",
                fx.schema,
                s.events,
                relay_settings(s, &InstantBroker::AT_ONCE),
                s.batch
            ),
        );
        let events = fixture::events(s, &dest, s.events);
        fx.fill(&events).await?;
        let sql = raw::pg_sql(&fx, s.events, s.batch).await?;
        say("P4", format!("raw SQL {} ev/s", rate(sql)));
        fx.fill(&events).await?;
        let measured = relay_drain("P4", Arc::new(fx.store.clone()), Arc::new(InstantBroker::AT_ONCE), s, s.events).await?;
        fx.check_published(s.events, "relay").await?;
        say("P4", format!("relay {} ev/s", rate(measured)));
        Ok(vec![Row::new(
            "P4",
            "PostgreSQL relay, instant broker",
            "raw SQL claim+complete",
            measured,
            Some(sql),
            Some(0.9),
            format!("1 relay, {}; raw SQL on one connection", relay_settings(s, &InstantBroker::AT_ONCE)),
            vec![("raw SQL".into(), sql)],
            s.seed,
        )])
    }
    .await;
    let _ = fx.drop().await;
    result
}

/// Durable check of a P5 drain: all `n` rows published, none pending, leased or parked.
async fn all_published(store: &outbox::sqlite::SqliteStore, n: usize, what: &str) -> Result<()> {
    let stats = store.stats().await?;
    if stats.published != n as u64 || stats.pending + stats.leased + stats.parked != 0 {
        return Err(fail(format!("{what} left {stats:?}")));
    }
    Ok(())
}

/// A temporary directory for a subject's SQLite files, removed when dropped.
fn sqlite_dir() -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("outbox-bench-")
        .tempdir()
        .map_err(|e| fail(format!("creating a temporary directory: {e}")))
}

/// P5: SQLite relay with the instant broker vs raw rusqlite.
async fn p5(s: &Settings) -> Result<Vec<Row>> {
    use outbox::sqlite::{SqliteConfig, SqliteStore};
    let dir = sqlite_dir()?;
    let dest = destination(s, "p5")?;
    let events = fixture::events(s, &dest, s.events);
    let open = |name: &str| SqliteStore::open(SqliteConfig::new(dir.path().join(name)));
    let raw_store = open("raw.db").await?;
    let synchronous = raw_store.config().synchronous.as_str();
    say(
        "P5",
        format!(
            "SQLite relay, broker that returns at once. files in {} (synchronous={synchronous}, WAL); {} events; {} keys; \
             relay: {}; raw rusqlite: one connection, the store's claim statements + completion per batch of {}, \
             and the claim before key order for reference",
            dir.path().display(),
            s.events,
            s.keys,
            relay_settings(s, &InstantBroker::AT_ONCE),
            s.batch
        ),
    );
    // The raw loop on its file, then the same loop with the claim before key order on another.
    let mut raw_rates = Vec::new();
    for (store, claim) in
        [(raw_store, raw::SqliteClaim::Store), (open("raw-before.db").await?, raw::SqliteClaim::BeforeKeyOrder)]
    {
        fill_sqlite(&store, &events).await?;
        let raw_rate = raw::sqlite(&store, s.events, s.batch, claim).await?;
        all_published(&store, s.events, &format!("raw rusqlite ({claim:?})")).await?;
        raw_rates.push(raw_rate);
    }
    let (raw_rate, before_rate) = (raw_rates[0], raw_rates[1]);
    say("P5", format!("raw rusqlite {} ev/s (the claim before key order: {} ev/s)", rate(raw_rate), rate(before_rate)));
    let store = open("relay.db").await?;
    fill_sqlite(&store, &events).await?;
    let measured = relay_drain("P5", Arc::new(store.clone()), Arc::new(InstantBroker::AT_ONCE), s, s.events).await?;
    all_published(&store, s.events, "the relay").await?;
    say("P5", format!("relay {} ev/s", rate(measured)));
    drop(store);
    let brokers = p5_real_brokers(s, &open, &dest, &events, raw_rate).await?;
    Ok(vec![Row::new(
        "P5",
        "SQLite relay, instant broker",
        "raw rusqlite claim+complete",
        measured,
        Some(raw_rate),
        Some(0.8),
        format!(
            "1 relay, {}; synchronous={synchronous}; {} keys; raw claim before key order {} ({:.2} of it){brokers}",
            relay_settings(s, &InstantBroker::AT_ONCE),
            s.keys,
            rate(before_rate),
            measured / before_rate
        ),
        vec![("raw rusqlite".into(), raw_rate), ("raw rusqlite before key order".into(), before_rate)],
        s.seed,
    )])
}

/// Producers of P9, each enqueueing one event at a time.
const P9_PRODUCERS: usize = 16;

/// P9: the SQLite store's own enqueue (one event per call) from [`P9_PRODUCERS`] tasks at once,
/// whose writes waiting together commit together (store-sqlite README, group commit), against
/// the same inserts by hand: one rusqlite `BEGIN IMMEDIATE` transaction per event on one
/// connection. A fifth of `--events`: one commit per event is slow with `synchronous=full`.
async fn p9(s: &Settings) -> Result<Vec<Row>> {
    use outbox::sqlite::rusqlite::TransactionBehavior;
    use outbox::sqlite::{SqliteConfig, SqliteStore};
    let dir = sqlite_dir()?;
    let n = (s.events / 5).max(P9_PRODUCERS);
    let dest = destination(s, "p9")?;
    let events = fixture::events(s, &dest, n);
    let open = |name: &str| SqliteStore::open(SqliteConfig::new(dir.path().join(name)));
    let raw_store = open("raw.db").await?;
    let synchronous = raw_store.config().synchronous.as_str();
    say(
        "P9",
        format!(
            "SQLite enqueue. files in {} (synchronous={synchronous}, WAL); {n} events of one each; \
             store: {P9_PRODUCERS} tasks calling enqueue; raw: one connection, one transaction per event",
            dir.path().display()
        ),
    );
    fixture::settle().await;
    let raw_events = events.clone();
    let mut conn = raw_store.connect_raw()?;
    let writer = raw_store.clone();
    let raw_rate = tokio::task::spawn_blocking(move || -> Result<f64> {
        let t = std::time::Instant::now();
        for e in &raw_events {
            let tx =
                conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(outbox::sqlite::sqlite_error)?;
            writer.enqueue_one_in(&tx, e)?;
            tx.commit().map_err(outbox::sqlite::sqlite_error)?;
        }
        Ok(per_second(raw_events.len(), t.elapsed()))
    })
    .await
    .map_err(|e| fail(format!("raw rusqlite task: {e}")))??;
    all_pending(&raw_store, n, "raw rusqlite").await?;
    say("P9", format!("raw rusqlite {} ev/s", rate(raw_rate)));

    let store = open("store.db").await?;
    fixture::settle().await;
    let per = n.div_ceil(P9_PRODUCERS);
    let t = std::time::Instant::now();
    let tasks: Vec<_> = events
        .chunks(per)
        .map(|chunk| {
            let (store, chunk) = (store.clone(), chunk.to_vec());
            tokio::spawn(async move {
                for e in &chunk {
                    store.enqueue(std::slice::from_ref(e)).await?;
                }
                Ok::<_, outbox::Error>(())
            })
        })
        .collect();
    for task in tasks {
        task.await.map_err(|e| fail(format!("producer task: {e}")))??;
    }
    let measured = per_second(n, t.elapsed());
    all_pending(&store, n, "the producers").await?;
    say("P9", format!("{P9_PRODUCERS} producers {} ev/s", rate(measured)));
    Ok(vec![Row::new(
        "P9",
        format!("SQLite enqueue, {P9_PRODUCERS} producers"),
        "one rusqlite transaction per event",
        measured,
        Some(raw_rate),
        Some(1.0),
        format!(
            "{n} events, one per enqueue call, {P9_PRODUCERS} tasks on one store (pool of {}); synchronous={synchronous}; \
             raw: one connection, BEGIN IMMEDIATE + the store's insert (enqueue_one_in) + COMMIT per event",
            store.config().pool_size
        ),
        vec![("raw rusqlite".into(), raw_rate)],
        s.seed,
    )])
}

/// Check that `store` holds exactly `n` rows, all pending (P9's durable state).
async fn all_pending(store: &outbox::sqlite::SqliteStore, n: usize, what: &str) -> Result<()> {
    let stats = store.stats().await?;
    if stats.pending != n as u64 || stats.published + stats.leased + stats.parked != 0 {
        return Err(fail(format!("{what} left {stats:?}, expected {n} pending rows")));
    }
    Ok(())
}

/// A P5 backlog: `events` enqueued in chunks, then the file settled (setup is not timed).
async fn fill_sqlite(store: &outbox::sqlite::SqliteStore, events: &[Event]) -> Result<()> {
    for chunk in events.chunks(2000) {
        store.enqueue(chunk).await?;
    }
    fixture::settle().await;
    Ok(())
}

/// The real brokers of P5's diagnostics.
#[derive(Clone, Copy)]
enum RealBroker {
    Redis,
    Kafka,
}

impl RealBroker {
    /// (name, `scripts/services` name, URL).
    fn server(self, s: &Settings) -> (&'static str, &'static str, &str) {
        match self {
            Self::Redis => ("Redis", "redis", &s.redis),
            Self::Kafka => ("Kafka", "kafka", &s.kafka),
        }
    }

    /// Drain `store` to this broker at `dest` with [`drain_to_broker`]; the destination is
    /// removed afterwards, also when the drain fails.
    async fn drain(self, s: &Settings, store: &outbox::sqlite::SqliteStore, dest: &Destination) -> Result<f64> {
        let (name, _, url) = self.server(s);
        let p = format!("P5 to {name}");
        let store = Arc::new(store.clone());
        match self {
            Self::Redis => {
                let config = outbox::redis::RedisConfig::from_url(url)?.with_prefix(format!("bench_{}:", s.run_id));
                let broker = outbox::redis::RedisBroker::connect(config).await?;
                let held = broker.stream_len(dest);
                let to = Arc::new(broker.clone());
                let measured = drain_to_broker(&p, store, to, s, s.events, "entries on the stream", held).await;
                let _ = broker.delete_destination(dest).await;
                measured
            }
            Self::Kafka => {
                let config = outbox::kafka::KafkaConfig::from_url(url)?;
                let broker = outbox::kafka::KafkaBroker::connect(config.clone()).await?;
                broker.declare(dest, &[]).await?;
                let held = topic_len(&config, dest, s.events);
                let to = Arc::new(broker.clone());
                let measured = drain_to_broker(&p, store, to, s, s.events, "messages on the topic", held).await;
                let _ = broker.delete_topic(dest).await;
                measured
            }
        }
    }
}

/// P5's diagnostics: the same SQLite relay publishing to Redis and to Kafka, each on a file of
/// its own with the same backlog, when the server answers (else a line says it was skipped). A
/// broker with latency is what decides whether a relay on a store with one writer claims ahead
/// (outbox-core's relay docs, "One writer"); the instant broker never shows it. Returns what P5's
/// configuration column adds: each rate with its ratio to the same run's raw rusqlite loop.
async fn p5_real_brokers<F, Fut>(
    s: &Settings,
    open: &F,
    dest: &Destination,
    events: &[Event],
    raw_rate: f64,
) -> Result<String>
where
    F: Fn(&str) -> Fut,
    Fut: std::future::Future<Output = Result<outbox::sqlite::SqliteStore>>,
{
    let mut note = String::new();
    for broker in [RealBroker::Redis, RealBroker::Kafka] {
        let (name, script, url) = broker.server(s);
        let addr = outbox_conformance_tests::service::service_addr(url);
        if let Err(e) = super::reachable(&addr) {
            say(
                "P5",
                format!(
                    "the relay to {name}: skipped, not reachable at {addr} ({e}); `scripts/services ensure {script}`"
                ),
            );
            continue;
        }
        let store = open(&format!("relay-{script}.db")).await?;
        fill_sqlite(&store, events).await?;
        let measured = broker.drain(s, &store, dest).await?;
        all_published(&store, s.events, &format!("the relay to {name}")).await?;
        let ratio = measured / raw_rate;
        say("P5", format!("the same relay to {name}: {} ev/s ({ratio:.2} of raw rusqlite)", rate(measured)));
        note.push_str(&format!("; the same relay to {name} {} ({ratio:.2})", rate(measured)));
    }
    Ok(note)
}

// ---------------------------------------------------------------------------------------------
// P6: the consumer.

/// Credits the event's amount to the account named by its key: `INSERT … ON CONFLICT DO UPDATE
/// SET balance = balance + amount`, the additive effect the inbox exists for.
fn credit_sql(table: &str) -> String {
    format!(
        "INSERT INTO {table} AS b (account, balance) VALUES ($1, $2)
         ON CONFLICT (account) DO UPDATE SET balance = b.balance + excluded.balance"
    )
}

fn account(event: &Event) -> Result<String> {
    event.key.clone().ok_or_else(|| fail(format!("event {} has no key", event.id)))
}

struct Credit {
    sql: String,
}

#[async_trait]
impl Handler<PgInbox> for Credit {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }
    async fn apply(&self, tx: &mut PgTx, event: &Event) -> Result<()> {
        sqlx::query(AssertSqlSafe(self.sql.clone()))
            .bind(account(event)?)
            .bind(fixture::amount(event)?)
            .execute(&mut **tx)
            .await
            .map_err(map_error)?;
        Ok(())
    }
}

/// P6: the consumer with the PostgreSQL inbox vs a hand-written loop, both reading the same
/// Redis stream (one consumer group each) and crediting the same amounts.
async fn p6(s: &Settings) -> Result<Vec<Row>> {
    let fx = PgFixture::new(s, "p6").await?;
    let config = outbox::redis::RedisConfig::from_url(&s.redis)?
        .with_prefix(format!("bench_{}:", s.run_id))
        .with_read_count(s.batch);
    let dest = destination(s, "p6")?;
    let broker = match outbox::redis::RedisBroker::connect(config.clone()).await {
        Ok(b) => b,
        Err(e) => {
            let _ = fx.drop().await;
            return Err(e);
        }
    };
    let result = p6_measure(s, &fx, &broker, &dest).await;
    let _ = broker.delete_destination(&dest).await;
    let _ = fx.drop().await;
    result
}

async fn p6_measure(
    s: &Settings,
    fx: &PgFixture,
    broker: &outbox::redis::RedisBroker,
    dest: &Destination,
) -> Result<Vec<Row>> {
    let n = s.events;
    let raw_group = ConsumerGroup::new("bench-raw")?;
    let inbox_group = ConsumerGroup::new("bench-inbox")?;
    let single_group = ConsumerGroup::new("bench-inbox-1")?;
    let raw_table = fx.store.tables().app_table("bench_balances_raw")?;
    let inbox_table = fx.store.tables().app_table("bench_balances_inbox")?;
    let single_table = fx.store.tables().app_table("bench_balances_inbox_1")?;
    // KNOB(CONSUMER): the consumer's deliveries in flight, the same as the loop's, and per commit.
    let config = ConsumerConfig::new("bench-inbox")
        .with_receive_wait(Duration::from_millis(50))
        .with_max_in_flight(s.in_flight)
        .with_max_per_commit(s.per_commit);
    let (consumer_in_flight, per_commit) = (config.max_in_flight, config.max_per_commit);
    say(
        "P6",
        format!(
            "consumer with the PostgreSQL inbox vs a hand-written loop, both on Redis (stream {}, read count {}); schema {}; \
             {n} messages; effect: credit the key's account (upsert, additive); loop: {} in flight, no inbox; consumer: \
             {consumer_in_flight} in flight{}, up to {per_commit} per commit",
            broker.stream_key(dest),
            s.batch,
            fx.schema,
            s.in_flight,
            if consumer_in_flight < s.in_flight { " (the consumer's limit)" } else { "" }
        ),
    );
    for table in [&raw_table, &inbox_table, &single_table] {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {table} (account text PRIMARY KEY, balance bigint NOT NULL)"
        )))
        .execute(fx.store.pool())
        .await
        .map_err(map_error)?;
    }
    broker.declare(dest, &[raw_group.clone(), inbox_group.clone(), single_group.clone()]).await?;
    let events = fixture::events(s, dest, n);
    let expected: i64 = events.iter().map(fixture::amount).sum::<Result<i64>>()?;
    for chunk in events.chunks(1000) {
        for r in broker.publish_batch(chunk).await {
            r?;
        }
    }
    let on_stream = broker.stream_len(dest).await?;
    if on_stream != n as u64 {
        return Err(fail(format!("{on_stream} entries on the stream after publishing {n}")));
    }

    // The baseline: receive, then up to `in_flight` effects at once, each its own transaction,
    // acknowledged after the commit. No marker, no fingerprint, no per-key order.
    let counter = AckCounter::new(n as u64);
    let mut sub = counter.wrap(broker.subscribe(dest, &raw_group).await?);
    let pool = fx.store.pool().clone();
    let sql = Arc::new(credit_sql(&raw_table));
    let permits = Arc::new(tokio::sync::Semaphore::new(s.in_flight));
    let mut tasks = tokio::task::JoinSet::new();
    let t = Instant::now();
    let mut received = 0usize;
    while received < n {
        if t.elapsed() > DRAIN_LIMIT {
            return Err(fail(format!("hand-written loop: {received} of {n} received within {DRAIN_LIMIT:?}")));
        }
        let permit = permits.clone().acquire_owned().await.map_err(|e| fail(e.to_string()))?;
        let Some(r) = sub.receive(Duration::from_millis(200)).await? else { continue };
        let Received::Event(d) = r else { return Err(fail("hand-written loop: a foreign message on the stream")) };
        received += 1;
        let (pool, sql) = (pool.clone(), sql.clone());
        tasks.spawn(async move {
            let _permit = permit;
            let mut tx = pool.begin().await.map_err(map_error)?;
            sqlx::query(AssertSqlSafe((*sql).clone()))
                .bind(account(&d.event)?)
                .bind(fixture::amount(&d.event)?)
                .execute(&mut *tx)
                .await
                .map_err(map_error)?;
            tx.commit().await.map_err(map_error)?;
            d.ack().await
        });
        while let Some(done) = tasks.try_join_next() {
            done.map_err(|e| fail(format!("loop task: {e}")))??;
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| fail(format!("loop task: {e}")))??;
    }
    let end = counter.wait(DRAIN_LIMIT, "hand-written loop").await?;
    let baseline = per_second(n, end - t);
    drop(sub);
    say("P6", format!("hand-written loop {} ev/s", rate(baseline)));

    // The subject: the consumer runtime with the inbox, same stream, its own group; then, when
    // it commits several deliveries at once, the same consumer committing each alone.
    let measured = p6_consumer(fx, broker, dest, &inbox_group, &inbox_table, config, expected).await?;
    say("P6", format!("consumer {} ev/s ({per_commit} per commit)", rate(measured)));
    let single = if per_commit > 1 {
        let config = ConsumerConfig::new("bench-inbox-1")
            .with_receive_wait(Duration::from_millis(50))
            .with_max_in_flight(s.in_flight);
        let r = p6_consumer(fx, broker, dest, &single_group, &single_table, config, expected).await?;
        say("P6", format!("consumer {} ev/s (1 per commit)", rate(r)));
        format!("; the same consumer with 1 per commit: {} ev/s ({:.2} of the loop)", rate(r), r / baseline)
    } else {
        String::new()
    };
    p6_credited_and_acknowledged(fx, broker, dest, &raw_group, &raw_table, expected, "hand-written loop").await?;
    Ok(vec![Row::new(
        "P6",
        "consumer, PostgreSQL inbox, additive effect",
        "hand-written loop, same effect, no inbox",
        measured,
        Some(baseline),
        Some(0.85),
        format!(
            "Redis, read count {}; consumer {consumer_in_flight} in flight, up to {per_commit} per commit; loop {} in flight, 1 per commit; {} accounts{single}",
            s.batch, s.in_flight, s.keys
        ),
        vec![("hand-written loop".into(), baseline)],
        s.seed,
    )])
}

/// One P6 consumer run: `config`'s consumer drains the stream through `group`, crediting
/// `table`. Afterwards every amount is credited once (the balances sum to `expected`), there is
/// one marker per event under the consumer's name, and nothing is left unacknowledged. Returns
/// events per second.
async fn p6_consumer(
    fx: &PgFixture,
    broker: &outbox::redis::RedisBroker,
    dest: &Destination,
    group: &ConsumerGroup,
    table: &str,
    config: ConsumerConfig,
    expected: i64,
) -> Result<f64> {
    let name = config.name.clone();
    let n = broker.stream_len(dest).await?;
    let counter = AckCounter::new(n);
    let mut sub = counter.wrap(broker.subscribe(dest, group).await?);
    let consumer = Consumer::new(fx.store.inbox(), Credit { sql: credit_sql(table) }, config);
    let shutdown = outbox::Shutdown::default();
    let t = Instant::now();
    let task = tokio::spawn({
        let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
        async move { consumer.run(&mut *sub, &shutdown).await }
    });
    let end = counter.wait(DRAIN_LIMIT, "consumer").await;
    shutdown.trigger();
    let stopped = tokio::time::timeout(Duration::from_secs(30), task).await;
    let end = end?;
    stopped.map_err(|_| fail("the consumer did not stop within 30 s"))?.map_err(|e| fail(e.to_string()))??;
    let measured = per_second(usize::try_from(n).unwrap_or(usize::MAX), end - t);

    // Durable state: every amount credited once; one marker per event; nothing unacknowledged.
    p6_credited_and_acknowledged(fx, broker, dest, group, table, expected, &format!("consumer {name}")).await?;
    let markers = fx.store.tables().table("inbox_markers")?;
    let marked: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {markers} WHERE consumer = $1")))
        .bind(&name)
        .fetch_one(fx.store.pool())
        .await
        .map_err(map_error)?;
    if u64::try_from(marked).ok() != Some(n) {
        return Err(fail(format!("consumer {name}: {marked} inbox markers, expected {n}")));
    }
    Ok(measured)
}

/// `table`'s balances sum to `expected` (every amount credited once) and `group` holds nothing
/// unacknowledged.
async fn p6_credited_and_acknowledged(
    fx: &PgFixture,
    broker: &outbox::redis::RedisBroker,
    dest: &Destination,
    group: &ConsumerGroup,
    table: &str,
    expected: i64,
    what: &str,
) -> Result<()> {
    let sum: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT sum(balance)::bigint FROM {table}")))
        .fetch_one(fx.store.pool())
        .await
        .map_err(map_error)?;
    if sum != Some(expected) {
        return Err(fail(format!("{what}: balances sum to {sum:?}, expected {expected}")));
    }
    let pending = broker.pending(dest, group).await?;
    if pending != 0 {
        return Err(fail(format!("{what}: group {}: {pending} deliveries unacknowledged", group.as_str())));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// P7: relays side by side.

/// P7: 1, 2, 4, 8 relays, each with its own store pool, on one PostgreSQL backlog with the
/// instant broker; each count against the best smaller one. Every count drains [`P7_ROUNDS`]
/// times, the counts interleaved ([`p7_order`]), and is judged by the median of its rounds: one
/// relay's rate moves by a third between two runs a minute apart on a two-core machine, so a
/// count measured once, against the largest of the smaller counts measured once each, reads
/// below 1 more often than not when the counts are equal in truth.
async fn p7(s: &Settings) -> Result<Vec<Row>> {
    let fx = PgFixture::new(s, "p7").await?;
    let result = async {
        let dest = destination(s, "p7")?;
        say(
            "P7",
            format!(
                "relays 1/2/4/8 on PostgreSQL, a broker {} (the store is what they share). schema {}; {} \
                 events per drain; {P7_ROUNDS} rounds, counts in the order {}; each relay: {}, its own pool of {P7_POOL}",
                fixture::answers(s.p7_broker_latency),
                fx.schema,
                s.events,
                p7_order().map(|i| RELAY_COUNTS[i].to_string()).collect::<Vec<_>>().join(","),
                relay_settings(s, &InstantBroker::AT_ONCE)
            ),
        );
        let events = fixture::events(s, &dest, s.events);
        // The raw baseline of this run: the same claims and completions by hand, on one
        // connection, so that every count's rate stands beside what the SQL alone does.
        fx.fill(&events).await?;
        let sql = raw::pg_sql(&fx, s.events, s.batch).await?;
        say("P7", format!("raw SQL {} ev/s", rate(sql)));
        // Each count's rates, in the order of RELAY_COUNTS.
        let mut rounds: [Vec<f64>; RELAY_COUNTS.len()] = Default::default();
        for (n, i) in p7_order().enumerate() {
            rounds[i].push(p7_drain(&fx, s, &events, RELAY_COUNTS[i], n / RELAY_COUNTS.len() + 1).await?);
        }
        let medians: Vec<(usize, f64)> = RELAY_COUNTS.iter().zip(&rounds).map(|(c, r)| (*c, median_of(r))).collect();
        let spread = |i: usize| rounds[i].iter().map(|x| rate(*x)).collect::<Vec<_>>().join("/");
        let mut rows = Vec::new();
        for (i, (count, measured)) in medians.iter().copied().enumerate() {
            let best = medians[..i].iter().copied().enumerate().max_by(|a, b| a.1.1.total_cmp(&b.1.1));
            let row = match best {
                // No goal for one relay (P4 judges it); the ratio to raw SQL is shown.
                None => Row::new(
                    "P7/1",
                    format!("1 relay, {}", p7_broker_name(s)),
                    "raw SQL claim+complete",
                    measured,
                    Some(sql),
                    None,
                    format!(
                        "1 relay, {}, pool {P7_POOL}; median of rounds {}; raw SQL on one connection",
                        relay_settings(s, &InstantBroker::AT_ONCE),
                        spread(i)
                    ),
                    vec![("raw SQL".into(), sql)],
                    s.seed,
                ),
                Some((best_i, (best_count, best_rate))) => Row::new(
                    format!("P7/{count}"),
                    format!("{count} relays, {}", p7_broker_name(s)),
                    format!("best smaller count ({best_count}), median of its rounds"),
                    measured,
                    Some(best_rate),
                    Some(1.0),
                    format!(
                        "{count} relays, {}, pool {P7_POOL} each; median of rounds {}; {best_count} relay(s): {}; raw \
                         SQL {}",
                        relay_settings(s, &InstantBroker::AT_ONCE),
                        spread(i),
                        spread(best_i),
                        rate(sql)
                    ),
                    std::iter::once(("raw SQL".to_string(), sql))
                        .chain(medians[..i].iter().map(|(c, r)| (format!("{c} relay(s), median"), *r)))
                        .collect(),
                    s.seed,
                ),
            };
            rows.push(row);
        }
        Ok(rows)
    }
    .await;
    let _ = fx.drop().await;
    result
}

/// P7's broker: one that returns at once, or after `--p7-broker-latency` per batch.
fn p7_broker(s: &Settings) -> Arc<dyn Broker> {
    Arc::new(InstantBroker::after(s.p7_broker_latency))
}

/// P7's broker in a row's subject: "instant broker", or the latency it answers after.
fn p7_broker_name(s: &Settings) -> String {
    if s.p7_broker_latency.is_zero() {
        "instant broker".into()
    } else {
        format!("broker answering after {:?}", s.p7_broker_latency)
    }
}

/// Rounds of P7 (each relay count drains this many times).
const P7_ROUNDS: usize = 3;

/// Rounds of P8 (each claim statement drains this many times).
const P8_ROUNDS: usize = 3;

/// The order P7 drains in, as indices into [`RELAY_COUNTS`]: the counts up, then down, then up
/// again (1, 2, 4, 8, 8, 4, 2, 1, 1, …), so that a machine getting faster or slower over the run
/// touches every count alike.
fn p7_order() -> impl Iterator<Item = usize> {
    let n = RELAY_COUNTS.len();
    (0..P7_ROUNDS).flat_map(move |round| (0..n).map(move |i| if round % 2 == 0 { i } else { n - 1 - i }))
}

/// The median of `rates` (the lower middle one for an even count, so that a tie never
/// flatters); 0 for none.
fn median_of(rates: &[f64]) -> f64 {
    let mut sorted = rates.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
}

/// One P7 drain: `count` relays, each on a store of its own, drain the backlog `events` (filled
/// here) together; events per second, after checking every row was published exactly once.
async fn p7_drain(fx: &PgFixture, s: &Settings, events: &[Event], count: usize, round: usize) -> Result<f64> {
    fx.fill(events).await?;
    let mut stores = Vec::new();
    for _ in 0..count {
        stores.push(fx.another_store(P7_POOL).await?);
    }
    // One recorder for every relay of the count: their stage calls pooled.
    let stages = Stages::default();
    let relays: Vec<Arc<Relay>> = stores
        .iter()
        .enumerate()
        .map(|(i, st)| {
            Arc::new(metrics::with_local_recorder(&stages, || {
                Relay::new(Arc::new(st.clone()), p7_broker(s), relay_config(s, format!("relay-bench{count}-{i}")))
            }))
        })
        .collect();
    let t = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for r in &relays {
        let r = r.clone();
        tasks.spawn(async move { r.drain().await });
    }
    let mut total = BatchReport::default();
    let joined = tokio::time::timeout(DRAIN_LIMIT, async {
        while let Some(r) = tasks.join_next().await {
            let report = r.map_err(|e| fail(format!("relay task: {e}")))??;
            add(&mut total, &report);
        }
        Ok::<_, outbox::Error>(())
    })
    .await;
    let elapsed = t.elapsed();
    for st in &stores {
        st.close().await;
    }
    joined.map_err(|_| fail(format!("{count} relays did not drain within {DRAIN_LIMIT:?}")))??;
    check_report(&total, s.events)?;
    fx.check_published(s.events, &format!("{count} relays")).await?;
    let measured = per_second(s.events, elapsed);
    say(
        "P7",
        format!(
            "round {round}: {count} relay(s) {} ev/s; stages per call, all relays: {}",
            rate(measured),
            stages.summary()
        ),
    );
    Ok(measured)
}

/// P8: what per-key order costs the PostgreSQL claim. The store's claim statement against the one
/// before key order (schema version 3: `SKIP LOCKED` in id order), each claiming and completing
/// the same backlog by raw SQL on one connection; once with the run's keys and once without keys.
/// The baseline is written as today's claim is (planned once); schema 3's claim as it shipped
/// (planned at every call) is measured beside it and shown in the configuration.
async fn p8(s: &Settings) -> Result<Vec<Row>> {
    let fx = PgFixture::new(s, "p8").await?;
    let result = async {
        let dest = destination(s, "p8")?;
        let before = raw::pg_claim_before_key_order(&fx, s.batch, raw::V3Form::Today)?;
        let shipped = raw::pg_claim_before_key_order(&fx, s.batch, raw::V3Form::AsShipped)?;
        let today = raw::RawClaim::store(&fx, s.batch);
        say(
            "P8",
            format!(
                "PostgreSQL claim with per-key order vs the claim before it (id order only). schema {}; {} events; \
                 raw SQL on one connection, claim+complete per batch of {}; {} keys, then none",
                fx.schema, s.events, s.batch, s.keys
            ),
        );
        let keyed = fixture::events(s, &dest, s.events);
        let keyless: Vec<_> = keyed.iter().cloned().map(|e| Event { key: None, ..e }).collect();
        let mut rows = Vec::new();
        for (id, label, events) in
            [("P8/keys", format!("{} keys", s.keys), &keyed), ("P8/none", "no keys".into(), &keyless)]
        {
            // [`P8_ROUNDS`] rounds, each statement once per round, the order turned by one each
            // round (the server's caches warm up and the machine drifts as the run goes), and
            // each statement's median kept: the best of two single drains had read 0.80–1.13
            // for the same code in three runs of one table.
            let statements = [&before, &today, &shipped];
            let mut rates = statements.map(|_| Vec::new());
            for round in 0..P8_ROUNDS {
                for i in 0..statements.len() {
                    let which = (round + i) % statements.len();
                    fx.fill(events).await?;
                    rates[which].push(raw::pg_sql_with(&fx, statements[which], s.events).await?);
                }
            }
            let [old_rate, new_rate, shipped_rate] = rates.each_ref().map(|r| median_of(r));
            say(
                "P8",
                format!(
                    "{label}: claim before key order {} ev/s (as schema 3 shipped it, planned at every call: {} \
                     ev/s), today's claim {} ev/s",
                    rate(old_rate),
                    rate(shipped_rate),
                    rate(new_rate)
                ),
            );
            rows.push(Row::new(
                id,
                format!("PostgreSQL claim with key order, {label}"),
                "claim before key order (schema v3)",
                new_rate,
                Some(old_rate),
                Some(0.9),
                format!(
                    "raw SQL on one connection, claim+complete per batch of {}, {label}, median of {P8_ROUNDS} \
                     rounds; both planned once (limit in the text); schema 3's claim as it shipped (planned at every call) {}, today's \
                     {:.2} of it",
                    s.batch,
                    rate(shipped_rate),
                    new_rate / shipped_rate.max(f64::MIN_POSITIVE)
                ),
                vec![
                    ("before key order".into(), old_rate),
                    ("with key order".into(), new_rate),
                    ("before key order, as shipped".into(), shipped_rate),
                ],
                s.seed,
            ));
        }
        Ok(rows)
    }
    .await;
    let _ = fx.drop().await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p7_drains_every_count_once_per_round_going_up_then_down() {
        let order: Vec<usize> = p7_order().map(|i| RELAY_COUNTS[i]).collect();
        assert_eq!(order, [1, 2, 4, 8, 8, 4, 2, 1, 1, 2, 4, 8]);
        for count in RELAY_COUNTS {
            assert_eq!(order.iter().filter(|c| **c == count).count(), P7_ROUNDS, "{count}");
        }
    }

    /// `--p7-broker-latency`: P7's broker answers each batch after the latency (on tokio's
    /// paused clock, so no time passes), and at once without it.
    #[tokio::test(start_paused = true)]
    async fn p7s_broker_answers_each_batch_after_the_latency_asked_for() {
        use outbox::EventId;
        let dest = Destination::new("p7").unwrap();
        let events: Vec<Event> =
            (0..3).map(|i| Event::new(EventId::new(format!("e{i}")).unwrap(), dest.clone(), vec![1])).collect();
        for (latency, name) in
            [(Duration::ZERO, "instant broker"), (Duration::from_millis(20), "broker answering after 20ms")]
        {
            let s = Settings {
                events: 3,
                batch: 3,
                payload: 1,
                keys: 1,
                pipeline_depth: None,
                in_flight: 1,
                per_commit: 1,
                p7_broker_latency: latency,
                repeat: 1,
                seed: 7,
                pg: String::new(),
                redis: String::new(),
                amqp: String::new(),
                kafka: String::new(),
                run_id: "t".into(),
            };
            assert_eq!(p7_broker_name(&s), name);
            let t = tokio::time::Instant::now();
            let answers = p7_broker(&s).publish_batch(&events).await;
            assert_eq!(t.elapsed(), latency, "{name}");
            assert_eq!(answers.len(), 3);
            assert!(answers.iter().all(Result::is_ok), "{name}: {answers:?}");
        }
    }

    #[test]
    fn a_counts_median_is_its_middle_round_and_the_lower_middle_of_an_even_number() {
        assert_eq!(median_of(&[30.0, 10.0, 20.0]), 20.0);
        assert_eq!(median_of(&[40.0, 10.0, 30.0, 20.0]), 20.0);
        assert_eq!(median_of(&[5.0]), 5.0);
        assert_eq!(median_of(&[]), 0.0);
    }
}
