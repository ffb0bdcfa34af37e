//! `outbox chaos`: the contract under real crashes, restarts and network faults, with figures.
//!
//! The conformance suite judges the contract against a model and healthy servers; users choose
//! an outbox library for what happens when processes die and servers restart. So this runner
//! does that to real OS processes and real servers — `outbox relay` processes and consumer
//! processes are SIGKILLed, the broker and PostgreSQL are restarted, connections are cut,
//! stalled and black-holed by a fault proxy — on a schedule that a seed replays, and then
//! judges the run from durable state only.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox::{Error, ErrorKind, Result};

use crate::duration;

mod env;
mod inject;
mod procs;
mod proxy;
mod report;
mod run;
mod schedule;
mod servers;
mod site;
mod stuck;
mod worker;

pub(crate) use worker::{WorkerCommand, run as run_worker};

/// Flags of `outbox chaos`.
#[derive(clap::Args)]
pub(crate) struct ChaosArgs {
    /// `ci`: a few minutes for all four combinations (5,000 events and a 40 s fault window each);
    /// `long`: a 30-minute fault window per combination, with table sizes and throughput per
    /// 5-minute window; its relays run retention (`--retain-published 60s`), so the outbox table
    /// stays bounded.
    #[arg(long, value_enum, default_value_t = Profile::Ci)]
    profile: Profile,
    /// Combinations to run, comma-separated (default: all four).
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    combos: Vec<ComboName>,
    /// Events each combination commits (default: 5,000 in `ci`, 40 per second of window in `long`).
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(100..=10_000_000))]
    events: Option<u64>,
    /// Seed of the schedule (faults, bad inputs, keys); printed at the start. Default: random.
    #[arg(long, allow_negative_numbers = true)]
    seed: Option<u64>,
    /// Length of each combination's fault window (`40s`, `30m`), instead of the profile's.
    #[arg(long, value_parser = duration::parse)]
    duration: Option<Duration>,
    /// Longest wait, once the faults stop, for every row to be published and every effect
    /// applied (default 240s in `ci`, 300s in `long`); a run that does not drain fails. The
    /// audit group's read afterwards has the same bound.
    #[arg(long, value_parser = duration::parse)]
    drain: Option<Duration>,
    /// Length of one statistics window of the `long` profile (default 5m).
    #[arg(long, value_parser = duration::parse)]
    stats_window: Option<Duration>,
    /// Relay processes per combination (2 to 4).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=4))]
    relays: u32,
    /// Write the figures, the faults and the seed to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Keep each combination's directory (process logs, SQLite files) even when it passed.
    #[arg(long)]
    keep: bool,
}

/// A profile: how long and how much.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Profile {
    /// A few minutes for all four combinations.
    Ci,
    /// ≥ 30 minutes per combination, with drift figures.
    Long,
}

/// The combinations the issue asks for.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
enum ComboName {
    /// PostgreSQL + Kafka (tansu).
    PgKafka,
    /// PostgreSQL + RabbitMQ.
    PgAmqp,
    /// PostgreSQL + Redis Streams.
    PgRedis,
    /// SQLite + Redis Streams.
    SqliteRedis,
}

/// Which store a combination uses.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum StoreKind {
    /// A runner-owned PostgreSQL.
    Postgres,
    /// A SQLite file.
    Sqlite,
}

/// Which broker a combination uses.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum BrokerKind {
    /// tansu, runner-owned.
    Kafka,
    /// The machine's RabbitMQ node.
    Amqp,
    /// A runner-owned Redis.
    Redis,
}

impl BrokerKind {
    /// Backend name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BrokerKind::Kafka => "kafka",
            BrokerKind::Amqp => "amqp",
            BrokerKind::Redis => "redis",
        }
    }
}

/// One store × broker combination.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Combo {
    /// `pg-redis`, …
    pub(crate) name: &'static str,
    /// Store.
    pub(crate) store: StoreKind,
    /// Broker.
    pub(crate) broker: BrokerKind,
}

impl Combo {
    /// Whether PostgreSQL is the store (and gets restarted).
    pub(crate) fn has_pg(self) -> bool {
        self.store == StoreKind::Postgres
    }
}

impl ComboName {
    fn combo(self) -> Combo {
        let (name, store, broker) = match self {
            ComboName::PgKafka => ("pg-kafka", StoreKind::Postgres, BrokerKind::Kafka),
            ComboName::PgAmqp => ("pg-amqp", StoreKind::Postgres, BrokerKind::Amqp),
            ComboName::PgRedis => ("pg-redis", StoreKind::Postgres, BrokerKind::Redis),
            ComboName::SqliteRedis => ("sqlite-redis", StoreKind::Sqlite, BrokerKind::Redis),
        };
        Combo { name, store, broker }
    }
}

/// What one combination run does.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// Events committed.
    pub(crate) events: u64,
    /// Fault window.
    pub(crate) window: Duration,
    /// Relay processes.
    pub(crate) relays: usize,
    /// Consumer processes.
    pub(crate) consumers: usize,
    /// Relay lease.
    pub(crate) lease: Duration,
    /// Bound on the drain after the faults stop.
    pub(crate) drain: Duration,
    /// Statistics window (long profile).
    pub(crate) stats_window: Option<Duration>,
    /// Relays run retention (`outbox relay --retain-published`) with this age (long profile),
    /// so the outbox table stays bounded however long the run.
    pub(crate) retain_published: Option<Duration>,
    /// Consumers prune their inbox markers older than this (long profile), checked against the
    /// redelivery horizon, so the marker table stays bounded too.
    pub(crate) retain_markers: Option<Duration>,
    /// Keep directories.
    pub(crate) keep: bool,
}

fn settings(args: &ChaosArgs) -> Settings {
    let (window, events, drain, stats) = match args.profile {
        Profile::Ci => {
            let window = args.duration.unwrap_or(Duration::from_secs(40));
            (window, args.events.unwrap_or(5_000), Duration::from_secs(240), None)
        }
        Profile::Long => {
            let window = args.duration.unwrap_or(Duration::from_secs(30 * 60));
            let events = args.events.unwrap_or((window.as_secs() * 40).max(1_000));
            (window, events, Duration::from_secs(300), Some(args.stats_window.unwrap_or(Duration::from_secs(300))))
        }
    };
    let drain = args.drain.unwrap_or(drain);
    Settings {
        events,
        window,
        relays: args.relays as usize,
        consumers: 2,
        lease: Duration::from_secs(3),
        drain,
        stats_window: stats,
        retain_published: match args.profile {
            Profile::Ci => None,
            Profile::Long => Some(RETAIN_PUBLISHED),
        },
        retain_markers: match args.profile {
            Profile::Ci => None,
            Profile::Long => Some(RETAIN_MARKERS),
        },
        keep: args.keep,
    }
}

/// Published-row retention of the `long` profile's relays. The runner snapshots rows more often
/// than this ([`run`]'s row keeper), so the judge still sees every row that was ever published.
const RETAIN_PUBLISHED: Duration = Duration::from_secs(60);

/// Marker retention of the `long` profile's consumers: twice the redelivery horizon.
const RETAIN_MARKERS: Duration = Duration::from_secs(120);

/// Owners of runner processes and servers ([`env::Env`], the relay and consumer fleet) still
/// alive. An interrupted run waits for this to reach zero before it exits, because tasks that
/// held them are dropped by the runtime after the run's future is.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Counted in [`LIVE`] while its owner lives; declared as the owner's last field, so it is
/// released after the owner's processes and servers are stopped.
pub(crate) struct Live(());

impl Live {
    pub(crate) fn new() -> Self {
        LIVE.fetch_add(1, Ordering::SeqCst);
        Live(())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How long an interrupted run waits for its processes and servers to stop (the runner's
/// PostgreSQL gets 40 s for `pg_ctl stop`).
const TEARDOWN_LIMIT: Duration = Duration::from_secs(60);

/// The first SIGTERM or SIGINT, by name, on `tx`; a second one exits at once (status 130).
fn forward_signals(
    tx: tokio::sync::watch::Sender<Option<&'static str>>,
) -> impl std::future::Future<Output = ()> + Send {
    crate::signals::first_then_exit(
        move |name| {
            eprintln!("outbox chaos: {name}: stopping the run's relays, consumers and servers (again to exit at once)");
            let _ = tx.send(Some(name));
        },
        |name| eprintln!("outbox chaos: second signal ({name}): exiting now; processes may be left running"),
        |name, e| eprintln!("outbox chaos: cannot listen for {name} ({e}); it will not stop the run's processes"),
    )
}

/// Resolves with the signal's name once the run is interrupted.
pub(crate) async fn interrupted(rx: &mut tokio::sync::watch::Receiver<Option<&'static str>>) -> &'static str {
    match rx.wait_for(Option::is_some).await {
        Ok(name) => name.unwrap_or("a signal"),
        // The listener is gone (it could not install its handlers): never interrupted.
        Err(_) => std::future::pending().await,
    }
}

/// Wait (bounded) until every [`Live`] owner is dropped; `false` when some were still alive at
/// the limit.
async fn torn_down(limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while LIVE.load(Ordering::SeqCst) > 0 {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

/// Run the chaos profile: `Ok(true)` when every combination passed.
///
/// # Errors
/// A combination that could not run (a server that would not start or restart, a missing
/// binary under `CI=true`), after the table was printed.
pub(crate) async fn run(args: ChaosArgs) -> Result<bool> {
    let started = Instant::now();
    let seed = args.seed.unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        outbox::core::rng::SplitMix64::new(nanos as u64 ^ u64::from(std::process::id())).next_u64() >> 11
    });
    let settings = settings(&args);
    let names = if args.combos.is_empty() {
        vec![ComboName::PgKafka, ComboName::PgAmqp, ComboName::PgRedis, ComboName::SqliteRedis]
    } else {
        let mut v = args.combos.clone();
        v.dedup();
        v
    };
    let profile = match args.profile {
        Profile::Ci => "ci",
        Profile::Long => "long",
    };
    println!("outbox chaos — profile {profile}, seed {seed} (replay with --seed {seed})");
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let (tx, signals) = tokio::sync::watch::channel(None);
    let listener = tokio::spawn(forward_signals(tx));
    let mut reports = Vec::new();
    for name in names {
        let combo = name.combo();
        if signals.borrow().is_some() {
            break;
        }
        if let Err(missing) = env::Env::available(combo) {
            if ci {
                reports.push(report::ComboReport {
                    name: combo.name.into(),
                    error: Some(format!("{missing} (CI=true: a missing server is a failure)")),
                    ..Default::default()
                });
            } else {
                eprintln!("outbox chaos: SKIPPING {}: {missing}", combo.name);
                reports.push(report::ComboReport {
                    name: combo.name.into(),
                    skipped: Some(missing),
                    ..Default::default()
                });
            }
            continue;
        }
        let r = run::run_combo(combo, &settings, seed, signals.clone()).await;
        if let Some(name) = *signals.borrow() {
            let stopped = torn_down(TEARDOWN_LIMIT).await;
            println!(
                "{}: interrupted by {name}: {}",
                combo.name,
                if stopped {
                    "every process and server the run started is stopped".to_string()
                } else {
                    format!("some processes or servers were still running after {TEARDOWN_LIMIT:?}")
                }
            );
        }
        println!(
            "{}: {} in {:.1?}{}",
            r.name,
            if r.passed() { "passed" } else { "FAILED" },
            r.duration,
            r.logs.as_ref().map(|l| format!(" (logs in {l})")).unwrap_or_default()
        );
        reports.push(r);
    }

    println!();
    print!("{}", report::table(&reports));
    for r in &reports {
        print!("{}", report::windows(r));
        let g = &r.figures;
        if g.dead_letter_records > g.dead_lettered {
            println!(
                "{}: NOTE: {} dead-letter records for {} events (an event recorded more than once)",
                r.name, g.dead_letter_records, g.dead_lettered
            );
        }
        for h in &r.broker_heals {
            println!("{}: NOTE: broker healed (restarted with the relays): {h}", r.name);
        }
        for p in &r.problems {
            println!("{}: FAIL: {p}", r.name);
        }
        if let Some(e) = &r.error {
            println!("{}: ERROR: {e}", r.name);
        }
    }
    listener.abort();
    let passed = reports.iter().all(report::ComboReport::passed);
    let errored = reports.iter().any(|r| r.error.is_some());
    let interrupted = signals.borrow().is_some();
    println!(
        "verdict: {} — seed {seed}, {:.1?} in all",
        if interrupted {
            "INTERRUPTED"
        } else if errored {
            "ERROR"
        } else if passed {
            "PASS"
        } else {
            "FAIL"
        },
        started.elapsed()
    );
    if let Some(path) = &args.json {
        let json = report::Json::obj(vec![
            ("seed", report::Json::Num(i128::from(seed))),
            ("profile", report::Json::Str(profile.into())),
            ("passed", report::Json::Bool(passed && !errored && !interrupted)),
            ("duration_ms", report::Json::Num(started.elapsed().as_millis() as i128)),
            ("window_ms", report::Json::Num(settings.window.as_millis() as i128)),
            ("combos", report::Json::Arr(reports.iter().map(report::combo_json).collect())),
        ]);
        std::fs::write(path, json.render()).map_err(|e| {
            Error::permanent(ErrorKind::Config, "chaos", format!("cannot write {}: {e}", path.display()))
        })?;
    }
    if let Some(r) = reports.iter().find(|r| r.error.is_some()) {
        return Err(Error::permanent(
            ErrorKind::Rejected,
            "chaos",
            format!("{}: {}", r.name, r.error.as_deref().unwrap_or_default()),
        ));
    }
    // A signal between combinations (or as one ended) still means not every one ran.
    if let Some(name) = *signals.borrow() {
        return Err(Error::permanent(
            ErrorKind::Rejected,
            "chaos",
            format!("interrupted by {name}: {} of the combinations ran", reports.len()),
        ));
    }
    Ok(passed)
}
