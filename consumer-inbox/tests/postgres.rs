//! The concurrent consumer on a real store: PostgreSQL's inbox (markers under a unique key, the
//! effect in the same transaction) with the reference broker. Judged by what PostgreSQL holds
//! afterwards: effect rows (with a sequence number in insert order), markers, and what the
//! broker still holds.
//!
//! Needs PostgreSQL (`OUTBOX_PG_URL`, else `postgres://postgres:postgres@127.0.0.1:5432/test`);
//! outside CI an unreachable server skips loudly, under `CI=true` it fails.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use common::{BOUND, Gauge, Running, dest, group, label, memory_broker};
use outbox_consumer_inbox::{Consumer, ConsumerConfig, EffectKind, Handled, Handler};
use outbox_core::memory::MemoryBroker;
use outbox_core::{Broker, Error, ErrorKind, Event, EventId, InboxAdmin, Result};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe};
use outbox_store_postgres::{PgConfig, PgInbox, PgStore, PgTx, map_error};
use tokio::sync::{Barrier, Semaphore};

const IDLE: Duration = Duration::from_millis(100);
const CONSUMER: &str = "billing";

/// A migrated store in a schema of its own, or `None` (skipped loudly) when PostgreSQL is down
/// outside CI.
async fn store(tag: &str) -> Option<(PgStore, String)> {
    static N: AtomicU64 = AtomicU64::new(0);
    let url = std::env::var("OUTBOX_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/test".to_string());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let schema =
        format!("obt_ci_{tag}_{}_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed), nanos % 1_000_000);
    let config = PgConfig::from_url(&url)
        .expect("a valid PostgreSQL URL")
        .with_schema(schema.clone())
        .with_pool_size(12)
        .with_connect_timeout(Duration::from_secs(5));
    match PgStore::open(config).await {
        Ok(store) => {
            let sql = format!(
                "CREATE TABLE \"{schema}\".effects (seq BIGSERIAL PRIMARY KEY, event_id TEXT NOT NULL, \
                 key TEXT, label TEXT NOT NULL, tx BIGINT NOT NULL DEFAULT txid_current())"
            );
            sqlx::raw_sql(AssertSqlSafe(sql)).execute(store.pool()).await.expect("create the effect table");
            Some((store, schema))
        }
        Err(e) if e.kind() == ErrorKind::Connection && !in_ci() => {
            eprintln!("SKIPPED: PostgreSQL is not reachable ({e}); start it with `scripts/services ensure postgres`");
            None
        }
        Err(e) => panic!("PostgreSQL at the test URL: {e}"),
    }
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

async fn drop_schema(store: &PgStore, schema: &str) {
    let sql = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
    sqlx::raw_sql(AssertSqlSafe(sql)).execute(store.pool()).await.expect("drop the test schema");
}

/// Inserts one effect row on the inbox transaction. `gate…` payloads meet at a barrier
/// (bounded); `hold…` payloads write their row, then wait for a permit with it uncommitted.
struct Credit {
    schema: String,
    gauge: Gauge,
    gate: Arc<Barrier>,
    gate_missed: AtomicBool,
    hold: Arc<Semaphore>,
}

impl Credit {
    fn new(schema: &str, gate: usize) -> Self {
        Self {
            schema: schema.to_string(),
            gauge: Gauge::default(),
            gate: Arc::new(Barrier::new(gate)),
            gate_missed: AtomicBool::new(false),
            hold: Arc::new(Semaphore::new(0)),
        }
    }
}

#[async_trait]
impl Handler<PgInbox> for Credit {
    fn effect(&self) -> EffectKind {
        EffectKind::Additive
    }
    async fn apply(&self, tx: &mut PgTx, event: &Event) -> Result<()> {
        let me = label(event);
        self.gauge.enter();
        let result = async {
            if me.starts_with("gate") && tokio::time::timeout(BOUND, self.gate.wait()).await.is_err() {
                self.gate_missed.store(true, Ordering::SeqCst);
                return Err(Error::transient(ErrorKind::Handler, "test", "gate not reached"));
            }
            let sql = format!("INSERT INTO \"{}\".effects (event_id, key, label) VALUES ($1, $2, $3)", self.schema);
            sqlx::query(AssertSqlSafe(sql))
                .bind(event.id.as_str())
                .bind(event.key.as_deref())
                .bind(&me)
                .execute(&mut **tx)
                .await
                .map_err(map_error)?;
            if me.starts_with("hold") {
                self.hold.acquire().await.expect("semaphore open").forget();
            }
            Ok(())
        }
        .await;
        self.gauge.leave();
        result
    }
}

fn ev(id: &str, payload: &str) -> Event {
    Event::new(EventId::new(id).unwrap(), dest(), payload.as_bytes().to_vec())
}

/// Effect rows in insert order: (event id, key, label).
async fn effect_rows(store: &PgStore, schema: &str) -> Vec<(String, Option<String>, String)> {
    let sql = format!("SELECT event_id, key, label FROM \"{schema}\".effects ORDER BY seq");
    sqlx::query_as(AssertSqlSafe(sql)).fetch_all(store.pool()).await.expect("read effects")
}

/// One effect row per event (`events` of them), and the rows of each key `k0…` in receive order
/// (`k<k>:0`, `k<k>:1`, …).
async fn assert_once_each_in_key_order(store: &PgStore, schema: &str, events: usize, keys: usize, per_key: usize) {
    let rows = effect_rows(store, schema).await;
    let mut per_event: BTreeMap<&str, usize> = BTreeMap::new();
    for (id, _, _) in &rows {
        *per_event.entry(id.as_str()).or_default() += 1;
    }
    assert_eq!(per_event.len(), events);
    assert!(per_event.values().all(|n| *n == 1), "one effect row per event: {per_event:?}");
    for k in 0..keys {
        let key = format!("k{k}");
        let order: Vec<&str> = rows.iter().filter(|r| r.1.as_deref() == Some(&key)).map(|r| r.2.as_str()).collect();
        let expected: Vec<String> = (0..per_key).map(|i| format!("k{k}:{i}")).collect();
        assert_eq!(order, expected, "effects of {key} in receive order");
    }
}

fn unacked(broker: &MemoryBroker) -> usize {
    broker.unacknowledged(&dest(), &group())
}

/// Eight in flight on PostgreSQL: four keyless deliveries meet at a barrier (so they really ran
/// at once), each key's effects are inserted in receive order, and every copy of an event after
/// the first applies nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_keeps_key_order_and_applies_copies_once_with_eight_in_flight() {
    let Some((store, schema)) = store("order").await else { return };
    const KEYS: usize = 4;
    const PER_KEY: usize = 10;
    let mut events: Vec<Event> = (0..4).map(|i| ev(&format!("gate-{i}"), &format!("gate{i}"))).collect();
    for i in 0..PER_KEY {
        events.extend((0..KEYS).map(|k| ev(&format!("k{k}-{i}"), &format!("k{k}:{i}")).with_key(format!("k{k}"))));
    }
    let first: Vec<Event> = events.clone();
    events.extend(first.iter().cloned()); // every event a second time
    let broker = memory_broker(&events).await;
    let handler = Credit::new(&schema, 4);
    let gauge = handler.gauge.clone();
    let consumer = Consumer::new(store.inbox(), handler, ConsumerConfig::new(CONSUMER).with_max_in_flight(8));
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let handled =
        tokio::time::timeout(BOUND * 3, consumer.drain(sub.as_mut(), IDLE)).await.expect("drain ends").unwrap();
    let count = |want: &Handled| handled.iter().filter(|h| *h == want).count();
    assert_eq!((count(&Handled::Applied), count(&Handled::Duplicate)), (first.len(), first.len()), "{handled:?}");
    assert!(gauge.max() >= 4, "the gate was met: at least four at once (max {})", gauge.max());

    assert_once_each_in_key_order(&store, &schema, first.len(), KEYS, PER_KEY).await;
    assert_eq!(store.inbox().markers(CONSUMER).await.unwrap().len(), first.len());
    assert_eq!(unacked(&broker), 0);
    drop_schema(&store, &schema).await;
}

/// Batch commit on PostgreSQL, sixteen in flight and up to eight per commit: 30 keys × 4
/// events, every event twice. Effects that share a transaction id prove the batches formed;
/// each event applies once, each key in receive order, one marker per event, nothing left on
/// the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_batches_share_a_transaction_and_apply_each_once() {
    let Some((store, schema)) = store("batch").await else { return };
    const KEYS: usize = 30;
    const PER_KEY: usize = 4;
    let mut first = Vec::new();
    for i in 0..PER_KEY {
        first.extend((0..KEYS).map(|k| ev(&format!("k{k}-{i}"), &format!("k{k}:{i}")).with_key(format!("k{k}"))));
    }
    let events: Vec<Event> = first.iter().flat_map(|e| [e.clone(), e.clone()]).collect();
    let broker = memory_broker(&events).await;
    let config = ConsumerConfig::new(CONSUMER).with_max_in_flight(16).with_max_per_commit(8);
    let consumer = Consumer::new(store.inbox(), Credit::new(&schema, 1), config);
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let handled =
        tokio::time::timeout(BOUND * 3, consumer.drain(sub.as_mut(), IDLE)).await.expect("drain ends").unwrap();
    let count = |want: &Handled| handled.iter().filter(|h| *h == want).count();
    assert_eq!((count(&Handled::Applied), count(&Handled::Duplicate)), (first.len(), first.len()), "{handled:?}");

    assert_once_each_in_key_order(&store, &schema, first.len(), KEYS, PER_KEY).await;
    let sql = format!("SELECT count(*) FROM \"{schema}\".effects GROUP BY tx ORDER BY count(*) DESC");
    let per_tx: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(sql)).fetch_all(store.pool()).await.expect("read tx ids");
    assert!(per_tx[0] >= 2, "no two effects committed in one transaction: {per_tx:?}");
    assert!(per_tx[0] <= 8, "more effects in one transaction than max_per_commit: {per_tx:?}");
    assert!(per_tx.len() < first.len(), "{} transactions for {} effects", per_tx.len(), first.len());
    assert_eq!(store.inbox().markers(CONSUMER).await.unwrap().len(), first.len());
    assert_eq!(unacked(&broker), 0);
    drop_schema(&store, &schema).await;
}

/// Two members of one group, eight in flight each, racing on three copies of every event: the
/// marker's unique key serializes them and each effect commits once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_members_racing_on_copies_apply_each_once() {
    let Some((store, schema)) = store("race").await else { return };
    const N: usize = 40;
    let once: Vec<Event> = (0..N).map(|i| ev(&format!("e{i}"), &format!("e{i}"))).collect();
    let events: Vec<Event> = once.iter().flat_map(|e| [e.clone(), e.clone(), e.clone()]).collect();
    let broker = memory_broker(&events).await;
    let config = ConsumerConfig::new(CONSUMER).with_max_in_flight(8);
    let one = Consumer::new(store.inbox(), Credit::new(&schema, 1), config.clone());
    let two = Consumer::new(store.inbox(), Credit::new(&schema, 1), config);
    let mut sub1 = broker.subscribe(&dest(), &group()).await.unwrap();
    let mut sub2 = broker.subscribe(&dest(), &group()).await.unwrap();
    let (a, b) = tokio::time::timeout(BOUND * 3, async {
        tokio::join!(one.drain(sub1.as_mut(), IDLE), two.drain(sub2.as_mut(), IDLE))
    })
    .await
    .expect("both drains end");
    let handled: Vec<Handled> = a.unwrap().into_iter().chain(b.unwrap()).collect();
    assert_eq!(handled.iter().filter(|h| **h == Handled::Applied).count(), N, "{handled:?}");
    assert_eq!(handled.iter().filter(|h| **h == Handled::Duplicate).count(), 2 * N, "{handled:?}");

    let rows = effect_rows(&store, &schema).await;
    let mut ids: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    ids.sort_unstable();
    let mut expected: Vec<String> = (0..N).map(|i| format!("e{i}")).collect();
    expected.sort();
    assert_eq!(ids, expected, "one effect row per event");
    assert_eq!(store.inbox().markers(CONSUMER).await.unwrap().len(), N);
    assert_eq!(unacked(&broker), 0);
    drop_schema(&store, &schema).await;
}

/// Shutdown with deliveries whose effect rows are written but not committed, and a grace of
/// zero: `run` returns, PostgreSQL holds neither their effects nor their markers, the broker
/// still holds them, and the next member applies each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_shutdown_after_the_grace_rolls_back_and_redelivers() {
    let Some((store, schema)) = store("grace").await else { return };
    let events: Vec<Event> = (0..3).map(|i| ev(&format!("h{i}"), &format!("hold{i}"))).collect();
    let broker = memory_broker(&events).await;
    let handler = Credit::new(&schema, 1);
    let gauge = handler.gauge.clone();
    let config =
        ConsumerConfig::new(CONSUMER).with_max_in_flight(4).with_shutdown_grace(Duration::ZERO).with_receive_wait(IDLE);
    let consumer = Consumer::new(store.inbox(), handler, config);
    let running = Running::start(&consumer, &broker).await;
    running.wait_inside(&gauge, 3, "three deliveries holding uncommitted effect rows").await;
    running.trigger();
    let sub = running.stopped("run stops after the grace").await;
    assert!(effect_rows(&store, &schema).await.is_empty(), "the unfinished effects rolled back");
    assert!(store.inbox().markers(CONSUMER).await.unwrap().is_empty(), "and their markers");
    assert_eq!(unacked(&broker), 3, "never acknowledged");
    drop(sub);

    let open = Credit::new(&schema, 1);
    open.hold.add_permits(3);
    let next = Consumer::new(store.inbox(), open, ConsumerConfig::new(CONSUMER));
    let mut sub = broker.subscribe(&dest(), &group()).await.unwrap();
    let handled = tokio::time::timeout(BOUND, next.drain(sub.as_mut(), IDLE)).await.expect("drain ends").unwrap();
    assert_eq!(handled, vec![Handled::Applied; 3]);
    let mut labels: Vec<String> = effect_rows(&store, &schema).await.into_iter().map(|r| r.2).collect();
    labels.sort();
    assert_eq!(labels, ["hold0", "hold1", "hold2"], "each once");
    assert_eq!(store.inbox().markers(CONSUMER).await.unwrap().len(), 3);
    assert_eq!(unacked(&broker), 0);
    drop_schema(&store, &schema).await;
}
