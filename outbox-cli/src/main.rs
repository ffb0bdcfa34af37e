//! The `outbox` program. It is the only place where a store and a broker are chosen for the user:
//! the library crates never pick infrastructure.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

mod conformance;
mod demo;

#[derive(Parser)]
#[command(name = "outbox", version, about = "Transactional outbox: the embedded demo and the conformance suite")]
struct Cli {
    /// Log filter (tracing `EnvFilter` syntax). `warn` shows every fenced completion; `outbox=debug` every publish.
    #[arg(long, env = "OUTBOX_LOG", default_value = "error", global = true)]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the whole story on the embedded default: SQLite files and the in-process broker, two
    /// relays (one stalls until its lease expires), a consumer applying credits through the inbox;
    /// then judge the contract from durable state.
    Demo(demo::DemoArgs),
    /// Run the conformance suite and print the failure-class table.
    Conformance(ConformanceArgs),
}

#[derive(clap::Args)]
struct ConformanceArgs {
    /// Which backends to judge.
    #[arg(long, value_enum, default_value_t = Backends::Sqlite)]
    store: Backends,
}

#[derive(Clone, Copy, ValueEnum)]
enum Backends {
    /// SQLite outbox and inbox with the in-process broker.
    Sqlite,
    /// The in-memory reference backends.
    Memory,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("outbox: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            Command::Conformance(args) => conformance::run(matches!(args.store, Backends::Memory)).await,
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("outbox: {e}");
            ExitCode::from(2)
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
