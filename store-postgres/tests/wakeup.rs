//! LISTEN/NOTIFY wakes a running relay at once, against a real server, each test in a fresh
//! schema.
//!
//! The relays here poll once an hour, so only the notification sent by enqueue's transaction
//! can get an event to the broker within the deadline. Judged by durable state: the broker's
//! log and the rows read back.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{TestDb, event};
use outbox_core::memory::MemoryBroker;
use outbox_core::store::all_rows;
use outbox_core::{BatchReport, Broker, ConsumerGroup, OutboxStore, Relay, RelayConfig, RowStatus, Subscription};
use outbox_store_postgres::sqlx::{self, AssertSqlSafe, Connection, PgConnection};
use outbox_store_postgres::{PgConfig, PgStore, enqueue, enqueue_one};
use tokio::task::JoinHandle;

const DEADLINE: Duration = Duration::from_secs(10);
const HOUR: Duration = Duration::from_secs(3600);

struct Running {
    relay: Arc<Relay>,
    task: JoinHandle<outbox_core::Result<BatchReport>>,
    broker: MemoryBroker,
    sub: Box<dyn Subscription>,
}

async fn start(store: &PgStore) -> Running {
    let broker = MemoryBroker::new();
    let sub = broker.subscribe(&common::dest(), &ConsumerGroup::new("check").unwrap()).await.unwrap();
    let config = RelayConfig::new("relay-wakeup").with_idle_poll(HOUR).with_seed(Some(5));
    let relay = Arc::new(Relay::new(Arc::new(store.clone()), Arc::new(broker.clone()), config));
    let task = tokio::spawn({
        let relay = relay.clone();
        async move { relay.run().await }
    });
    Running { relay, task, broker, sub }
}

impl Running {
    /// The id of the next event on the broker, waiting at most [`DEADLINE`].
    async fn next_id(&mut self, what: &str) -> String {
        let delivery = self.sub.next(DEADLINE).await.unwrap().unwrap_or_else(|| {
            panic!("{what}: nothing reached the broker within {DEADLINE:?} (the relay polls hourly)")
        });
        let id = delivery.event.id.as_str().to_owned();
        delivery.ack().await.unwrap();
        id
    }

    /// Stop the relay; its last batch is finished (completed) when this returns.
    async fn stop(self) -> (BatchReport, MemoryBroker) {
        self.relay.shutdown_handle().trigger();
        let report = tokio::time::timeout(DEADLINE, self.task).await.expect("relay did not stop").unwrap().unwrap();
        (report, self.broker)
    }
}

fn broker_ids(broker: &MemoryBroker) -> Vec<String> {
    broker.log(&common::dest()).iter().map(|e| e.id.as_str().to_owned()).collect()
}

async fn assert_all_published(store: &PgStore, expected: &[&str]) {
    let rows = all_rows(store).await.unwrap();
    let ids: Vec<_> = rows.iter().map(|r| r.event.id.as_str()).collect();
    assert_eq!(ids, expected);
    for r in &rows {
        assert_eq!(r.status, RowStatus::Published, "{r:?}");
    }
}

/// Sessions whose `application_name` is `config`'s (only those that last ran `LISTEN`, if
/// `listening`), seen from a connection of its own.
async fn sessions(config: &PgConfig, listening: bool) -> i64 {
    let name = config.application_name().expect("tests set an application name").to_owned();
    let mut conn =
        PgConnection::connect_with(&config.connect_options().unwrap().application_name("wakeup-probe")).await.unwrap();
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND (NOT $2 OR query LIKE 'LISTEN%')",
    )
    .bind(name)
    .bind(listening)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let _ = conn.close().await;
    n
}

/// Wait (bounded) until [`sessions`] is `n`.
async fn wait_for_sessions(config: &PgConfig, listening: bool, n: i64, what: &str) {
    let start = Instant::now();
    loop {
        let now = sessions(config, listening).await;
        if now == n {
            return;
        }
        assert!(start.elapsed() < DEADLINE, "{what}: {now} sessions after {DEADLINE:?}, expected {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_enqueue_wakes_a_polling_relay() {
    let Some(db) = TestDb::new("wake_store").await else { return };
    let mut running = start(&db.store).await;
    for i in 0..5 {
        let id = format!("ev-{i}");
        db.store.enqueue(&[event(&id, b"x")]).await.unwrap();
        assert_eq!(running.next_id(&id).await, id);
    }
    let (report, broker) = running.stop().await;
    assert_eq!(report.published, 5, "{report:?}");
    assert_eq!(broker_ids(&broker), ["ev-0", "ev-1", "ev-2", "ev-3", "ev-4"]);
    assert_all_published(&db.store, &["ev-0", "ev-1", "ev-2", "ev-3", "ev-4"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_in_the_callers_transaction_notifies_at_commit() {
    let Some(db) = TestDb::new("wake_tx").await else { return };
    let orders = db.store.tables().app_table("orders").unwrap();
    db.exec(format!("CREATE TABLE {orders} (id text PRIMARY KEY)")).await;
    let mut running = start(&db.store).await;

    let mut tx = db.store.pool().begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {orders} (id) VALUES ('o-1')"))).execute(&mut *tx).await.unwrap();
    // Only the tables, as an application with its own pool and no store would.
    enqueue(&mut tx, db.store.tables(), &[event("order-1", b"{}"), event("order-2", b"{}")]).await.unwrap();
    tx.commit().await.unwrap();

    let mut got = vec![running.next_id("order-1 or -2").await, running.next_id("order-1 or -2").await];
    got.sort();
    assert_eq!(got, ["order-1", "order-2"]);
    let (report, _) = running.stop().await;
    assert_eq!(report.published, 2, "{report:?}");
    assert_all_published(&db.store, &["order-1", "order-2"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_enqueue_wakes_nobody_and_publishes_nothing() {
    let Some(db) = TestDb::new("wake_rollback").await else { return };
    let mut running = start(&db.store).await;

    let mut tx = db.store.pool().begin().await.unwrap();
    enqueue_one(&mut tx, &db.store, &event("ghost", b"{}")).await.unwrap();
    tx.rollback().await.unwrap();
    {
        // Dropped without commit: rolled back as well.
        let mut tx = db.store.pool().begin().await.unwrap();
        enqueue_one(&mut tx, &db.store, &event("ghost-2", b"{}")).await.unwrap();
    }
    db.store.enqueue(&[event("real", b"{}")]).await.unwrap();

    assert_eq!(running.next_id("real").await, "real");
    let (report, broker) = running.stop().await;
    assert_eq!(report.published, 1, "{report:?}");
    assert_eq!(broker_ids(&broker), ["real"], "a rolled-back event must never be published");
    assert_all_published(&db.store, &["real"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_reconnects_after_its_session_is_killed() {
    let Some(db) = TestDb::new("wake_reconnect").await else { return };
    let mut running = start(&db.store).await;
    db.store.enqueue(&[event("before", b"{}")]).await.unwrap();
    assert_eq!(running.next_id("before").await, "before");
    wait_for_sessions(&db.config, true, 1, "listening before the kill").await;

    let mut conn = PgConnection::connect_with(&db.config.connect_options().unwrap()).await.unwrap();
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND query LIKE 'LISTEN%' AND pid <> pg_backend_pid()) AS k",
    )
    .bind(db.schema())
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let _ = conn.close().await;
    assert_eq!(killed, 1);

    // Whether this commits before or after the listener is back, the relay learns of it: a
    // notification, or the signal the listener sends once it listens again.
    db.store.enqueue(&[event("after", b"{}")]).await.unwrap();
    assert_eq!(running.next_id("after").await, "after");
    wait_for_sessions(&db.config, true, 1, "listening after the reconnect").await;
    let (report, _) = running.stop().await;
    assert_eq!(report.published, 2, "{report:?}");
    assert_all_published(&db.store, &["before", "after"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_ends_with_close_and_with_the_last_clone() {
    let Some(db) = TestDb::new("wake_close").await else { return };
    // Stores of their own, told apart from the test's store by their application name.
    let config = db.config.clone().with_application_name(format!("{}_own", db.schema()));

    // A store that no relay asked for a signal never listens.
    let producer = PgStore::connect(config.clone()).await.unwrap();
    producer.enqueue(&[event("e1", b"{}")]).await.unwrap();
    assert_eq!(sessions(&config, true).await, 0);
    producer.close().await;
    wait_for_sessions(&config, false, 0, "after closing the producer").await;

    // Dropped: the listener of a store goes away with its last clone.
    let dropped = PgStore::connect(config.clone()).await.unwrap();
    let clone = dropped.clone();
    let wakeup = clone.wakeup().expect("a PostgreSQL store has a wake-up signal");
    let again = dropped.wakeup().expect("a second subscription");
    wait_for_sessions(&config, true, 1, "one listener for two subscriptions").await;
    drop(dropped);
    wait_for_sessions(&config, true, 1, "a clone still lives").await;
    drop(clone);
    drop((wakeup, again));
    wait_for_sessions(&config, false, 0, "after dropping the store").await;

    // Closed: no listener, and no new one for later subscriptions.
    let closed = PgStore::connect(config.clone()).await.unwrap();
    let _w = closed.wakeup().expect("signal");
    wait_for_sessions(&config, true, 1, "before close").await;
    closed.close().await;
    wait_for_sessions(&config, false, 0, "after close").await;
    assert!(closed.wakeup().is_none(), "a closed store must not listen again");
}
