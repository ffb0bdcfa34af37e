//! `complete_many` splits its work into statements small enough for one TLS record (one per
//! owner and per few hundred rows, in one transaction); the outcome per input entry and the
//! rows read back must be exactly what one `complete` per entry would give.

mod common;

use std::time::Duration;

use common::{TestDb, event};
use outbox_core::store::all_rows;
use outbox_core::{Completion, Lease, OutboxStore, RowStatus};

const LEASE: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_large_batch_is_completed_in_several_statements_of_one_transaction() {
    let Some(db) = TestDb::new("complete_big").await else { return };
    let events: Vec<_> = (0..1500).map(|i| event(&format!("ev-{i:04}"), b"x")).collect();
    db.store.enqueue(&events).await.unwrap();
    let claimed = db.store.claim("relay-bench1", 2000, LEASE).await.unwrap();
    assert_eq!(claimed.len(), 1500);
    let rows: Vec<_> = claimed.iter().map(|c| (c.record.row_id, c.lease.clone())).collect();
    let out = db.store.complete_many(&rows).await.unwrap();
    assert!(out.iter().all(|c| *c == Completion::Published), "{out:?}");
    let stored = all_rows(&db.store).await.unwrap();
    assert_eq!(stored.len(), 1500);
    for r in &stored {
        assert_eq!(r.status, RowStatus::Published, "{r:?}");
        assert_eq!(r.published_token, Some(r.token), "{r:?}");
    }
    // Again: everything is fenced now, nothing changes.
    let again = db.store.complete_many(&rows).await.unwrap();
    assert!(again.iter().all(|c| *c == Completion::Fenced), "{again:?}");
}

#[tokio::test]
async fn owners_duplicates_and_stale_tokens_are_judged_per_entry() {
    let Some(db) = TestDb::new("complete_mixed").await else { return };
    let events: Vec<_> = (0..6).map(|i| event(&format!("ev-{i}"), b"x")).collect();
    db.store.enqueue(&events).await.unwrap();
    // An owner so long that each of its rows needs a statement of its own.
    let long = "b".repeat(20_000);
    let a = db.store.claim("a", 3, LEASE).await.unwrap();
    let b = db.store.claim(&long, 3, LEASE).await.unwrap();
    assert_eq!((a.len(), b.len()), (3, 3));
    let entry = |c: &outbox_core::Claimed| (c.record.row_id, c.lease.clone());
    let stale = Lease { token: a[2].lease.token - 1, ..a[2].lease.clone() };
    let wrong_owner = Lease { owner: "c".into(), ..b[2].lease.clone() };
    let input = vec![
        entry(&b[0]),
        entry(&a[0]),
        entry(&a[0]), // listed twice: the first entry publishes it
        entry(&b[1]),
        (a[1].record.row_id, a[1].lease.clone()),
        (a[2].record.row_id, stale),
        (b[2].record.row_id, wrong_owner),
    ];
    let out = db.store.complete_many(&input).await.unwrap();
    use Completion::{Fenced, Published};
    assert_eq!(out, [Published, Published, Fenced, Published, Published, Fenced, Fenced]);

    let stored = all_rows(&db.store).await.unwrap();
    let status: Vec<_> = stored.iter().map(|r| r.status).collect();
    use RowStatus::{Leased, Published as Done};
    // Rows in id order: a's three, then b's three.
    assert_eq!(status, [Done, Done, Leased, Done, Done, Leased]);
    // The stale and the wrong-owner entries left their rows as they were.
    assert_eq!(stored[2].token, a[2].lease.token);
    assert_eq!(stored[5].owner.as_deref(), Some(long.as_str()));
}
