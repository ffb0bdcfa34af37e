//! The relay's `/metrics` (Prometheus text format 0.0.4) and `/healthz` endpoints.
//!
//! Two endpoints and plain HTTP/1.1 don't justify a web framework in the one binary operators
//! deploy: this is a small, bounded server (one request per connection, 8 KiB of request
//! head, a 5 s read deadline) that reads the relay's counters and the store's durable counts
//! at scrape time.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use outbox::{OutboxAdmin, Relay, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::debug;

use crate::relay::io_error;

/// How long a scrape may wait for the store's counts.
const STATS_TIMEOUT: Duration = Duration::from_secs(3);

/// A running metrics server.
pub(crate) struct Server {
    /// The address it listens on (the port is known even when `:0` was asked).
    pub(crate) addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Stop accepting connections.
    pub(crate) fn stop(self) {
        self.task.abort();
    }
}

/// Listen on `addr` and serve until [`Server::stop`].
pub(crate) async fn serve(addr: SocketAddr, relay: Arc<Relay>, store: Arc<dyn OutboxAdmin>) -> Result<Server> {
    let listener = TcpListener::bind(addr).await.map_err(|e| io_error(&format!("--metrics {addr}"), e))?;
    let addr = listener.local_addr().map_err(|e| io_error("--metrics", e))?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let (relay, store) = (relay.clone(), store.clone());
            tokio::spawn(async move {
                if let Err(e) = handle(stream, &relay, &*store).await {
                    debug!(target: "outbox.metrics", error = %e, "metrics request failed");
                }
            });
        }
    });
    Ok(Server { addr, task })
}

async fn handle(mut stream: TcpStream, relay: &Relay, store: &dyn OutboxAdmin) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        std::io::Result::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(5), read).await.map_err(|_| std::io::ErrorKind::TimedOut)??;
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET", "/metrics") => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", render(relay, store).await),
        ("GET", "/healthz") => match health(relay, store).await {
            Ok(()) => ("200 OK", "text/plain; charset=utf-8", "ok\n".to_string()),
            Err(why) => ("503 Service Unavailable", "text/plain; charset=utf-8", format!("{why}\n")),
        },
        ("GET", _) => ("404 Not Found", "text/plain; charset=utf-8", "try /metrics or /healthz\n".to_string()),
        _ => ("405 Method Not Allowed", "text/plain; charset=utf-8", "GET only\n".to_string()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// Healthy while the relay runs and its store answers.
async fn health(relay: &Relay, store: &dyn OutboxAdmin) -> std::result::Result<(), String> {
    if relay.shutdown_handle().is_triggered() {
        return Err("shutting down".into());
    }
    match tokio::time::timeout(STATS_TIMEOUT, store.stats()).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("store: {e}")),
        Err(_) => Err(format!("store: no answer within {STATS_TIMEOUT:?}")),
    }
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

async fn render(relay: &Relay, store: &dyn OutboxAdmin) -> String {
    let owner = label(&relay.config().owner);
    let t = relay.totals();
    let mut out = String::new();
    let counters = [
        ("claimed", "Rows claimed by this relay.", t.claimed),
        ("published", "Rows this relay published and completed.", t.published),
        ("fenced", "Completions or transitions rejected because the lease was stale.", t.fenced),
        ("retried", "Failed publishes sent back to pending with a retry time.", t.retried),
        ("parked", "Rows this relay dead-lettered.", t.parked),
        ("released", "Rows released unpublished (shutdown, or an earlier failure of the same key).", t.released),
        ("refused", "Rows released because the broker refused the relay's credentials (not parked).", t.refused),
    ];
    for (name, help, value) in counters {
        let _ = writeln!(out, "# HELP outbox_relay_{name}_total {help}");
        let _ = writeln!(out, "# TYPE outbox_relay_{name}_total counter");
        let _ = writeln!(out, "outbox_relay_{name}_total{{owner=\"{owner}\"}} {value}");
    }
    let stats = tokio::time::timeout(STATS_TIMEOUT, store.stats()).await;
    let up = matches!(stats, Ok(Ok(_)));
    let _ = writeln!(out, "# HELP outbox_store_up Whether the store answered this scrape's count query.");
    let _ = writeln!(out, "# TYPE outbox_store_up gauge");
    let _ = writeln!(out, "outbox_store_up{{backend=\"{}\"}} {}", store.backend(), u8::from(up));
    if let Ok(Ok(s)) = stats {
        let _ = writeln!(out, "# HELP outbox_rows Outbox rows by status, read from the store.");
        let _ = writeln!(out, "# TYPE outbox_rows gauge");
        for (status, n) in
            [("pending", s.pending), ("leased", s.leased), ("parked", s.parked), ("published", s.published)]
        {
            let _ = writeln!(out, "outbox_rows{{status=\"{status}\"}} {n}");
        }
        let _ = writeln!(out, "# HELP outbox_oldest_pending_age_seconds Age of the oldest pending row (0 if none).");
        let _ = writeln!(out, "# TYPE outbox_oldest_pending_age_seconds gauge");
        let age = s.oldest_pending_age.map_or(0.0, |d| d.as_secs_f64());
        let _ = writeln!(out, "outbox_oldest_pending_age_seconds {age}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
