//! The relay's `/metrics` (Prometheus text format 0.0.4) and `/healthz` endpoints.
//!
//! Two endpoints and plain HTTP/1.1 don't justify a web framework in the one binary operators
//! deploy: this is a small, bounded server (one request per connection, 8 KiB of request
//! head, a 5 s read deadline) that reads the relay's counters and the store's durable counts
//! at scrape time.
//!
//! The libraries measure through the `metrics` facade (the relay's publish latency, the consumer
//! runtime's outcomes), which records nothing until a process installs a recorder. With
//! `--metrics` this process installs a Prometheus recorder and appends its rendering to the
//! families above. A family rendered here first (the relay's `*_total` counters, read from
//! [`Relay::totals`] and labelled with the owner) is not repeated from the recorder, so every
//! name appears once however the libraries label their own copies.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use outbox::{OutboxAdmin, Relay, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use crate::relay::io_error;

/// How long a scrape may wait for the store's counts.
const STATS_TIMEOUT: Duration = Duration::from_secs(3);

/// Bucket bounds (seconds) of every recorded histogram: publish and handle latencies, from a
/// local broker's sub-millisecond acknowledgement to a stalled one. Buckets, not quantiles, so
/// that several relays' histograms add up in Prometheus.
pub(crate) const LATENCY_BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// How often recorded histogram samples are folded into their buckets between scrapes, so an
/// unscraped relay's memory stays bounded.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Install this process's `metrics` recorder (once; later calls return the same handle).
///
/// `None` when another recorder was installed first: then `/metrics` shows only the families
/// this module renders itself, and a warning says why.
pub(crate) fn install_recorder() -> Option<PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = match PrometheusBuilder::new().set_buckets(LATENCY_BUCKETS) {
                Ok(builder) => builder.build_recorder(),
                Err(e) => {
                    warn!(target: "outbox.metrics", error = %e, "histogram buckets refused; recording quantiles");
                    PrometheusBuilder::new().build_recorder()
                }
            };
            let handle = recorder.handle();
            match ::metrics::set_global_recorder(recorder) {
                Ok(()) => Some(handle),
                Err(e) => {
                    warn!(target: "outbox.metrics", error = %e, "a metrics recorder is already installed; /metrics shows the relay's own counters only");
                    None
                }
            }
        })
        .clone()
}

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

/// Listen on `addr` and serve until [`Server::stop`], with this process's recorder
/// ([`install_recorder`], installed here if it was not yet).
pub(crate) async fn serve(addr: SocketAddr, relay: Arc<Relay>, store: Arc<dyn OutboxAdmin>) -> Result<Server> {
    let listener = TcpListener::bind(addr).await.map_err(|e| io_error(&format!("--metrics {addr}"), e))?;
    let addr = listener.local_addr().map_err(|e| io_error("--metrics", e))?;
    let recorder = install_recorder();
    let task = tokio::spawn(async move {
        let mut upkeep = tokio::time::interval(UPKEEP_EVERY);
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = upkeep.tick() => {
                    if let Some(recorder) = &recorder {
                        recorder.run_upkeep();
                    }
                    continue;
                }
            };
            let Ok((stream, _)) = accepted else { continue };
            let (relay, store, recorder) = (relay.clone(), store.clone(), recorder.clone());
            tokio::spawn(async move {
                if let Err(e) = handle(stream, &relay, &*store, recorder.as_ref()).await {
                    debug!(target: "outbox.metrics", error = %e, "metrics request failed");
                }
            });
        }
    });
    Ok(Server { addr, task })
}

async fn handle(
    mut stream: TcpStream,
    relay: &Relay,
    store: &dyn OutboxAdmin,
    recorder: Option<&PrometheusHandle>,
) -> std::io::Result<()> {
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
        ("GET", "/metrics") => {
            let mut body = render(relay, store).await;
            if let Some(recorder) = recorder {
                append_recorded(&mut body, &recorder.render());
            }
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body)
        }
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

/// The metric family names `text` declares (`# TYPE name kind`).
fn families(text: &str) -> BTreeSet<&str> {
    text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split_whitespace().next()).collect()
}

/// Append the recorder's rendering `recorded` to `out`, family by family, leaving out every
/// family `out` already has.
fn append_recorded(out: &mut String, recorded: &str) {
    let taken: BTreeSet<String> = families(out).into_iter().map(str::to_owned).collect();
    // The exporter ends every family with an empty line.
    for block in recorded.split("\n\n") {
        let block = block.trim_matches('\n');
        let Some(name) = families(block).into_iter().next() else { continue };
        if taken.contains(name) {
            continue;
        }
        out.push_str(block);
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_families_are_appended_once() {
        let mut out = "# HELP outbox_relay_published_total Rows.\n# TYPE outbox_relay_published_total counter\n\
                       outbox_relay_published_total{owner=\"r\"} 3\n"
            .to_string();
        let recorded = "# TYPE outbox_relay_published_total counter\noutbox_relay_published_total 3\n\n\
                        # HELP outbox_relay_publish_seconds Latency.\n# TYPE outbox_relay_publish_seconds histogram\n\
                        outbox_relay_publish_seconds_bucket{le=\"+Inf\"} 3\noutbox_relay_publish_seconds_count 3\n\n";
        append_recorded(&mut out, recorded);
        assert_eq!(out.matches("# TYPE outbox_relay_published_total").count(), 1, "{out}");
        assert!(out.contains("outbox_relay_published_total{owner=\"r\"} 3\n"), "{out}");
        assert!(!out.contains("outbox_relay_published_total 3"), "{out}");
        assert!(out.contains("# HELP outbox_relay_publish_seconds Latency.\n"), "{out}");
        assert!(out.ends_with("outbox_relay_publish_seconds_count 3\n"), "{out}");
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
