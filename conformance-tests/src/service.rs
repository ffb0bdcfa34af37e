//! Reaching the real servers that adapter tests need.
//!
//! Adapter tests talk to real PostgreSQL, Redis, RabbitMQ and Kafka. Outside CI a missing server
//! skips the test loudly, naming the service and the command that starts it; under `CI=true` a
//! missing server is a failure, never a silent pass.
//!
//! The local servers' URLs live here, and only here: the libraries' `from_env` has no default
//! (a deployment with a missing variable must fail, not write to whatever listens on
//! localhost), while a test run on a developer's machine should find the servers that
//! `scripts/services` starts without any variable set.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use outbox_core::config::{ConnectionUrl, UrlSpec};

/// The PostgreSQL URL variable ([`pg_url`]).
pub const PG_URL_ENV: &str = "OUTBOX_PG_URL";
/// The local PostgreSQL of `scripts/services ensure postgres`.
pub const LOCAL_PG_URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/test";
/// The Redis URL variable ([`redis_url`]).
pub const REDIS_URL_ENV: &str = "OUTBOX_REDIS_URL";
/// The local Redis of `scripts/services ensure redis`.
pub const LOCAL_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// The RabbitMQ URL variable ([`amqp_url`]).
pub const AMQP_URL_ENV: &str = "OUTBOX_AMQP_URL";
/// The local RabbitMQ of `scripts/services ensure rabbitmq` (default account, vhost `/`).
pub const LOCAL_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The Kafka URL variable ([`kafka_url`]).
pub const KAFKA_URL_ENV: &str = "OUTBOX_KAFKA_URL";
/// The local Kafka-protocol broker (tansu) of `scripts/services ensure kafka`.
pub const LOCAL_KAFKA_URL: &str = "kafka://127.0.0.1:9092";

/// The PostgreSQL URL tests use: `OUTBOX_PG_URL`, else [`LOCAL_PG_URL`].
///
/// # Panics
/// When the variable is set but not valid Unicode.
pub fn pg_url() -> String {
    url_or_local(PG_URL_ENV, LOCAL_PG_URL)
}

/// The Redis URL tests use: `OUTBOX_REDIS_URL`, else [`LOCAL_REDIS_URL`].
///
/// # Panics
/// When the variable is set but not valid Unicode.
pub fn redis_url() -> String {
    url_or_local(REDIS_URL_ENV, LOCAL_REDIS_URL)
}

/// The RabbitMQ URL tests use: `OUTBOX_AMQP_URL`, else [`LOCAL_AMQP_URL`].
///
/// # Panics
/// When the variable is set but not valid Unicode.
pub fn amqp_url() -> String {
    url_or_local(AMQP_URL_ENV, LOCAL_AMQP_URL)
}

/// The Kafka URL tests use: `OUTBOX_KAFKA_URL`, else [`LOCAL_KAFKA_URL`].
///
/// # Panics
/// When the variable is set but not valid Unicode.
pub fn kafka_url() -> String {
    url_or_local(KAFKA_URL_ENV, LOCAL_KAFKA_URL)
}

/// The value of `var` (trimmed), or `local` when it is unset or blank.
///
/// # Panics
/// When the variable is set but not valid Unicode.
pub fn url_or_local(var: &str, local: &str) -> String {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => v.trim().to_string(),
        Ok(_) | Err(std::env::VarError::NotPresent) => local.to_string(),
        Err(std::env::VarError::NotUnicode(_)) => panic!("{var} is not valid Unicode"),
    }
}

/// `host:port` of the (first) server of a service URL, for [`require_service`]; the port
/// defaults to the scheme's usual one.
///
/// # Panics
/// When the URL does not parse or has no host (the message shows it redacted).
pub fn service_addr(url: &str) -> String {
    const SPEC: UrlSpec = UrlSpec::new(
        "test service",
        &["postgres", "postgresql", "redis", "rediss", "amqp", "amqps", "kafka", "kafka+ssl"],
    )
    .multi_host();
    let parsed = ConnectionUrl::parse(&SPEC, url).unwrap_or_else(|e| panic!("{e}"));
    let default_port = match parsed.scheme() {
        "postgres" | "postgresql" => 5432,
        "redis" | "rediss" => 6379,
        "amqp" => 5672,
        "amqps" => 5671,
        _ => 9092,
    };
    let host = parsed.require_host().unwrap_or_else(|e| panic!("{e}"));
    host.with_port(default_port)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_addr_takes_the_first_host_and_the_usual_port() {
        assert_eq!(service_addr(LOCAL_PG_URL), "127.0.0.1:5432");
        assert_eq!(service_addr("postgresql://u:p@db"), "db:5432");
        assert_eq!(service_addr(LOCAL_REDIS_URL), "127.0.0.1:6379");
        assert_eq!(service_addr(LOCAL_AMQP_URL), "127.0.0.1:5672");
        assert_eq!(service_addr("amqps://rabbit/%2f"), "rabbit:5671");
        assert_eq!(service_addr("kafka://k1,k2:9093"), "k1:9092");
        assert_eq!(service_addr("redis://[::1]:7000"), "[::1]:7000");
    }
}
