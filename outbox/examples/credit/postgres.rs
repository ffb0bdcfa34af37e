//! The credit ports on PostgreSQL: the SQL that changes with the store, and nothing else.

use std::collections::BTreeMap;

use async_trait::async_trait;
use outbox::postgres::sqlx::{self, AssertSqlSafe};
use outbox::postgres::{PgInbox, PgStore, PgTx, enqueue_one, map_commit_error, map_error};
use outbox::{Destination, EventId, Result, RowId};

use super::{Accounts, Order, Orders};

/// The shop's tables in the store's schema.
#[derive(Debug, Clone)]
pub struct Shop {
    store: PgStore,
    orders: String,
    credits: String,
    balances: String,
}

impl Shop {
    /// Create the application's tables (the store's own come from its migrations).
    pub async fn create(store: &PgStore) -> Result<Self> {
        let t = |name| store.tables().app_table(name);
        let (orders, credits, balances) = (t("orders")?, t("credits")?, t("balances")?);
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {orders} (id text PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS {credits} (seq bigserial PRIMARY KEY, event_id text NOT NULL,
                                                  account text NOT NULL, amount bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS {balances} (account text PRIMARY KEY, balance bigint NOT NULL);"
        );
        sqlx::raw_sql(AssertSqlSafe(ddl)).execute(store.pool()).await.map_err(map_error)?;
        Ok(Self { store: store.clone(), orders, credits, balances })
    }
}

#[async_trait]
impl Accounts<PgInbox> for Shop {
    async fn credit(&self, tx: &mut PgTx, event: &EventId, account: &str, amount: i64) -> Result<()> {
        let credit = format!("INSERT INTO {} (event_id, account, amount) VALUES ($1, $2, $3)", self.credits);
        let balance = format!(
            "INSERT INTO {} AS b (account, balance) VALUES ($1, $2)
             ON CONFLICT (account) DO UPDATE SET balance = b.balance + excluded.balance",
            self.balances
        );
        let (conn, event) = (&mut **tx, event.as_str());
        sqlx::query(AssertSqlSafe(credit))
            .bind(event)
            .bind(account)
            .bind(amount)
            .execute(&mut *conn)
            .await
            .map_err(map_error)?;
        sqlx::query(AssertSqlSafe(balance)).bind(account).bind(amount).execute(&mut *conn).await.map_err(map_error)?;
        Ok(())
    }
}

#[async_trait]
impl Orders for Shop {
    async fn place_order(&self, order: &Order, destination: &Destination) -> Result<RowId> {
        let event = order.event(destination)?;
        let insert = format!("INSERT INTO {} (id, account, amount) VALUES ($1, $2, $3)", self.orders);
        let mut tx = self.store.pool().begin().await.map_err(map_error)?;
        sqlx::query(AssertSqlSafe(insert))
            .bind(&order.id)
            .bind(&order.account)
            .bind(order.amount)
            .execute(&mut *tx)
            .await
            .map_err(map_error)?;
        let row = enqueue_one(&mut tx, &self.store, &event).await?; // the store's clock and payload limit
        tx.commit().await.map_err(map_commit_error)?;
        Ok(row)
    }

    async fn credits(&self) -> Result<Vec<(String, String, i64)>> {
        let sql = format!("SELECT event_id, account, amount FROM {} ORDER BY seq", self.credits);
        sqlx::query_as(AssertSqlSafe(sql)).fetch_all(self.store.pool()).await.map_err(map_error)
    }

    async fn balances(&self) -> Result<BTreeMap<String, i64>> {
        let sql = format!("SELECT account, balance FROM {}", self.balances);
        let rows: Vec<(String, i64)> =
            sqlx::query_as(AssertSqlSafe(sql)).fetch_all(self.store.pool()).await.map_err(map_error)?;
        Ok(rows.into_iter().collect())
    }
}
