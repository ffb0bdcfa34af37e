//! `Broker::publish_batch` against the real Redis server (`scripts/services ensure redis`), for
//! what is particular to the batch script: the dedupe window inside it, and a key stopped by a
//! server error raised inside the script, across the script's chunks. What every broker promises
//! (each event once, byte-for-byte, in key order; an invalid event failing alone, its key's later
//! events `Skipped`) is judged by the shared suite's `broker_publish_batch_…` cases
//! (`--test conformance`). Every test works under a key prefix of its own, deleted at the end.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outbox_broker_redis::{RedisBroker, RedisConfig};
use outbox_conformance_tests::redis_url;
use outbox_core::{Broker, Destination, ErrorKind, Event, EventId};

fn unique() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("{}-{}-{nanos}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Deletes every key under the test's prefix when dropped (also when the test panics).
struct Cleanup {
    url: String,
    prefix: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let Ok(client) = redis::Client::open(self.url.as_str()) else { return };
        let Ok(mut conn) = client.get_connection() else { return };
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(format!("{}*", self.prefix)).query(&mut conn).unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(&keys).query(&mut conn);
        }
    }
}

/// `None` (test skipped) when Redis is not reachable outside CI.
async fn broker(f: impl FnOnce(RedisConfig) -> RedisConfig) -> Option<(RedisBroker, Cleanup)> {
    if !outbox_conformance_tests::require_service(
        "Redis",
        "redis",
        &outbox_conformance_tests::service_addr(&redis_url()),
    ) {
        return None;
    }
    let prefix = format!("outbox-batch-test:{}:", unique());
    let config = f(RedisConfig::from_url(&redis_url()).expect("OUTBOX_REDIS_URL").with_prefix(prefix.clone()));
    let cleanup = Cleanup { url: config.url.clone(), prefix };
    Some((RedisBroker::connect(config).await.expect("connect to Redis"), cleanup))
}

/// `n` events on `dest`: keys `a`, `b`, `c` and keyless ones interleaved, every payload distinct
/// and binary, some with headers.
fn mixed(dest: &Destination, tag: &str, n: u32) -> Vec<Event> {
    (0..n)
        .map(|i| {
            let payload: Vec<u8> = (0..64u32).map(|j| ((i * 31 + j * 7) % 256) as u8).chain(i.to_be_bytes()).collect();
            let mut e = Event::new(EventId::new(format!("{tag}-{i}")).unwrap(), dest.clone(), payload);
            match i % 4 {
                0 => e = e.with_key("a"),
                1 => e = e.with_key("b").with_header("trace", format!("t{i}").into_bytes()),
                2 => e = e.with_key("c"),
                _ => {}
            }
            e
        })
        .collect()
}

/// Every event of `sent` is in `stored` exactly once and equal byte-for-byte, and the stored
/// events of each key are in the order they were sent.
fn assert_arrived_once_in_order(sent: &[Event], stored: &[Event]) {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for e in stored {
        *seen.entry(e.id.as_str()).or_default() += 1;
    }
    for e in sent {
        assert_eq!(seen.get(e.id.as_str()), Some(&1), "event {} must be stored exactly once", e.id);
    }
    assert_eq!(stored.len(), sent.len(), "nothing else is stored");
    let by_id: HashMap<&str, &Event> = stored.iter().map(|e| (e.id.as_str(), e)).collect();
    for e in sent {
        assert!(by_id[e.id.as_str()] == e, "event {} must arrive byte-for-byte", e.id);
    }
    for key in ["a", "b", "c"] {
        let want: Vec<&str> = sent.iter().filter(|e| e.key.as_deref() == Some(key)).map(|e| e.id.as_str()).collect();
        let got: Vec<&str> = stored.iter().filter(|e| e.key.as_deref() == Some(key)).map(|e| e.id.as_str()).collect();
        assert_eq!(got, want, "key {key} in slice order");
    }
}

#[tokio::test]
async fn a_batch_through_the_script_path_dedupes_and_keeps_order() {
    // A dedupe window sends every event through the full publish logic inside the batch script.
    let Some((broker, _cleanup)) = broker(|c| c.with_dedupe_window(Duration::from_secs(60))).await else { return };
    let dest = Destination::new("orders").unwrap();
    let mut events = mixed(&dest, "d", 240);
    let again = events[5].clone();
    events.push(again);
    let results = broker.publish_batch(&events).await;
    assert!(results.iter().all(Result::is_ok), "{:?}", results.iter().find(|r| r.is_err()));
    let stored = broker.events(&dest).await.unwrap();
    events.pop();
    assert_arrived_once_in_order(&events, &stored);
}

#[tokio::test]
async fn a_server_error_inside_the_script_stops_its_key_across_chunks() {
    let Some((broker, cleanup)) = broker(|c| c).await else { return };
    let dest = Destination::new("orders").unwrap();
    // Key `b` fails inside the script (its destination's key holds a string: WRONGTYPE); its later
    // events go on to `dest`, in the same script (not attempted there) and in the next one (the
    // batch is over 512 events: not sent at all). The other keys go on.
    let broken = Destination::new("not-a-stream").unwrap();
    let client = redis::Client::open(cleanup.url.as_str()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SET").arg(broker.stream_key(&broken)).arg("x").query_async(&mut raw).await.unwrap();

    const FAILED: usize = 81;
    let mut events = mixed(&dest, "f", 700);
    let wrongtype = Event::new(EventId::new("f-wrongtype").unwrap(), broken.clone(), b"x".to_vec()).with_key("b");
    events.insert(FAILED, wrongtype);
    let results = broker.publish_batch(&events).await;
    assert_eq!(results.len(), events.len());

    let mut expected_stored = Vec::new();
    for (i, (e, r)) in events.iter().zip(&results).enumerate() {
        if i == FAILED {
            let err = r.as_ref().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Rejected, "{err}");
            assert!(err.is_permanent(), "WRONGTYPE is permanent: {err}");
        } else if e.key.as_deref() == Some("b") && i > FAILED {
            let err = r.as_ref().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Skipped, "event {} after its key failed: {err}", e.id);
            assert!(err.is_transient());
        } else {
            assert!(r.is_ok(), "event {} of another key: {r:?}", e.id);
            expected_stored.push(e.clone());
        }
    }
    let stored = broker.events(&dest).await.unwrap();
    assert_arrived_once_in_order(&expected_stored, &stored);
    let kind: String = redis::cmd("TYPE").arg(broker.stream_key(&broken)).query_async(&mut raw).await.unwrap();
    assert_eq!(kind, "string", "nothing was appended for the failed event");
}
