//! When a drain does not finish, say where the missing effects are, from the broker's side.
//!
//! "Published but never applied" has two causes that look the same from the store: the group
//! stopped fetching (a stuck coordinator or client, which is the broker's or the driver's
//! problem) or it committed its position past deliveries it never applied (a loss, which would
//! be ours). Only the broker knows which, so after an incomplete drain the runner asks it, while
//! the run's servers are still up, and prints the answer with the verdict.

use std::collections::{BTreeMap, BTreeSet};

use outbox::kafka::{GroupPosition, KafkaBroker};
use outbox::{ConsumerGroup, Destination, Result};

/// How many unapplied event ids are printed at most.
const SHOWN: usize = 10;

/// Print what the broker says about the events in `unapplied` (published, not parked, not
/// dead-lettered, without their effect). Returns how many of them lie below the group's
/// committed position: deliveries the group will never be offered again.
pub(crate) async fn explain(
    combo: &str,
    kafka: Option<&KafkaBroker>,
    destination: &Destination,
    group: &ConsumerGroup,
    unapplied: &BTreeSet<String>,
) -> Result<u64> {
    let shown: Vec<&str> = unapplied.iter().take(SHOWN).map(String::as_str).collect();
    println!("{combo}: {} published events without their effect, first: {}", unapplied.len(), shown.join(", "));
    match kafka {
        Some(broker) => on_kafka(combo, broker, destination, group, unapplied).await,
        // Redis and RabbitMQ redeliver what was not acknowledged by themselves (pending entries
        // claimed, unacked messages requeued); there is no committed position to pass.
        None => Ok(0),
    }
}

async fn on_kafka(
    combo: &str,
    broker: &KafkaBroker,
    destination: &Destination,
    group: &ConsumerGroup,
    unapplied: &BTreeSet<String>,
) -> Result<u64> {
    let positions = broker.group_positions(destination, group).await?;
    // Each unapplied event's last copy per partition: a copy the group passed is lost only if
    // no later copy (a relay's re-publish) is still ahead of it.
    let mut last: BTreeMap<i32, BTreeMap<String, i64>> = BTreeMap::new();
    let (records, _foreign) = broker.read_events(destination).await?;
    for m in records {
        if unapplied.contains(m.event.id.as_str()) {
            let offset = last.entry(m.partition).or_default().entry(m.event.id.to_string()).or_insert(m.offset);
            *offset = (*offset).max(m.offset);
        }
    }
    let mut passed = 0u64;
    for p in &positions {
        let mut offsets: Vec<i64> =
            last.get(&p.partition).map(|events| events.values().copied().collect()).unwrap_or_default();
        offsets.sort_unstable();
        let offsets = offsets.as_slice();
        let Some((below, line)) = partition_line(p, offsets) else { continue };
        passed += below;
        println!("{combo}: {destination}[{}]: {line}", p.partition);
    }
    Ok(passed)
}

/// One partition's line, and how many of its unapplied `offsets` (each event's last copy,
/// ascending) lie below the group's committed offset; `None` for a partition fully committed with nothing unapplied.
fn partition_line(p: &GroupPosition, offsets: &[i64]) -> Option<(u64, String)> {
    if offsets.is_empty() && p.committed == Some(p.high) {
        return None;
    }
    let below = offsets.iter().filter(|o| p.committed.is_some_and(|c| **o < c)).count() as u64;
    let committed = p.committed.map_or_else(|| "nothing".to_string(), |c| c.to_string());
    let span = match (offsets.first(), offsets.last()) {
        (Some(a), Some(b)) => format!("{} unapplied at offsets {a}..={b}", offsets.len()),
        _ => "none unapplied".to_string(),
    };
    let verdict = if below > 0 {
        format!("{below} BELOW the committed offset: committed past deliveries never applied")
    } else if offsets.is_empty() {
        "the group has not committed to the end".to_string()
    } else {
        "all at or above the committed offset: the group has not applied them yet".to_string()
    };
    Some((below, format!("records {}..{}, committed {committed}; {span}; {verdict}", p.low, p.high)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(committed: Option<i64>) -> GroupPosition {
        GroupPosition { partition: 2, low: 0, high: 1250, committed }
    }

    #[test]
    fn unapplied_records_below_the_committed_offset_are_counted_as_passed() {
        let (below, line) = partition_line(&at(Some(1000)), &[990, 999, 1000, 1200]).expect("a line");
        assert_eq!(below, 2, "{line}");
        assert!(line.contains("4 unapplied at offsets 990..=1200") && line.contains("2 BELOW"), "{line}");
    }

    #[test]
    fn a_group_that_stopped_short_passed_nothing() {
        let (below, line) = partition_line(&at(Some(954)), &[954, 1249]).expect("a line");
        assert_eq!(below, 0);
        assert!(line.contains("committed 954") && line.contains("not applied them yet"), "{line}");
        let (below, line) = partition_line(&at(None), &[0, 7]).expect("a line");
        assert_eq!(below, 0, "nothing committed passes nothing");
        assert!(line.contains("committed nothing"), "{line}");
    }

    #[test]
    fn a_partition_committed_to_its_end_with_nothing_unapplied_is_not_printed() {
        assert!(partition_line(&at(Some(1250)), &[]).is_none());
        let (below, _) = partition_line(&at(Some(1100)), &[]).expect("lagging without unapplied");
        assert_eq!(below, 0);
    }
}
