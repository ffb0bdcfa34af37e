//! `outbox demo`: the whole story on the embedded default, judged from durable state.
//!
//! A producer commits orders and their outbox events together; relay A publishes a batch and
//! then stalls until its lease expires, so relay B claims the same rows with a newer fencing
//! token and publishes them again; A's late completion is fenced. The broker therefore holds
//! duplicates — by design — and the consumer's inbox makes each credit apply once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use indicatif::{ProgressBar, ProgressStyle};
use outbox_consumer_inbox::{Consumer, ConsumerConfig, EffectKind, Handled, Handler};
use outbox_core::memory::MemoryBroker;
use outbox_core::rng::SplitMix64;
use outbox_core::store::all_rows;
use outbox_core::{
    Broker, ConsumerGroup, Destination, Error, ErrorKind, Event, EventId, Inbox, OutboxStore, Relay, RelayConfig,
    Result, RowSnapshot, RowStatus, Subscription,
};
use outbox_store_sqlite::rusqlite::{TransactionBehavior, params};
use outbox_store_sqlite::{SqliteConfig, SqliteStore, SqliteTx, sqlite_error};

/// Flags of `outbox demo`.
#[derive(clap::Args)]
pub(crate) struct DemoArgs {
    /// Events (credits) to commit.
    #[arg(long, default_value_t = 1000)]
    events: u64,
    /// Producer database file (the consumer's is next to it, `-consumer` added). Both are
    /// recreated.
    #[arg(long, default_value = "outbox-demo.db")]
    db: PathBuf,
    /// Accounts the credits go to.
    #[arg(long, default_value_t = 8)]
    accounts: u64,
    /// Relay lease length, in milliseconds.
    #[arg(long, default_value_t = 200)]
    lease_ms: u64,
    /// Events relay A stalls on after sending them, until relay B re-offered them.
    #[arg(long, default_value_t = 100)]
    stalls: u64,
    /// Seed for the credit amounts.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// No progress bars.
    #[arg(long)]
    quiet: bool,
}

const CONSUMER: &str = "ledger";

/// A broker whose publish, for the first `remaining` events, returns only after another relay
/// has published the same event again: relay A "pauses after sending" (GC, network, a slow disk)
/// past its lease, relay B re-claims the rows with a newer token and re-offers them, and A's late
/// completion is fenced. A decorator of the `Broker` trait; relay and store are untouched.
struct StallAfterSend {
    inner: MemoryBroker,
    remaining: AtomicU64,
    stalled: AtomicU64,
    limit: Duration,
}

#[async_trait]
impl Broker for StallAfterSend {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        self.inner.declare(destination, groups).await
    }

    async fn publish(&self, event: &Event) -> Result<()> {
        self.inner.publish(event).await?;
        if self.remaining.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            self.stalled.fetch_add(1, Ordering::Relaxed);
            let deadline = Instant::now() + self.limit;
            while self.inner.log(&event.destination).iter().filter(|e| e.id == event.id).count() < 2
                && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        Ok(())
    }

    async fn subscribe(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        self.inner.subscribe(destination, group).await
    }
}

/// Credits an account: additive and not idempotent, so it names `EffectKind::Additive` and the
/// runtime guards it with an inbox marker in the same SQLite transaction.
struct Credit;

fn parse_credit(event: &Event) -> Result<(String, i64)> {
    let bad =
        || Error::permanent(ErrorKind::Handler, "demo", format!("event {}: payload is not account:amount", event.id));
    let text = std::str::from_utf8(&event.payload).map_err(|_| bad())?;
    let (account, amount) = text.split_once(':').ok_or_else(bad)?;
    Ok((account.to_string(), amount.parse().map_err(|_| bad())?))
}

#[async_trait]
impl Handler<SqliteStore> for Credit {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }

    async fn apply(&self, tx: &mut SqliteTx, event: &Event) -> Result<()> {
        let (account, amount) = parse_credit(event)?;
        let id = event.id.to_string();
        tx.run(move |c| {
            c.execute(
                "INSERT INTO credits (event_id, account, amount) VALUES (?1, ?2, ?3)",
                params![id, account, amount],
            )?;
            c.execute(
                "INSERT INTO balances (account, balance) VALUES (?1, ?2)
                 ON CONFLICT (account) DO UPDATE SET balance = balance + excluded.balance",
                params![account, amount],
            )
        })
        .await?;
        Ok(())
    }
}

fn bar(quiet: bool, len: u64, what: &str) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} {per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b.set_message(what.to_string());
    b
}

fn remove_db(path: &std::path::Path) -> Result<()> {
    for p in [path.to_path_buf(), crate::sibling_ext(path, "-wal"), crate::sibling_ext(path, "-shm")] {
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::permanent(
                    ErrorKind::Rejected,
                    "demo",
                    format!("cannot remove {}: {e}", p.display()),
                ));
            }
        }
    }
    Ok(())
}

/// Run the demo; `Ok(false)` when a contract property failed.
pub(crate) async fn run(args: DemoArgs) -> Result<bool> {
    if args.events == 0 || args.accounts == 0 {
        return Err(Error::invalid_input("demo", "--events and --accounts must be at least 1"));
    }
    let started = Instant::now();
    let consumer_path = crate::sibling(&args.db, "consumer");
    remove_db(&args.db)?;
    remove_db(&consumer_path)?;
    let producer = SqliteStore::open(SqliteConfig::new(&args.db)).await?;
    let consumer_db = SqliteStore::open(SqliteConfig::new(&consumer_path)).await?;
    producer
        .with_connection(|c| {
            c.execute_batch(
                "CREATE TABLE orders (id INTEGER PRIMARY KEY, event_id TEXT NOT NULL UNIQUE,
                                      account TEXT NOT NULL, amount INTEGER NOT NULL)",
            )
        })
        .await?;
    // No uniqueness on credits.event_id on purpose: the inbox alone must keep effects single.
    consumer_db
        .with_connection(|c| {
            c.execute_batch(
                "CREATE TABLE credits (seq INTEGER PRIMARY KEY, event_id TEXT NOT NULL,
                                       account TEXT NOT NULL, amount INTEGER NOT NULL);
                 CREATE TABLE balances (account TEXT PRIMARY KEY, balance INTEGER NOT NULL);",
            )
        })
        .await?;

    let broker = MemoryBroker::new();
    let credits = Destination::new("credits")?;
    let ledger = ConsumerGroup::new(CONSUMER)?;
    broker.declare(&credits, std::slice::from_ref(&ledger)).await?;

    // 1. The producer: each order and its event commit in one transaction, 100 per batch.
    produce(&producer, &credits, &args).await?;

    // 2. Two relays and a consumer, concurrently.
    let lease = Duration::from_millis(args.lease_ms.max(10));
    let stalling = Arc::new(StallAfterSend {
        inner: broker.clone(),
        remaining: AtomicU64::new(args.stalls),
        stalled: AtomicU64::new(0),
        limit: lease * 50,
    });
    let relay_config = |owner: &str| RelayConfig {
        owner: owner.into(),
        batch_size: 100,
        lease,
        idle_poll: Duration::from_millis(10),
        ..RelayConfig::default()
    };
    let relay_a = Arc::new(Relay::new(Arc::new(producer.clone()), stalling.clone(), relay_config("relay-A")));
    let relay_b = Arc::new(Relay::new(Arc::new(producer.clone()), Arc::new(broker.clone()), relay_config("relay-B")));
    let consumer = Consumer::new(consumer_db.clone(), Credit, ConsumerConfig::new(CONSUMER));
    let mut subscription = broker.subscribe(&credits, &ledger).await?;

    let relays_done = outbox_core::Shutdown::default();
    let (a, b) = (relay_a.clone(), relay_b.clone());
    let (sa, sb) = (a.shutdown_handle(), b.shutdown_handle());
    let task_a = tokio::spawn(async move { a.run().await });
    let task_b = tokio::spawn(async move { b.run().await });
    let watcher = {
        let producer = producer.clone();
        let done = relays_done.clone();
        tokio::spawn(async move {
            loop {
                let s = producer.stats().await?;
                if s.pending == 0 && s.leased == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            sa.trigger();
            sb.trigger();
            done.trigger();
            Ok::<_, Error>(())
        })
    };

    let applying = bar(args.quiet, args.events, "applied");
    let mut handled: BTreeMap<&'static str, u64> = BTreeMap::new();
    loop {
        match subscription.next(Duration::from_millis(100)).await? {
            Some(d) => {
                let h = consumer.process(d).await?;
                let label = match h {
                    Handled::Applied => {
                        applying.inc(1);
                        "applied"
                    }
                    Handled::Duplicate => "duplicate",
                    Handled::Conflict => "conflict",
                    Handled::Retry { .. } => "retried",
                    Handled::DeadLettered { .. } => "dead-lettered",
                    Handled::Stale { .. } | Handled::Uncertain => "other",
                };
                *handled.entry(label).or_default() += 1;
            }
            None if relays_done.is_triggered() => break,
            None => {}
        }
    }
    applying.finish_and_clear();
    watcher.await.map_err(join_error)??;
    let totals_a = task_a.await.map_err(join_error)??;
    let totals_b = task_b.await.map_err(join_error)??;
    drop(subscription);

    // 3. Judge from durable state only.
    let report = Report::read(&producer, &consumer_db, &broker, &credits).await?;
    let elapsed = started.elapsed();
    Ok(report.print(
        &args,
        &consumer_path,
        &handled,
        totals_a.fenced + totals_b.fenced,
        stalling.stalled.load(Ordering::Relaxed),
        elapsed,
    ))
}

fn join_error(e: tokio::task::JoinError) -> Error {
    Error::permanent(ErrorKind::Rejected, "demo", format!("a task failed: {e}"))
}

async fn produce(producer: &SqliteStore, credits: &Destination, args: &DemoArgs) -> Result<()> {
    let committing = bar(args.quiet, args.events, "committed");
    let mut rng = SplitMix64::new(args.seed);
    let mut next = 0u64;
    while next < args.events {
        let n = (args.events - next).min(100);
        let batch: Vec<(String, String, i64)> = (next..next + n)
            .map(|i| (format!("credit-{i:07}"), format!("acct-{}", i % args.accounts), 1 + rng.below(100) as i64))
            .collect();
        let store = producer.clone();
        let destination = credits.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            let mut conn = store.connect_raw()?;
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(sqlite_error)?;
            let mut events = Vec::with_capacity(batch.len());
            for (id, account, amount) in &batch {
                tx.execute(
                    "INSERT INTO orders (event_id, account, amount) VALUES (?1, ?2, ?3)",
                    params![id, account, amount],
                )
                .map_err(sqlite_error)?;
                events.push(
                    Event::new(EventId::new(id.clone())?, destination.clone(), format!("{account}:{amount}"))
                        .with_key(account.clone()),
                );
            }
            store.enqueue_in(&tx, &events)?;
            tx.commit().map_err(sqlite_error)
        })
        .await
        .map_err(join_error)??;
        next += n;
        committing.inc(n);
    }
    committing.finish_and_clear();
    Ok(())
}

struct Report {
    orders: BTreeMap<String, (String, i64)>,
    rows: Vec<RowSnapshot>,
    offers: BTreeMap<EventId, u64>,
    credits: Vec<(String, String, i64)>,
    balances: BTreeMap<String, i64>,
    markers: usize,
}

impl Report {
    async fn read(
        producer: &SqliteStore,
        consumer: &SqliteStore,
        broker: &MemoryBroker,
        dest: &Destination,
    ) -> Result<Self> {
        let orders = producer
            .with_connection(|c| {
                let mut s = c.prepare("SELECT event_id, account, amount FROM orders")?;
                let rows = s.query_map([], |r| Ok((r.get::<_, String>(0)?, (r.get(1)?, r.get(2)?))))?;
                rows.collect::<std::result::Result<BTreeMap<_, _>, _>>()
            })
            .await?;
        let rows = all_rows(producer).await?;
        let mut offers = BTreeMap::new();
        for e in broker.log(dest) {
            *offers.entry(e.id).or_default() += 1;
        }
        let credits = consumer
            .with_connection(|c| {
                let mut s = c.prepare("SELECT event_id, account, amount FROM credits ORDER BY seq")?;
                let rows = s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
                rows.collect::<std::result::Result<Vec<_>, _>>()
            })
            .await?;
        let balances = consumer
            .with_connection(|c| {
                let mut s = c.prepare("SELECT account, balance FROM balances")?;
                let rows = s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
                rows.collect::<std::result::Result<BTreeMap<_, _>, _>>()
            })
            .await?;
        let markers = consumer.markers(CONSUMER).await?.len();
        Ok(Self { orders, rows, offers, credits, balances, markers })
    }

    fn print(
        &self,
        args: &DemoArgs,
        consumer_path: &std::path::Path,
        handled: &BTreeMap<&'static str, u64>,
        fenced: u64,
        stalled: u64,
        elapsed: Duration,
    ) -> bool {
        let committed = self.orders.len();
        let published = self.rows.iter().filter(|r| r.status == RowStatus::Published).count();
        let parked = self.rows.iter().filter(|r| r.status == RowStatus::Parked).count();
        let stale_rows = self.rows.iter().filter(|r| r.published_token.is_some_and(|t| t != r.token)).count();
        let reclaimed = self.rows.iter().filter(|r| r.token > 1).count();
        let offers: u64 = self.offers.values().sum();
        let duplicates = offers - self.offers.len() as u64;
        let missing: Vec<&String> =
            self.orders.keys().filter(|id| !self.offers.keys().any(|o| o.as_str() == id.as_str())).collect();
        let mut per_event: BTreeMap<&str, u64> = BTreeMap::new();
        for (id, _, _) in &self.credits {
            *per_event.entry(id.as_str()).or_default() += 1;
        }
        let doubled = per_event.values().filter(|n| **n > 1).count();
        let distinct: BTreeSet<&str> = per_event.keys().copied().collect();
        let mut expected: BTreeMap<&str, i64> = BTreeMap::new();
        for (account, amount) in self.orders.values() {
            *expected.entry(account.as_str()).or_default() += amount;
        }
        let mismatched: Vec<String> = expected
            .iter()
            .filter(|(a, v)| self.balances.get(**a) != Some(*v))
            .map(|(a, v)| format!("{a}: expected {v}, found {:?}", self.balances.get(*a)))
            .collect();
        let total: i64 = expected.values().sum();

        let at_least_once = missing.is_empty() && published + parked == committed && stale_rows == 0;
        let at_most_once =
            doubled == 0 && self.credits.len() == committed && self.markers == committed && mismatched.is_empty();
        let yes = |b: bool| if b { "PASS" } else { "FAIL" };
        println!("outbox demo — embedded default: SQLite + in-process broker");
        println!("  databases            {} (producer), {} (consumer)", args.db.display(), consumer_path.display());
        println!("  events committed     {committed} orders, each with its outbox row in the same transaction");
        println!("  outbox rows          {} published, {parked} parked, {reclaimed} claimed more than once", published);
        println!("  offers on broker     {offers} ({} distinct events, {duplicates} duplicates)", self.offers.len());
        println!(
            "  stale completions    {fenced} rejected by fencing token (relay A stalled after sending {stalled} events until its lease expired; relay B re-offered them); {stale_rows} rows published by a stale token"
        );
        println!("  deliveries handled   {handled:?}");
        println!(
            "  effects applied      {} credit rows for {} distinct events ({doubled} applied twice)",
            self.credits.len(),
            distinct.len()
        );
        println!("  inbox markers        {}", self.markers);
        println!("  account balances     {} accounts, total {total}", expected.len());
        for (account, balance) in &self.balances {
            let want = expected.get(account.as_str()).copied().unwrap_or(0);
            println!(
                "    {account:<12} {balance:>10}   expected {want:>10}  {}",
                if *balance == want { "ok" } else { "MISMATCH" }
            );
        }
        println!(
            "  at-least-once offer  {}: every committed event was offered ({} missing) and every row is published or parked",
            yes(at_least_once),
            missing.len()
        );
        println!(
            "  at-most-once effect  {}: one effect and one marker per event despite {duplicates} duplicate offers; balances {}",
            yes(at_most_once),
            if mismatched.is_empty() { "match".to_string() } else { format!("differ: {mismatched:?}") }
        );
        println!("  wall time            {elapsed:.2?} for {} events", args.events);
        at_least_once && at_most_once
    }
}
