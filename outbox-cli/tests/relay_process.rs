//! `outbox relay` as an OS process against PostgreSQL and each real broker.
//!
//! Events are enqueued through the library into a fresh schema; the relay process publishes
//! them; SIGTERM mid-stream must exit 0 with no row left leased (published or released, never
//! stranded under a lease); a second relay process finishes the rest; then the broker's
//! contents are read back and every event must be there byte-for-byte.

mod common;

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use outbox::core::store::all_rows;
use outbox::{AnyStore, ConsumerGroup, Destination, Event, EventId, RowStatus};

const EVENTS: usize = 3000;

struct Target {
    name: &'static str,
    url: String,
    service: &'static str,
    script: &'static str,
}

fn targets() -> Vec<Target> {
    vec![
        Target { name: "redis", url: service::redis_url(), service: "Redis", script: "redis" },
        Target { name: "amqp", url: service::amqp_url(), service: "RabbitMQ", script: "rabbitmq" },
        Target { name: "kafka", url: service::kafka_url(), service: "Kafka (tansu)", script: "kafka" },
    ]
}

fn events(destination: &Destination, tag: &str) -> Vec<Event> {
    (0..EVENTS)
        .map(|i| {
            let mut payload = format!("{tag}:{i}:").into_bytes();
            payload.extend_from_slice(&[0, 0xff, (i % 251) as u8]);
            Event::new(EventId::new(format!("{tag}-{i:05}")).unwrap(), destination.clone(), payload)
                .with_key(format!("k{}", i % 7))
                .with_header("trace", vec![1, 2, (i % 256) as u8])
        })
        .collect()
}

async fn counts(store: &AnyStore) -> BTreeMap<&'static str, usize> {
    let mut out = BTreeMap::new();
    for r in all_rows(&*store.outbox()).await.expect("rows read back") {
        let s = match r.status {
            RowStatus::Pending => "pending",
            RowStatus::Leased => "leased",
            RowStatus::Published => "published",
            RowStatus::Parked => "parked",
        };
        *out.entry(s).or_default() += 1;
    }
    out
}

fn spawn_relay(store_url: &str, broker_url: &str, owner: &str, metrics_port: Option<u16>) -> std::process::Child {
    let mut args = vec![
        "relay".to_string(),
        "--store".into(),
        store_url.into(),
        "--broker".into(),
        broker_url.into(),
        "--owner".into(),
        owner.into(),
        "--batch".into(),
        "50".into(),
        "--lease".into(),
        "60s".into(),
        "--log-format".into(),
        "json".into(),
    ];
    if let Some(port) = metrics_port {
        args.push("--metrics".into());
        args.push(format!("127.0.0.1:{port}"));
    }
    outbox().args(&args).stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().expect("outbox relay starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_process_publishes_everything_and_stops_cleanly_on_sigterm() {
    let pg = service::pg_url();
    if !service::require_service("PostgreSQL", "postgres", &service::service_addr(&pg)) {
        return;
    }
    for target in targets() {
        if !service::require_service(target.service, target.script, &service::service_addr(&target.url)) {
            continue;
        }
        run_against(&pg, &target).await;
    }
}

async fn run_against(pg: &str, target: &Target) {
    let schema = unique(&format!("relayproc_{}", target.name));
    let store_url = with_param(pg, "outbox_schema", &schema);
    let store = AnyStore::connect(&store_url).await.expect("store connects");

    // Without migrations the relay refuses to start, naming the command that fixes it.
    let out = run(&["relay", "--store", &store_url, "--broker", &target.url], Duration::from_secs(60));
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("outbox migrate"), "{stderr}");

    let migrated = ok(&["migrate", "--store", &store_url]);
    assert!(migrated.contains("schema at version"), "{migrated}");

    let destination = Destination::new(unique(&format!("relayproc-{}", target.name)).replace('_', "-")).unwrap();
    let group = ConsumerGroup::new("relayproc-check").unwrap();
    let broker = outbox::broker_from_url(&target.url).await.expect("broker connects");
    broker.declare(&destination, std::slice::from_ref(&group)).await.expect("declare");
    let mut subscription = broker.subscribe(&destination, &group).await.expect("subscribe");

    let sent = events(&destination, &schema);
    for chunk in sent.chunks(500) {
        store.outbox().enqueue(chunk).await.expect("enqueue");
    }

    // First relay: SIGTERM as soon as it has published something.
    let metrics_port = free_port();
    let mut first = spawn_relay(&store_url, &target.url, "proc-relay-1", Some(metrics_port));
    eventually(Duration::from_secs(60), "the first relay publishes a row", || async {
        (counts(&store).await.get("published").copied().unwrap_or(0) > 0).then_some(())
    })
    .await;
    let (status, metrics) = eventually(Duration::from_secs(30), "the metrics endpoint answers", || async {
        http_get(metrics_port, "/metrics")
    })
    .await;
    assert_eq!(status, 200, "{metrics}");
    assert!(metrics.contains("outbox_relay_published_total{owner=\"proc-relay-1\"}"), "{metrics}");
    assert!(metrics.contains("outbox_rows{status=\"published\"}"), "{metrics}");
    assert_eq!(http_get(metrics_port, "/healthz").map(|r| r.0), Some(200));
    sigterm(&first);
    let status = wait_status(&mut first, Duration::from_secs(60), "relay after SIGTERM");
    assert_eq!(status.code(), Some(0), "graceful shutdown exits 0");
    let after_first = counts(&store).await;
    assert_eq!(after_first.get("leased"), None, "{}: rows left leased after SIGTERM: {after_first:?}", target.name);
    assert_eq!(after_first.get("parked"), None, "{after_first:?}");

    // Second relay finishes the rest.
    let mut second = spawn_relay(&store_url, &target.url, "proc-relay-2", None);
    eventually(Duration::from_secs(120), "every row published", || async {
        (counts(&store).await.get("published").copied() == Some(EVENTS)).then_some(())
    })
    .await;
    sigterm(&second);
    assert_eq!(wait_status(&mut second, Duration::from_secs(60), "second relay").code(), Some(0));
    let rows = all_rows(&*store.outbox()).await.unwrap();
    assert!(rows.iter().all(|r| r.status == RowStatus::Published && r.published_token == Some(r.token)));

    // The broker holds every event, byte-for-byte (duplicates allowed and counted).
    let expected: BTreeMap<EventId, Event> = sent.into_iter().map(|e| (e.id.clone(), e)).collect();
    let mut seen: BTreeMap<EventId, usize> = BTreeMap::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while seen.len() < expected.len() {
        assert!(
            std::time::Instant::now() < deadline,
            "{}: only {} of {} events read back from the broker",
            target.name,
            seen.len(),
            expected.len()
        );
        if let Some(d) = subscription.next(Duration::from_millis(500)).await.expect("receive") {
            let want = expected.get(&d.event.id).unwrap_or_else(|| panic!("ghost event {}", d.event.id));
            assert_eq!(&d.event, want, "{}: event differs on the broker", target.name);
            *seen.entry(d.event.id.clone()).or_default() += 1;
            d.ack().await.expect("ack");
        }
    }
    let offers: usize = seen.values().sum();
    println!(
        "{}: {} events, {} offers ({} duplicates); after SIGTERM: {:?}",
        target.name,
        expected.len(),
        offers,
        offers - expected.len(),
        after_first
    );

    drop(subscription);
    cleanup(&store, &schema).await;
}

async fn cleanup(store: &AnyStore, schema: &str) {
    if let AnyStore::Postgres(pg) = store {
        use outbox::postgres::sqlx::{self, AssertSqlSafe};
        let _ =
            sqlx::query(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))).execute(pg.pool()).await;
        pg.close().await;
    }
}

#[test]
fn bad_urls_and_wrong_passwords_are_one_clear_line_without_the_secret() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite://{}/relay.db", dir.path().display());
    let mut cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["stats".into(), "--store".into(), "mysql://u:hunter2@127.0.0.1/db".into()], "names no store"),
        (vec!["stats".into(), "--store".into(), "postgres://u:hunter2@[::1".into()], "postgres"),
        (
            vec![
                "relay".into(),
                "--store".into(),
                sqlite.clone(),
                "--broker".into(),
                "nats://u:hunter2@127.0.0.1:4222".into(),
            ],
            "names no broker",
        ),
        (
            vec![
                "relay".into(),
                "--store".into(),
                format!("{sqlite}?outbox_nonsense=1"),
                "--broker".into(),
                "memory://".into(),
            ],
            "outbox_nonsense",
        ),
        (
            // Nothing listens on port 1.
            vec![
                "stats".into(),
                "--store".into(),
                "postgres://u:hunter2@127.0.0.1:1/db?outbox_connect_timeout_ms=2000".into(),
            ],
            "postgres",
        ),
    ];
    let amqp_up =
        std::net::TcpStream::connect_timeout(&"127.0.0.1:5672".parse().unwrap(), Duration::from_secs(1)).is_ok();
    if amqp_up || service::in_ci() {
        cases.push((
            vec![
                "relay".into(),
                "--store".into(),
                sqlite.clone(),
                "--broker".into(),
                "amqp://guest:hunter2@127.0.0.1:5672/%2f".into(),
            ],
            "amqp",
        ));
    }
    for (args, needle) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(&args, Duration::from_secs(60));
        let (stdout, stderr) = text(&out);
        let shown = format!("outbox {}\nstdout:\n{stdout}\nstderr:\n{stderr}", args.join(" "));
        assert_eq!(out.status.code(), Some(1), "{shown}");
        assert!(!stdout.contains("hunter2") && !stderr.contains("hunter2"), "the password leaked: {shown}");
        // Log lines (the relay logs at info) may precede it; the error itself is one line, last.
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("outbox: ")).collect();
        assert_eq!(errors.len(), 1, "one error line expected: {shown}");
        assert_eq!(stderr.trim_end().lines().last(), Some(errors[0]), "{shown}");
        assert!(stderr.contains(needle), "expected {needle:?}: {shown}");
    }
    // Usage errors exit 2.
    for args in [
        vec!["relay", "--store", "memory://", "--broker", "memory://", "--lease", "30"],
        vec!["relay", "--store", "memory://", "--broker", "memory://", "--batch", "0"],
        vec!["stats", "--store", "memory://", "--log", "no such filter=!!"],
        vec!["demo", "--events", "-5"],
    ] {
        let out = run(&args, Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {:?}", text(&out));
        assert!(!text(&out).1.contains("unexpected argument"), "{args:?}: {:?}", text(&out));
    }
}

/// Log lines written to a pipe or a file (journald, a log shipper) are plain text: no terminal
/// colour codes around levels and field names.
#[test]
fn log_lines_to_a_pipe_carry_no_terminal_colour_codes() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite://{}/relay.db", dir.path().display());
    let mut child = outbox()
        .args(["relay", "--store", &sqlite, "--broker", "memory://", "--log", "info"])
        .env_remove("NO_COLOR")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("outbox relay starts");
    let stderr = child.stderr.take().expect("stderr piped");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !lines.iter().any(|l: &String| l.contains("relay started")) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => lines.push(line),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("no \"relay started\" line within 30s; stderr so far:\n{}", lines.join("\n"));
            }
        }
    }
    sigterm(&child);
    let status = wait_status(&mut child, Duration::from_secs(30), "outbox relay after SIGTERM");
    reader.join().expect("the stderr reader ends at EOF");
    lines.extend(rx.try_iter());
    let all = lines.join("\n");
    assert!(status.success(), "{status}: {all}");
    assert!(all.contains("relay stopped"), "the stop is logged: {all}");
    assert!(!all.contains('\u{1b}'), "terminal escape codes in piped log lines: {all:?}");
    // Plain `LEVEL target: message key=value` text, as a log shipper reads it.
    let started = lines.iter().find(|l| l.contains("relay started")).expect("seen above");
    assert!(started.contains(" INFO outbox.relay: relay started owner="), "{started}");
}
