//! Running the built `outbox` binary from tests: bounded waits, fresh names, real servers.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use outbox_conformance_tests::service;

/// The binary under test.
pub fn outbox() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_outbox"));
    c.env_remove("OUTBOX_STORE_URL").env_remove("OUTBOX_BROKER_URL").env_remove("OUTBOX_INBOX_URL");
    c
}

/// Run `outbox args…` to completion, killed after `limit` with a failure message.
pub fn run(args: &[&str], limit: Duration) -> Output {
    let child =
        outbox().args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("the outbox binary starts");
    wait_output(child, limit, &format!("outbox {}", args.join(" ")))
}

/// Wait for a child with a deadline; kill it and panic when it does not exit in time.
pub fn wait_output(mut child: Child, limit: Duration, what: &str) -> Output {
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "{what} did not exit within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Wait for a child's exit status with a deadline (its output is not captured).
pub fn wait_status(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Send SIGTERM to a child.
pub fn sigterm(child: &Child) {
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill runs");
    assert!(status.success(), "kill -TERM {} failed", child.id());
}

/// stdout and stderr as text.
pub fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Assert success and return stdout.
pub fn ok(args: &[&str]) -> String {
    let out = run(args, Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "outbox {} failed ({:?})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        args.join(" "),
        out.status
    );
    stdout
}

/// A name no other test, run or process uses (lowercase, digits and `_`).
pub fn unique(tag: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{tag}_{}_{}_{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed), nanos % 1_000_000)
}

/// `url` with `param=value` added to its query.
pub fn with_param(url: &str, param: &str, value: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{param}={value}")
}

/// A free loopback port (bound and released; good enough for one test process).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// GET `path` from `127.0.0.1:port`; `None` when nothing listens yet.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let status = body.split_whitespace().nth(1)?.parse().ok()?;
    let content = body.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((status, content))
}

/// Poll `check` every 20 ms until it returns `Some`, failing with `what` after `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
