//! `outbox chaos-worker consume`: a consumer OS process the chaos runner starts, SIGKILLs and
//! starts again. It is a real process so that a kill loses exactly what a crash loses: the open
//! transaction, the unacknowledged deliveries, the connections.

use std::time::Duration;

use outbox::consumer::{Consumer, ConsumerConfig, Handler};
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
}

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
    let config = ConsumerConfig::new(CONSUMER);
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
    consumer.run(subscription.as_mut(), shutdown).await
}

async fn on_sigterm(shutdown: Shutdown) {
    if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        term.recv().await;
        shutdown.trigger();
    }
}
