//! `outbox bench`: throughput against the real servers, each subject beside a raw baseline
//! measured in the same run.
//!
//! An events-per-second figure alone says little: it moves with the machine, the server
//! settings and whatever else runs. What a user needs to know is how much the library costs
//! over doing the same durable work by hand, so every subject here is paired with a baseline
//! that does that work without the library (the same `UPDATE … FOR UPDATE SKIP LOCKED` claim and
//! fenced completion, the broker's own batching with the same acknowledgement), measured on the
//! same servers minutes apart, and judged by the ratio. The subjects and goals are those of
//! issue 14 (P1–P7, and P9 for the SQLite store's producers) and issue 16 (P8); `docs/bench.md` holds the latest table.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use outbox::{Error, ErrorKind, Result};
use outbox_conformance_tests::service;

mod fixture;
mod raw;
mod report;
mod stages;
mod subjects;

use report::Row;

/// Flags of `outbox bench`.
#[derive(clap::Args)]
pub(crate) struct BenchArgs {
    /// Subjects to run, comma-separated (default: all of P1..P9).
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    only: Vec<Subject>,
    /// Backlog per measurement: rows in the outbox (P1–P5, P7 per relay count) or messages on
    /// the stream (P6). The default keeps the whole run at a few minutes on two cores.
    #[arg(long, allow_negative_numbers = true, default_value_t = 50_000, value_parser = clap::value_parser!(u64).range(100..=10_000_000))]
    events: u64,
    /// Rows a relay (and the raw SQL loop) claims per batch; also the raw Redis pipeline length.
    #[arg(long, allow_negative_numbers = true, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    batch: u32,
    /// Payload bytes per event.
    #[arg(long, allow_negative_numbers = true, default_value_t = 256, value_parser = clap::value_parser!(u32).range(16..=1_000_000))]
    payload: u32,
    /// Distinct event keys (aggregates); events are spread over them by the seed.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    keys: u32,
    /// Batches a relay has at the broker at once (`RelayConfig::pipeline_depth`; one more is
    /// claimed ahead; 1: claim, publish and complete one after another). Default: the broker's
    /// preference (RabbitMQ 8), else 2, as `outbox relay` does.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=64))]
    pipeline_depth: Option<u32>,
    /// Deliveries in flight in P6, for the consumer and for the hand-written loop alike.
    #[arg(long, allow_negative_numbers = true, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    in_flight: u32,
    /// Deliveries the P6 consumer commits in one transaction, at most
    /// (`ConsumerConfig::max_per_commit`; 1: a transaction per delivery, as the loop does).
    /// Above 1, P6 also measures the same consumer with 1 per commit, in the same run.
    #[arg(long, allow_negative_numbers = true, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    per_commit: u32,
    /// How long P7's broker takes to answer each batch (default: at once, so the relays share
    /// only the store). With your broker's batch latency, P7 shows whether more relays drain
    /// faster against your database: where one relay waits on the broker, more add throughput
    /// until the store is busy.
    #[arg(long, value_parser = crate::duration::parse, value_name = "DURATION")]
    p7_broker_latency: Option<Duration>,
    /// Seed of keys, amounts and payload bytes (default: random; printed first).
    #[arg(long, allow_negative_numbers = true)]
    seed: Option<u64>,
    /// PostgreSQL server (a fresh schema per subject, dropped afterwards).
    #[arg(long, env = "OUTBOX_PG_URL", hide_env_values = true, default_value = service::LOCAL_PG_URL)]
    pg: String,
    /// Redis server (fresh stream keys per subject, deleted afterwards).
    #[arg(long, env = "OUTBOX_REDIS_URL", hide_env_values = true, default_value = service::LOCAL_REDIS_URL)]
    redis: String,
    /// RabbitMQ server (a fresh exchange and queue per subject, deleted afterwards).
    #[arg(long, env = "OUTBOX_AMQP_URL", hide_env_values = true, default_value = service::LOCAL_AMQP_URL)]
    amqp: String,
    /// Kafka-protocol broker (a fresh topic per subject, deleted afterwards).
    #[arg(long, env = "OUTBOX_KAFKA_URL", hide_env_values = true, default_value = service::LOCAL_KAFKA_URL)]
    kafka: String,
    /// Write the table, the configuration and the seed to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Run each subject this many times, its baseline again each time, and report per row the
    /// run with the median ratio; every run's ratio is listed beside it. Ratios move between
    /// runs by more than their goals' margins on a small machine, so 3 or 5 is worth the time.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    repeat: u32,
    /// Exit 3 when a ratio is below its goal (by default such a row is reported as FAIL and the
    /// exit code is 0).
    #[arg(long)]
    strict: bool,
}

/// One of the subjects.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug, clap::ValueEnum)]
pub(crate) enum Subject {
    /// PostgreSQL → Redis relay vs min(raw SQL, raw pipelined XADD).
    #[value(name = "P1", alias = "p1")]
    P1,
    /// PostgreSQL → RabbitMQ relay vs min(raw SQL, raw publish with a window of confirms).
    #[value(name = "P2", alias = "p2")]
    P2,
    /// PostgreSQL → Kafka relay vs min(raw SQL, raw producer with many in flight).
    #[value(name = "P3", alias = "p3")]
    P3,
    /// PostgreSQL relay with a broker that returns at once vs raw SQL.
    #[value(name = "P4", alias = "p4")]
    P4,
    /// SQLite relay with a broker that returns at once vs raw rusqlite.
    #[value(name = "P5", alias = "p5")]
    P5,
    /// Consumer with the PostgreSQL inbox vs a hand-written loop without one (Redis).
    #[value(name = "P6", alias = "p6")]
    P6,
    /// 1, 2, 4, 8 relays on PostgreSQL.
    #[value(name = "P7", alias = "p7")]
    P7,
    /// PostgreSQL claim with per-key order vs the claim before it, with keys and without.
    #[value(name = "P8", alias = "p8")]
    P8,
    /// SQLite store's own enqueue from 16 producers at once vs one rusqlite transaction per event.
    #[value(name = "P9", alias = "p9")]
    P9,
}

impl Subject {
    const ALL: [Subject; 9] = [
        Subject::P1,
        Subject::P2,
        Subject::P3,
        Subject::P4,
        Subject::P5,
        Subject::P6,
        Subject::P7,
        Subject::P8,
        Subject::P9,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Subject::P1 => "P1",
            Subject::P2 => "P2",
            Subject::P3 => "P3",
            Subject::P4 => "P4",
            Subject::P5 => "P5",
            Subject::P6 => "P6",
            Subject::P7 => "P7",
            Subject::P8 => "P8",
            Subject::P9 => "P9",
        }
    }

    /// The servers it needs: (name, script name, URL).
    fn servers(self, s: &Settings) -> Vec<(&'static str, &'static str, String)> {
        let pg = ("PostgreSQL", "postgres", s.pg.clone());
        match self {
            Subject::P1 | Subject::P6 => vec![pg, ("Redis", "redis", s.redis.clone())],
            Subject::P2 => vec![pg, ("RabbitMQ", "rabbitmq", s.amqp.clone())],
            Subject::P3 => vec![pg, ("Kafka", "kafka", s.kafka.clone())],
            Subject::P4 | Subject::P7 | Subject::P8 => vec![pg],
            Subject::P5 | Subject::P9 => vec![],
        }
    }
}

/// The run's settings, shared by every subject.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) events: usize,
    pub(crate) batch: usize,
    pub(crate) payload: usize,
    pub(crate) keys: u64,
    /// `--pipeline-depth`; `None`: each broker's preference, else the relay's default.
    pub(crate) pipeline_depth: Option<usize>,
    pub(crate) in_flight: usize,
    pub(crate) per_commit: usize,
    /// `--p7-broker-latency`: P7's broker answers each batch after this (zero: at once).
    pub(crate) p7_broker_latency: Duration,
    /// Runs per subject (`--repeat`).
    pub(crate) repeat: usize,
    pub(crate) seed: u64,
    pub(crate) pg: String,
    pub(crate) redis: String,
    pub(crate) amqp: String,
    pub(crate) kafka: String,
    /// `<pid>_<nanos>`: makes every schema, stream, queue and topic name of this run unique.
    pub(crate) run_id: String,
}

impl Settings {
    /// The configuration every row shares, for the header and the JSON.
    fn describe(&self) -> String {
        format!(
            "events {} | batch {} | payload {} B | keys {} | relay pipeline depth {} | P6 in flight {} | P6 per commit {} | P7 broker {} | runs per subject {} | seed {}",
            self.events,
            self.batch,
            self.payload,
            self.keys,
            self.pipeline_depth
                .map_or_else(|| format!("the broker's, else {}", outbox::DEFAULT_PIPELINE_DEPTH), |d| d.to_string()),
            self.in_flight,
            self.per_commit,
            fixture::answers(self.p7_broker_latency),
            self.repeat,
            self.seed
        )
    }
}

/// What one subject produced: its rows, or why it could not run.
pub(crate) enum Outcome {
    Rows(Vec<Row>),
    Skipped(String),
    Failed(String),
}

/// Run the selected subjects and print the table: `Ok(true)` unless `--strict` and a ratio is
/// below its goal.
///
/// # Errors
/// A subject that could not run (after the table and the JSON file were written), or a JSON
/// file that cannot be written.
pub(crate) async fn run(args: BenchArgs) -> Result<bool> {
    let started = Instant::now();
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0x5eed, |d| d.as_nanos() as u64)
    });
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let settings = Settings {
        events: usize::try_from(args.events).unwrap_or(usize::MAX),
        batch: args.batch as usize,
        payload: args.payload as usize,
        keys: u64::from(args.keys),
        pipeline_depth: args.pipeline_depth.map(|d| d as usize),
        in_flight: args.in_flight as usize,
        per_commit: args.per_commit as usize,
        p7_broker_latency: args.p7_broker_latency.unwrap_or(Duration::ZERO),
        repeat: args.repeat as usize,
        seed,
        pg: args.pg.clone(),
        redis: args.redis.clone(),
        amqp: args.amqp.clone(),
        kafka: args.kafka.clone(),
        run_id: format!("{}_{nanos}", std::process::id()),
    };
    let mut selected: Vec<Subject> = if args.only.is_empty() { Subject::ALL.to_vec() } else { args.only.clone() };
    selected.sort();
    selected.dedup();

    let machine = report::machine();
    println!("outbox bench: seed {seed} (--seed {seed} repeats the keys, amounts and payloads)");
    println!("  {}", settings.describe());
    println!("  machine: {machine}");
    println!("  subjects: {}", selected.iter().map(|s| s.name()).collect::<Vec<_>>().join(", "));

    // Bad URLs are usage errors, before anything runs.
    for subject in &selected {
        for (_, _, url) in subject.servers(&settings) {
            check_url(&url)?;
        }
    }

    let mut outcomes: Vec<(Subject, Outcome)> = Vec::new();
    for subject in selected {
        println!();
        let missing = subject.servers(&settings).into_iter().find_map(|(name, script, url)| {
            let addr = service::service_addr(&url);
            reachable(&addr).err().map(|e| {
                format!("{name} is not reachable at {addr} ({e}); start it with `scripts/services ensure {script}`")
            })
        });
        if let Some(why) = missing {
            println!("{}: SKIPPED: {why}", subject.name());
            outcomes.push((subject, Outcome::Skipped(why)));
            continue;
        }
        let t = Instant::now();
        let mut runs = Vec::with_capacity(settings.repeat);
        let mut failed = None;
        for i in 0..settings.repeat {
            if settings.repeat > 1 {
                println!("{}: run {} of {}", subject.name(), i + 1, settings.repeat);
            }
            // Names unique per run, so that nothing one run leaves behind meets the next.
            let run = Settings { run_id: format!("{}_{i}", settings.run_id), ..settings.clone() };
            match subjects::run(subject, &run).await {
                Ok(rows) => runs.push(rows),
                Err(e) => {
                    let text = e.to_string().replace(['\n', '\r'], " ");
                    println!("{}: ERROR: {text}", subject.name());
                    failed = Some(text);
                    break;
                }
            }
        }
        let outcome = match failed {
            Some(text) => Outcome::Failed(text),
            None => Outcome::Rows(report::median(runs)),
        };
        println!("{}: done in {:.1} s", subject.name(), t.elapsed().as_secs_f64());
        outcomes.push((subject, outcome));
    }

    println!();
    let table = report::table(&outcomes);
    println!("{table}");
    println!("total time {:.0} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let json = report::json(&settings, &machine, &outcomes, started.elapsed()).render();
        std::fs::write(path, json)
            .map_err(|e| Error::permanent(ErrorKind::Config, "bench", format!("writing {}: {e}", path.display())))?;
        println!("figures written to {}", path.display());
    }

    let unran: Vec<String> = outcomes
        .iter()
        .filter_map(|(s, o)| match o {
            Outcome::Rows(_) => None,
            Outcome::Skipped(why) | Outcome::Failed(why) => Some(format!("{}: {why}", s.name())),
        })
        .collect();
    if !unran.is_empty() {
        return Err(Error::transient(
            ErrorKind::Connection,
            "bench",
            format!("{} subject(s) did not run: {}", unran.len(), unran.join("; ")),
        ));
    }
    let below =
        outcomes.iter().any(|(_, o)| matches!(o, Outcome::Rows(rows) if rows.iter().any(|r| r.pass == Some(false))));
    Ok(!(args.strict && below))
}

/// Parse a server URL with its adapter's own parser, so that `service_addr` cannot fail on it.
fn check_url(url: &str) -> Result<()> {
    let invalid = |e: Error| Error::invalid_input("bench", e.to_string());
    match url.split(':').next().unwrap_or_default() {
        "postgres" | "postgresql" => outbox::postgres::PgConfig::from_url(url).map(drop).map_err(invalid),
        "redis" | "rediss" => outbox::redis::RedisConfig::from_url(url).map(drop).map_err(invalid),
        "amqp" | "amqps" => outbox::amqp::AmqpConfig::from_url(url).map(drop).map_err(invalid),
        "kafka" | "kafka+ssl" => outbox::kafka::KafkaConfig::from_url(url).map(drop).map_err(invalid),
        other => Err(Error::invalid_input("bench", format!("unknown scheme {other:?} in a server URL"))),
    }
}

pub(crate) fn reachable(addr: &str) -> std::result::Result<(), String> {
    use std::net::{TcpStream, ToSocketAddrs};
    let a = addr.to_socket_addrs().map_err(|e| e.to_string())?.next().ok_or_else(|| "no address".to_string())?;
    TcpStream::connect_timeout(&a, Duration::from_secs(2)).map(|_| ()).map_err(|e| e.to_string())
}
