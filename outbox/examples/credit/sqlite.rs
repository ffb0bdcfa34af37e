//! The credit ports on SQLite: the SQL that changes with the store, and nothing else.

use std::collections::BTreeMap;

use async_trait::async_trait;
use outbox::sqlite::rusqlite::{TransactionBehavior, params};
use outbox::sqlite::{SqliteInbox, SqliteStore, SqliteTx, enqueue_one, sqlite_error};
use outbox::{Destination, Error, ErrorKind, EventId, Result, RowId};

use super::{Accounts, Order, Orders};

/// The shop's tables in the store's database file.
#[derive(Debug, Clone)]
pub struct Shop {
    store: SqliteStore,
}

impl Shop {
    /// Create the application's tables (the store's own come from its migrations).
    pub async fn create(store: &SqliteStore) -> Result<Self> {
        store
            .with_connection(|c| {
                c.execute_batch(
                    "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, account TEXT NOT NULL, amount INTEGER NOT NULL);
                     CREATE TABLE IF NOT EXISTS credits (seq INTEGER PRIMARY KEY, event_id TEXT NOT NULL,
                                                         account TEXT NOT NULL, amount INTEGER NOT NULL);
                     CREATE TABLE IF NOT EXISTS balances (account TEXT PRIMARY KEY, balance INTEGER NOT NULL);",
                )
            })
            .await?;
        Ok(Self { store: store.clone() })
    }
}

#[async_trait]
impl Accounts<SqliteInbox> for Shop {
    async fn credit(&self, tx: &mut SqliteTx, event: &EventId, account: &str, amount: i64) -> Result<()> {
        let (event, account) = (event.to_string(), account.to_string());
        tx.run(move |c| {
            c.execute(
                "INSERT INTO credits (event_id, account, amount) VALUES (?1, ?2, ?3)",
                params![event, account, amount],
            )?;
            c.execute(
                "INSERT INTO balances (account, balance) VALUES (?1, ?2)
                 ON CONFLICT (account) DO UPDATE SET balance = balance + excluded.balance",
                params![account, amount],
            )
        })
        .await?;
        Ok(())
    }
}

#[async_trait]
impl Orders for Shop {
    async fn place_order(&self, order: &Order, destination: &Destination) -> Result<RowId> {
        let (store, order, event) = (self.store.clone(), order.clone(), order.event(destination)?);
        // rusqlite blocks: run the transaction on the blocking pool.
        let write = tokio::task::spawn_blocking(move || {
            let mut conn = store.connect_raw()?;
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(sqlite_error)?;
            tx.execute(
                "INSERT INTO orders (id, account, amount) VALUES (?1, ?2, ?3)",
                params![order.id, order.account, order.amount],
            )
            .map_err(sqlite_error)?;
            let row = enqueue_one(&tx, &store, &event)?; // the store's clock and payload limit
            tx.commit().map_err(sqlite_error)?;
            Ok(row)
        });
        write.await.map_err(|e| Error::permanent(ErrorKind::Rejected, "sqlite", format!("order task failed: {e}")))?
    }

    async fn credits(&self) -> Result<Vec<(String, String, i64)>> {
        self.store
            .with_connection(|c| {
                let mut s = c.prepare("SELECT event_id, account, amount FROM credits ORDER BY seq")?;
                let rows = s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
                rows.collect()
            })
            .await
    }

    async fn balances(&self) -> Result<BTreeMap<String, i64>> {
        self.store
            .with_connection(|c| {
                let mut s = c.prepare("SELECT account, balance FROM balances")?;
                let rows = s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
                rows.collect()
            })
            .await
    }
}
