//! Where a relay row's time went: the relay's own stage histograms, read back in process.
//!
//! A ratio says how far a relay is from its baseline; the stage times say which of claim,
//! publish and complete to work on. They are the same `outbox_relay_*_seconds` histograms
//! `outbox relay --metrics` exports, captured by a recorder local to the measured relay.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The stages, by histogram name, in pipeline order.
const STAGES: [(&str, &str); 3] = [
    ("claim", "outbox_relay_claim_seconds"),
    ("publish", "outbox_relay_publish_seconds"),
    ("complete", "outbox_relay_complete_seconds"),
];

#[derive(Default)]
struct Observations(Mutex<Vec<f64>>);

impl metrics::HistogramFn for Observations {
    fn record(&self, value: f64) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(value);
    }
}

/// A `metrics` recorder keeping every observation of the stage histograms; the relay's other
/// metrics go nowhere. Install it with [`metrics::with_local_recorder`] around `Relay::new`: the
/// relay registers its handles there, once.
#[derive(Default)]
pub(crate) struct Stages(Mutex<BTreeMap<&'static str, Arc<Observations>>>);

impl metrics::Recorder for Stages {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        match STAGES.iter().find(|(_, name)| *name == key.name()) {
            Some((stage, _)) => metrics::Histogram::from_arc(
                self.0.lock().unwrap_or_else(PoisonError::into_inner).entry(stage).or_default().clone(),
            ),
            None => metrics::Histogram::noop(),
        }
    }
}

impl Stages {
    /// `claim 14.3 ms (p90 18.0, 201 calls), publish …`: the median and 90th percentile of each
    /// stage's calls, in milliseconds.
    pub(crate) fn summary(&self) -> String {
        let kept = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let parts: Vec<String> = STAGES
            .iter()
            .map(|(stage, _)| {
                let mut v = kept
                    .get(stage)
                    .map(|o| o.0.lock().unwrap_or_else(PoisonError::into_inner).clone())
                    .unwrap_or_default();
                v.sort_by(f64::total_cmp);
                match (quantile(&v, 0.5), quantile(&v, 0.9)) {
                    (Some(m), Some(p90)) => {
                        format!("{stage} {:.2} ms (p90 {:.2}, {} calls)", m * 1e3, p90 * 1e3, v.len())
                    }
                    _ => format!("{stage} -"),
                }
            })
            .collect();
        parts.join(", ")
    }
}

/// CPU time of this process and of the whole machine, from `/proc` (Linux; zeros elsewhere), to
/// tell a relay that waits from one that lacks CPU.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Cpu {
    /// This process's user + system time, in clock ticks.
    process: u64,
    /// Every CPU's busy and idle (idle + iowait) time, in clock ticks.
    busy: u64,
    idle: u64,
}

impl Cpu {
    /// Read now.
    pub(crate) fn now() -> Self {
        let process = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| {
                // Fields after the command name (which may hold spaces), from the 3rd on.
                let rest = s.rsplit_once(')')?.1;
                let f: Vec<&str> = rest.split_whitespace().collect();
                Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
            })
            .unwrap_or(0);
        let (busy, idle) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| {
                let line = s.lines().next()?.strip_prefix("cpu ")?.to_string();
                let v: Vec<u64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
                let idle = v.get(3)? + v.get(4)?;
                Some((v.iter().take(8).sum::<u64>() - idle, idle))
            })
            .unwrap_or((0, 0));
        Self { process, busy, idle }
    }

    /// `process 0.62 cores, machine 81% busy` over `wall` seconds since `self` (Linux's 100
    /// ticks per second).
    pub(crate) fn since(self, wall: f64) -> String {
        let later = Self::now();
        let ticks = |a: u64, b: u64| b.saturating_sub(a) as f64;
        let process = ticks(self.process, later.process) / 100.0 / wall.max(1e-9);
        let (busy, idle) = (ticks(self.busy, later.busy), ticks(self.idle, later.idle));
        if busy + idle == 0.0 {
            return "CPU not readable".to_string();
        }
        format!("this process {process:.2} cores, machine {:.0}% busy", 100.0 * busy / (busy + idle))
    }
}

/// The `q` quantile of sorted `v` (nearest rank), `None` when empty.
fn quantile(v: &[f64], q: f64) -> Option<f64> {
    let last = v.len().checked_sub(1)?;
    v.get(((last as f64) * q).round() as usize).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_stage_histograms_are_kept_and_summarized_in_pipeline_order() {
        let stages = Stages::default();
        metrics::with_local_recorder(&stages, || {
            for v in [0.004, 0.001, 0.002] {
                metrics::histogram!("outbox_relay_claim_seconds", "owner" => "x").record(v);
            }
            metrics::histogram!("outbox_relay_complete_seconds").record(0.010);
            metrics::histogram!("outbox_relay_batch_seconds").record(9.0);
        });
        assert_eq!(
            stages.summary(),
            "claim 2.00 ms (p90 4.00, 3 calls), publish -, complete 10.00 ms (p90 10.00, 1 calls)"
        );
    }

    /// Through a real relay: the recorder installed around `Relay::new` (as `relay_drain` does)
    /// sees one claim per claim call and one publish and completion per batch, so a renamed
    /// histogram or a recorder installed elsewhere shows as `-` and fails this.
    #[tokio::test]
    async fn a_relay_built_under_the_recorder_reports_every_stage() {
        use outbox::core::memory::{MemoryBroker, MemoryOutbox};
        use outbox::{Broker, Destination, Event, EventId, OutboxAdmin, OutboxStore, Relay, RelayConfig};
        let (store, broker) = (MemoryOutbox::default(), MemoryBroker::new());
        let dest = Destination::new("stages").unwrap();
        broker.declare(&dest, &[]).await.unwrap();
        let events: Vec<Event> =
            (0..5).map(|i| Event::new(EventId::new(format!("e{i}")).unwrap(), dest.clone(), vec![1])).collect();
        store.enqueue(&events).await.unwrap();
        let stages = Stages::default();
        let relay = metrics::with_local_recorder(&stages, || {
            Relay::new(
                std::sync::Arc::new(store.clone()),
                std::sync::Arc::new(broker.clone()),
                RelayConfig::new("stages").with_batch_size(5).with_pipeline_depth(1),
            )
        });
        let report = relay.drain().await.unwrap();
        assert_eq!(report.published, 5);
        assert_eq!(store.stats().await.unwrap().published, 5, "durable: every row published");
        let summary = stages.summary();
        // One batch of 5, then the empty claim that ends the drain.
        for want in ["2 calls), publish ", "1 calls), complete "] {
            assert!(summary.contains(want), "{want:?} in {summary}");
        }
        assert!(summary.ends_with("1 calls)"), "{summary}");
        assert!(!summary.contains(" -"), "every stage observed: {summary}");
    }

    #[test]
    fn cpu_time_of_this_process_and_the_machine_is_read() {
        let start = Cpu::now();
        assert!(start.busy + start.idle > 0, "/proc/stat read: {start:?}");
        // Spin until this process has used 3 ticks (30 ms) of CPU, bounded.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut x = 0u64;
        while Cpu::now().process < start.process + 3 {
            assert!(std::time::Instant::now() < deadline, "/proc/self/stat never moved: {:?}", Cpu::now());
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        assert!(start.since(1.0).starts_with("this process "), "{x}");
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        assert_eq!(quantile(&[], 0.5), None);
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0], 0.5), Some(3.0));
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 0.9), Some(9.0));
    }
}
