//! `outbox cleanup`: retention run once, from cron or by hand, for stores whose relays do not
//! run it themselves (`outbox relay --retain-published`).
//!
//! It deletes published outbox rows older than the given age in bounded batches (never a
//! pending, leased or parked row) and, when asked, a consumer's inbox markers — but only with the
//! consumer's redelivery horizon stated, because a marker deleted before the last possible
//! redelivery lets that redelivery apply its effect again. An unsafe setting is refused before
//! anything is deleted.

use std::time::Duration;

use outbox::Result;
use outbox::consumer::Retention;
use outbox::core::retention::{Cleanup, CleanupConfig, MarkerPruning};

use crate::duration;

/// Flags of `outbox cleanup`.
#[derive(clap::Args)]
pub(crate) struct CleanupArgs {
    /// The outbox store: `postgres://…` or `sqlite:///path.db`.
    #[arg(long, env = "OUTBOX_STORE_URL", hide_env_values = true)]
    store: String,
    /// Delete published rows published longer ago than this (`7d`, `12h`, `30m`); must be longer
    /// than zero.
    #[arg(long, value_parser = duration::parse)]
    published_older_than: Duration,
    /// Rows deleted per transaction.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    batch: u32,
    /// Pause between two batches, so the cleanup never holds the database for long.
    #[arg(long, default_value = "50ms", value_parser = duration::parse)]
    pause: Duration,
    /// Stop after this many batches (run again for the rest).
    #[arg(long, allow_negative_numbers = true, default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(1..))]
    max_batches: u32,
    /// Also prune the inbox markers of this consumer (as named in its `ConsumerConfig`).
    #[arg(long, value_name = "CONSUMER", requires_all = ["markers_older_than", "max_redelivery", "dead_letter_retention"])]
    markers: Option<String>,
    /// Delete the consumer's markers committed longer ago than this. Refused unless it is at least
    /// `--max-redelivery` + `--dead-letter-retention`.
    #[arg(long, value_parser = duration::parse, requires = "markers")]
    markers_older_than: Option<Duration>,
    /// The longest time after a first delivery that the broker may deliver a message again
    /// (visibility / idle / session timeouts, retries).
    #[arg(long, value_parser = duration::parse, requires = "markers")]
    max_redelivery: Option<Duration>,
    /// How long the consumer's dead-letter queue keeps messages that may be replayed (`0s` if
    /// there is none).
    #[arg(long, value_parser = duration::parse, requires = "markers")]
    dead_letter_retention: Option<Duration>,
    /// The store holding the consumer's inbox, if it is not `--store`.
    #[arg(long, env = "OUTBOX_INBOX_URL", hide_env_values = true, requires = "markers")]
    inbox: Option<String>,
}

/// `outbox cleanup`.
pub(crate) async fn run(args: CleanupArgs) -> Result<()> {
    let config = CleanupConfig::new(args.published_older_than)
        .with_batch(args.batch as usize)
        .with_pause(args.pause)
        .with_max_batches(args.max_batches as usize);
    config.validate()?;
    // Check the marker retention before connecting anywhere: an unsafe one deletes nothing.
    let retention = match (&args.markers, args.markers_older_than, args.max_redelivery, args.dead_letter_retention) {
        (Some(_), Some(keep), Some(redelivery), Some(dead)) => Some(Retention::new(keep, redelivery, dead)?),
        _ => None,
    };
    let store = crate::ops::open(&args.store).await?;
    let mut cleanup = Cleanup::new(store.outbox(), config)?;
    if let (Some(consumer), Some(r)) = (&args.markers, retention) {
        let inbox = match &args.inbox {
            Some(url) => crate::ops::open(url).await?.inbox_admin(),
            None => store.inbox_admin(),
        };
        cleanup = cleanup.with_markers(MarkerPruning::new(inbox, consumer.clone(), r.markers(), r.horizon())?);
    }
    let report = cleanup.run_once().await?;
    println!(
        "{}: deleted {} published row(s) older than {} in {} batch(es)",
        store.backend(),
        report.published_deleted,
        human(args.published_older_than),
        report.batches
    );
    if report.capped > 0 {
        println!("stopped after --max-batches {}: older published rows remain; run again", args.max_batches);
    }
    if let (Some(consumer), Some(keep)) = (&args.markers, args.markers_older_than) {
        println!("deleted {} marker(s) of consumer {consumer} older than {}", report.markers_deleted, human(keep));
    }
    Ok(())
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    if d.subsec_millis() != 0 || s == 0 {
        format!("{}ms", d.as_millis())
    } else if s.is_multiple_of(86_400) {
        format!("{}d", s / 86_400)
    } else if s.is_multiple_of(3600) {
        format!("{}h", s / 3600)
    } else if s.is_multiple_of(60) {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_are_printed_in_their_largest_whole_unit() {
        assert_eq!(human(Duration::from_secs(7 * 86_400)), "7d");
        assert_eq!(human(Duration::from_secs(90)), "90s");
        assert_eq!(human(Duration::from_millis(1500)), "1500ms");
    }
}
