//! One error type for the whole contract.
//!
//! The relay and the consumer runtime must decide *what to do* with a failure (retry, park,
//! treat as maybe-sent) without knowing which backend produced it. So every adapter converts its
//! library's errors into [`Error`], choosing a [`ErrorKind`] (what went wrong) and a [`Retry`]
//! class (whether trying again can help). Nobody downcasts or reads message text to decide.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// Result alias used throughout the workspace.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, independent of the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Input was rejected before anything was written (bad event id, oversized payload, bad name).
    InvalidInput,
    /// A configuration value is invalid or unsafe (bad URL, unsafe retention, bad identifier).
    Config,
    /// The server could not be reached or the connection broke.
    Connection,
    /// The backend is busy or locked (SQLite busy, lock timeout, serialization failure, deadlock).
    Busy,
    /// An operation exceeded its deadline.
    Timeout,
    /// The broker could tell that nothing would receive the message (no route / no topic).
    Unroutable,
    /// The message or row is larger than the backend accepts.
    TooLarge,
    /// The same event id arrived with a different payload.
    Conflict,
    /// The stored data is damaged or from a newer schema than this code understands.
    Corrupt,
    /// A subscription or component was closed.
    Closed,
    /// The backend rejected the operation for a reason not listed above.
    Rejected,
    /// An error inside user code (a handler).
    Handler,
    /// The server refused the credentials (wrong user or password, unknown ACL user, failed SASL
    /// handshake). Permanent on every backend: retrying the same credentials cannot succeed, and
    /// retrying them may lock the account.
    Auth,
    /// Not attempted: an earlier event of the same key failed in the same batch
    /// ([`Broker::publish_batch`](crate::Broker::publish_batch)), and sending this one first
    /// would break the key's order, or the relay calling it is shutting down. Transient; not the
    /// event's fault.
    Skipped,
}

/// Whether trying the same operation again can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Retry {
    /// Nothing happened; trying again later may succeed.
    Transient,
    /// Nothing happened and trying again will fail the same way.
    Permanent,
    /// The operation may or may not have taken effect (a publish that timed out, a connection lost
    /// during `COMMIT`). Callers must treat the outcome as "not done" and rely on the contract's
    /// idempotence downstream.
    OutcomeUnknown,
}

/// The error of every trait in this workspace.
///
/// It names the backend that produced it (`"sqlite"`, `"kafka"`, ...) and, where the adapter
/// knows it, the operation that failed (`"publish"`, `"commit"`, `"connect to …"`), so logs say
/// where a failure came from without the caller knowing concrete types. The driver's own error
/// is kept as [`source`](std::error::Error::source), so `anyhow`-style reports print the whole
/// chain.
///
/// Displayed as `backend: operation failed: message: source` (the parts that are present).
/// Cloning shares the source.
#[derive(Clone)]
pub struct Error {
    kind: ErrorKind,
    retry: Retry,
    backend: Cow<'static, str>,
    operation: Option<Cow<'static, str>>,
    message: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Error {
    /// A new error with an explicit kind and retry class.
    pub fn new(
        kind: ErrorKind,
        retry: Retry,
        backend: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        Self { kind, retry, backend: backend.into(), operation: None, message: message.into(), source: None }
    }

    /// Authentication refused: permanent, kind [`ErrorKind::Auth`].
    pub fn auth(backend: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Auth, Retry::Permanent, backend, message)
    }

    /// Invalid input: permanent.
    pub fn invalid_input(backend: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, Retry::Permanent, backend, message)
    }

    /// Invalid configuration: permanent.
    pub fn config(backend: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, Retry::Permanent, backend, message)
    }

    /// A transient failure of the given kind.
    pub fn transient(kind: ErrorKind, backend: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::new(kind, Retry::Transient, backend, message)
    }

    /// A permanent failure of the given kind.
    pub fn permanent(kind: ErrorKind, backend: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::new(kind, Retry::Permanent, backend, message)
    }

    /// A failure whose outcome is unknown (may have taken effect).
    pub fn outcome_unknown(kind: ErrorKind, backend: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::new(kind, Retry::OutcomeUnknown, backend, message)
    }

    /// Attach the underlying library error.
    #[must_use]
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// Name the operation that failed (`"publish"`, `"commit"`, `"XACK 1-0 in g on s"`).
    #[must_use]
    pub fn with_operation(mut self, operation: impl Into<Cow<'static, str>>) -> Self {
        self.operation = Some(operation.into());
        self
    }

    /// The operation that failed, when the adapter named it.
    pub fn operation(&self) -> Option<&str> {
        self.operation.as_deref()
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Whether retrying can help.
    pub fn retry(&self) -> Retry {
        self.retry
    }

    /// `true` when retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        self.retry == Retry::Transient
    }

    /// `true` when retrying cannot help.
    pub fn is_permanent(&self) -> bool {
        self.retry == Retry::Permanent
    }

    /// `true` when the operation may or may not have taken effect.
    pub fn is_outcome_unknown(&self) -> bool {
        self.retry == Retry::OutcomeUnknown
    }

    /// The backend that produced the error.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// The human-readable message (without the backend name).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.backend)?;
        if let Some(operation) = &self.operation {
            write!(f, ": {operation} failed")?;
        }
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.kind)
            .field("retry", &self.retry)
            .field("backend", &self.backend)
            .field("operation", &self.operation)
            .field("message", &self.message)
            .field("source", &self.source.as_ref().map(|s| s.to_string()))
            .finish()
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|s| s as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_backend_and_source() {
        let io = std::io::Error::other("boom");
        let err = Error::transient(ErrorKind::Connection, "redis", "connect failed").with_source(io);
        assert_eq!(err.to_string(), "redis: connect failed: boom");
        assert!(err.is_transient());
        assert_eq!(err.kind(), ErrorKind::Connection);
        assert!(std::error::Error::source(&err).is_some());
        assert_eq!(err.operation(), None);
    }

    #[test]
    fn display_names_the_operation_and_clones_keep_the_source() {
        let io = std::io::Error::other("reset");
        let err = Error::transient(ErrorKind::Connection, "postgres", "").with_operation("commit").with_source(io);
        assert_eq!(err.to_string(), "postgres: commit failed: reset");
        assert_eq!(err.operation(), Some("commit"));
        let copy = err.clone();
        assert_eq!(std::error::Error::source(&copy).map(ToString::to_string).as_deref(), Some("reset"));
        let auth = Error::auth("amqp", "credentials refused");
        assert_eq!((auth.kind(), auth.retry()), (ErrorKind::Auth, Retry::Permanent));
    }
}
