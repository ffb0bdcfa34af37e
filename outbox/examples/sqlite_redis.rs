//! One credit handler on one store and one broker, end to end: orders and their events commit
//! together, a relay publishes them, a consumer credits each account exactly once.
//!
//! `sqlite_redis.rs` and `postgres_kafka.rs` are the same program before and after a swap of
//! both store and broker: they differ only in the lines marked `// swap` (the outbox README
//! counts them, `tests/handler_swap.rs` checks the count). The handler (`credit/mod.rs`) does
//! not change at all; the store's SQL lives in `credit/sqlite.rs` / `credit/postgres.rs`.
//!
//! Run: `cargo run -p outbox --all-features --example sqlite_redis` (or `postgres_kafka`)
//! (`STORE_URL` / `BROKER_URL` override the defaults below).

// Shared by both examples and tests/handler_swap.rs; each uses part of it.
#[allow(dead_code, unreachable_pub)]
#[path = "credit/mod.rs"]
mod credit;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use credit::sqlite::Shop; // swap
use credit::{Credit, Order, Orders};
use outbox::consumer::{Consumer, ConsumerConfig};
use outbox::sqlite::{SqliteConfig as Config, SqliteStore as Store}; // swap
use outbox::{ConsumerGroup, Destination, InboxAdmin, Relay, RelayConfig};

const STORE_URL: &str = "sqlite:///tmp/outbox-example-shop.db"; // swap
const BROKER_URL: &str = "redis://127.0.0.1:6379"; // swap

#[tokio::main]
async fn main() -> outbox::Result<()> {
    let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
    let store = Store::open(Config::from_url(&env("STORE_URL", STORE_URL))?).await?; // connect + migrate
    let broker = outbox::broker_from_url(&env("BROKER_URL", BROKER_URL)).await?;
    let shop = Shop::create(&store).await?;

    let destination = Destination::new("shop-orders")?;
    let group = ConsumerGroup::new("billing")?;
    broker.declare(&destination, std::slice::from_ref(&group)).await?;
    let mut subscription = broker.subscribe(&destination, &group).await?;

    // Producer: each order row and its event commit in one transaction.
    let run = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    for (i, (account, amount)) in [("alice", 7), ("bob", 7), ("alice", 7)].into_iter().enumerate() {
        shop.place_order(&Order::new(format!("{run}-{i}"), account, amount), &destination).await?;
    }

    // Relay: every committed event is offered to the broker at least once.
    let report = Relay::new(Arc::new(store.clone()), broker.clone(), RelayConfig::new("relay-1")).drain().await?;
    println!("relay: {report:?}");

    // Consumer: the same handler on whichever inbox the store has.
    let consumer = Consumer::new(store.inbox(), Credit::new(shop.clone()), ConsumerConfig::new("billing"));
    let handled = consumer.drain(&mut *subscription, Duration::from_secs(10)).await?;
    println!("handled: {handled:?}");
    println!("markers: {}", store.inbox().markers("billing").await?.len());
    println!("balances: {:?}", shop.balances().await?);
    Ok(())
}
