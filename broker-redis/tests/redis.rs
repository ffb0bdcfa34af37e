//! Tests against the real Redis server (`scripts/services ensure redis`). Every test works under a
//! key prefix of its own and deletes everything under it at the end, even when it fails.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outbox_broker_redis::{RedisBroker, RedisConfig};
use outbox_conformance_tests::redis_url;
use outbox_core::InboxAdmin;
use outbox_core::memory::MemoryInbox;
use outbox_core::{
    Broker, ConsumerGroup, Delivery, Destination, ErrorKind, Event, EventId, Inbox, MarkOutcome, Subscription,
};
use tokio::time::Instant;

const CLAIM_IDLE: Duration = Duration::from_millis(200);

fn service_up() -> bool {
    outbox_conformance_tests::require_service("Redis", "redis", &outbox_conformance_tests::service_addr(&redis_url()))
}

fn unique() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("{}-{}-{nanos}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

fn base_config() -> RedisConfig {
    RedisConfig::from_url(&redis_url()).expect("OUTBOX_REDIS_URL")
}

/// Deletes every key under the test's prefix when dropped (also when the test panics).
struct Cleanup {
    url: String,
    prefix: String,
    users: Vec<String>,
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
        for user in &self.users {
            let _: redis::RedisResult<i64> = redis::cmd("ACL").arg("DELUSER").arg(user).query(&mut conn);
        }
    }
}

struct Env {
    broker: RedisBroker,
    dest: Destination,
    group: ConsumerGroup,
    raw: redis::aio::MultiplexedConnection,
    cleanup: Cleanup,
}

impl Env {
    fn config(&self) -> &RedisConfig {
        self.broker.config()
    }

    fn stream(&self) -> String {
        self.broker.stream_key(&self.dest)
    }

    fn event(&self, id: &str, payload: &[u8]) -> Event {
        Event::new(EventId::new(id).unwrap(), self.dest.clone(), payload.to_vec())
    }

    async fn xlen(&mut self) -> u64 {
        redis::cmd("XLEN").arg(self.stream()).query_async(&mut self.raw).await.unwrap()
    }

    /// `(entry id, owner, delivery count)` of every pending entry of the group.
    async fn xpending(&mut self) -> Vec<(String, String, u64)> {
        let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(self.stream())
            .arg(self.group.as_str())
            .arg("-")
            .arg("+")
            .arg(100)
            .query_async(&mut self.raw)
            .await
            .unwrap();
        rows.into_iter().map(|(id, owner, _, n)| (id, owner, n)).collect()
    }

    /// A Redis user of its own (deleted at cleanup), and the settings to connect as it.
    async fn user(&mut self, rules: &[&str]) -> (String, RedisConfig) {
        let user = format!("outbox-test-{}", unique());
        self.cleanup.users.push(user.clone());
        let password = "pw-secret-1";
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER").arg(&user).arg("on").arg(format!(">{password}"));
        for r in rules {
            cmd.arg(*r);
        }
        let _: () = cmd.query_async(&mut self.raw).await.unwrap();
        let mut url = url::Url::parse(&self.config().url).unwrap();
        url.set_username(&user).unwrap();
        url.set_password(Some(password)).unwrap();
        let mut config = self.config().clone();
        config.url = url.to_string();
        (user, config)
    }
}

/// `None` (test skipped) when Redis is not reachable outside CI.
async fn env(f: impl FnOnce(RedisConfig) -> RedisConfig) -> Option<Env> {
    if !service_up() {
        return None;
    }
    let prefix = format!("outbox-test:{}:", unique());
    let config =
        f(base_config().with_prefix(prefix.clone()).with_claim_idle(CLAIM_IDLE).with_block(Duration::from_millis(100)));
    let url = config.url.clone();
    let cleanup = Cleanup { url: url.clone(), prefix, users: Vec::new() };
    let broker = RedisBroker::connect(config).await.expect("connect to Redis");
    let raw = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    Some(Env {
        broker,
        dest: Destination::new("orders").unwrap(),
        group: ConsumerGroup::new("billing").unwrap(),
        raw,
        cleanup,
    })
}

/// Poll `sub` until a delivery arrives or `within` passes.
async fn next_within(sub: &mut dyn Subscription, within: Duration) -> Option<Delivery> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(d) = sub.next(Duration::from_millis(100)).await.expect("next") {
            return Some(d);
        }
    }
    None
}

/// Poll `sub` for `period`, asserting that nothing arrives.
async fn assert_nothing_for(sub: &mut dyn Subscription, period: Duration) {
    let until = Instant::now() + period;
    while Instant::now() < until {
        if let Some(d) = sub.next(Duration::from_millis(50)).await.expect("next") {
            panic!("unexpected delivery {:?}", d);
        }
    }
}

#[tokio::test]
async fn round_trip_is_byte_for_byte() {
    let Some(mut env) = env(|c| c).await else { return };
    let with_everything = env
        .event("order-1/credit:7", b"\0nul\xff\xfe not utf-8 \xc3\x28 \r\n\0")
        .with_key("aggregate-42")
        .with_header("bin", vec![0u8, 0xff, b'\n', 0x80, 0])
        .with_header("empty", Vec::new())
        .with_header("content-type", b"application/octet-stream".to_vec());
    let no_key = env.event("order-2", b"");
    let empty_key = env.event("order-3", &[0u8; 3]).with_key("");
    let all = [with_everything, no_key, empty_key];

    env.broker.declare(&env.dest, std::slice::from_ref(&env.group)).await.unwrap();
    for e in &all {
        env.broker.publish(e).await.unwrap();
    }
    let mut sub = env.broker.subscribe(&env.dest, &env.group).await.unwrap();
    for expected in &all {
        let d = next_within(sub.as_mut(), Duration::from_secs(5)).await.expect("delivery");
        assert_eq!(&d.event, expected, "delivered event differs");
        assert_eq!(d.event.key, expected.key, "absent and empty keys must stay apart");
        assert!(!d.redelivered);
        assert_eq!(d.attempt, Some(1));
        d.ack().await.unwrap();
    }
    // Durable state: the stream holds exactly the three events, the group has nothing pending.
    assert_eq!(env.broker.events(&env.dest).await.unwrap(), all.to_vec());
    assert_eq!(env.xlen().await, 3);
    assert!(env.xpending().await.is_empty());
    assert_eq!(env.broker.unacknowledged(&env.dest, &env.group).await.unwrap(), 0);
}

#[tokio::test]
async fn acknowledged_delivery_is_not_redelivered() {
    let Some(mut env) = env(|c| c).await else { return };
    let e = env.event("ack-1", b"once");
    env.broker.declare(&env.dest, std::slice::from_ref(&env.group)).await.unwrap();
    env.broker.publish(&e).await.unwrap();
    let mut first = env.broker.subscribe(&env.dest, &env.group).await.unwrap();
    let d = next_within(first.as_mut(), Duration::from_secs(5)).await.expect("delivery");
    d.ack().await.unwrap();
    drop(first);

    // Another member, for several claim idle times: nothing comes back.
    let mut second = env.broker.subscribe(&env.dest, &env.group).await.unwrap();
    assert_nothing_for(second.as_mut(), CLAIM_IDLE * 4).await;
    assert!(env.xpending().await.is_empty());
    assert_eq!(env.broker.unacknowledged(&env.dest, &env.group).await.unwrap(), 0);
    assert_eq!(env.xlen().await, 1, "acknowledging does not delete the entry");
}

#[tokio::test]
async fn unacked_delivery_of_a_dropped_subscription_goes_to_another_consumer() {
    let Some(mut env) = env(|c| c).await else { return };
    let e = env.event("gone-1", b"\x00payload");
    env.broker.declare(&env.dest, std::slice::from_ref(&env.group)).await.unwrap();
    env.broker.publish(&e).await.unwrap();

    let mut first = env.broker.subscription(&env.dest, &env.group).await.unwrap();
    let first_name = first.consumer().to_string();
    let d = next_within(&mut first, Duration::from_secs(5)).await.expect("delivery");
    assert_eq!(d.attempt, Some(1));
    let dropped_at = Instant::now();
    drop(d); // neither acked nor nacked
    drop(first); // the consumer went away

    let mut second = env.broker.subscription(&env.dest, &env.group).await.unwrap();
    assert_ne!(second.consumer(), first_name);
    let d = next_within(&mut second, Duration::from_secs(10)).await.expect("redelivery to the other consumer");
    let waited = dropped_at.elapsed();
    eprintln!("redelivered to another consumer {waited:?} after the drop (claim idle {CLAIM_IDLE:?})");
    assert_eq!(d.event, e);
    assert!(d.redelivered);
    assert!(d.attempt.unwrap() >= 2, "attempt {:?}", d.attempt);
    // Redis measures idleness from the first delivery, a little before the drop.
    assert!(waited + Duration::from_millis(100) >= CLAIM_IDLE, "reclaimed after only {waited:?}");
    let pending = env.xpending().await;
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].1, second.consumer(), "the entry now belongs to the second consumer");
    d.ack().await.unwrap();
    assert!(env.xpending().await.is_empty());
}

#[tokio::test]
async fn unacked_delivery_stays_with_a_live_subscription_within_the_idle_time() {
    let Some(mut env) = env(|c| c.with_claim_idle(Duration::from_secs(30))).await else { return };
    env.broker.declare(&env.dest, std::slice::from_ref(&env.group)).await.unwrap();
    env.broker.publish(&env.event("held-1", b"x")).await.unwrap();
    let mut first = env.broker.subscription(&env.dest, &env.group).await.unwrap();
    let held = next_within(&mut first, Duration::from_secs(5)).await.expect("delivery");
    let mut second = env.broker.subscription(&env.dest, &env.group).await.unwrap();
    assert_nothing_for(&mut second, Duration::from_millis(500)).await;
    let pending = env.xpending().await;
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].1, first.consumer());
    held.ack().await.unwrap();
    assert!(env.xpending().await.is_empty());
}

#[tokio::test]
async fn restarted_consumer_rereads_its_own_pending_entry_first() {
    // A long claim idle time: what comes back can only come from re-reading our own entries.
    let Some(mut env) = env(|c| c.with_claim_idle(Duration::from_secs(60))).await else { return };
    let name = format!("worker-{}", unique());
    let e1 = env.event("restart-1", b"first");
    let e2 = env.event("restart-2", b"second");
    env.broker.declare(&env.dest, std::slice::from_ref(&env.group)).await.unwrap();
    env.broker.publish(&e1).await.unwrap();

    let mut before = env.broker.subscribe_as(&env.dest, &env.group, &name).await.unwrap();
    let d = next_within(&mut before, Duration::from_secs(5)).await.expect("delivery");
    assert_eq!(d.event, e1);
    drop(d);
    drop(before); // crash
    env.broker.publish(&e2).await.unwrap();

    let mut after = env.broker.subscribe_as(&env.dest, &env.group, &name).await.unwrap();
    assert_eq!(after.consumer(), name);
    let d = after.next(Duration::from_secs(5)).await.unwrap().expect("own pending entry");
    assert_eq!(d.event, e1, "the held entry comes back before anything new");
    assert!(d.redelivered);
    assert_eq!(d.attempt, Some(2));
    d.ack().await.unwrap();
    let d = after.next(Duration::from_secs(5)).await.unwrap().expect("new entry");
    assert_eq!(d.event, e2);
    assert!(!d.redelivered);
    assert_eq!(d.attempt, Some(1));
    d.ack().await.unwrap();
    assert!(env.xpending().await.is_empty());
}

#[tokio::test]
async fn nack_redelivers_promptly() {
    // Far longer than the test waits: the redelivery must come from the nack, not from idleness.
    let Some(mut env) = env(|c| c.with_claim_idle(Duration::from_secs(30))).await else { return };
    let e = env.event("nack-1", b"retry me");
    env.broker.declare(&env.dest, std::slice::from_ref(&env.group)).await.unwrap();
    env.broker.publish(&e).await.unwrap();
    let mut sub = env.broker.subscribe(&env.dest, &env.group).await.unwrap();
    let d = next_within(sub.as_mut(), Duration::from_secs(5)).await.expect("delivery");
    d.nack().await.unwrap();
    let nacked_at = Instant::now();
    let d = next_within(sub.as_mut(), Duration::from_secs(5)).await.expect("redelivery after nack");
    eprintln!("redelivered {:?} after the nack", nacked_at.elapsed());
    assert_eq!(d.event, e);
    assert!(d.redelivered);
    assert_eq!(d.attempt, Some(2));
    d.ack().await.unwrap();
    assert!(env.xpending().await.is_empty());
    assert_eq!(env.xlen().await, 1);
}

#[tokio::test]
async fn nacked_entry_can_go_to_another_member() {
    let Some(mut env) = env(|c| c.with_claim_idle(Duration::from_secs(30))).await else { return };
    env.broker.declare(&env.dest, std::slice::from_ref(&env.group)).await.unwrap();
    env.broker.publish(&env.event("nack-2", b"x")).await.unwrap();
    let mut first = env.broker.subscription(&env.dest, &env.group).await.unwrap();
    let d = next_within(&mut first, Duration::from_secs(5)).await.expect("delivery");
    d.nack().await.unwrap();
    drop(first);
    let mut second = env.broker.subscription(&env.dest, &env.group).await.unwrap();
    let d = next_within(&mut second, Duration::from_secs(5)).await.expect("redelivery to another member");
    assert_eq!(d.attempt, Some(2));
    d.ack().await.unwrap();
    assert!(env.xpending().await.is_empty());
}

#[tokio::test]
async fn members_of_a_group_share_the_work_without_duplicates() {
    let Some(mut env) = env(|c| c).await else { return };
    env.broker.declare(&env.dest, std::slice::from_ref(&env.group)).await.unwrap();
    let mut a = env.broker.subscribe(&env.dest, &env.group).await.unwrap();
    let mut b = env.broker.subscribe(&env.dest, &env.group).await.unwrap();
    for i in 0..20 {
        env.broker.publish(&env.event(&format!("share-{i}"), &[i])).await.unwrap();
    }
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.len() < 20 && Instant::now() < deadline {
        for sub in [&mut a, &mut b] {
            if let Some(d) = sub.next(Duration::from_millis(20)).await.unwrap() {
                assert!(!d.redelivered);
                seen.push(d.event.id.to_string());
                d.ack().await.unwrap();
            }
        }
    }
    seen.sort();
    let mut expected: Vec<String> = (0..20).map(|i| format!("share-{i}")).collect();
    expected.sort();
    assert_eq!(seen, expected);
    assert!(env.xpending().await.is_empty());
}

#[tokio::test]
async fn groups_start_at_the_beginning_and_declare_is_idempotent() {
    let Some(mut env) = env(|c| c).await else { return };
    let declared = ConsumerGroup::new("declared").unwrap();
    env.broker.declare(&env.dest, std::slice::from_ref(&declared)).await.unwrap();
    env.broker.publish(&env.event("early-1", b"1")).await.unwrap();
    env.broker.declare(&env.dest, &[declared.clone(), declared.clone()]).await.unwrap();
    env.broker.publish(&env.event("early-2", b"2")).await.unwrap();
    // A group created only by subscribing, after the publishes, also starts at the beginning.
    for group in [declared, ConsumerGroup::new("late").unwrap()] {
        let mut sub = env.broker.subscribe(&env.dest, &group).await.unwrap();
        for id in ["early-1", "early-2"] {
            let d = next_within(sub.as_mut(), Duration::from_secs(5)).await.expect("delivery");
            assert_eq!(d.event.id.as_str(), id);
            d.ack().await.unwrap();
        }
        assert_eq!(env.broker.unacknowledged(&env.dest, &group).await.unwrap(), 0);
    }
    assert_eq!(env.xlen().await, 2);
}

#[tokio::test]
async fn publish_to_an_undeclared_destination_succeeds() {
    // Redis cannot tell "unroutable": the stream is created by the first publish.
    let Some(mut env) = env(|c| c).await else { return };
    env.broker.publish(&env.event("nobody-1", b"x")).await.unwrap();
    assert_eq!(env.xlen().await, 1);
    assert_eq!(env.broker.unacknowledged(&env.dest, &env.group).await.unwrap(), 1);
}

#[tokio::test]
async fn oversized_payload_is_refused_before_anything_is_written() {
    let Some(mut env) = env(|c| c.with_max_payload(10)).await else { return };
    let err = env.broker.publish(&env.event("big-1", &[7u8; 11])).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge);
    assert!(err.is_permanent());
    env.broker.publish(&env.event("small-1", &[7u8; 10])).await.unwrap();
    assert_eq!(env.xlen().await, 1);
}

#[tokio::test]
async fn dedupe_window_suppresses_a_second_publish_within_the_window() {
    let Some(mut env) = env(|c| c.with_dedupe_window(Duration::from_secs(60))).await else { return };
    let e = env.event("dup-1", b"payload");
    env.broker.publish(&e).await.unwrap();
    env.broker.publish(&e).await.unwrap();
    assert_eq!(env.xlen().await, 1, "second publish within the window must not append");
    env.broker.publish(&env.event("dup-2", b"payload")).await.unwrap();
    assert_eq!(env.xlen().await, 2, "another id is appended");
    let ids: Vec<String> = env.broker.events(&env.dest).await.unwrap().iter().map(|e| e.id.to_string()).collect();
    assert_eq!(ids, ["dup-1", "dup-2"]);
}

#[tokio::test]
async fn dedupe_window_helps_within_the_window_only() {
    let window = Duration::from_millis(300);
    let Some(mut env) = env(|c| c.with_dedupe_window(window)).await else { return };
    let e = env.event("dup-3", b"payload");
    env.broker.publish(&e).await.unwrap();
    let key = format!("{}:dedupe:dup-3", env.stream());
    let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut env.raw).await.unwrap();
    assert!(ttl > 0 && ttl <= 300, "dedupe key ttl {ttl}");
    // Wait for the window to close (the key expires on the server).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let exists: i64 = redis::cmd("EXISTS").arg(&key).query_async(&mut env.raw).await.unwrap();
        if exists == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "dedupe key never expired");
        tokio::task::yield_now().await;
    }
    env.broker.publish(&e).await.unwrap();
    assert_eq!(env.xlen().await, 2, "after the window the same id is appended again");
}

#[tokio::test]
async fn dedupe_is_off_by_default() {
    let Some(mut env) = env(|c| c).await else { return };
    assert_eq!(env.config().dedupe_window, None);
    let e = env.event("dup-4", b"payload");
    env.broker.publish(&e).await.unwrap();
    env.broker.publish(&e).await.unwrap();
    assert_eq!(env.xlen().await, 2, "without a window every publish is appended (duplicates are counted)");
}

#[tokio::test]
async fn trimming_never_deletes_entries_a_group_has_not_acknowledged() {
    let Some(mut env) = env(|c| c.with_max_len(2)).await else { return };
    let lagging = ConsumerGroup::new("lagging").unwrap();
    env.broker.declare(&env.dest, &[env.group.clone(), lagging.clone()]).await.unwrap();
    for i in 1..=4 {
        env.broker.publish(&env.event(&format!("trim-{i}"), b"x")).await.unwrap();
    }
    assert_eq!(env.xlen().await, 4, "nothing acknowledged: nothing trimmed");

    // `billing` acknowledges everything; `lagging` has read nothing: still nothing may go.
    let mut sub = env.broker.subscription(&env.dest, &env.group).await.unwrap();
    for _ in 1..=4 {
        next_within(&mut sub, Duration::from_secs(5)).await.expect("delivery").ack().await.unwrap();
    }
    env.broker.publish(&env.event("trim-5", b"x")).await.unwrap();
    assert_eq!(env.xlen().await, 5, "a group that has not read the entries holds them");

    // `lagging` acknowledges trim-1 and keeps trim-2 pending: only trim-1 may go.
    let mut lag = env.broker.subscription(&env.dest, &lagging).await.unwrap();
    next_within(&mut lag, Duration::from_secs(5)).await.expect("trim-1").ack().await.unwrap();
    let held = next_within(&mut lag, Duration::from_secs(5)).await.expect("trim-2");
    assert_eq!(held.event.id.as_str(), "trim-2");
    env.broker.publish(&env.event("trim-6", b"x")).await.unwrap();
    let ids: Vec<String> = env.broker.events(&env.dest).await.unwrap().iter().map(|e| e.id.to_string()).collect();
    assert_eq!(ids, ["trim-2", "trim-3", "trim-4", "trim-5", "trim-6"], "the pending trim-2 stays");

    // Everything acknowledged by both groups: the stream shrinks to max_len.
    held.ack().await.unwrap();
    for _ in 3..=6 {
        next_within(&mut lag, Duration::from_secs(5)).await.expect("delivery").ack().await.unwrap();
    }
    for _ in 5..=6 {
        next_within(&mut sub, Duration::from_secs(5)).await.expect("delivery").ack().await.unwrap();
    }
    env.broker.publish(&env.event("trim-7", b"x")).await.unwrap();
    let ids: Vec<String> = env.broker.events(&env.dest).await.unwrap().iter().map(|e| e.id.to_string()).collect();
    assert_eq!(ids, ["trim-6", "trim-7"]);
}

#[tokio::test]
async fn trimming_leaves_a_stream_without_groups_alone() {
    let Some(mut env) = env(|c| c.with_max_len(1)).await else { return };
    for i in 1..=3 {
        env.broker.publish(&env.event(&format!("solo-{i}"), b"x")).await.unwrap();
    }
    assert_eq!(env.xlen().await, 3, "no group acknowledged anything, so nothing is trimmed");
}

#[tokio::test]
async fn unsafe_trimming_settings_are_refused() {
    let Some(mut env) = env(|c| c).await else { return };
    // max_len 0 could only be met by deleting unacknowledged entries.
    let err = RedisBroker::connect(env.config().clone().with_max_len(0)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);

    // A user that may not read group progress cannot trim safely: refused when connecting …
    let (user, limited) = env.user(&["~*", "+@all", "-xinfo"]).await;
    let limited = limited.with_max_len(10);
    let err = RedisBroker::connect(limited.clone()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.is_permanent());
    assert!(!format!("{err} {err:?} {limited:?} {limited}").contains("pw-secret-1"), "password leaked");

    // … and at the first publish when the permission is taken away later, with nothing written.
    let _: () = redis::cmd("ACL").arg("SETUSER").arg(&user).arg("+xinfo").query_async(&mut env.raw).await.unwrap();
    let broker = RedisBroker::connect(limited).await.unwrap();
    let _: () = redis::cmd("ACL").arg("SETUSER").arg(&user).arg("-xinfo").query_async(&mut env.raw).await.unwrap();
    let err = broker.publish(&env.event("trim-acl", b"x")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert_eq!(env.xlen().await, 0, "a refused publish appends nothing");
}

#[tokio::test]
async fn unreachable_server_is_a_quick_transient_connection_error() {
    let config = RedisConfig::from_url("redis://127.0.0.1:1").unwrap();
    let started = Instant::now();
    let err = RedisBroker::connect(config).await.unwrap_err();
    let took = started.elapsed();
    eprintln!("unreachable server reported after {took:?}: {err}");
    assert_eq!(err.kind(), ErrorKind::Connection, "{err:?}");
    assert!(err.is_transient());
    assert_eq!(err.backend(), "redis");
    assert!(took < Duration::from_secs(3), "took {took:?}");
}

#[tokio::test]
async fn wrong_password_is_a_permanent_auth_error() {
    if !service_up() {
        return;
    }
    let mut url = url::Url::parse(&base_config().url).unwrap();
    url.set_username("no-such-user-outbox").unwrap();
    url.set_password(Some("hunter2")).unwrap();
    let err = RedisBroker::connect(RedisConfig::from_url(url.as_str()).unwrap()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Auth, "{err:?}");
    assert!(err.is_permanent());
    assert!(!format!("{err} {err:?}").contains("hunter2"));
}

#[tokio::test]
async fn durability_setting_is_read_and_exposed() {
    let Some(mut env) = env(|c| c).await else { return };
    let reply: std::collections::HashMap<String, String> =
        redis::cmd("CONFIG").arg("GET").arg("appendonly").query_async(&mut env.raw).await.unwrap();
    let expected = reply.get("appendonly").map(|v| v == "yes");
    assert_eq!(env.broker.aof_enabled(), expected);
    assert_eq!(env.broker.check_durability().await.unwrap(), expected);

    // A server that will not say (CONFIG not permitted) is tolerated and reported as unknown.
    let (_, config) = env.user(&["~*", "+@all", "-config"]).await;
    let broker = RedisBroker::connect(config).await.unwrap();
    assert_eq!(broker.aof_enabled(), None);
}

#[tokio::test]
async fn config_debug_hides_the_password() {
    let config = RedisConfig::from_url("redis://app:s3cr3t-pw@127.0.0.1:6379/2").unwrap();
    let text = format!("{config:?} / {config}");
    assert!(!text.contains("s3cr3t-pw"), "{text}");
    assert!(text.contains("app:***@"), "{text}");
}

/// The end-to-end case: consumer 1 commits its effect and goes away without
/// acknowledging; consumer 2 gets the redelivery, the inbox says Duplicate, and the effect table
/// still holds exactly one row.
#[tokio::test]
async fn effect_commits_once_when_the_consumer_goes_away_before_ack() {
    let Some(mut env) = env(|c| c).await else { return };
    const CONSUMER: &str = "billing-service";
    let inbox = MemoryInbox::default();
    let e = env.event("credit-7", b"account=a;amount=7");
    env.broker.declare(&env.dest, std::slice::from_ref(&env.group)).await.unwrap();
    env.broker.publish(&e).await.unwrap();

    // Consumer 1: effect and marker in one transaction, committed; then it dies before the ack.
    let mut one = env.broker.subscription(&env.dest, &env.group).await.unwrap();
    let d = next_within(&mut one, Duration::from_secs(5)).await.expect("delivery");
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(inbox.mark(&mut tx, CONSUMER, &d.event.id, &d.event.fingerprint()).await.unwrap(), MarkOutcome::New);
    tx.insert("effects", d.event.payload.clone());
    inbox.commit(tx).await.unwrap();
    drop(d);
    drop(one);

    // Consumer 2: the redelivery is recognised; nothing is applied twice.
    let mut two = env.broker.subscription(&env.dest, &env.group).await.unwrap();
    let d = next_within(&mut two, Duration::from_secs(10)).await.expect("redelivery");
    assert!(d.redelivered);
    assert!(d.attempt.unwrap() >= 2);
    let mut tx = inbox.begin().await.unwrap();
    let outcome = inbox.mark(&mut tx, CONSUMER, &d.event.id, &d.event.fingerprint()).await.unwrap();
    assert_eq!(outcome, MarkOutcome::Duplicate);
    inbox.commit(tx).await.unwrap();
    d.ack().await.unwrap();

    assert_eq!(inbox.table("effects"), vec![b"account=a;amount=7".to_vec()]);
    assert_eq!(inbox.markers(CONSUMER).await.unwrap().len(), 1);
    assert!(env.xpending().await.is_empty());
    assert_nothing_for(&mut two, CLAIM_IDLE * 2).await;
}

#[tokio::test]
async fn lost_connections_are_transient_errors_and_reconnect() {
    let Some(mut env) = env(|c| c).await else { return };
    // A user of its own, so that killing its connections touches nobody else's.
    let (user, config) = env.user(&["~*", "+@all"]).await;
    let broker = RedisBroker::connect(config).await.unwrap();
    broker.declare(&env.dest, std::slice::from_ref(&env.group)).await.unwrap();
    let mut sub = broker.subscription(&env.dest, &env.group).await.unwrap();
    broker.publish(&env.event("conn-1", b"1")).await.unwrap();
    next_within(&mut sub, Duration::from_secs(5)).await.expect("delivery").ack().await.unwrap();

    let killed: i64 = redis::cmd("CLIENT").arg("KILL").arg("USER").arg(&user).query_async(&mut env.raw).await.unwrap();
    assert!(killed >= 2, "killed {killed} connections");

    // Publishing: at most a few transient connection errors, then it works again.
    let e2 = env.event("conn-2", b"2");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut publish_errors = 0;
    loop {
        match broker.publish(&e2).await {
            Ok(()) => break,
            Err(err) => {
                assert_eq!(err.kind(), ErrorKind::Connection, "{err:?}");
                assert!(!err.is_permanent(), "{err:?}");
                publish_errors += 1;
                assert!(Instant::now() < deadline, "publish never recovered: {err}");
            }
        }
    }
    // Reading: the same.
    let mut read_errors = 0;
    let d = loop {
        match sub.next(Duration::from_millis(100)).await {
            Ok(Some(d)) => break d,
            Ok(None) => {}
            Err(err) => {
                assert_eq!(err.kind(), ErrorKind::Connection, "{err:?}");
                assert!(err.is_transient(), "{err:?}");
                read_errors += 1;
            }
        }
        assert!(Instant::now() < deadline, "subscription never recovered");
    };
    eprintln!("after CLIENT KILL: {publish_errors} publish error(s), {read_errors} read error(s)");
    assert_eq!(d.event, e2);
    d.ack().await.unwrap();
    assert!(env.xpending().await.is_empty());
    assert!(env.broker.events(&env.dest).await.unwrap().iter().any(|e| e.id.as_str() == "conn-2"));
}

#[tokio::test]
async fn deleted_stream_closes_the_subscription() {
    let Some(env) = env(|c| c).await else { return };
    let mut sub = env.broker.subscribe(&env.dest, &env.group).await.unwrap();
    assert!(sub.next(Duration::from_millis(10)).await.unwrap().is_none());
    env.broker.delete_destination(&env.dest).await.unwrap();
    let err = sub.next(Duration::from_millis(10)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "{err:?}");
    assert!(err.is_permanent());
    assert_eq!(env.broker.stream_len(&env.dest).await.unwrap(), 0);
}
