//! `outbox relay`: the deployable relay process.
//!
//! A relay is a long-running process an operator starts beside a service, one or more per
//! outbox. Everything it needs comes from two URLs; everything an orchestrator needs from it is
//! a clean exit on SIGTERM (in-flight publishes finish, the rest of the batch is released so
//! another relay takes it at once instead of after the lease) and a health/metrics endpoint.

use std::sync::Arc;
use std::time::Duration;

use outbox::core::config::redact;
use outbox::core::retention::{Cleanup, CleanupConfig};
use outbox::{AnyStore, Error, ErrorKind, Relay, RelayConfig, Result};
use tracing::{info, warn};

use crate::duration;
use crate::metrics;

/// Flags of `outbox relay`.
#[derive(clap::Args)]
pub(crate) struct RelayArgs {
    /// The outbox store: `postgres://…`, `sqlite:///path.db` (or `memory://`).
    #[arg(long, env = "OUTBOX_STORE_URL", hide_env_values = true)]
    store: String,
    /// The broker: `kafka://host:9092`, `amqp://…`, `redis://…` (or `memory://`).
    #[arg(long, env = "OUTBOX_BROKER_URL", hide_env_values = true)]
    broker: String,
    /// Rows claimed per batch, at most: after a batch outlasted its lease (another relay
    /// re-claimed it) the relay claims half as many, and grows back as batches fit the lease.
    #[arg(long, allow_negative_numbers = true, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batch: u32,
    /// Batches at the broker at once: with 2, the next batch publishes while this one waits for
    /// its acknowledgements, one more is claimed ahead, and each completes as its publish ends
    /// (up to 2 × depth + 1 between claim and recorded outcome); 1 runs claim, publish and
    /// complete one after another. Deeper helps a broker bound by confirm latency (RabbitMQ) and
    /// may cost a relay whose store is its limit (README). Keep 2 × (publish time of a batch)
    /// well under the lease. Default: the broker's preference (RabbitMQ 8), else 2.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=64))]
    pipeline_depth: Option<u32>,
    /// Ignored (kept so existing command lines still parse): the broker's batching now decides
    /// how many publishes are in flight.
    #[arg(long, hide = true, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    concurrency: Option<u32>,
    /// Lease length per claim (`30s`, `500ms`, `2m`): how long a row stays with this relay before
    /// another may take it.
    #[arg(long, default_value = "30s", value_parser = duration::parse)]
    lease: Duration,
    /// Lease owner name, unique among live relays (default: `relay-<host>-<pid>`).
    #[arg(long)]
    owner: Option<String>,
    /// Failed publish attempts after which a row is parked.
    #[arg(long, allow_negative_numbers = true, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    max_attempts: u32,
    /// Poll interval when idle. Stores that signal new rows (PostgreSQL LISTEN/NOTIFY, SQLite
    /// in-process) wake the relay at once; the poll is the safety net.
    #[arg(long, default_value = "500ms", value_parser = duration::parse)]
    idle_poll: Duration,
    /// Serve Prometheus metrics at `http://ADDR/metrics` and a health check at `/healthz`
    /// (e.g. `127.0.0.1:9464`).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Run the store's migrations before starting (otherwise a PostgreSQL outbox without tables
    /// is an error naming `outbox migrate`).
    #[arg(long)]
    migrate: bool,
    /// Run retention beside the relay: delete rows published longer ago than this (`7d`, `12h`,
    /// `60s`), in bounded batches, every `--retain-interval`. Off by default.
    #[arg(long, value_parser = duration::parse)]
    retain_published: Option<Duration>,
    /// Time between two retention rounds (with `--retain-published`).
    #[arg(long, default_value = "1m", value_parser = duration::parse, requires = "retain_published")]
    retain_interval: Duration,
    /// Rows deleted per retention transaction (with `--retain-published`).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1000, requires = "retain_published", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    retain_batch: u32,
}

fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_string());
    format!("relay-{host}-{}", std::process::id())
}

/// Run the relay until SIGTERM or SIGINT.
pub(crate) async fn run(args: RelayArgs) -> Result<()> {
    let owner = args.owner.clone().unwrap_or_else(default_owner);
    if owner.is_empty() || owner.len() > 200 {
        return Err(Error::invalid_input("relay", "--owner must be 1 to 200 bytes"));
    }
    let store = AnyStore::connect(&args.store).await?;
    if args.migrate {
        let version = store.migrate().await?;
        info!(target: "outbox.relay", backend = store.backend(), version, "schema migrated");
    }
    store.check_schema().await?;
    let broker = outbox::broker_from_url(&args.broker).await?;
    let outbox = store.outbox();

    if args.concurrency.is_some() {
        warn!(target: "outbox.relay", "--concurrency is ignored: the broker's batching decides how many publishes are in flight (see --pipeline-depth)");
    }
    let mut config = RelayConfig::default()
        .with_owner(owner.clone())
        .with_batch_size(args.batch as usize)
        .with_lease(args.lease)
        .with_max_attempts(args.max_attempts)
        .with_idle_poll(args.idle_poll);
    if let Some(depth) = args.pipeline_depth {
        config = config.with_pipeline_depth(depth as usize);
    }
    // Checked before the relay starts: a bad retention setting (zero) fails here, not later.
    let cleanup = match args.retain_published {
        Some(age) => Some(Arc::new(Cleanup::new(
            outbox.clone(),
            CleanupConfig::new(age).with_interval(args.retain_interval).with_batch(args.retain_batch as usize),
        )?)),
        None => None,
    };
    if args.metrics.is_some() {
        // Before the relay exists, so that the libraries describe their metrics to it.
        metrics::install_recorder();
    }
    let relay = Arc::new(Relay::new(outbox.clone(), broker.clone(), config));
    let shutdown = relay.shutdown_handle();

    let server = match args.metrics {
        Some(addr) => Some(metrics::serve(addr, relay.clone(), outbox.clone()).await?),
        None => None,
    };

    // Listening before the start is announced: a signal after the line is a clean stop.
    let signals = tokio::spawn(wait_for_signals(shutdown.clone()));
    info!(
        target: "outbox.relay",
        %owner,
        store = %redact(&args.store),
        broker = %redact(&args.broker),
        batch = args.batch,
        pipeline_depth = relay.pipeline_depth(),
        lease = ?args.lease,
        metrics = ?server.as_ref().map(|s| s.addr),
        "relay started"
    );

    // Retention runs beside the relay until the same shutdown; a permanent failure of it (the
    // store refuses the purge) stops the relay too, so the operator hears about it.
    let retention = cleanup.map(|cleanup| {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let result = cleanup.run(shutdown.clone()).await;
            if let Err(e) = &result {
                tracing::error!(target: "outbox.relay", error = %e, "retention failed; stopping the relay");
                shutdown.trigger();
            }
            result
        })
    });
    let totals = relay.run().await;
    signals.abort();
    if let Some(task) = retention {
        match task.await {
            Ok(Ok(r)) => info!(
                target: "outbox.relay",
                published_deleted = r.published_deleted,
                batches = r.batches,
                "retention stopped"
            ),
            Ok(Err(e)) => return Err(e),
            Err(e) => warn!(target: "outbox.relay", error = %e, "retention task ended abnormally"),
        }
    }
    if let Some(server) = server {
        server.stop();
    }
    let totals = totals?;
    info!(
        target: "outbox.relay",
        %owner,
        claimed = totals.claimed,
        published = totals.published,
        fenced = totals.fenced,
        retried = totals.retried,
        parked = totals.parked,
        released = totals.released,
        refused = totals.refused,
        "relay stopped"
    );
    Ok(())
}

/// First SIGTERM/SIGINT: graceful shutdown. A second one: exit at once (status 130).
/// The handlers are installed by this call (`first_then_exit`), before the future runs.
fn wait_for_signals(shutdown: outbox::Shutdown) -> impl std::future::Future<Output = ()> + Send {
    crate::signals::first_then_exit(
        move |_| {
            info!(target: "outbox.relay", "signal received: finishing in-flight publishes, releasing the rest");
            shutdown.trigger();
        },
        |_| warn!(target: "outbox.relay", "second signal: exiting now; unfinished rows are retried after their lease"),
        |name, e| warn!(target: "outbox.relay", error = %e, "cannot listen for {name}; only the other signal stops the relay"),
    )
}

/// Map an I/O error of the metrics listener.
pub(crate) fn io_error(what: &str, e: std::io::Error) -> Error {
    Error::permanent(ErrorKind::Config, "relay", format!("{what}: {e}"))
}
