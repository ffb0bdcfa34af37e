//! Reaching the real servers that adapter tests need.
//!
//! Adapter tests talk to real PostgreSQL, Redis, RabbitMQ and Kafka. Outside CI a missing server
//! skips the test loudly, naming the service and the command that starts it; under `CI=true` a
//! missing server is a failure, never a silent pass.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Whether the tests run under CI (`CI=true`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Check that `service` answers at `addr` (`host:port`).
///
/// Returns `true` when it does. When it does not: under CI this panics with the start command;
/// otherwise it prints a `SKIPPED` line naming the service and the command
/// (`scripts/services ensure <script_name>`) and returns `false`, and the caller returns early.
///
/// # Panics
/// Under `CI=true` when the service is unreachable.
pub fn require_service(service: &str, script_name: &str, addr: &str) -> bool {
    let reachable = addr
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok());
    if reachable {
        return true;
    }
    let msg = format!("{service} is not reachable at {addr}; start it with `scripts/services ensure {script_name}`");
    if in_ci() {
        panic!("{msg} (CI=true: an unreachable service is a failure)");
    }
    eprintln!("SKIPPED: {msg}");
    false
}
