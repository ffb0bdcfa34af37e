//! `outbox relay --metrics` scraped while the relay runs as an OS process on SQLite.
//!
//! The relay's counters, the store's durable counts and what the libraries record through the
//! `metrics` facade (the publish latency histogram) are on one page, each family once, and
//! their numbers agree with the outbox rows read back from the database file.
//!
//! - Redis: every event is published; the published counter equals the number of rows, the
//!   publish histogram (one sample per `publish_batch` call) has between one sample and one per
//!   row, all under `+Inf`, and the rows are all `published`.
//! - `memory://` (the relay process's own, never declared, so every publish is unroutable) with
//!   `--max-attempts 1`: the head row of each of the three keys is parked and blocks the rest of
//!   its key (the default), so the parked counter and `outbox_rows` say 3 parked, 22 pending, and
//!   the oldest pending row has an age.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::process::{Child, Stdio};
use std::time::Duration;

use common::*;
use outbox::core::store::all_rows;
use outbox::{AnyStore, ConsumerGroup, Destination, Event, EventId, RowStatus};

const EVENTS: usize = 25;
/// Events are keyed `k0`, `k1`, `k2` in turn.
const KEYS: usize = 3;

/// The value of the sample written exactly as `series` (name and labels), if there is one.
fn sample(page: &str, series: &str) -> Option<f64> {
    page.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The sum of every sample of metric `name`, whatever its labels (`None` when there is none).
fn sum(page: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = page
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// Every family is declared once.
fn assert_families_unique(page: &str) {
    let mut seen = BTreeMap::<&str, usize>::new();
    for name in page.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split_whitespace().next()) {
        *seen.entry(name).or_default() += 1;
    }
    let repeated: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.is_empty(), "families declared more than once: {repeated:?}\n{page}");
}

async fn status_counts(store: &AnyStore) -> HashMap<RowStatus, usize> {
    let mut out = HashMap::new();
    for r in all_rows(&*store.outbox()).await.expect("rows read back") {
        *out.entry(r.status).or_default() += 1;
    }
    out
}

/// A fresh SQLite outbox holding `EVENTS` events for a fresh destination.
async fn outbox_with_events(dir: &std::path::Path, tag: &str) -> (String, AnyStore, Destination) {
    let store_url = format!("sqlite://{}/relay.db", dir.display());
    let store = AnyStore::connect(&store_url).await.expect("store opens");
    let destination = Destination::new(unique(tag).replace('_', "-")).unwrap();
    let events: Vec<Event> = (0..EVENTS)
        .map(|i| {
            Event::new(EventId::new(format!("{tag}-{i:03}")).unwrap(), destination.clone(), format!("payload {i}"))
                .with_key(format!("k{}", i % KEYS))
        })
        .collect();
    store.outbox().enqueue(&events).await.expect("enqueue");
    (store_url, store, destination)
}

fn spawn_relay(store_url: &str, broker_url: &str, owner: &str, port: u16, extra: &[&str]) -> Child {
    let metrics = format!("127.0.0.1:{port}");
    let mut args = vec!["relay", "--store", store_url, "--broker", broker_url, "--owner", owner, "--metrics", &metrics];
    args.extend_from_slice(extra);
    outbox().args(&args).stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().expect("outbox relay starts")
}

/// Scrape until `series` reads `want` (counters move after the store's rows do).
async fn scrape_until(port: u16, series: &str, want: f64) -> String {
    eventually(Duration::from_secs(30), &format!("{series} reaches {want}"), || async {
        let (status, page) = http_get(port, "/metrics")?;
        (status == 200 && sample(&page, series) == Some(want)).then_some(page)
    })
    .await
}

async fn stop(mut relay: Child) {
    sigterm(&relay);
    assert_eq!(wait_status(&mut relay, Duration::from_secs(30), "relay after SIGTERM").code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_counter_and_publish_histogram_count_every_row_on_sqlite_and_redis() {
    let redis = service::redis_url();
    if !service::require_service("Redis", "redis", &service::service_addr(&redis)) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (store_url, store, destination) = outbox_with_events(dir.path(), "metrics-redis").await;
    let broker = outbox::broker_from_url(&redis).await.expect("broker connects");
    broker.declare(&destination, &[ConsumerGroup::new("metrics-check").unwrap()]).await.expect("declare");

    let port = free_port();
    let relay = spawn_relay(&store_url, &redis, "metrics-relay", port, &[]);
    eventually(Duration::from_secs(60), "every row published", || async {
        (status_counts(&store).await.get(&RowStatus::Published) == Some(&EVENTS)).then_some(())
    })
    .await;
    let n = EVENTS as f64;
    let page = scrape_until(port, "outbox_relay_published_total{owner=\"metrics-relay\"}", n).await;
    stop(relay).await;

    assert_families_unique(&page);
    assert!(sample(&page, "outbox_relay_claimed_total{owner=\"metrics-relay\"}").is_some_and(|c| c >= n), "{page}");
    for (status, want) in [("published", n), ("pending", 0.0), ("leased", 0.0), ("parked", 0.0)] {
        assert_eq!(sample(&page, &format!("outbox_rows{{status=\"{status}\"}}")), Some(want), "{status}\n{page}");
    }
    assert_eq!(sample(&page, "outbox_oldest_pending_age_seconds"), Some(0.0), "{page}");
    assert!(page.contains("# TYPE outbox_relay_publish_seconds histogram\n"), "{page}");
    let calls = sum(&page, "outbox_relay_publish_seconds_count").unwrap_or(0.0);
    assert!((1.0..=n).contains(&calls), "one sample per publish_batch call: {calls}\n{page}");
    let inf: f64 = page
        .lines()
        .filter(|l| l.starts_with("outbox_relay_publish_seconds_bucket{") && l.contains("le=\"+Inf\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(inf, calls, "{page}");
    assert!(page.contains("# TYPE outbox_relay_batch_seconds histogram\n"), "{page}");
    assert!(sum(&page, "outbox_relay_publish_seconds_sum").is_some_and(|s| s > 0.0), "{page}");
    // Every publish call follows a claim, and every batch it published completes once.
    let claims = sum(&page, "outbox_relay_claim_seconds_count").unwrap_or(0.0);
    assert!(claims >= calls, "a claim per batch at least: {claims} claims, {calls} publishes\n{page}");
    let completions = sum(&page, "outbox_relay_complete_seconds_count").unwrap_or(0.0);
    assert!((1.0..=calls).contains(&completions), "{completions} completions, {calls} publishes\n{page}");
    assert!(status_counts(&store).await.keys().all(|s| *s == RowStatus::Published));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_and_pending_rows_show_in_the_counters_and_durable_counts_on_sqlite_and_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (store_url, store, _) = outbox_with_events(dir.path(), "metrics-memory").await;
    let port = free_port();
    let relay = spawn_relay(&store_url, "memory://", "metrics-parker", port, &["--max-attempts", "1"]);
    eventually(Duration::from_secs(60), "the head row of every key parked", || async {
        (status_counts(&store).await.get(&RowStatus::Parked) == Some(&KEYS)).then_some(())
    })
    .await;
    let page = scrape_until(port, "outbox_relay_parked_total{owner=\"metrics-parker\"}", KEYS as f64).await;
    stop(relay).await;

    assert_families_unique(&page);
    assert_eq!(sample(&page, "outbox_relay_published_total{owner=\"metrics-parker\"}"), Some(0.0), "{page}");
    let pending = (EVENTS - KEYS) as f64;
    for (status, want) in [("published", 0.0), ("pending", pending), ("leased", 0.0), ("parked", KEYS as f64)] {
        assert_eq!(sample(&page, &format!("outbox_rows{{status=\"{status}\"}}")), Some(want), "{status}\n{page}");
    }
    assert!(sample(&page, "outbox_oldest_pending_age_seconds").is_some_and(|age| age > 0.0), "{page}");
    assert_eq!(sample(&page, "outbox_store_up{backend=\"sqlite\"}"), Some(1.0), "{page}");
    let durable = status_counts(&store).await;
    assert_eq!(
        (durable.get(&RowStatus::Parked), durable.get(&RowStatus::Pending)),
        (Some(&KEYS), Some(&(EVENTS - KEYS)))
    );
}
