//! Writing outbox rows inside the caller's own transaction.
//!
//! This is the half of the pattern that makes it transactional: the domain write and the outbox
//! row commit or roll back together, on the caller's connection. The rows are written inside a
//! savepoint, so a rejected batch leaves the caller's transaction exactly as it was and the
//! caller decides whether to commit its domain write anyway.

use outbox_core::{Error, ErrorKind, Event, Result, RowId, Timestamp};
use rusqlite::{Connection, Transaction};

use crate::error::{BACKEND, ResultExt, map};
use crate::store::SqliteStore;
use outbox_core::event::encode_headers;

/// Enqueue `events` in the caller's transaction `tx`, with `store`'s clock and payload limit
/// ([`SqliteConfig::max_payload`](crate::SqliteConfig)), and wake `store`'s relays — the same
/// shape as `outbox_store_postgres::enqueue(&mut tx, &store, &events)`.
///
/// The rows become visible to relays when `tx` commits, and vanish if it rolls back. The relays
/// of `store` (and its clones) are woken when the rows are written; their claim then waits for
/// your commit on SQLite's write lock (see [`SqliteStore`]'s "Waking relays").
/// Open the connection with [`SqliteStore::connect_raw`] and start `tx` with
/// `TransactionBehavior::Immediate` so it does not fail half-way on a lock. Blocking, like every
/// `rusqlite` call.
///
/// # Errors
/// - [`ErrorKind::InvalidInput`] / [`ErrorKind::TooLarge`] from [`Event::validate`], before
///   anything is written;
/// - [`ErrorKind::Conflict`] when an event id is already stored (or repeated in `events`); the
///   message names the id;
/// - SQLite errors, converted.
///
/// On any error nothing of `events` is written and `tx` is still open and usable.
pub fn enqueue(tx: &Transaction<'_>, store: &SqliteStore, events: &[Event]) -> Result<Vec<RowId>> {
    store.enqueue_in(tx, events)
}

/// [`enqueue`] for one event.
///
/// # Errors
/// As [`enqueue`].
pub fn enqueue_one(tx: &Transaction<'_>, store: &SqliteStore, event: &Event) -> Result<RowId> {
    enqueue(tx, store, std::slice::from_ref(event))?
        .into_iter()
        .next()
        .ok_or_else(|| Error::permanent(ErrorKind::Rejected, BACKEND, "enqueue returned no row id"))
}

/// Validate, then insert inside a savepoint on `conn` (which is in a transaction or not).
pub(crate) fn insert_events(
    conn: &Connection,
    events: &[Event],
    now: Timestamp,
    max_payload: usize,
) -> Result<Vec<RowId>> {
    for e in events {
        e.validate(max_payload)?;
    }
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let what = "enqueue";
    conn.execute_batch("SAVEPOINT outbox_enqueue").ctx(what)?;
    match insert_rows(conn, events, now) {
        Ok(ids) => {
            conn.execute_batch("RELEASE outbox_enqueue").ctx(what)?;
            Ok(ids)
        }
        Err(e) => {
            // Undo this batch only; the caller's own writes in the transaction stay.
            let _ = conn.execute_batch("ROLLBACK TO outbox_enqueue; RELEASE outbox_enqueue");
            Err(e)
        }
    }
}

fn insert_rows(conn: &Connection, events: &[Event], now: Timestamp) -> Result<Vec<RowId>> {
    let mut stmt = conn
        .prepare_cached(
            "INSERT INTO outbox_rows
                 (event_id, destination, event_key, headers, payload, attempts, token, available_at, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, 0, 0, ?6, ?6)",
        )
        .ctx("enqueue")?;
    let mut ids = Vec::with_capacity(events.len());
    for e in events {
        let inserted = stmt.execute((
            e.id.as_str(),
            e.destination.as_str(),
            e.key.as_deref(),
            encode_headers(&e.headers),
            &e.payload,
            now.0,
        ));
        match inserted {
            Ok(_) => ids.push(conn.last_insert_rowid()),
            Err(err) => {
                let mapped = map("enqueue", err);
                if mapped.kind() == ErrorKind::Conflict {
                    // event_id is the table's only unique column besides the row id.
                    return Err(Error::permanent(
                        ErrorKind::Conflict,
                        BACKEND,
                        format!("event id {} is already in the outbox; nothing of the batch was written", e.id),
                    ));
                }
                return Err(mapped);
            }
        }
    }
    Ok(ids)
}
