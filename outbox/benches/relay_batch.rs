//! Relay throughput on PostgreSQL by batch size, with a broker that returns at once, against
//! the raw claim + complete SQL as the baseline measured in the same run.
//!
//! `cargo bench -p outbox --features postgres --bench relay_batch`
//!
//! A backlog of `BENCH_ROWS` rows (default 50,000; 256-byte payloads) is drained by one relay
//! whose owner name is 12 bytes long, once per batch size (1, 100, 500), then by the store's
//! `claim` + `complete_many` without a relay, then by hand-written SQL. Batch 1 drains a
//! smaller backlog (it is a round trip per row). The server is `OUTBOX_PG_URL` (default: the
//! local test server); everything happens in a fresh schema that is dropped at the end.
//!
//! What to watch: batch 500 must not be slower than batch 100. It was (9.0k vs 43k events/s
//! with a 1-byte owner) when `complete_many` sent the owner once per row: its request then
//! outgrew one TCP send and waited for a delayed ACK, about 40 ms per batch (see the
//! `outbox-store-postgres` README).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::{
    Broker, ConsumerGroup, Destination, Error, ErrorKind, Event, EventId, OutboxAdmin, OutboxStore, Relay, RelayConfig,
    Result, Subscription,
};
use outbox_store_postgres::sqlx::postgres::PgSslMode;
use outbox_store_postgres::sqlx::{self, AssertSqlSafe, Connection, PgConnection, Row};
use outbox_store_postgres::{PgConfig, PgStore};

/// 12 bytes, the owner length that showed the stall.
const OWNER: &str = "relay-bench1";
const LEASE: Duration = Duration::from_secs(60);
const PAYLOAD: usize = 256;

/// A broker that accepts everything at once: the relay's and the store's cost only.
struct Instant0;

#[async_trait]
impl Broker for Instant0 {
    fn backend(&self) -> &'static str {
        "instant"
    }
    async fn declare(&self, _: &Destination, _: &[ConsumerGroup]) -> Result<()> {
        Ok(())
    }
    async fn publish(&self, _: &Event) -> Result<()> {
        Ok(())
    }
    async fn subscribe(&self, _: &Destination, _: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        Err(Error::permanent(ErrorKind::Rejected, "instant", "this broker keeps nothing"))
    }
}

struct Bench {
    store: PgStore,
    events: String,
}

impl Bench {
    /// Replace whatever is in the table with `rows` pending rows.
    async fn fill(&self, rows: usize) {
        sqlx::raw_sql(AssertSqlSafe(format!("TRUNCATE {}", self.events))).execute(self.store.pool()).await.unwrap();
        let dest = Destination::new("bench").unwrap();
        let payload = vec![0xab_u8; PAYLOAD];
        let mut n = 0;
        while n < rows {
            let chunk: Vec<Event> = (n..rows.min(n + 2000))
                .map(|i| Event::new(EventId::new(format!("ev-{i:07}")).unwrap(), dest.clone(), payload.clone()))
                .collect();
            n += chunk.len();
            self.store.enqueue(&chunk).await.unwrap();
        }
        sqlx::raw_sql(AssertSqlSafe(format!("ANALYZE {}", self.events))).execute(self.store.pool()).await.unwrap();
    }

    async fn pending(&self) -> u64 {
        self.store.stats().await.unwrap().pending
    }

    /// Events per second of a relay draining `rows` rows in batches of `batch`.
    async fn relay(&self, rows: usize, batch: usize, owner: &str) -> f64 {
        self.fill(rows).await;
        let config = RelayConfig::new(owner).with_batch_size(batch).with_lease(LEASE).with_seed(Some(1));
        let relay = Relay::new(Arc::new(self.store.clone()), Arc::new(Instant0), config);
        let t = Instant::now();
        let report = relay.drain().await.unwrap();
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(report.published, rows as u64, "{report:?}");
        assert_eq!(self.pending().await, 0);
        rows as f64 / secs
    }

    /// The store's own calls, without a relay: claim, then complete_many.
    async fn store_calls(&self, rows: usize, batch: usize) -> f64 {
        self.fill(rows).await;
        let t = Instant::now();
        let mut done = 0;
        loop {
            let claimed = self.store.claim(OWNER, batch, LEASE).await.unwrap();
            if claimed.is_empty() {
                break;
            }
            let sent: Vec<_> = claimed.into_iter().map(|c| (c.record.row_id, c.lease)).collect();
            done += self.store.complete_many(&sent).await.unwrap().len();
        }
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(done, rows);
        rows as f64 / secs
    }

    /// Hand-written SQL on one connection: the store's claim statement and the smallest fenced
    /// completion (ids and tokens as arrays, the owner once). With `owner_per_row`, the owner is
    /// sent once per row as well, the request shape that stalled.
    async fn raw_sql(&self, rows: usize, batch: usize, conn: &mut PgConnection, owner_per_row: bool) -> f64 {
        self.fill(rows).await;
        let claim = self.store.tables().claim_sql(batch);
        let complete = if owner_per_row {
            format!(
                "UPDATE {events} AS t SET published_token = t.token, published_at = 0, lease_expires_at = NULL
                 FROM unnest($1::bigint[], $2::bigint[], $4::text[]) AS i(id, token, owner)
                 WHERE t.id = i.id AND t.token = i.token AND t.owner = i.owner AND t.owner = $3
                   AND t.published_at IS NULL",
                events = self.events
            )
        } else {
            format!(
                "UPDATE {events} AS t SET published_token = t.token, published_at = 0, lease_expires_at = NULL
                 FROM unnest($1::bigint[], $2::bigint[]) AS i(id, token)
                 WHERE t.id = i.id AND t.token = i.token AND t.owner = $3 AND t.published_at IS NULL",
                events = self.events
            )
        };
        let t = Instant::now();
        let mut done = 0;
        loop {
            let claimed = sqlx::query(AssertSqlSafe(claim.clone()))
                .bind(None::<i64>)
                .bind(OWNER)
                .bind(i64::try_from(LEASE.as_millis()).unwrap())
                .fetch_all(&mut *conn)
                .await
                .unwrap();
            if claimed.is_empty() {
                break;
            }
            let ids: Vec<i64> = claimed.iter().map(|r| r.get("id")).collect();
            let tokens: Vec<i64> = claimed.iter().map(|r| r.get("token")).collect();
            let owners = vec![OWNER; ids.len()];
            let mut q = sqlx::query(AssertSqlSafe(complete.clone())).bind(ids).bind(tokens).bind(OWNER);
            if owner_per_row {
                q = q.bind(owners);
            }
            let r = q.execute(&mut *conn).await.unwrap();
            done += usize::try_from(r.rows_affected()).unwrap();
        }
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(done, rows);
        rows as f64 / secs
    }
}

/// `BENCH_BATCHES` (comma-separated), default `1,100,500`.
fn batches() -> Vec<usize> {
    std::env::var("BENCH_BATCHES")
        .ok()
        .map(|v| v.split(',').filter_map(|b| b.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 100, 500])
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rows = env_usize("BENCH_ROWS", 50_000);
    let url = outbox_conformance_tests::pg_url();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let schema = format!("bench_batch_{}_{nanos}", std::process::id());
    let config = PgConfig::from_url(&url).unwrap().with_schema(schema.clone()).with_application_name(schema.clone());
    let store = PgStore::connect(config.clone()).await.unwrap_or_else(|e| panic!("PostgreSQL: {e}"));
    store.migrate().await.unwrap();
    let bench = Bench { events: store.tables().table("events").unwrap(), store };

    println!("relay_batch: PostgreSQL relay + instant broker, raw SQL as the baseline");
    println!(
        "  server {}  schema {schema}  backlog {rows} rows of {PAYLOAD} B  owner {OWNER:?} ({} bytes)  \
         lease {LEASE:?}  pipeline depth {}  (no randomness: no seed)",
        config.redacted_url(),
        OWNER.len(),
        RelayConfig::default().pipeline_depth_for(&Instant0),
    );

    let mut raw_conn = PgConnection::connect_with(&config.connect_options().unwrap()).await.unwrap();
    let tls: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&mut raw_conn)
        .await
        .unwrap();
    println!("  connection TLS: {tls} (the stall needs TLS: a request over 16 KiB is two TLS records, two writes)");
    let mut table = Vec::new();
    let mut relay_rates = Vec::new();
    for batch in batches() {
        // A round trip per row: a smaller backlog keeps the run short.
        let n = if batch == 1 { rows.min(2_000) } else { rows };
        let relay = bench.relay(n, batch, OWNER).await;
        let store = bench.store_calls(n, batch).await;
        let raw = bench.raw_sql(n, batch, &mut raw_conn, false).await;
        relay_rates.push((batch, relay));
        table.push((batch, OWNER.len(), n, relay, store, raw));
    }
    // The stall depended on the owner's length; show that it no longer does.
    let short = bench.relay(rows, 500, "r").await;
    table.push((500, 1, rows, short, f64::NAN, f64::NAN));

    println!();
    println!(
        "{:>6} {:>6} {:>8} {:>12} {:>12} {:>12} {:>10} {:>9}",
        "batch", "owner", "rows", "relay ev/s", "store ev/s", "raw SQL ev/s", "relay/raw", "ms/batch"
    );
    for (batch, owner, n, relay, store, raw) in &table {
        let fmt = |v: f64| if v.is_nan() { "-".to_string() } else { format!("{v:.0}") };
        let ratio = if raw.is_nan() { "-".to_string() } else { format!("{:.2}", relay / raw) };
        println!(
            "{batch:>6} {:>6} {n:>8} {:>12} {:>12} {:>12} {ratio:>10} {:>9.2}",
            format!("{owner} B"),
            fmt(*relay),
            fmt(*store),
            fmt(*raw),
            *batch as f64 / relay * 1000.0,
        );
    }
    // The cause, in the same run: the old request shape (the owner once per row, 20 KiB for 500
    // rows) on the same connection.
    let old_shape = bench.raw_sql(rows, 500, &mut raw_conn, true).await;
    let plain_options = config.connect_options().unwrap().ssl_mode(PgSslMode::Disable);
    let old_shape_plain = match PgConnection::connect_with(&plain_options).await {
        Ok(mut plain) => {
            let rate = bench.raw_sql(rows, 500, &mut plain, true).await;
            let _ = plain.close().await;
            format!("{rate:.0} events/s")
        }
        Err(e) => format!("not measured ({e})"),
    };
    println!();
    println!("raw SQL at batch 500 with the owner once per row (the request shape before the fix):");
    println!("  over TLS {old_shape:.0} events/s; over plain TCP (sslmode=disable) {old_shape_plain}");
    let rate = |b: usize| relay_rates.iter().find(|(x, _)| *x == b).map(|(_, r)| *r).unwrap_or(0.0);
    let ok = rate(500) >= rate(100);
    println!();
    println!(
        "batch 500 >= batch 100: {} ({:.0} vs {:.0} events/s)",
        if ok { "yes" } else { "NO" },
        rate(500),
        rate(100)
    );

    let _ = raw_conn.close().await;
    bench.store.close().await;
    let mut conn = PgConnection::connect_with(&config.connect_options().unwrap()).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE"))).execute(&mut conn).await.unwrap();
    let _ = conn.close().await;
}
