//! The raw baselines: the same durable work as the library does, written by hand with the
//! drivers, as fast as the drivers allow. Each is checked on durable state after it ran (rows
//! published, entries on the stream, messages in the queue, offsets on the topic), so a fast
//! baseline that skipped work would fail instead of lowering every ratio.

use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use outbox::postgres::map_error;
use outbox::postgres::sqlx::{self, AssertSqlSafe, Connection, Row as _};
use outbox::sqlite::SqliteStore;
use outbox::sqlite::rusqlite::{self, TransactionBehavior};
use outbox::{ConsumerGroup, Destination, Error, ErrorKind, Event, Result};

use super::fixture::{DRAIN_LIMIT, LEASE, PgFixture, fail, per_second};

/// Owner name of the raw loops (12 bytes, like a relay's).
const OWNER: &str = "raw-bench-01";

/// Confirms outstanding on the raw AMQP channel.
pub(crate) const AMQP_WINDOW: usize = 1_000;
/// Deliveries in flight in the raw Kafka producer.
pub(crate) const KAFKA_IN_FLIGHT: usize = 10_000;
/// Redis pipelines in flight on the raw connection.
pub(crate) const REDIS_PIPELINES: usize = 4;

/// Raw SQL on one connection, one batch after another: the store's own claim statement
/// (`UPDATE … FOR UPDATE SKIP LOCKED … RETURNING` every column), then one fenced completion per
/// batch (ids and tokens as arrays, the owner once; `published_token`, `published_at`,
/// `lease_expires_at` set as the store sets them). The backlog must already be in place.
pub(crate) async fn pg_sql(fx: &PgFixture, n: usize, batch: usize) -> Result<f64> {
    pg_sql_with(fx, &RawClaim::store(fx, batch), n).await
}

/// A claim statement for the raw SQL loop. Parameters: `$1` now, `$2` owner, `$3` lease, and
/// `$4` the limit where `limit_param` is set (else the limit is in the text).
pub(crate) struct RawClaim {
    sql: String,
    limit_param: Option<usize>,
}

impl RawClaim {
    /// The store's own claim of at most `limit` rows.
    pub(crate) fn store(fx: &PgFixture, limit: usize) -> Self {
        Self { sql: fx.store.tables().claim_sql(limit), limit_param: None }
    }
}

/// The claim statement of schema version 3, before per-key order (issue 16): the first `limit`
/// open, due, unleased rows in id order, `FOR UPDATE SKIP LOCKED`, returning what the store's
/// claim returns. Kept here as the baseline of P8, which measures what key order costs.
///
/// [`V3Form::Today`] writes it in the form of today's statement (the limit in the text, the clock
/// in an init plan), so that both keep a generic plan and differ only in which rows they pick;
/// [`V3Form::AsShipped`] as schema 3 shipped it (the limit a parameter, `$4`, and the clock a
/// plain expression: planned again at every call).
pub(crate) fn pg_claim_before_key_order(fx: &PgFixture, limit: usize, form: V3Form) -> Result<RawClaim> {
    let current = fx.store.tables().claim_sql(limit);
    // The `RETURNING` list and the clock expression of today's statement.
    let returning = current
        .find("RETURNING ")
        .and_then(|at| current[at..].find('\n').map(|end| &current[at..at + end]))
        .ok_or_else(|| fail("the store's claim statement has no RETURNING line"))?;
    let clock = "COALESCE($1::bigint, floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint)";
    let init_plan = format!("(SELECT {clock})");
    if !current.contains(&init_plan) || !current.contains(&format!("LIMIT {limit}\n")) {
        return Err(fail("the store's claim statement no longer reads the clock or its limit as P8 expects"));
    }
    let (now, limit_text, limit_param) = match form {
        V3Form::Today => (init_plan, limit.to_string(), None),
        V3Form::AsShipped => (clock.to_owned(), "$4".to_owned(), Some(limit)),
    };
    let sql = format!(
        "WITH c AS (
    SELECT id FROM {events}
    WHERE published_at IS NULL AND parked_at IS NULL
      AND available_at <= {now}
      AND (lease_expires_at IS NULL OR lease_expires_at <= {now})
    ORDER BY id
    LIMIT {limit_text}
    FOR UPDATE SKIP LOCKED
), u AS (
    UPDATE {events} AS t
    SET token = t.token + 1, owner = $2, lease_expires_at = {now} + $3
    FROM c
    WHERE t.id = c.id
    {returning}
)
SELECT * FROM u ORDER BY id",
        events = fx.events_table
    );
    Ok(RawClaim { sql, limit_param })
}

/// How [`pg_claim_before_key_order`] writes schema 3's claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum V3Form {
    /// In the form of today's claim: the limit in the text, the clock in an init plan.
    Today,
    /// As schema 3 shipped it: the limit is the parameter `$4`.
    AsShipped,
}

/// [`pg_sql`] with another claim statement.
pub(crate) async fn pg_sql_with(fx: &PgFixture, claim: &RawClaim, n: usize) -> Result<f64> {
    let mut conn = fx.connection().await?;
    let complete = format!(
        "UPDATE {events} AS t SET published_token = t.token,
             published_at = floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint,
             lease_expires_at = NULL
         FROM unnest($1::bigint[], $2::bigint[]) AS i(id, token)
         WHERE t.id = i.id AND t.token = i.token AND t.owner = $3
           AND t.published_at IS NULL AND t.parked_at IS NULL",
        events = fx.events_table
    );
    let lease_ms = i64::try_from(LEASE.as_millis()).unwrap_or(i64::MAX);
    let t = Instant::now();
    let mut done = 0usize;
    loop {
        let mut query = sqlx::query(AssertSqlSafe(claim.sql.clone())).bind(None::<i64>).bind(OWNER).bind(lease_ms);
        if let Some(limit) = claim.limit_param {
            query = query.bind(i64::try_from(limit).unwrap_or(i64::MAX));
        }
        let claimed = query.fetch_all(&mut conn).await.map_err(map_error)?;
        if claimed.is_empty() {
            break;
        }
        let mut ids = Vec::with_capacity(claimed.len());
        let mut tokens = Vec::with_capacity(claimed.len());
        for r in &claimed {
            ids.push(r.try_get::<i64, _>("id").map_err(map_error)?);
            tokens.push(r.try_get::<i64, _>("token").map_err(map_error)?);
        }
        let r = sqlx::query(AssertSqlSafe(complete.clone()))
            .bind(ids)
            .bind(tokens)
            .bind(OWNER)
            .execute(&mut conn)
            .await
            .map_err(map_error)?;
        done += usize::try_from(r.rows_affected()).unwrap_or(0);
        if t.elapsed() > super::fixture::DRAIN_LIMIT {
            return Err(fail(format!("raw SQL: {done} of {n} rows after {:?}", super::fixture::DRAIN_LIMIT)));
        }
    }
    let elapsed = t.elapsed();
    let _ = conn.close().await;
    if done != n {
        return Err(fail(format!("raw SQL completed {done} rows, expected {n}")));
    }
    fx.check_published(n, "raw SQL").await?;
    Ok(per_second(n, elapsed))
}

/// `ids` as the JSON array the SQLite claim's statements take.
fn json_ids(ids: &[i64]) -> String {
    let list: Vec<String> = ids.iter().map(i64::to_string).collect();
    format!("[{}]", list.join(","))
}

/// Which claim the raw rusqlite loop runs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SqliteClaim {
    /// The store's own statements (key order: candidates, the keys' gaps, then the update).
    Store,
    /// One `UPDATE … WHERE row_id IN (first open, due, unleased rows in row order)`: the claim
    /// before per-key order, to show what key order costs.
    BeforeKeyOrder,
}

/// Raw rusqlite on one connection of the store's own settings: per batch one `BEGIN IMMEDIATE`
/// transaction with the claim (every column returned and read), then one with the store's fenced
/// completion per row (a cached statement), as `SqliteStore` runs them. With
/// [`SqliteClaim::Store`] the claim is the store's statements, the candidates filtered at their
/// keys' gaps by hand.
pub(crate) async fn sqlite(store: &SqliteStore, n: usize, batch: usize, claim: SqliteClaim) -> Result<f64> {
    let mut conn = store.connect_raw()?;
    // The store's own connections keep temporary storage in memory; so does the baseline's.
    conn.pragma_update(None, "temp_store", "MEMORY").map_err(outbox::sqlite::sqlite_error)?;
    let statements = store.claim_sql();
    let lease_ms = i64::try_from(LEASE.as_millis()).unwrap_or(i64::MAX);
    let limit = i64::try_from(batch).unwrap_or(i64::MAX);
    let (done, elapsed) = tokio::task::spawn_blocking(move || -> rusqlite::Result<(usize, Duration)> {
        let now =
            || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        let t = Instant::now();
        let mut done = 0;
        loop {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let at = now();
            let mut claimed: Vec<(i64, i64)> = Vec::new();
            let mut read = |r: &rusqlite::Row<'_>| -> rusqlite::Result<()> {
                // Read every column, as the store decodes every column into a record.
                let _: (String, String, Option<String>, Vec<u8>, Vec<u8>) =
                    (r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?);
                claimed.push((r.get(0)?, r.get(7)?));
                Ok(())
            };
            match claim {
                SqliteClaim::BeforeKeyOrder => {
                    let mut stmt = tx.prepare_cached(
                        "UPDATE outbox_rows SET token = token + 1, owner = ?1, lease_expires_at = ?2
                         WHERE row_id IN (
                             SELECT row_id FROM outbox_rows
                             WHERE published_token IS NULL AND parked_at IS NULL
                               AND available_at <= ?3
                               AND (lease_expires_at IS NULL OR lease_expires_at <= ?3)
                             ORDER BY row_id LIMIT ?4)
                         RETURNING row_id, event_id, destination, event_key, headers, payload, attempts, token, owner,
                             lease_expires_at, available_at, created_at, published_token, parked_at, last_error",
                    )?;
                    let mut rows = stmt.query((OWNER, at + lease_ms, at, limit))?;
                    while let Some(r) = rows.next()? {
                        read(r)?;
                    }
                }
                SqliteClaim::Store => {
                    let candidates: Vec<(i64, Option<String>)> = tx
                        .prepare_cached(statements.candidates)?
                        .query_map((at, limit), |r| Ok((r.get(0)?, r.get(1)?)))?
                        .collect::<rusqlite::Result<_>>()?;
                    let mut ids: Vec<i64> = candidates.iter().map(|(id, _)| *id).collect();
                    if candidates.iter().any(|(_, key)| key.is_some()) {
                        let gaps: std::collections::HashMap<String, i64> = tx
                            .prepare_cached(statements.gaps)?
                            .query_map([json_ids(&ids)], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?)))?
                            .filter_map(|r| r.map(|(key, gap)| gap.map(|gap| (key, gap))).transpose())
                            .collect::<rusqlite::Result<_>>()?;
                        ids = candidates
                            .into_iter()
                            .filter(|(id, key)| key.as_ref().and_then(|k| gaps.get(k)).is_none_or(|gap| id < gap))
                            .map(|(id, _)| id)
                            .collect();
                    }
                    if !ids.is_empty() {
                        let mut stmt = tx.prepare_cached(statements.update)?;
                        let mut rows = stmt.query((OWNER, at + lease_ms, json_ids(&ids)))?;
                        while let Some(r) = rows.next()? {
                            read(r)?;
                        }
                    }
                }
            }
            tx.commit()?;
            if claimed.is_empty() {
                break;
            }
            claimed.sort_unstable();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            {
                let at = now();
                let mut stmt = tx.prepare_cached(
                    "UPDATE outbox_rows SET published_token = token, published_at = ?4, lease_expires_at = NULL
                     WHERE row_id = ?1 AND token = ?2 AND owner = ?3 AND published_token IS NULL AND parked_at IS NULL",
                )?;
                for (row, token) in &claimed {
                    done += stmt.execute((row, token, OWNER, at))?;
                }
            }
            tx.commit()?;
        }
        Ok((done, t.elapsed()))
    })
    .await
    .map_err(|e| fail(format!("raw rusqlite task: {e}")))?
    .map_err(outbox::sqlite::sqlite_error)?;
    if done != n {
        return Err(fail(format!("raw rusqlite completed {done} rows, expected {n}")));
    }
    Ok(per_second(n, elapsed))
}

fn driver(backend: &'static str, what: &str, e: impl std::fmt::Display) -> Error {
    Error::transient(ErrorKind::Connection, backend, format!("raw {what}: {e}"))
}

/// Raw `XADD`s of `events` to `stream`, in pipelines of `batch` with [`REDIS_PIPELINES`] in
/// flight on one multiplexed connection, each entry with the adapter's fields (`v`, `id`, `k`,
/// `h:<header>`, `p`). Checks `XLEN` afterwards and deletes the key.
pub(crate) async fn redis_xadd(url: &str, stream: &str, events: &[Event], batch: usize) -> Result<f64> {
    let client = redis::Client::open(url).map_err(|e| driver("redis", "client", e))?;
    let conn = client.get_multiplexed_async_connection().await.map_err(|e| driver("redis", "connect", e))?;
    let _: i64 =
        redis::cmd("DEL").arg(stream).query_async(&mut conn.clone()).await.map_err(|e| driver("redis", "DEL", e))?;
    let t = Instant::now();
    let results: Vec<redis::RedisResult<Vec<String>>> = futures::stream::iter(events.chunks(batch.max(1)))
        .map(|chunk| {
            let mut conn = conn.clone();
            let mut pipe = redis::pipe();
            for e in chunk {
                let cmd = pipe.cmd("XADD").arg(stream).arg("*").arg("v").arg("1").arg("id").arg(e.id.as_str());
                if let Some(k) = &e.key {
                    cmd.arg("k").arg(k.as_str());
                }
                for (name, value) in &e.headers {
                    cmd.arg(format!("h:{name}")).arg(value.as_slice());
                }
                cmd.arg("p").arg(e.payload.as_slice());
            }
            async move { pipe.query_async::<Vec<String>>(&mut conn).await }
        })
        .buffer_unordered(REDIS_PIPELINES)
        .collect()
        .await;
    let elapsed = t.elapsed();
    for r in results {
        r.map_err(|e| driver("redis", "XADD pipeline", e))?;
    }
    let len: u64 =
        redis::cmd("XLEN").arg(stream).query_async(&mut conn.clone()).await.map_err(|e| driver("redis", "XLEN", e))?;
    let _: i64 =
        redis::cmd("DEL").arg(stream).query_async(&mut conn.clone()).await.map_err(|e| driver("redis", "DEL", e))?;
    if len != events.len() as u64 {
        return Err(fail(format!("raw XADD: {len} entries on {stream}, expected {}", events.len())));
    }
    Ok(per_second(events.len(), elapsed))
}

/// The broker adapter alone, in the relay's shape: [`Broker::publish_batch`](outbox::Broker)
/// over `events` in batches of `batch`, `depth` batches at once, no store. Every event must be
/// accepted. It separates what the adapter's way of publishing a batch can do from what the
/// relay around it costs. Unlike the relay's, batches in flight here may share keys: a key's
/// order across them is not kept, which a throughput figure does not need.
pub(crate) async fn adapter_batches(
    broker: &dyn outbox::Broker,
    events: &[Event],
    batch: usize,
    depth: usize,
) -> Result<f64> {
    let t = Instant::now();
    let publishes = futures::stream::iter(events.chunks(batch.max(1)))
        .map(|chunk| broker.publish_batch(chunk))
        .buffer_unordered(depth.max(1))
        .collect::<Vec<Vec<Result<()>>>>();
    let results = tokio::time::timeout(DRAIN_LIMIT, publishes)
        .await
        .map_err(|_| fail(format!("the adapter did not publish {} events within {DRAIN_LIMIT:?}", events.len())))?;
    let elapsed = t.elapsed();
    for r in results.into_iter().flatten() {
        r?;
    }
    Ok(per_second(events.len(), elapsed))
}

/// Raw AMQP publishes of `events` on one channel in confirm mode, `mandatory` and persistent,
/// with the adapter's properties (message id, header table with the key and the header names),
/// to the exchange the adapter declared for `destination` (its queue for `group` bound), with up
/// to [`AMQP_WINDOW`] confirms outstanding; every confirm must be a plain ack. Checks the queue
/// depth afterwards (the caller purges by deleting the queue).
pub(crate) async fn amqp_publish(
    url: &str,
    broker: &outbox::amqp::AmqpBroker,
    destination: &Destination,
    group: &ConsumerGroup,
    events: &[Event],
) -> Result<f64> {
    use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
    let config = broker.config();
    let exchange = config.exchange_name(destination)?;
    let plain = url.split('?').next().unwrap_or(url);
    let conn = lapin::Connection::connect(plain, lapin::ConnectionProperties::default())
        .await
        .map_err(|e| driver("amqp", "connect", e))?;
    let result = async {
        let channel = conn.create_channel().await.map_err(|e| driver("amqp", "channel", e))?;
        channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await
            .map_err(|e| driver("amqp", "confirm_select", e))?;
        let mut pending = FuturesUnordered::new();
        let mut confirmed = 0usize;
        let check = |c: std::result::Result<lapin::Confirmation, lapin::Error>| match c {
            Ok(lapin::Confirmation::Ack(None)) => Ok(()),
            Ok(other) => Err(fail(format!("raw AMQP publish not confirmed: {other:?}"))),
            Err(e) => Err(driver("amqp", "confirm", e)),
        };
        let t = Instant::now();
        for e in events {
            let mut table = FieldTable::default();
            let mut names = FieldArray::default();
            for (name, value) in &e.headers {
                table.insert(ShortString::from(name.as_str()), AMQPValue::LongString(LongString::from(value.clone())));
                names.push(AMQPValue::LongString(LongString::from(name.as_bytes())));
            }
            table.insert(outbox::amqp::HEADER_NAMES_HEADER.into(), AMQPValue::FieldArray(names));
            if let Some(key) = &e.key {
                table.insert(outbox::amqp::KEY_HEADER.into(), AMQPValue::LongString(LongString::from(key.as_bytes())));
            }
            let properties = lapin::BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(e.id.as_str().into())
                .with_headers(table);
            let routing_key = config.routing_key_for(e)?;
            let confirm = channel
                .basic_publish(
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    lapin::options::BasicPublishOptions { mandatory: true, immediate: false },
                    &e.payload,
                    properties,
                )
                .await
                .map_err(|e| driver("amqp", "publish", e))?;
            pending.push(confirm);
            if pending.len() >= AMQP_WINDOW
                && let Some(c) = pending.next().await
            {
                check(c)?;
                confirmed += 1;
            }
        }
        while let Some(c) = pending.next().await {
            check(c)?;
            confirmed += 1;
        }
        let elapsed = t.elapsed();
        let _ = channel.close(200, "OK".into()).await;
        Ok::<_, Error>((confirmed, elapsed))
    }
    .await;
    let _ = conn.close(200, "OK".into()).await;
    let (confirmed, elapsed) = result?;
    let depth = broker.queue_depth(destination, group).await?;
    if confirmed != events.len() || depth as usize != events.len() {
        return Err(fail(format!("raw AMQP: {confirmed} confirmed, {depth} in the queue, expected {}", events.len())));
    }
    Ok(per_second(events.len(), elapsed))
}

/// Raw Kafka produce of `events` to `topic` (created by the caller) with an `rdkafka`
/// `FutureProducer` configured as the adapter's (`acks=all`, idempotent, the URL's options),
/// the event id header, key and headers, up to [`KAFKA_IN_FLIGHT`] deliveries awaited at once.
/// Reads the topic back afterwards.
pub(crate) async fn kafka_produce(config: &outbox::kafka::KafkaConfig, topic: &str, events: &[Event]) -> Result<f64> {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use rdkafka::util::Timeout;
    let mut client = rdkafka::ClientConfig::new();
    client.set("bootstrap.servers", config.bootstrap_servers.join(","));
    for (k, v) in &config.options {
        client.set(k, v);
    }
    client.set("enable.idempotence", "true").set("acks", "all").set("message.timeout.ms", "60000");
    let producer: FutureProducer = client.create().map_err(|e| driver("kafka", "producer", e))?;
    // Warm-up, not timed: the producer's connection, metadata and idempotence id. One record
    // without an event id; the check below counts it.
    producer
        .send(
            FutureRecord::<[u8], [u8]>::to(topic).payload(b"warm-up".as_slice()),
            Timeout::After(Duration::from_secs(60)),
        )
        .await
        .map_err(|(e, _)| driver("kafka", "warm-up delivery", e))?;
    let t = Instant::now();
    let mut pending = FuturesUnordered::new();
    let mut delivered = 0usize;
    fn check<T, M>(r: std::result::Result<T, (rdkafka::error::KafkaError, M)>) -> Result<()> {
        r.map(|_| ()).map_err(|(e, _)| driver("kafka", "delivery", e))
    }
    for e in events {
        let mut headers = OwnedHeaders::new_with_capacity(e.headers.len() + 1)
            .insert(Header { key: outbox::kafka::EVENT_ID_HEADER, value: Some(e.id.as_str().as_bytes()) });
        for (name, value) in &e.headers {
            headers = headers.insert(Header { key: name.as_str(), value: Some(value.as_slice()) });
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(e.payload.as_slice()).headers(headers);
        if let Some(key) = &e.key {
            record = record.key(key.as_bytes());
        }
        pending.push(producer.send(record, Timeout::After(Duration::from_secs(60))));
        if pending.len() >= KAFKA_IN_FLIGHT
            && let Some(r) = pending.next().await
        {
            check(r)?;
            delivered += 1;
        }
    }
    while let Some(r) = pending.next().await {
        check(r)?;
        delivered += 1;
    }
    let elapsed = t.elapsed();
    // Durable check: the topic holds what was delivered.
    let stored = kafka_count(config, topic, events.len() + 1).await? - 1;
    if delivered != events.len() || stored != events.len() as i64 {
        return Err(fail(format!(
            "raw Kafka: {delivered} delivered, {stored} on the topic, expected {}",
            events.len()
        )));
    }
    Ok(per_second(events.len(), elapsed))
}

/// Messages on a Kafka topic, counted by reading it from the beginning (every partition) until,
/// `expected` or more read, nothing more arrives for half a second (10 s before that), within a
/// minute. Not from the watermarks: after a batched
/// produce tansu reports a high watermark of 1 for a partition holding 2,000 records.
pub(crate) async fn kafka_count(config: &outbox::kafka::KafkaConfig, topic: &str, expected: usize) -> Result<i64> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    use rdkafka::{Offset, TopicPartitionList};
    let topic_name = topic.to_string();
    let mut client = rdkafka::ClientConfig::new();
    client.set("bootstrap.servers", config.bootstrap_servers.join(","));
    for (k, v) in &config.options {
        client.set(k, v);
    }
    client
        .set("group.id", "outbox-bench-reader")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false");
    tokio::task::spawn_blocking(move || -> std::result::Result<i64, String> {
        let consumer: BaseConsumer = client.create().map_err(|e| e.to_string())?;
        let metadata =
            consumer.fetch_metadata(Some(topic_name.as_str()), Duration::from_secs(10)).map_err(|e| e.to_string())?;
        let mut list = TopicPartitionList::new();
        for t in metadata.topics().iter().filter(|t| t.name() == topic_name) {
            for p in t.partitions() {
                list.add_partition_offset(&topic_name, p.id(), Offset::Beginning).map_err(|e| e.to_string())?;
            }
        }
        consumer.assign(&list).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = Instant::now();
        let mut count = 0i64;
        let expected = i64::try_from(expected).unwrap_or(i64::MAX);
        while Instant::now() < deadline {
            let idle = last.elapsed();
            if (count >= expected && idle > Duration::from_millis(500)) || idle > Duration::from_secs(10) {
                break;
            }
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(_)) => {
                    count += 1;
                    last = Instant::now();
                }
                Some(Err(e)) => return Err(e.to_string()),
                None => {}
            }
        }
        Ok(count)
    })
    .await
    .map_err(|e| fail(format!("topic reader task: {e}")))?
    .map_err(|e| driver("kafka", "reading the topic back", e))
}
