//! A running relay publishes an enqueue at once instead of at its next poll.
//!
//! The relays here poll once an hour, so only the store's in-process wake-up signal can get an
//! event to the broker within the deadline. Judged by durable state: the broker's log and the
//! rows read back.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::event;
use outbox_core::memory::MemoryBroker;
use outbox_core::store::all_rows;
use outbox_core::{BatchReport, Broker, ConsumerGroup, OutboxStore, Relay, RelayConfig, RowStatus, Subscription};
use outbox_store_sqlite::SqliteStore;
use outbox_store_sqlite::rusqlite::TransactionBehavior;
use tokio::task::JoinHandle;

const DEADLINE: Duration = Duration::from_secs(10);
const HOUR: Duration = Duration::from_secs(3600);

struct Running {
    relay: Arc<Relay>,
    task: JoinHandle<outbox_core::Result<BatchReport>>,
    broker: MemoryBroker,
    sub: Box<dyn Subscription>,
}

async fn start(store: &SqliteStore) -> Running {
    let broker = MemoryBroker::new();
    let sub = broker.subscribe(&common::dest(), &ConsumerGroup::new("check").unwrap()).await.unwrap();
    let config = RelayConfig::new("relay-wakeup").with_idle_poll(HOUR).with_seed(Some(3));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_enqueue_wakes_a_polling_relay() {
    let db = common::open().await;
    let mut running = start(&db.store).await;
    for i in 0..5 {
        let id = format!("ev-{i}");
        db.store.enqueue(&[event(&id, b"x")]).await.unwrap();
        assert_eq!(running.next_id(&id).await, id);
    }
    let (report, broker) = running.stop().await;
    assert_eq!(report.published, 5, "{report:?}");
    assert_eq!(broker_ids(&broker), ["ev-0", "ev-1", "ev-2", "ev-3", "ev-4"]);
    let rows = all_rows(&db.store).await.unwrap();
    assert_eq!(rows.len(), 5);
    assert!(rows.iter().all(|r| r.status == RowStatus::Published), "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_in_the_callers_transaction_wakes_the_relay_for_the_commit() {
    let db = common::open().await;
    let mut running = start(&db.store).await;
    let store = db.store.clone();
    tokio::task::spawn_blocking(move || {
        let mut conn = store.connect_raw().unwrap();
        conn.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY)").unwrap();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
        tx.execute("INSERT INTO orders VALUES ('o-1')", []).unwrap();
        store.enqueue_one_in(&tx, &event("order-1", b"{}")).unwrap();
        // The relay is woken now, while this transaction still holds the write lock: its claim
        // waits for the commit below.
        tx.execute("INSERT INTO orders VALUES ('o-2')", []).unwrap();
        tx.commit().unwrap();
    })
    .await
    .unwrap();
    assert_eq!(running.next_id("order-1").await, "order-1");
    let (report, broker) = running.stop().await;
    assert_eq!(report.published, 1, "{report:?}");
    assert_eq!(broker_ids(&broker), ["order-1"]);
    let rows = all_rows(&db.store).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].status, RowStatus::Published, "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_enqueue_publishes_nothing_and_the_relay_keeps_listening() {
    let db = common::open().await;
    let mut running = start(&db.store).await;
    let store = db.store.clone();
    tokio::task::spawn_blocking(move || {
        let mut conn = store.connect_raw().unwrap();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
        store.enqueue_one_in(&tx, &event("ghost", b"{}")).unwrap();
        tx.rollback().unwrap();
    })
    .await
    .unwrap();
    // The signal of the rolled-back enqueue woke the relay for nothing; the next one still works.
    db.store.enqueue(&[event("real", b"{}")]).await.unwrap();
    assert_eq!(running.next_id("real").await, "real");
    let (report, broker) = running.stop().await;
    assert_eq!(report.published, 1, "{report:?}");
    assert_eq!(broker_ids(&broker), ["real"], "the rolled-back event must never be published");
    let rows = all_rows(&db.store).await.unwrap();
    let ids: Vec<_> = rows.iter().map(|r| r.event.id.as_str()).collect();
    assert_eq!(ids, ["real"], "the rolled-back row must not exist");
    assert_eq!(rows[0].status, RowStatus::Published);
}
