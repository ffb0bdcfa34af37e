//! The operator commands against SQLite and PostgreSQL: what they print matches the durable
//! state, and what they change is read back from the store.

mod common;

use std::time::Duration;

use common::*;
use outbox::core::store::all_rows;
use outbox::core::{DeadLetterReason, Timestamp};
use outbox::{AnyStore, DeadLetter, Destination, Event, EventId, Inbox, RowStatus};

/// Six rows: 0–1 published, 2–3 parked, 4 leased, 5 pending.
async fn seed_rows(store: &AnyStore, tag: &str) -> Vec<i64> {
    let outbox = store.outbox();
    let dest = Destination::new("ops-orders").unwrap();
    let events: Vec<Event> = (0..6)
        .map(|i| Event::new(EventId::new(format!("{tag}-{i}")).unwrap(), dest.clone(), format!("p{i}")))
        .collect();
    let ids = outbox.enqueue(&events).await.unwrap();
    let claimed = outbox.claim("ops-test", 5, Duration::from_secs(600)).await.unwrap();
    assert_eq!(claimed.len(), 5);
    for c in &claimed[..2] {
        assert_eq!(outbox.complete(c.record.row_id, &c.lease).await.unwrap(), outbox::core::Completion::Published);
    }
    for c in &claimed[2..4] {
        assert_eq!(
            outbox.park(c.record.row_id, &c.lease, "broker said no").await.unwrap(),
            outbox::core::Outcome::Applied
        );
    }
    ids
}

fn status_of(rows: &[outbox::RowSnapshot], id: i64) -> Option<RowStatus> {
    rows.iter().find(|r| r.row_id == id).map(|r| r.status)
}

async fn outbox_commands(url: &str, store: &AnyStore, tag: &str) {
    let ids = seed_rows(store, tag).await;

    let stats = ok(&["stats", "--store", url]);
    for line in ["pending    1", "leased     1", "parked     2", "published  2"] {
        assert!(stats.contains(line), "{line:?} missing:\n{stats}");
    }

    let parked = ok(&["inspect", "--store", url, "--status", "parked"]);
    let listed: Vec<&str> = parked.lines().skip(1).collect();
    assert_eq!(listed.len(), 2, "{parked}");
    assert!(listed.iter().all(|l| l.contains("parked") && l.contains("broker said no")), "{parked}");
    let leased = ok(&["inspect", "--store", url, "--status", "leased", "--limit", "5"]);
    assert!(
        leased.lines().nth(1).is_some_and(|l| l.contains(&format!("{tag}-4")) && l.contains("ops-test")),
        "{leased}"
    );
    let limited = ok(&["inspect", "--store", url, "--limit", "3"]);
    assert_eq!(limited.lines().count(), 4, "{limited}");

    let list = ok(&["parked", "list", "--store", url]);
    assert!(list.contains(&format!("{tag}-2")) && list.contains(&format!("{tag}-3")), "{list}");
    assert!(list.contains("2 parked row(s) shown"), "{list}");

    // Requeue one by id: it is pending again with attempts reset; the other stays parked.
    let out = ok(&["parked", "requeue", "--store", url, &ids[2].to_string()]);
    assert!(out.contains("requeued 1 row(s)"), "{out}");
    let rows = all_rows(&*store.outbox()).await.unwrap();
    assert_eq!(status_of(&rows, ids[2]), Some(RowStatus::Pending));
    assert_eq!(status_of(&rows, ids[3]), Some(RowStatus::Parked));
    // An id that is not parked changes nothing and says so.
    let out = run(&["parked", "purge", "--store", url, &ids[0].to_string()], Duration::from_secs(60));
    assert!(out.status.success());
    assert!(text(&out).0.contains("purged 0 row(s)"), "{:?}", text(&out));
    assert_eq!(status_of(&all_rows(&*store.outbox()).await.unwrap(), ids[0]), Some(RowStatus::Published));
    // Neither ids nor --all is a usage error.
    assert_eq!(run(&["parked", "purge", "--store", url], Duration::from_secs(30)).status.code(), Some(2));
    // --all purges what is parked and nothing else.
    let out = ok(&["parked", "purge", "--store", url, "--all"]);
    assert!(out.contains("purged 1 row(s)"), "{out}");
    let rows = all_rows(&*store.outbox()).await.unwrap();
    assert_eq!(status_of(&rows, ids[3]), None, "purged row is gone");
    assert_eq!(rows.len(), 5);
    assert_eq!(store.outbox().stats().await.unwrap().parked, 0);
}

fn letter(consumer: &str, id: &str, reason: DeadLetterReason) -> DeadLetter {
    DeadLetter {
        id: 0,
        consumer: consumer.into(),
        event: Event::new(EventId::new(id).unwrap(), Destination::new("ops-credits").unwrap(), vec![0u8, 1, 2, 0xff])
            .with_key("acct-1")
            .with_header("bin", vec![0u8, 0xfe]),
        reason,
        error: "handler failed 5 times:\nno such account".into(),
        at: Timestamp::from_millis(0),
    }
}

async fn write_letters<I: Inbox>(inbox: &I, consumer: &str, tag: &str) {
    let mut tx = inbox.begin().await.unwrap();
    for (i, reason) in [DeadLetterReason::HandlerFailed, DeadLetterReason::Conflict, DeadLetterReason::HandlerFailed]
        .into_iter()
        .enumerate()
    {
        inbox.dead_letter(&mut tx, &letter(consumer, &format!("{tag}-dl{i}"), reason)).await.unwrap();
    }
    inbox
        .dead_letter(&mut tx, &letter("someone-else", &format!("{tag}-other"), DeadLetterReason::Conflict))
        .await
        .unwrap();
    inbox.commit(tx).await.unwrap();
}

async fn dead_letter_commands(url: &str, store: &AnyStore, tag: &str) {
    let consumer = "ledger";
    match store {
        AnyStore::Postgres(pg) => write_letters(&pg.inbox(), consumer, tag).await,
        AnyStore::Sqlite(s) => write_letters(s, consumer, tag).await,
        _ => unreachable!("SQLite and PostgreSQL only"),
    }
    let admin = store.inbox_admin();
    let stored = admin.dead_letters(consumer).await.unwrap();
    assert_eq!(stored.len(), 3);

    let list = ok(&["dead-letters", "list", "--inbox", url, "--consumer", consumer]);
    for d in &stored {
        assert!(list.contains(d.event.id.as_str()), "{list}");
    }
    assert!(list.contains("handler_failed") && list.contains("conflict") && list.contains("acct-1"), "{list}");
    assert!(list.contains("3 dead letter(s) of consumer \"ledger\""), "{list}");
    assert!(!list.contains(&format!("{tag}-other")), "another consumer's letters are not listed:\n{list}");

    // An unknown id changes nothing.
    let out =
        run(&["dead-letters", "purge", "--inbox", url, "--consumer", consumer, "999999"], Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert_eq!(admin.dead_letters(consumer).await.unwrap().len(), 3);

    // Purge one by id.
    let out = ok(&["dead-letters", "purge", "--inbox", url, "--consumer", consumer, &stored[1].id.to_string()]);
    assert!(out.contains("purged 1"), "{out}");
    let left = admin.dead_letters(consumer).await.unwrap();
    assert_eq!(left.iter().map(|d| d.id).collect::<Vec<_>>(), vec![stored[0].id, stored[2].id]);

    // Replay the rest to a real broker: they arrive exactly as delivered, and are removed.
    let redis = service::redis_url();
    if service::require_service("Redis", "redis", &service::service_addr(&redis)) {
        let broker = outbox::broker_from_url(&redis).await.unwrap();
        let dest = Destination::new("ops-credits").unwrap();
        let group = outbox::ConsumerGroup::new(unique("replaycheck").replace('_', "-")).unwrap();
        broker.declare(&dest, std::slice::from_ref(&group)).await.unwrap();
        let mut sub = broker.subscribe(&dest, &group).await.unwrap();
        // Drain whatever earlier runs left on the shared destination.
        while let Some(d) = sub.next(Duration::from_millis(200)).await.unwrap() {
            d.ack().await.unwrap();
        }
        let out = ok(&["dead-letters", "replay", "--inbox", url, "--consumer", consumer, "--broker", &redis, "--all"]);
        assert!(out.contains("replayed 2 dead letter(s)"), "{out}");
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while got.len() < 2 {
            assert!(std::time::Instant::now() < deadline, "replayed events did not arrive: {got:?}");
            if let Some(d) = sub.next(Duration::from_millis(500)).await.unwrap() {
                got.push(d.event.clone());
                d.ack().await.unwrap();
            }
        }
        got.sort_by(|a, b| a.id.cmp(&b.id));
        assert_eq!(got, vec![left[0].event.clone(), left[1].event.clone()], "replay is byte-for-byte");
        assert!(admin.dead_letters(consumer).await.unwrap().is_empty());
    } else {
        let out = ok(&["dead-letters", "purge", "--inbox", url, "--consumer", consumer, "--all"]);
        assert!(out.contains("purged 2"), "{out}");
    }
    assert_eq!(admin.dead_letters("someone-else").await.unwrap().len(), 1, "other consumers untouched");

    // A malformed letter (a message that was not an event) is listed with its reason, and replay
    // refuses it by name, changing nothing.
    let odd = "ledger-malformed";
    let mut record = letter(odd, "malformed:orders[0]@7", DeadLetterReason::Malformed);
    record.error = "no-event-id: no outbox-event-id header (kafka orders[0]@7)".into();
    match store {
        AnyStore::Postgres(pg) => {
            let inbox = pg.inbox();
            let mut tx = inbox.begin().await.unwrap();
            inbox.dead_letter(&mut tx, &record).await.unwrap();
            inbox.commit(tx).await.unwrap();
        }
        AnyStore::Sqlite(s) => {
            let mut tx = s.begin().await.unwrap();
            s.dead_letter(&mut tx, &record).await.unwrap();
            s.commit(tx).await.unwrap();
        }
        _ => unreachable!("SQLite and PostgreSQL only"),
    }
    let stored = admin.dead_letters(odd).await.unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].reason, DeadLetterReason::Malformed, "the reason reads back");
    assert_eq!(stored[0].event.payload, record.event.payload, "raw payload byte-for-byte");
    let list = ok(&["dead-letters", "list", "--inbox", url, "--consumer", odd]);
    assert!(list.contains("malformed") && list.contains("no-event-id"), "{list}");
    let out = run(
        &["dead-letters", "replay", "--inbox", url, "--consumer", odd, "--broker", "memory://", "--all"],
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    let err = text(&out).1;
    assert!(err.contains("malformed") && err.contains(&stored[0].id.to_string()), "{err}");
    assert_eq!(admin.dead_letters(odd).await.unwrap(), stored, "nothing changed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/ops.db", dir.path().display());
    let out = ok(&["migrate", "--store", &url]);
    assert!(out.starts_with("sqlite: schema at version"), "{out}");
    let store = AnyStore::connect(&url).await.unwrap();
    outbox_commands(&url, &store, "sq").await;
    dead_letter_commands(&url, &store, "sq").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_on_postgres() {
    let pg = service::pg_url();
    if !service::require_service("PostgreSQL", "postgres", &service::service_addr(&pg)) {
        return;
    }
    let schema = unique("opscli");
    let url = with_param(&pg, "outbox_schema", &schema);
    // Before migrate, every command names the fix.
    let out = run(&["stats", "--store", &url], Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).1.contains("outbox migrate"), "{:?}", text(&out));
    let out = ok(&["migrate", "--store", &url]);
    assert!(out.starts_with("postgres: schema at version"), "{out}");
    assert_eq!(ok(&["migrate", "--store", &url]), out, "migrate is idempotent");
    let store = AnyStore::connect(&url).await.unwrap();
    outbox_commands(&url, &store, "pg").await;
    dead_letter_commands(&url, &store, "pg").await;
    if let AnyStore::Postgres(p) = &store {
        use outbox::postgres::sqlx::{self, AssertSqlSafe};
        sqlx::query(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE"))).execute(p.pool()).await.unwrap();
    }
}
