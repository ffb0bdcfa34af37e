//! Enqueue inside the caller's own transaction: the point of an outbox.
//!
//! The domain write and the outbox row commit or roll back together because they run on the same
//! connection in the same transaction; these functions take `&mut PgConnection` so they accept
//! `&mut *tx` of a `sqlx::Transaction`, a pooled connection, or a bare one.
//!
//! A batch is one statement that inserts either every row or none: it first looks for ids that
//! already exist and, if any do, inserts nothing and names them. A duplicate committed by a
//! concurrent transaction in between is caught by the unique constraint instead (that error
//! aborts the caller's transaction, as any failed statement does in PostgreSQL).

use std::collections::{BTreeMap, BTreeSet};

use outbox_core::{Error, ErrorKind, Event, Result, RowId};
use sqlx::{AssertSqlSafe, Connection, PgConnection, Row};

use crate::error::{BACKEND, Phase, map};
use crate::store::corrupt;
use crate::tables::PgTables;
use outbox_core::event::encode_headers;

/// Insert `events` as pending outbox rows on `conn` (typically `&mut *tx`), in one statement.
///
/// Returns the row ids in input order. Accepts a [`PgStore`](crate::PgStore) or a [`PgTables`]
/// as `outbox`.
///
/// # Errors
/// - validation of every event first ([`Event::validate`] with the configured payload limit):
///   [`ErrorKind::InvalidInput`] or [`ErrorKind::TooLarge`], nothing sent to the server;
/// - an id repeated in the batch or already stored: [`ErrorKind::Conflict`] naming the id(s),
///   nothing written;
/// - otherwise the server's error, mapped (a lost connection outside a transaction is
///   [`Retry::OutcomeUnknown`](outbox_core::Retry::OutcomeUnknown)).
pub async fn enqueue(
    conn: &mut PgConnection,
    outbox: &(impl AsRef<PgTables> + ?Sized),
    events: &[Event],
) -> Result<Vec<RowId>> {
    // The caller's trace travels with the events (free without `opentelemetry`).
    let events: &[Event] = &outbox_core::telemetry::with_trace_context(events);
    let tables = outbox.as_ref();
    for e in events {
        e.validate(tables.max_payload())?;
    }
    let mut seen = BTreeSet::new();
    if let Some(dup) = events.iter().find(|e| !seen.insert(&e.id)) {
        return Err(conflict(&[dup.id.as_str()], "appears twice in the batch"));
    }
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<String> = events.iter().map(|e| e.id.as_str().to_owned()).collect();
    let destinations: Vec<String> = events.iter().map(|e| e.destination.as_str().to_owned()).collect();
    let keys: Vec<Option<String>> = events.iter().map(|e| e.key.clone()).collect();
    let headers: Vec<Vec<u8>> = events.iter().map(|e| encode_headers(&e.headers)).collect();
    let payloads: Vec<Vec<u8>> = events.iter().map(|e| e.payload.clone()).collect();
    let phase = if conn.is_in_transaction() { Phase::InTransaction } else { Phase::AutocommitWrite };
    let rows = sqlx::query(AssertSqlSafe(tables.sql.enqueue.clone()))
        .bind(tables.now_param())
        .bind(ids)
        .bind(destinations)
        .bind(keys)
        .bind(headers)
        .bind(payloads)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| enqueue_error(e, phase))?;

    let mut inserted = BTreeMap::new();
    let mut existing = Vec::new();
    for row in &rows {
        let decode = |e| map(e, Phase::InTransaction, "enqueue: decoding the result");
        let duplicate: bool = row.try_get("duplicate").map_err(decode)?;
        let event_id: String = row.try_get("event_id").map_err(decode)?;
        if duplicate {
            existing.push(event_id);
        } else {
            let id: i64 = row.try_get("id").map_err(decode)?;
            inserted.insert(event_id, id);
        }
    }
    if !existing.is_empty() {
        existing.sort();
        let existing: Vec<&str> = existing.iter().map(String::as_str).collect();
        return Err(conflict(&existing, "is already in the outbox"));
    }
    events
        .iter()
        .map(|e| {
            inserted
                .get(e.id.as_str())
                .copied()
                .ok_or_else(|| corrupt(format!("enqueue: no row id returned for {}", e.id)))
        })
        .collect()
}

/// Insert one event; see [`enqueue`].
///
/// # Errors
/// As [`enqueue`].
pub async fn enqueue_one(
    conn: &mut PgConnection,
    outbox: &(impl AsRef<PgTables> + ?Sized),
    event: &Event,
) -> Result<RowId> {
    let ids = enqueue(conn, outbox, std::slice::from_ref(event)).await?;
    ids.into_iter().next().ok_or_else(|| corrupt("enqueue returned no row id"))
}

fn conflict(ids: &[&str], what: &str) -> Error {
    let list = ids.join(", ");
    let noun = if ids.len() == 1 { "event id" } else { "event ids" };
    Error::permanent(ErrorKind::Conflict, BACKEND, format!("{noun} {list} {what}; nothing was enqueued"))
}

fn enqueue_error(err: sqlx::Error, phase: Phase) -> Error {
    if crate::error::is_unique_violation(&err) {
        // A concurrent transaction committed one of the ids after this statement looked. The
        // server's detail names the key; it is shown, never parsed.
        let detail = match &err {
            sqlx::Error::Database(db) => db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .and_then(|pg| pg.detail())
                .map(|d| format!(" ({d})"))
                .unwrap_or_default(),
            _ => String::new(),
        };
        return Error::permanent(
            ErrorKind::Conflict,
            BACKEND,
            format!("enqueue: an event id is already in the outbox{detail}; nothing was enqueued"),
        )
        .with_source(err);
    }
    map(err, phase, "enqueue")
}
