//! Consumer throughput on PostgreSQL's inbox by `max_in_flight`, with the reference broker (so
//! the store is the only remote party): `cargo bench -p outbox-consumer-inbox --bench in_flight`.
//! Prints one line per setting; the workspace benchmark (`outbox bench`) owns the comparison
//! with a hand-written loop.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_consumer_inbox::{Consumer, ConsumerConfig, EffectKind, Handler};
use outbox_core::memory::MemoryBroker;
use outbox_core::{Broker, ConsumerGroup, Destination, Event, EventId, Result};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe};
use outbox_store_postgres::{PgConfig, PgInbox, PgStore, PgTx, map_error};

struct Credit(String);

#[async_trait]
impl Handler<PgInbox> for Credit {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }
    async fn apply(&self, tx: &mut PgTx, event: &Event) -> Result<()> {
        let sql = format!("INSERT INTO \"{}\".effects (event_id, amount) VALUES ($1, $2)", self.0);
        sqlx::query(AssertSqlSafe(sql))
            .bind(event.id.as_str())
            .bind(event.payload.len() as i64)
            .execute(&mut **tx)
            .await
            .map_err(map_error)?;
        Ok(())
    }
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::var("BENCH_EVENTS").ok().and_then(|v| v.parse().ok()).unwrap_or(4000);
    let url = std::env::var("OUTBOX_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/test".to_string());
    let schema = format!("obb_inflight_{}", std::process::id());
    let config = PgConfig::from_url(&url).unwrap().with_schema(schema.clone()).with_pool_size(20);
    let store = PgStore::open(config).await.expect("PostgreSQL");
    let ddl = format!("CREATE TABLE \"{schema}\".effects (event_id TEXT NOT NULL, amount BIGINT NOT NULL)");
    sqlx::raw_sql(AssertSqlSafe(ddl)).execute(store.pool()).await.unwrap();
    let d = Destination::new("bench").unwrap();
    let g = ConsumerGroup::new("g").unwrap();
    println!("events {n}, payload 256 B, 64 keys, PostgreSQL inbox, memory broker");
    for in_flight in [1usize, 4, 8, 16, 32] {
        let broker = MemoryBroker::new();
        broker.declare(&d, std::slice::from_ref(&g)).await.unwrap();
        for i in 0..n {
            let e = Event::new(EventId::new(format!("f{in_flight}-e{i}")).unwrap(), d.clone(), vec![7u8; 256])
                .with_key(format!("k{}", i % 64));
            broker.publish(&e).await.unwrap();
        }
        let consumer = Consumer::new(
            store.inbox(),
            Credit(schema.clone()),
            ConsumerConfig::new(format!("bench-{in_flight}")).with_max_in_flight(in_flight),
        );
        let mut sub = broker.subscribe(&d, &g).await.unwrap();
        let start = Instant::now();
        let handled = consumer.drain(sub.as_mut(), Duration::from_millis(20)).await.unwrap();
        let secs = start.elapsed().as_secs_f64();
        assert_eq!(handled.len(), n);
        println!("max_in_flight {in_flight:>2}: {:>8.0} deliveries/s", n as f64 / secs);
    }
    let drop = format!("DROP SCHEMA \"{schema}\" CASCADE");
    sqlx::raw_sql(AssertSqlSafe(drop)).execute(store.pool()).await.unwrap();
}
