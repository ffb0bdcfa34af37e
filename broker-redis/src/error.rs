//! From `redis::RedisError` to the workspace's error, by error kind and server error code.
//!
//! Whether a failed command may still have taken effect depends on the operation: a refused
//! connection never sent anything, but a write whose reply was lost (timeout, connection dropped
//! mid-flight) may have been applied. The caller says which case it is in with [`Op`].

use outbox_core::{Error, ErrorKind, Retry};
use redis::{ErrorKind as RK, RedisError, ServerErrorKind as SK};

use crate::BACKEND;

/// Error code the publish script raises when the connected user may not run a command the
/// configured trimming or dedupe needs (checked before anything is written).
pub(crate) const ACL_CODE: &str = "OUTBOXACL";

/// What kind of operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Reads and idempotent administrative commands: a lost reply changed nothing that matters.
    Read,
    /// A write whose effect is not idempotent (publish): a lost reply is an unknown outcome.
    Write,
}

/// Convert with a short description of what was being done (`"publish to outbox:orders"`).
pub(crate) fn map(err: RedisError, op: Op, doing: &str) -> Error {
    let (kind, retry) = classify(&err, op);
    let detail = match err.code() {
        Some(code) => format!("{} ({code})", err.category()),
        None => err.category().to_string(),
    };
    Error::new(kind, retry, BACKEND, detail).with_operation(doing.to_string()).with_source(err)
}

fn classify(err: &RedisError, op: Op) -> (ErrorKind, Retry) {
    use ErrorKind as K;
    let unsure = if op == Op::Write { Retry::OutcomeUnknown } else { Retry::Transient };
    if err.is_connection_refusal() {
        // Nothing reached the server.
        return (K::Connection, Retry::Transient);
    }
    if err.is_timeout() {
        return (K::Timeout, unsure);
    }
    if err.is_io_error() || err.is_connection_dropped() {
        return (K::Connection, unsure);
    }
    match err.kind() {
        // Wrong password or unknown ACL user: the same credentials fail again.
        RK::AuthenticationFailed => (K::Auth, Retry::Permanent),
        RK::InvalidClientConfig | RK::RESP3NotSupported => (K::Config, Retry::Permanent),
        RK::Parse | RK::UnexpectedReturnType => (K::Corrupt, Retry::Permanent),
        RK::Server(SK::BusyLoading | SK::TryAgain | SK::MasterDown | SK::ClusterDown) => (K::Busy, Retry::Transient),
        // A failover demoted the server; the write was refused, a retry may reach the new primary.
        RK::Server(SK::ReadOnly) => (K::Rejected, Retry::Transient),
        RK::Server(SK::NoPerm) => (K::Config, Retry::Permanent),
        RK::Extension => match err.code() {
            Some("NOAUTH" | "WRONGPASS") => (K::Auth, Retry::Permanent),
            Some("NOPERM") => (K::Config, Retry::Permanent),
            Some(ACL_CODE) => (K::Config, Retry::Permanent),
            Some("NOGROUP") => (K::Closed, Retry::Permanent),
            Some("BUSY") => (K::Busy, Retry::Transient),
            // The same server errors, caught inside a batch script and rebuilt from their text.
            Some("LOADING" | "TRYAGAIN" | "MASTERDOWN" | "CLUSTERDOWN") => (K::Busy, Retry::Transient),
            Some("READONLY") => (K::Rejected, Retry::Transient),
            // Out of memory, or writes refused after a failed RDB save: nothing was written, and
            // the operator can fix it without us.
            Some("OOM" | "MISCONF") => (K::Rejected, Retry::Transient),
            _ => (K::Rejected, Retry::Permanent),
        },
        _ => (K::Rejected, Retry::Permanent),
    }
}

/// A reply of an unexpected shape.
pub(crate) fn corrupt(message: impl Into<String>) -> Error {
    Error::permanent(ErrorKind::Corrupt, BACKEND, message)
}
