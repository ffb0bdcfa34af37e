//! `outbox chaos-worker consume`: a consumer OS process the chaos runner starts, SIGKILLs and
//! starts again. It is a real process so that a kill loses exactly what a crash loses: the open
//! transaction, the unacknowledged deliveries, the connections.

use std::time::Duration;

use outbox::consumer::{Consumer, ConsumerConfig, Handler, Retention};
use outbox::{AnyStore, Broker, ConsumerGroup, Destination, Error, Inbox, Result, Shutdown};
use tracing::{info, warn};

use super::site::{CONSUMER, Effect, effects_table};

/// The hidden worker subcommands of `outbox chaos`.
#[derive(clap::Subcommand)]
pub(crate) enum WorkerCommand {
    /// Consume one destination with the inbox until SIGTERM (the chaos runner's consumer).
    Consume(ConsumeArgs),
}

/// Flags of `outbox chaos-worker consume`.
#[derive(clap::Args)]
pub(crate) struct ConsumeArgs {
    /// The store holding the inbox and the effect table.
    #[arg(long, hide_env_values = true)]
    store: String,
    /// The broker.
    #[arg(long, hide_env_values = true)]
    broker: String,
    /// Destination to consume.
    #[arg(long)]
    destination: String,
    /// Consumer group.
    #[arg(long)]
    group: String,
    /// This process's label, recorded with each effect.
    #[arg(long)]
    worker: String,
    /// The event id whose handler always fails.
    #[arg(long)]
    poison: String,
    /// Prune inbox markers older than this (long profile), every `PRUNE_EVERY`; the redelivery
    /// horizon the retention is checked against is `--max-redelivery`.
    #[arg(long, value_parser = crate::duration::parse, requires = "max_redelivery")]
    marker_retention: Option<Duration>,
    /// The longest a delivery may come back after its first delivery (consumer kills, lease
    /// expiry): markers must outlive it ([`outbox::consumer::Retention`]).
    #[arg(long, value_parser = crate::duration::parse)]
    max_redelivery: Option<Duration>,
}

/// How often a chaos consumer prunes its markers when `--marker-retention` is set.
const PRUNE_EVERY: Duration = Duration::from_secs(5);

/// Run a worker subcommand.
pub(crate) async fn run(command: WorkerCommand) -> Result<()> {
    match command {
        WorkerCommand::Consume(args) => consume(args).await,
    }
}

async fn consume(args: ConsumeArgs) -> Result<()> {
    let destination = Destination::new(args.destination.clone())?;
    let group = ConsumerGroup::new(args.group.clone())?;
    let store = AnyStore::connect(&args.store).await?;
    let broker = outbox::broker_from_url(&args.broker).await?;
    let effect = Effect { table: effects_table(&store)?, worker: args.worker.clone(), poison: args.poison.clone() };
    let mut config = ConsumerConfig::new(CONSUMER);
    if let (Some(markers), Some(redelivery)) = (args.marker_retention, args.max_redelivery) {
        config = config.with_retention(Some(Retention::new(markers, redelivery, Duration::ZERO)?));
    }
    let shutdown = Shutdown::default();
    tokio::spawn(on_sigterm(shutdown.clone()));
    match store {
        AnyStore::Postgres(s) => {
            serve(Consumer::new(s.inbox(), effect, config), broker, &destination, &group, &shutdown).await
        }
        AnyStore::Sqlite(s) => serve(Consumer::new(s, effect, config), broker, &destination, &group, &shutdown).await,
        other => {
            Err(Error::invalid_input("chaos", format!("the chaos worker needs a SQL store, not {}", other.backend())))
        }
    }
}

async fn serve<I: Inbox, H: Handler<I>>(
    consumer: Consumer<I, H>,
    broker: std::sync::Arc<dyn Broker>,
    destination: &Destination,
    group: &ConsumerGroup,
    shutdown: &Shutdown,
) -> Result<()> {
    // Subscribing needs the broker; while it restarts, try again (the runner's drain is bounded).
    let mut subscription = loop {
        match broker.subscribe(destination, group).await {
            Ok(s) => break s,
            Err(e) if !shutdown.is_triggered() => {
                warn!(target: "outbox.chaos", error = %e, "subscribe failed; retrying");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(e) => return Err(e),
        }
    };
    info!(target: "outbox.chaos", "consumer started");
    // Pruning runs beside the consumer on this task, until the consumer returns.
    let done = std::sync::atomic::AtomicBool::new(false);
    let run = async {
        let result = consumer.run(subscription.as_mut(), shutdown).await;
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        result
    };
    let prune = async {
        if consumer.config().retention.is_none() {
            return;
        }
        let mut last = tokio::time::Instant::now();
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if last.elapsed() < PRUNE_EVERY {
                continue;
            }
            last = tokio::time::Instant::now();
            match consumer.prune_markers().await {
                Ok(n) if n > 0 => info!(target: "outbox.chaos", pruned = n, "markers pruned"),
                Ok(_) => {}
                Err(e) => warn!(target: "outbox.chaos", error = %e, "pruning markers failed; next round"),
            }
        }
    };
    let (result, ()) = tokio::join!(run, prune);
    result
}

async fn on_sigterm(shutdown: Shutdown) {
    if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        term.recv().await;
        shutdown.trigger();
    }
}
