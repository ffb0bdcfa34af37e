//! `outbox demo` as a user runs it: the built binary, judged by its exit code, its verdict lines
//! and what it leaves behind (nothing in the current directory, no schema, no stream).

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outbox::postgres::{PgConfig, PgStore, map_error, sqlx};
use outbox::redis::{RedisBroker, RedisConfig};
use outbox_conformance_tests::service::{require_service, service_addr};
use outbox_core::Destination;

/// Longest a demo run may take before it is killed and the test fails.
const LIMIT: Duration = Duration::from_secs(120);

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn describe(&self) -> String {
        format!("exit {:?}\n--- stdout\n{}--- stderr\n{}", self.code, self.stdout, self.stderr)
    }

    /// Both verdict lines say PASS.
    fn assert_passed(&self) {
        assert_eq!(self.code, Some(0), "{}", self.describe());
        for property in ["at-least-once offer  PASS", "at-most-once effect  PASS"] {
            assert!(self.stdout.contains(property), "no `{property}` line:\n{}", self.describe());
        }
    }

    /// The story happened: relay A stalled, relay B offered its rows again, A's late completion
    /// was fenced, and no row was published by a stale token (the figures line: offers counted
    /// on the broker, rows read back from the store, fenced calls from the relays).
    fn assert_story(&self) {
        let figure = |key: &str| -> u64 {
            let at = format!(" {key}=");
            self.word_after(&at).parse().unwrap_or_else(|e| panic!("{key}: {e}\n{}", self.describe()))
        };
        assert!(
            figure("duplicates_offered") > 0,
            "no duplicates offered: the stall did not happen\n{}",
            self.describe()
        );
        assert!(
            figure("fenced") > 0,
            "nothing fenced: relay A's late completion was not rejected\n{}",
            self.describe()
        );
        assert_eq!(figure("stale_published"), 0, "{}", self.describe());
    }

    /// The word after `marker` in the output (a schema, a destination, a path).
    fn word_after(&self, marker: &str) -> String {
        let at = self.stdout.find(marker).unwrap_or_else(|| panic!("no {marker:?} in:\n{}", self.describe()));
        let rest = &self.stdout[at + marker.len()..];
        rest.split(|c: char| c.is_whitespace() || c == ';' || c == ')' || c == ',').next().unwrap_or("").to_string()
    }
}

/// Run `outbox demo ARGS` in `cwd`; kill it after [`LIMIT`].
fn demo(cwd: &Path, args: &[&str]) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .arg("demo")
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the outbox binary");
    let pipe = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = r.read_to_string(&mut text);
            text
        })
    };
    let stdout = pipe(Box::new(child.stdout.take().expect("stdout")));
    let stderr = pipe(Box::new(child.stderr.take().expect("stderr")));
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the demo") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let run = Run {
        code: status.and_then(|s| s.code()),
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    };
    assert!(
        status.is_some(),
        "outbox demo {args:?} did not finish within {LIMIT:?} and was killed\n{}",
        run.describe()
    );
    run
}

/// `host:port` of a URL such as `postgres://user:pw@host:5432/db`.
#[test]
fn default_demo_passes_and_leaves_the_current_directory_empty() {
    let cwd = tempfile::tempdir().expect("a temporary directory");
    let run = demo(cwd.path(), &["--events", "300", "--quiet"]);
    run.assert_passed();
    assert!(run.stdout.contains("outbox demo — SQLite + the in-process broker"), "{}", run.describe());
    run.assert_story();
    let left: Vec<_> =
        std::fs::read_dir(cwd.path()).expect("read the directory").map(|e| e.map(|e| e.file_name())).collect();
    assert!(left.is_empty(), "the demo wrote into the current directory: {left:?}\n{}", run.describe());
    let temp = run.word_after("temporary directory ");
    assert!(!Path::new(&temp).exists(), "the demo's temporary directory {temp} is still there\n{}", run.describe());
}

#[test]
fn postgres_and_redis_demo_passes_and_removes_its_schema_and_stream() {
    let pg_url = outbox_conformance_tests::service::pg_url();
    let redis_url = outbox_conformance_tests::service::redis_url();
    if !require_service("PostgreSQL", "postgres", &service_addr(&pg_url))
        || !require_service("Redis", "redis", &service_addr(&redis_url))
    {
        return;
    }
    let cwd = tempfile::tempdir().expect("a temporary directory");
    let run = demo(cwd.path(), &["--store", &pg_url, "--broker", &redis_url, "--events", "300", "--quiet"]);
    run.assert_passed();
    run.assert_story();
    assert!(run.stdout.contains("outbox demo — PostgreSQL + Redis Streams"), "{}", run.describe());
    let schema = run.word_after("dropped schema ");
    assert!(schema.starts_with("outbox_demo_"), "{}", run.describe());
    let destination = run.word_after("destination ");
    assert!(std::fs::read_dir(cwd.path()).expect("read the directory").next().is_none(), "{}", run.describe());

    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(async {
        let store = PgStore::connect(PgConfig::from_url(&pg_url).expect("the PostgreSQL URL")).await.expect("connect");
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM information_schema.schemata WHERE schema_name = $1")
            .bind(&schema)
            .fetch_one(store.pool())
            .await
            .map_err(map_error)
            .expect("query information_schema");
        assert_eq!(left, 0, "schema {schema} is still there\n{}", run.describe());
        store.close().await;

        let redis =
            RedisBroker::connect(RedisConfig::from_url(&redis_url).expect("the Redis URL")).await.expect("redis");
        let entries =
            redis.stream_len(&Destination::new(destination.clone()).expect("a destination")).await.expect("XLEN");
        assert_eq!(entries, 0, "stream of {destination} still holds {entries} entries\n{}", run.describe());
    });
}
