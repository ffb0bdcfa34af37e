//! The reference store's claim starts its walk after the rows already published, so a claim does
//! not cost more with every batch a relay has published. These tests hold it to the contract at
//! the edges of that shortcut: rows behind newer published rows (a parked row requeued, a failed
//! row once due, an expired lease) are still found, and a claim of nothing moves nothing.
//! Judged by the rows read back.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::memory::MemoryOutbox;
use outbox_core::store::all_rows;
use outbox_core::{
    Claimed, Completion, Destination, Event, EventId, ManualClock, OutboxAdmin, OutboxStore, Outcome, ParkedHead,
    RowStatus,
};

const SECOND: Duration = Duration::from_secs(1);
const MINUTE: Duration = Duration::from_secs(60);

fn event(id: &str) -> Event {
    Event::new(EventId::new(id).unwrap(), Destination::new("orders").unwrap(), id.as_bytes().to_vec())
}

fn ids(claimed: &[Claimed]) -> Vec<&str> {
    claimed.iter().map(|c| c.record.event.id.as_str()).collect()
}

async fn complete(store: &MemoryOutbox, claimed: &[Claimed]) {
    for c in claimed {
        assert_eq!(store.complete(c.record.row_id, &c.lease).await.unwrap(), Completion::Published, "{c:?}");
    }
}

/// Rows left open behind published ones (parked, backing off, leased) are claimed once they may
/// be, in row order, whichever parked-head rule holds; every row ends published once.
#[tokio::test]
async fn open_rows_behind_published_ones_are_still_claimed() {
    for parked_head in [ParkedHead::Skip, ParkedHead::Block] {
        let clock = ManualClock::default();
        let store = MemoryOutbox::new(Arc::new(clock.clone())).with_parked_head(parked_head);
        let events: Vec<Event> = ["r1", "r2", "r3", "r4", "r5", "r6"].into_iter().map(event).collect();
        store.enqueue(&events).await.unwrap();
        let c = store.claim("relay", 6, SECOND).await.unwrap();
        assert_eq!(ids(&c), ["r1", "r2", "r3", "r4", "r5", "r6"]);
        assert_eq!(store.park(c[0].record.row_id, &c[0].lease, "poison").await.unwrap(), Outcome::Applied);
        assert_eq!(store.fail(c[1].record.row_id, &c[1].lease, MINUTE, "later").await.unwrap(), Outcome::Applied);
        // r3 stays leased; r4..r6 are published.
        complete(&store, &c[3..]).await;
        assert!(store.claim("relay", 10, SECOND).await.unwrap().is_empty(), "{parked_head:?}");

        store.enqueue(&[event("r7")]).await.unwrap();
        let c7 = store.claim("relay", 10, SECOND).await.unwrap();
        assert_eq!(ids(&c7), ["r7"], "{parked_head:?}");
        complete(&store, &c7).await;

        clock.advance(2 * SECOND); // r3's lease has expired
        let c3 = store.claim("relay", 10, SECOND).await.unwrap();
        assert_eq!(ids(&c3), ["r3"], "{parked_head:?}");
        assert_eq!(c3[0].lease.token, 2, "{parked_head:?}");
        complete(&store, &c3).await;

        clock.advance(MINUTE); // r2 is due
        let c2 = store.claim("relay", 10, SECOND).await.unwrap();
        assert_eq!(ids(&c2), ["r2"], "{parked_head:?}");
        complete(&store, &c2).await;

        assert_eq!(store.requeue_parked(&[c[0].record.row_id]).await.unwrap(), 1);
        let c1 = store.claim("relay", 10, SECOND).await.unwrap();
        assert_eq!(ids(&c1), ["r1"], "{parked_head:?}");
        complete(&store, &c1).await;

        store.enqueue(&[event("r8")]).await.unwrap();
        let c8 = store.claim("relay", 10, SECOND).await.unwrap();
        assert_eq!(ids(&c8), ["r8"], "{parked_head:?}");
        complete(&store, &c8).await;

        let rows = all_rows(&store as &dyn OutboxAdmin).await.unwrap();
        assert_eq!(rows.len(), 8);
        for r in rows {
            assert_eq!(r.status, RowStatus::Published, "{parked_head:?}: {r:?}");
            assert_eq!(r.published_token, Some(r.token), "{parked_head:?}: {r:?}");
        }
    }
}

/// A claim of no rows, or one that stops at its limit, leaves the rest to the next claim.
#[tokio::test]
async fn a_claim_stopped_by_its_limit_leaves_the_rest() {
    let store = MemoryOutbox::new(Arc::new(ManualClock::default()));
    let events: Vec<Event> = ["a", "b", "c"].into_iter().map(event).collect();
    store.enqueue(&events).await.unwrap();
    assert!(store.claim("relay", 0, MINUTE).await.unwrap().is_empty());
    let first = store.claim("relay", 1, MINUTE).await.unwrap();
    assert_eq!(ids(&first), ["a"]);
    complete(&store, &first).await;
    let rest = store.claim("relay", 10, MINUTE).await.unwrap();
    assert_eq!(ids(&rest), ["b", "c"]);
    complete(&store, &rest).await;
    let rows = all_rows(&store as &dyn OutboxAdmin).await.unwrap();
    assert_eq!(
        rows.iter().map(|r| (r.event.id.as_str(), r.status)).collect::<Vec<_>>(),
        [("a", RowStatus::Published), ("b", RowStatus::Published), ("c", RowStatus::Published)]
    );
}
