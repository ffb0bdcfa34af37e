//! Operator commands: migrations, counts, row inspection, parked rows and consumer dead letters.
//!
//! Each command is one short-lived connection through the same facade functions a service
//! uses (`outbox::AnyStore`, `outbox::broker_from_url`), so what an operator sees is what the
//! relay and the consumer see. Commands that change rows say what they changed, by id.

use std::collections::BTreeSet;
use std::time::Duration;

use outbox::core::Timestamp;
use outbox::core::store::ParkedRow;
use outbox::{AnyStore, DeadLetter, Error, OutboxAdmin, Result, RowId, RowSnapshot, RowStatus};

/// Page size when walking rows.
const PAGE: usize = 1000;

/// `--store URL`.
#[derive(clap::Args)]
pub(crate) struct StoreArgs {
    /// The outbox store: `postgres://…` or `sqlite:///path.db`.
    #[arg(long, env = "OUTBOX_STORE_URL", hide_env_values = true)]
    store: String,
}

/// Flags of `outbox stats`.
#[derive(clap::Args)]
pub(crate) struct StatsArgs {
    #[command(flatten)]
    store: StoreArgs,
}

/// Flags of `outbox inspect`.
#[derive(clap::Args)]
pub(crate) struct InspectArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Only rows of this status.
    #[arg(long, value_enum)]
    status: Option<Status>,
    /// At most this many rows.
    #[arg(long, allow_negative_numbers = true, default_value_t = 50)]
    limit: usize,
    /// Start after this row id.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    after: RowId,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Status {
    Pending,
    Leased,
    Published,
    Parked,
}

impl Status {
    fn matches(self, s: RowStatus) -> bool {
        matches!(
            (self, s),
            (Self::Pending, RowStatus::Pending)
                | (Self::Leased, RowStatus::Leased)
                | (Self::Published, RowStatus::Published)
                | (Self::Parked, RowStatus::Parked)
        )
    }
}

/// Which rows or letters a command changes: explicit ids, or `--all`.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
pub(crate) struct Selection {
    /// Ids to act on.
    ids: Vec<i64>,
    /// Act on every one.
    #[arg(long)]
    all: bool,
}

/// `outbox parked …`.
#[derive(clap::Subcommand)]
pub(crate) enum ParkedCommand {
    /// List parked rows with their reason, oldest first.
    List {
        #[command(flatten)]
        store: StoreArgs,
        /// At most this many rows.
        #[arg(long, allow_negative_numbers = true, default_value_t = 100)]
        limit: usize,
    },
    /// Make parked rows pending again (attempts reset); the relay publishes them.
    Requeue {
        #[command(flatten)]
        store: StoreArgs,
        #[command(flatten)]
        select: Selection,
    },
    /// Delete parked rows for good.
    Purge {
        #[command(flatten)]
        store: StoreArgs,
        #[command(flatten)]
        select: Selection,
    },
}

/// `--inbox URL --consumer NAME`.
#[derive(clap::Args)]
pub(crate) struct InboxArgs {
    /// The store holding the consumer's inbox: `postgres://…` or `sqlite:///path.db`.
    #[arg(long, env = "OUTBOX_INBOX_URL", hide_env_values = true)]
    inbox: String,
    /// The consumer's name (as in its `ConsumerConfig`).
    #[arg(long)]
    consumer: String,
}

/// `outbox dead-letters …`.
#[derive(clap::Subcommand)]
pub(crate) enum DeadLetterCommand {
    /// List the consumer's dead letters, oldest first.
    List {
        #[command(flatten)]
        inbox: InboxArgs,
    },
    /// Publish dead letters again, exactly as they were delivered (destination, key, headers,
    /// payload), then remove them and their failure counts. Every group of the destination
    /// receives them again; consumers that applied them already see a duplicate and apply
    /// nothing. A conflict (same id, different payload) comes back as a conflict.
    Replay {
        #[command(flatten)]
        inbox: InboxArgs,
        /// The broker to publish to: `kafka://…`, `amqp://…`, `redis://…`.
        #[arg(long, env = "OUTBOX_BROKER_URL", hide_env_values = true)]
        broker: String,
        #[command(flatten)]
        select: Selection,
    },
    /// Delete dead letters for good.
    Purge {
        #[command(flatten)]
        inbox: InboxArgs,
        #[command(flatten)]
        select: Selection,
    },
}

/// `outbox migrate`.
pub(crate) async fn migrate(args: StoreArgs) -> Result<()> {
    let store = AnyStore::connect(&args.store).await?;
    let version = store.migrate().await?;
    println!("{}: schema at version {version}", store.backend());
    Ok(())
}

/// Connect to the store at `url` and check that its schema is current.
pub(crate) async fn open(url: &str) -> Result<AnyStore> {
    let store = AnyStore::connect(url).await?;
    store.check_schema().await?;
    Ok(store)
}

/// `outbox stats`.
pub(crate) async fn stats(args: StatsArgs) -> Result<()> {
    let store = open(&args.store.store).await?;
    let s = store.outbox().stats().await?;
    println!("pending    {}", s.pending);
    println!("leased     {}", s.leased);
    println!("parked     {}", s.parked);
    println!("published  {}", s.published);
    match s.oldest_pending_age {
        Some(age) => println!("oldest pending age  {}", human(age)),
        None => println!("oldest pending age  - (nothing pending)"),
    }
    Ok(())
}

/// `outbox inspect`.
pub(crate) async fn inspect(args: InspectArgs) -> Result<()> {
    let store = open(&args.store.store).await?;
    let outbox = store.outbox();
    let mut shown = Vec::new();
    let mut after = args.after;
    while shown.len() < args.limit {
        let page = outbox.inspect(after, PAGE).await?;
        let Some(last) = page.last() else { break };
        after = last.row_id;
        shown.extend(page.into_iter().filter(|r| args.status.is_none_or(|s| s.matches(r.status))));
    }
    shown.truncate(args.limit);
    println!(
        "{:>10}  {:<9}  {:>8}  {:>5}  {:<24}  {:<16}  {:<12}  {:>9}  owner / last error",
        "row", "status", "attempts", "token", "event id", "destination", "key", "payload"
    );
    for r in &shown {
        print_row(r);
    }
    if shown.is_empty() {
        println!("(no rows)");
    }
    Ok(())
}

fn print_row(r: &RowSnapshot) {
    let status = match r.status {
        RowStatus::Pending => "pending",
        RowStatus::Leased => "leased",
        RowStatus::Published => "published",
        RowStatus::Parked => "parked",
    };
    let mut tail = r.owner.clone().unwrap_or_default();
    if let Some(e) = &r.last_error {
        tail = format!("{tail} / {}", one_line(e));
    }
    println!(
        "{:>10}  {:<9}  {:>8}  {:>5}  {:<24}  {:<16}  {:<12}  {:>7} B  {tail}",
        r.row_id,
        status,
        r.attempts,
        r.token,
        r.event.id.as_str(),
        r.event.destination.as_str(),
        r.event.key.as_deref().unwrap_or("-"),
        r.event.payload.len(),
    );
}

/// `outbox parked …`.
pub(crate) async fn parked(cmd: ParkedCommand) -> Result<()> {
    match cmd {
        ParkedCommand::List { store, limit } => {
            let store = open(&store.store).await?;
            let rows = store.outbox().list_parked(limit).await?;
            println!(
                "{:>10}  {:<24}  {:<16}  {:>8}  {:<20}  reason",
                "row", "event id", "destination", "attempts", "parked at"
            );
            for p in &rows {
                println!(
                    "{:>10}  {:<24}  {:<16}  {:>8}  {:<20}  {}",
                    p.record.row_id,
                    p.record.event.id.as_str(),
                    p.record.event.destination.as_str(),
                    p.record.attempts,
                    utc(p.parked_at),
                    one_line(&p.reason)
                );
            }
            println!("{} parked row(s) shown", rows.len());
            Ok(())
        }
        ParkedCommand::Requeue { store, select } => {
            let store = open(&store.store).await?;
            let n = for_parked(&*store.outbox(), &select, ParkedOp::Requeue).await?;
            println!("requeued {n} row(s)");
            Ok(())
        }
        ParkedCommand::Purge { store, select } => {
            let store = open(&store.store).await?;
            let n = for_parked(&*store.outbox(), &select, ParkedOp::Purge).await?;
            println!("purged {n} row(s)");
            Ok(())
        }
    }
}

/// What `outbox parked` does to the selected rows.
#[derive(Clone, Copy)]
enum ParkedOp {
    Requeue,
    Purge,
}

impl ParkedOp {
    async fn apply(self, outbox: &dyn OutboxAdmin, ids: &[RowId]) -> Result<u64> {
        match self {
            Self::Requeue => outbox.requeue_parked(ids).await,
            Self::Purge => outbox.purge_parked(ids).await,
        }
    }
}

/// Apply `op` to the selected parked rows: the given ids, or every parked row page by page.
async fn for_parked(outbox: &dyn OutboxAdmin, select: &Selection, op: ParkedOp) -> Result<u64> {
    if !select.all {
        let n = op.apply(outbox, &select.ids).await?;
        let missing = select.ids.len() as u64 - n.min(select.ids.len() as u64);
        if missing > 0 {
            eprintln!("note: {missing} of the given id(s) were not parked rows and were left alone");
        }
        return Ok(n);
    }
    let mut total = 0;
    loop {
        let page: Vec<RowId> = outbox.list_parked(PAGE).await?.iter().map(|p: &ParkedRow| p.record.row_id).collect();
        if page.is_empty() {
            return Ok(total);
        }
        let n = op.apply(outbox, &page).await?;
        if n == 0 {
            // Rows listed as parked but not changed: another operator got there first, or the
            // store disagrees with itself. Stop rather than loop.
            return Err(Error::permanent(
                outbox::ErrorKind::Rejected,
                outbox.backend(),
                format!("{} parked row(s) listed but none changed (first id {}); stopping", page.len(), page[0]),
            ));
        }
        total += n;
    }
}

/// `outbox dead-letters …`.
pub(crate) async fn dead_letters(cmd: DeadLetterCommand) -> Result<()> {
    match cmd {
        DeadLetterCommand::List { inbox } => {
            let (store, letters) = letters(&inbox).await?;
            println!(
                "{:>8}  {:<24}  {:<16}  {:<12}  {:<14}  {:>9}  {:<20}  error",
                "id", "event id", "destination", "key", "reason", "payload", "at"
            );
            for d in &letters {
                println!(
                    "{:>8}  {:<24}  {:<16}  {:<12}  {:<14}  {:>7} B  {:<20}  {}",
                    d.id,
                    d.event.id.as_str(),
                    d.event.destination.as_str(),
                    d.event.key.as_deref().unwrap_or("-"),
                    d.reason.as_str(),
                    d.event.payload.len(),
                    utc(d.at),
                    one_line(&d.error)
                );
            }
            println!("{} dead letter(s) of consumer {:?} in {}", letters.len(), inbox.consumer, store.backend());
            Ok(())
        }
        DeadLetterCommand::Replay { inbox, broker, select } => {
            let (store, letters) = letters(&inbox).await?;
            let chosen = choose(&letters, &select)?;
            // A malformed letter is a message that was never an outbox event: publishing the
            // event it is filed as would not reproduce the raw message (its id, headers and format
            // were the problem). Refuse by name.
            let malformed: Vec<String> = chosen
                .iter()
                .filter(|d| d.reason == outbox::core::DeadLetterReason::Malformed)
                .map(|d| d.id.to_string())
                .collect();
            if !malformed.is_empty() {
                return Err(Error::invalid_input(
                    "dead-letters",
                    format!(
                        "dead letter(s) {} are malformed: messages that were not outbox events (see their error \
                         text), kept byte-for-byte for inspection; replay cannot republish the raw message \
                         faithfully, so fix and publish it from its source, then purge the letter; nothing changed",
                        malformed.join(", ")
                    ),
                ));
            }
            // Letters written before schema 2 did not keep their destination: nowhere to send them.
            let unknown: Vec<String> =
                chosen.iter().filter(|d| !d.destination_known()).map(|d| d.id.to_string()).collect();
            if !unknown.is_empty() {
                return Err(Error::invalid_input(
                    "dead-letters",
                    format!(
                        "dead letter(s) {} were recorded before destinations were kept and cannot be replayed \
                         faithfully; purge them or publish their payload by hand; nothing changed",
                        unknown.join(", ")
                    ),
                ));
            }
            let broker = outbox::broker_from_url(&broker).await?;
            let admin = store.inbox_admin();
            let mut replayed = 0u64;
            for d in chosen {
                // Publish first, then remove: a failure in between leaves the letter, and a second
                // replay publishes a duplicate the inbox absorbs. Nothing is lost either way.
                broker.publish(&d.event).await.inspect_err(|_| {
                    eprintln!("replayed {replayed} letter(s) before the failure");
                })?;
                admin.remove_dead_letters(&inbox.consumer, &[d.id]).await?;
                println!("replayed {} (event {} to {})", d.id, d.event.id.as_str(), d.event.destination.as_str());
                replayed += 1;
            }
            println!("replayed {replayed} dead letter(s)");
            Ok(())
        }
        DeadLetterCommand::Purge { inbox, select } => {
            let (store, letters) = letters(&inbox).await?;
            let ids: Vec<i64> = choose(&letters, &select)?.iter().map(|d| d.id).collect();
            let n =
                if ids.is_empty() { 0 } else { store.inbox_admin().remove_dead_letters(&inbox.consumer, &ids).await? };
            println!("purged {n} dead letter(s)");
            Ok(())
        }
    }
}

async fn letters(args: &InboxArgs) -> Result<(AnyStore, Vec<DeadLetter>)> {
    outbox::ConsumerGroup::new(args.consumer.clone())
        .map_err(|e| Error::invalid_input("dead-letters", format!("--consumer: {}", e.message())))?;
    let store = open(&args.inbox).await?;
    let letters = store.inbox_admin().dead_letters(&args.consumer).await?;
    Ok((store, letters))
}

/// The letters `select` names; an id that is not one of the consumer's letters is an error
/// (before anything is changed).
fn choose<'a>(letters: &'a [DeadLetter], select: &Selection) -> Result<Vec<&'a DeadLetter>> {
    if select.all {
        return Ok(letters.iter().collect());
    }
    let wanted: BTreeSet<i64> = select.ids.iter().copied().collect();
    let known: BTreeSet<i64> = letters.iter().map(|d| d.id).collect();
    let unknown: Vec<String> = wanted.difference(&known).map(ToString::to_string).collect();
    if !unknown.is_empty() {
        return Err(Error::invalid_input(
            "dead-letters",
            format!("no dead letter with id {} for this consumer; nothing changed", unknown.join(", ")),
        ));
    }
    Ok(letters.iter().filter(|d| wanted.contains(&d.id)).collect())
}

fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => format!("{}ms", d.as_millis()),
        1..60 => format!("{:.1}s", d.as_secs_f64()),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// A store timestamp (Unix milliseconds) as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc(t: Timestamp) -> String {
    let secs = t.as_millis().div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, (rem % 3600) / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_and_human() {
        assert_eq!(utc(Timestamp::from_millis(0)), "1970-01-01T00:00:00Z");
        assert_eq!(utc(Timestamp::from_millis(1_796_083_200_000)), "2026-12-01T00:00:00Z");
        assert_eq!(utc(Timestamp::from_millis(951_782_400_000 + 3_723_000)), "2000-02-29T01:02:03Z");
        assert_eq!(human(Duration::from_millis(250)), "250ms");
        assert_eq!(human(Duration::from_secs(125)), "2m05s");
    }
}
