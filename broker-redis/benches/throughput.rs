//! Publish and consume throughput of the Redis Streams adapter, against a bare `XADD` / `XREADGROUP`
//! loop on the same server as the baseline measured in the same run:
//! `cargo bench -p outbox-broker-redis` (needs Redis; `scripts/services ensure redis`).

use std::time::{Duration, Instant};

use outbox_broker_redis::{RedisBroker, RedisConfig};
use outbox_core::{Broker, ConsumerGroup, Destination, Event, EventId};

const N: usize = 2000;
const PAYLOAD: usize = 256;

fn rate(d: Duration) -> f64 {
    N as f64 / d.as_secs_f64()
}

async fn baseline(url: &str, key: &str) -> redis::RedisResult<(Duration, Duration)> {
    let client = redis::Client::open(url)?;
    let mut con = client.get_multiplexed_async_connection().await?;
    let payload = vec![0u8; PAYLOAD];
    let _: () =
        redis::cmd("XGROUP").arg("CREATE").arg(key).arg("g").arg("0").arg("MKSTREAM").query_async(&mut con).await?;
    let t = Instant::now();
    for i in 0..N {
        let _: String = redis::cmd("XADD")
            .arg(key)
            .arg("*")
            .arg("id")
            .arg(i)
            .arg("p")
            .arg(&payload[..])
            .query_async(&mut con)
            .await?;
    }
    let publish = t.elapsed();
    let t = Instant::now();
    for _ in 0..N {
        let reply: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("c")
            .arg("COUNT")
            .arg(1)
            .arg("STREAMS")
            .arg(key)
            .arg(">")
            .query_async(&mut con)
            .await?;
        let id = first_id(&reply).unwrap_or_default();
        let _: i64 = redis::cmd("XACK").arg(key).arg("g").arg(id).query_async(&mut con).await?;
    }
    let consume = t.elapsed();
    let _: i64 = redis::cmd("DEL").arg(key).query_async(&mut con).await?;
    Ok((publish, consume))
}

fn first_id(v: &redis::Value) -> Option<String> {
    match v {
        redis::Value::BulkString(b) => {
            let s = std::str::from_utf8(b).ok()?;
            let (ms, seq) = s.split_once('-')?;
            (ms.bytes().all(|c| c.is_ascii_digit()) && seq.bytes().all(|c| c.is_ascii_digit())).then(|| s.to_string())
        }
        redis::Value::Array(items) | redis::Value::Set(items) => items.iter().find_map(first_id),
        redis::Value::Map(kv) => kv.iter().find_map(|(k, v)| first_id(k).or_else(|| first_id(v))),
        _ => None,
    }
}

async fn adapter(config: RedisConfig, dest: &Destination) -> outbox_core::Result<(Duration, Duration)> {
    let broker = RedisBroker::connect(config).await?;
    let group = ConsumerGroup::new("g")?;
    broker.declare(dest, std::slice::from_ref(&group)).await?;
    let t = Instant::now();
    for i in 0..N {
        broker.publish(&Event::new(EventId::new(format!("m-{i}"))?, dest.clone(), vec![0u8; PAYLOAD])).await?;
    }
    let publish = t.elapsed();
    let mut sub = broker.subscribe(dest, &group).await?;
    let t = Instant::now();
    let mut got = 0;
    while got < N {
        if let Some(d) = sub.next(Duration::from_secs(5)).await? {
            d.ack().await?;
            got += 1;
        }
    }
    let consume = t.elapsed();
    drop(sub);
    broker.delete_destination(dest).await?;
    Ok((publish, consume))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let url = outbox_conformance_tests::redis_url();
    let config = match RedisConfig::from_url(&url) {
        Ok(c) => c,
        Err(e) => return eprintln!("bench not run: {e}"),
    };
    let prefix = format!("outbox-bench:{}:", std::process::id());
    println!(
        "outbox-broker-redis bench: {N} messages of {PAYLOAD} bytes, sequential publish, then consume + ack one at a time; server {}",
        config.redacted_url()
    );
    let base = match baseline(&config.url, &format!("{prefix}baseline")).await {
        Ok(b) => b,
        Err(e) => {
            return eprintln!("bench not run: Redis unreachable ({e}); start it with `scripts/services ensure redis`");
        }
    };
    let dest = |n: &str| Destination::new(n).expect("valid destination");
    let mut rows = vec![("bare XADD / XREADGROUP (baseline)".to_string(), base)];
    for (name, cfg) in [
        ("adapter, defaults", config.clone().with_prefix(prefix.clone())),
        (
            "adapter, dedupe window + max_len",
            config
                .clone()
                .with_prefix(prefix.clone())
                .with_dedupe_window(Duration::from_secs(60))
                .with_max_len(100_000),
        ),
    ] {
        match adapter(cfg, &dest(if name.contains("dedupe") { "dedupe" } else { "plain" })).await {
            Ok(r) => rows.push((name.to_string(), r)),
            Err(e) => return eprintln!("bench failed: {e}"),
        }
    }
    println!("{:<36} {:>12} {:>11} {:>16} {:>11}", "", "publish/s", "time ×base", "consume+ack/s", "time ×base");
    for (name, (p, c)) in &rows {
        println!(
            "{name:<36} {:>12.0} {:>10.1}x {:>16.0} {:>10.1}x",
            rate(*p),
            p.as_secs_f64() / base.0.as_secs_f64(),
            rate(*c),
            c.as_secs_f64() / base.1.as_secs_f64()
        );
    }
}
