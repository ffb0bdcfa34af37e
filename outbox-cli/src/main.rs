//! The `outbox` program. It is the only place where a store and a broker are chosen for the user
//! (by URL, through the `outbox` facade crate): the library crates never pick infrastructure.
//!
//! Exit codes: 0 success; 1 a runtime error (unreachable server, wrong password, failed
//! operation); 2 a usage error (bad flag, bad duration, bad log filter); 3 a failed verdict
//! (`demo`, `conformance`, `chaos`).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

mod bench;
mod chaos;
mod cleanup;
mod conformance;
mod demo;
mod duration;
mod json;
mod metrics;
mod ops;
mod relay;
mod signals;
mod stderr;

/// Exit code of a runtime error.
const EXIT_ERROR: u8 = 1;
/// Exit code of a usage error (clap uses it too).
const EXIT_USAGE: u8 = 2;
/// Exit code of a failed verdict.
const EXIT_VERDICT: u8 = 3;

#[derive(Parser)]
#[command(
    name = "outbox",
    version,
    about = "Transactional outbox: run a relay, operate the outbox and the inbox, the demo and the conformance suite",
    after_help = "Exit codes: 0 success, 1 runtime error, 2 usage error, 3 failed verdict (demo, conformance, chaos)."
)]
struct Cli {
    /// Log filter (tracing `EnvFilter` syntax, e.g. `info`, `outbox.relay=debug`). `warn` shows every
    /// fenced completion.
    #[arg(long, env = "OUTBOX_LOG", global = true)]
    log: Option<String>,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run a relay until SIGTERM/SIGINT: claim rows from the store, publish them to the broker,
    /// record the outcome. On the signal, in-flight publishes finish, the rest of the batch is
    /// released, and the program exits 0.
    Relay(relay::RelayArgs),
    /// Apply the store's schema migrations (idempotent; PostgreSQL's are explicit, SQLite
    /// migrates on open).
    Migrate(ops::StoreArgs),
    /// Print the outbox's row counts by status and the age of the oldest pending row.
    Stats(ops::StatsArgs),
    /// List outbox rows, optionally only those of one status.
    Inspect(ops::InspectArgs),
    /// Retention, once: delete published rows older than an age in bounded batches (never a
    /// pending, leased or parked row) and, if asked, a consumer's inbox markers — refused when
    /// shorter than the consumer's redelivery horizon.
    Cleanup(cleanup::CleanupArgs),
    /// Dead-lettered (parked) outbox rows: list, requeue or purge them.
    #[command(subcommand)]
    Parked(ops::ParkedCommand),
    /// A consumer's dead letters: list, replay (publish again) or purge them.
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(ops::DeadLetterCommand),
    /// Run the whole story (producer, two relays — one stalls past its lease — and a consumer
    /// with the inbox) on any store and broker, then judge the contract from durable state.
    Demo(demo::DemoArgs),
    /// Run the conformance suite and print the failure-class table.
    Conformance(ConformanceArgs),
    /// Kill relays and consumers, restart every server, cut connections — on a seeded schedule —
    /// then judge the contract from durable state and print one row per combination × fault.
    Chaos(chaos::ChaosArgs),
    /// Throughput of P1–P9 against the real servers, each beside a raw baseline measured in the
    /// same run: one table (ratio, goal, pass/fail), optionally a JSON file. Exit 0 when every
    /// subject ran (a ratio below its goal is a FAIL row, exit 3 only with `--strict`).
    Bench(bench::BenchArgs),
    /// The chaos runner's own worker processes (not for direct use).
    #[command(subcommand, hide = true, name = "chaos-worker")]
    ChaosWorker(chaos::WorkerCommand),
}

#[derive(clap::Args)]
struct ConformanceArgs {
    /// The store to judge: `sqlite` (files in a temporary directory), `sqlite:///DIR`,
    /// `postgres://…` (a fresh schema per case, dropped afterwards) or `memory`.
    #[arg(long, default_value = "sqlite")]
    store: String,
    /// The broker to judge it with: `memory` (in-process), `kafka://…`, `amqp://…` or `redis://…`.
    #[arg(long, default_value = "memory")]
    broker: String,
}

fn init_logging(cli: &Cli) -> Result<(), String> {
    // The relay logs its start, stop and a summary of its work at info; the one-shot commands
    // only what went wrong.
    let default = match cli.command {
        Command::Relay(_) => "info",
        Command::Demo(_) | Command::Conformance(_) | Command::Bench(_) => "error",
        // The runner's own connections go through the fault proxies: drivers' complaints about
        // cut connections are the point, not news.
        Command::Chaos(_) => "error,lapin=off,rdkafka=off",
        _ => "warn",
    };
    let spec = cli.log.clone().unwrap_or_else(|| default.to_string());
    let filter = tracing_subscriber::EnvFilter::try_new(&spec).map_err(|e| format!("--log {spec:?}: {e}"))?;
    // Colours only for a person at a terminal: a file, a pipe or journald gets plain lines.
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(|| stderr::Log);
    match cli.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = init_logging(&cli) {
        stderr::final_error(&e);
        return ExitCode::from(EXIT_USAGE);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            stderr::final_error(&format!("cannot start the async runtime: {e}"));
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Relay(args) => relay::run(args).await.map(|()| true),
            Command::Migrate(args) => ops::migrate(args).await.map(|()| true),
            Command::Stats(args) => ops::stats(args).await.map(|()| true),
            Command::Inspect(args) => ops::inspect(args).await.map(|()| true),
            Command::Cleanup(args) => cleanup::run(args).await.map(|()| true),
            Command::Parked(cmd) => ops::parked(cmd).await.map(|()| true),
            Command::DeadLetters(cmd) => ops::dead_letters(cmd).await.map(|()| true),
            Command::Demo(args) => demo::run(args).await,
            Command::Conformance(args) => conformance::run(&args.store, &args.broker).await,
            Command::Chaos(args) => chaos::run(args).await,
            Command::Bench(args) => bench::run(args).await,
            Command::ChaosWorker(cmd) => chaos::run_worker(cmd).await.map(|()| true),
        }
    });
    // Don't wait for tasks still blocked on a dead server.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(EXIT_VERDICT),
        Err(e) => {
            stderr::final_error(&e.to_string());
            ExitCode::from(if e.kind() == outbox::ErrorKind::InvalidInput { EXIT_USAGE } else { EXIT_ERROR })
        }
    }
}

/// `path` with `-suffix` added to the file stem (`demo.db` → `demo-consumer.db`).
fn sibling(path: &std::path::Path, suffix: &str) -> PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "outbox".into());
    let ext = path.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    path.with_file_name(format!("{stem}-{suffix}{ext}"))
}

/// `path` with a suffix after the whole file name (`demo.db` → `demo.db-wal`).
fn sibling_ext(path: &std::path::Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}
