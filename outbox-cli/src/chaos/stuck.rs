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

/// Print what the broker says about the events `unapplied` yields (published, not parked, not
/// dead-lettered, without their effect). Returns how many of them lie below the group's
/// committed position: deliveries the group will never be offered again.
///
/// On Kafka the group's positions are read before `unapplied` runs: a member commits only past
/// deliveries it applied, so every record below a position read first has its effect in a
/// read made after it. Read the other way round, consumers still at work (a drain cut short)
/// commit past records that were unapplied a moment earlier, and a slow group looks like a lost
/// one.
pub(crate) async fn explain(
    combo: &str,
    kafka: Option<&KafkaBroker>,
    destination: &Destination,
    group: &ConsumerGroup,
    unapplied: impl std::future::Future<Output = Result<BTreeSet<String>>>,
) -> Result<u64> {
    let positions = match kafka {
        Some(broker) => Some(broker.group_positions(destination, group).await?),
        None => None,
    };
    let unapplied = unapplied.await?;
    let shown: Vec<&str> = unapplied.iter().take(SHOWN).map(String::as_str).collect();
    println!("{combo}: {} published events without their effect, first: {}", unapplied.len(), shown.join(", "));
    match (kafka, positions) {
        (Some(broker), Some(positions)) => on_kafka(combo, broker, destination, &positions, &unapplied).await,
        // Redis and RabbitMQ redeliver what was not acknowledged by themselves (pending entries
        // claimed, unacked messages requeued); there is no committed position to pass.
        _ => Ok(0),
    }
}

async fn on_kafka(
    combo: &str,
    broker: &KafkaBroker,
    destination: &Destination,
    positions: &[GroupPosition],
    unapplied: &BTreeSet<String>,
) -> Result<u64> {
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
    for p in positions {
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

/// Lines of each log printed after an incomplete drain.
const LOG_TAIL: usize = 12;

/// Print, for each consumer log in `logs` (`consumer-<n>.log`, every generation of that worker
/// appended), its last [`LOG_TAIL`] lines that say what the member held or what went wrong:
/// assignment changes (`rebalance`, logged at info by the Kafka adapter) and warnings or
/// errors; then the last lines of the broker's own log, where the runner keeps one (tansu's
/// group coordinator: members evicted, leaders chosen). The directory is kept after a failed
/// run but not on a CI machine; these lines are in the run's output, so a stall can be read
/// from the CI log alone (which member last held which partitions, whether it lost them,
/// whether it said anything since, and what the coordinator did).
pub(crate) fn print_log_tails(combo: &str, logs: &std::path::Path, broker_log: Option<&std::path::Path>) {
    let mut files: Vec<std::path::PathBuf> = match std::fs::read_dir(logs) {
        Ok(dir) => dir
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("consumer-")))
            .collect(),
        Err(e) => {
            println!("{combo}: cannot read the consumers' logs in {}: {e}", logs.display());
            Vec::new()
        }
    };
    files.sort();
    for file in files {
        let name = file.file_stem().and_then(|n| n.to_str()).unwrap_or("consumer").to_string();
        print_tail(combo, &name, &file, "its rebalance, warning and error lines", telling);
    }
    if let Some(file) = broker_log {
        print_tail(combo, "broker", file, "its log lines", |l| !l.trim().is_empty());
    }
}

/// Print the last [`LOG_TAIL`] lines of `file` that `keep` accepts, each prefixed with the
/// combination and `name`; a file that cannot be read is said so, not skipped.
fn print_tail(combo: &str, name: &str, file: &std::path::Path, what: &str, keep: impl Fn(&str) -> bool) {
    match super::servers::log_lines(file, LOG_TAIL, keep) {
        Ok(tail) => {
            println!("{combo}: {name}: last {} of {what}:", tail.len());
            for line in tail {
                println!("{combo}:   {name}: {line}");
            }
        }
        Err(e) => println!("{combo}: {name}: cannot read {}: {e}", file.display()),
    }
}

/// Whether a consumer's log line (colours stripped) is an assignment change, a warning or an
/// error. librdkafka's `CONFWARN` at each start (the consumer's URL sets `max.poll.interval.ms`,
/// which its producer ignores) says nothing about a stall and is left out.
fn telling(line: &str) -> bool {
    (line.contains(" rebalance") || line.contains(" WARN ") || line.contains(" ERROR ")) && !line.contains(" CONFWARN ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group still at work between the two reads (a drain cut short): the unapplied set was
    /// read while e1 and e2 were unapplied, then the member applied and committed them. With the
    /// positions read first, nothing is called passed; read after the set (as before this
    /// order was fixed), both would have been reported lost.
    #[tokio::test]
    async fn positions_read_before_the_unapplied_set_do_not_call_a_working_group_lossy() {
        use outbox::kafka::KafkaConfig;
        use outbox::{Broker as _, Event, EventId};
        use outbox_conformance_tests::service;
        let url = service::kafka_url();
        if !service::require_service("kafka", "kafka", &service::service_addr(&url)) {
            return;
        }
        let broker = KafkaBroker::connect(KafkaConfig::from_url(&url).unwrap()).await.unwrap();
        let dest = Destination::new(format!("stuck-order-{}", std::process::id())).unwrap();
        let group = ConsumerGroup::new("stuck-order").unwrap();
        broker.declare(&dest, std::slice::from_ref(&group)).await.unwrap();
        for id in ["e0", "e1", "e2"] {
            let event = Event::new(EventId::new(id).unwrap(), dest.clone(), id.as_bytes().to_vec()).with_key("k");
            broker.publish(&event).await.unwrap();
        }
        let mut sub = broker.subscribe(&dest, &group).await.unwrap();
        let mut deliveries = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while deliveries.len() < 3 {
            assert!(std::time::Instant::now() < deadline, "3 deliveries within 30 s, got {}", deliveries.len());
            if let Some(d) = sub.next(std::time::Duration::from_secs(1)).await.unwrap() {
                deliveries.push(d);
            }
        }
        let mut deliveries = deliveries.into_iter();
        deliveries.next().unwrap().ack().await.unwrap();
        let unapplied = async move {
            let set: BTreeSet<String> = ["e1", "e2"].map(String::from).into();
            for d in deliveries {
                d.ack().await?;
            }
            Ok(set)
        };
        let passed = explain("test", Some(&broker), &dest, &group, unapplied).await.unwrap();
        let positions = broker.group_positions(&dest, &group).await.unwrap();
        drop(sub);
        broker.delete_topic(&dest).await.unwrap();
        assert_eq!(
            positions.iter().map(|p| p.committed).collect::<Vec<_>>(),
            [Some(3)],
            "the group committed all three"
        );
        assert_eq!(passed, 0, "e1 and e2 were applied after the positions were read: none passed");
    }

    #[test]
    fn log_tails_keep_the_last_rebalance_warning_and_error_lines_without_colours() {
        let log = "\u{1b}[2m2026-12-06T09:06:03Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m outbox.kafka: rebalance topic=t assigned=true lost=false partitions=[0, 2]
2026-12-06T09:06:04Z  INFO outbox.chaos: consumer started
2026-12-06T09:06:04Z  WARN librdkafka: librdkafka: CONFWARN [thrd:app]: Configuration property max.poll.interval.ms is a consumer property and will be ignored by this producer instance
2026-12-06T09:06:05Z  WARN outbox.consumer: receive failed error=AllBrokersDown
2026-12-06T09:06:06Z ERROR rdkafka::client: librdkafka: Global error
2026-12-06T09:06:07Z  INFO outbox.kafka: rebalance topic=t assigned=false lost=true partitions=[0, 2]
";
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), log).unwrap();
        let tail = super::super::servers::log_lines(file.path(), 3, telling).unwrap();
        assert_eq!(
            tail,
            [
                "2026-12-06T09:06:05Z  WARN outbox.consumer: receive failed error=AllBrokersDown",
                "2026-12-06T09:06:06Z ERROR rdkafka::client: librdkafka: Global error",
                "2026-12-06T09:06:07Z  INFO outbox.kafka: rebalance topic=t assigned=false lost=true partitions=[0, 2]",
            ]
        );
        let all = super::super::servers::log_lines(file.path(), 12, telling).unwrap();
        assert_eq!(all.len(), 4, "neither the 'consumer started' line nor the CONFWARN is one of them: {all:?}");
        assert_eq!(
            all[0],
            "2026-12-06T09:06:03Z  INFO outbox.kafka: rebalance topic=t assigned=true lost=false partitions=[0, 2]"
        );
    }

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
