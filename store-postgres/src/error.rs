//! sqlx errors to [`outbox_core::Error`], decided by SQLSTATE and error variant, never by text.
//!
//! The retry class depends on where the failure happened, not only on what it was: a broken
//! connection inside an open transaction lost nothing (the server rolls it back), but a broken
//! connection during `COMMIT`, or during a statement that commits by itself, may or may not have
//! taken effect.

use outbox_core::{Error, ErrorKind, Retry};

/// Backend name carried by every error of this crate.
pub const BACKEND: &str = "postgres";

/// Where a statement ran, which decides what a lost connection means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Inside an open transaction, or a statement that writes nothing: a lost connection
    /// changed nothing.
    InTransaction,
    /// A statement that commits by itself: a lost connection leaves the outcome unknown.
    AutocommitWrite,
    /// `COMMIT`: a lost connection leaves the outcome unknown.
    Commit,
}

/// Convert an error of a statement run inside an open transaction (a handler's effect, for
/// example). A lost connection is transient there: the server rolls the transaction back.
pub fn map_error(err: sqlx::Error) -> Error {
    map(err, Phase::InTransaction, "statement")
}

/// Convert an error of `COMMIT` of a transaction the caller opened itself (a producer that
/// enqueues in its own transaction, see [`enqueue`](crate::enqueue)): a lost connection is
/// [`Retry::OutcomeUnknown`], because the commit may have happened.
pub fn map_commit_error(err: sqlx::Error) -> Error {
    map(err, Phase::Commit, "commit")
}

/// The SQLSTATE of a database error, if it is one.
pub(crate) fn sqlstate(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// `true` for a unique-constraint violation (SQLSTATE 23505).
pub fn is_unique_violation(err: &sqlx::Error) -> bool {
    sqlstate(err).as_deref() == Some("23505")
}

/// `true` for the failures a retry of the whole transaction can fix: serialization failure
/// (40001), deadlock (40P01), lock timeout (55P03).
pub fn is_retryable_conflict(err: &sqlx::Error) -> bool {
    matches!(sqlstate(err).as_deref(), Some("40001" | "40P01" | "55P03"))
}

/// Convert an error of `operation` (`"claim"`, `"begin"`, `"connecting to …"`): the operation
/// is named in the error, the driver error kept as its source.
pub(crate) fn map(err: sqlx::Error, phase: Phase, operation: &str) -> Error {
    classify(&err, phase).with_operation(operation.to_string()).with_source(err)
}

fn classify(err: &sqlx::Error, phase: Phase) -> Error {
    let lost = |msg: &str| match phase {
        Phase::InTransaction => Error::transient(ErrorKind::Connection, BACKEND, msg.to_string()),
        Phase::AutocommitWrite | Phase::Commit => Error::outcome_unknown(
            ErrorKind::Connection,
            BACKEND,
            format!("{msg}; the write may or may not have been committed"),
        ),
    };
    match err {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            from_sqlstate(&code, phase)
        }
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => {
            lost("connection failed or broke")
        }
        sqlx::Error::Tls(_) => Error::transient(ErrorKind::Connection, BACKEND, "TLS failure"),
        sqlx::Error::PoolTimedOut => {
            Error::transient(ErrorKind::Connection, BACKEND, "no connection available within the connect timeout")
        }
        sqlx::Error::PoolClosed => Error::permanent(ErrorKind::Closed, BACKEND, "the connection pool is closed"),
        sqlx::Error::Configuration(_) => Error::config(BACKEND, "invalid connection settings"),
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::TypeNotFound { .. } => {
            Error::permanent(ErrorKind::Corrupt, BACKEND, "stored data does not have the expected shape (run migrate?)")
        }
        _ => Error::permanent(ErrorKind::Rejected, BACKEND, ""),
    }
}

fn from_sqlstate(code: &str, phase: Phase) -> Error {
    let msg = |m: &str| format!("{m} (SQLSTATE {code})");
    let class = code.get(..2).unwrap_or("");
    match (code, class) {
        ("40001", _) => Error::transient(ErrorKind::Busy, BACKEND, msg("serialization failure")),
        ("40P01", _) => Error::transient(ErrorKind::Busy, BACKEND, msg("deadlock detected")),
        ("55P03", _) => Error::transient(ErrorKind::Busy, BACKEND, msg("lock not available (lock_timeout)")),
        ("57014", _) => Error::transient(ErrorKind::Timeout, BACKEND, msg("statement canceled (statement_timeout)")),
        ("40003", _) => Error::outcome_unknown(ErrorKind::Connection, BACKEND, msg("statement completion unknown")),
        ("23505", _) => Error::permanent(ErrorKind::Conflict, BACKEND, msg("unique violation")),
        ("22001" | "54000", _) => Error::permanent(ErrorKind::TooLarge, BACKEND, msg("value too large")),
        ("57P01" | "57P02" | "57P03", _) | (_, "08") => {
            let retry = if phase == Phase::InTransaction { Retry::Transient } else { Retry::OutcomeUnknown };
            Error::new(ErrorKind::Connection, retry, BACKEND, msg("server closed or refused the connection"))
        }
        ("53300", _) => Error::transient(ErrorKind::Connection, BACKEND, msg("too many connections")),
        (_, "53") => Error::transient(ErrorKind::Busy, BACKEND, msg("insufficient resources")),
        // Wrong password, unknown role, no pg_hba entry: the same credentials fail again.
        (_, "28") => Error::auth(BACKEND, msg("authentication failed")),
        ("3D000", _) => Error::config(BACKEND, msg("database does not exist")),
        ("3F000" | "42P01", _) => {
            Error::permanent(ErrorKind::Rejected, BACKEND, msg("schema or table missing (run PgStore::migrate)"))
        }
        _ => Error::permanent(ErrorKind::Rejected, BACKEND, msg("rejected by the server")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_depends_on_phase() {
        let io = || sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(map(io(), Phase::InTransaction, "x").retry(), Retry::Transient);
        assert_eq!(map(io(), Phase::Commit, "x").retry(), Retry::OutcomeUnknown);
        assert_eq!(map(io(), Phase::AutocommitWrite, "x").retry(), Retry::OutcomeUnknown);
        assert_eq!(map_commit_error(io()).kind(), ErrorKind::Connection);
        assert_eq!(map_error(sqlx::Error::PoolTimedOut).retry(), Retry::Transient);
        assert_eq!(map_error(sqlx::Error::PoolClosed).kind(), ErrorKind::Closed);
        let e = map(io(), Phase::Commit, "claim");
        assert_eq!(e.operation(), Some("claim"));
        assert!(e.to_string().starts_with("postgres: claim failed: connection failed or broke"), "{e}");
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn sqlstates() {
        let cases = [
            ("40001", ErrorKind::Busy, Retry::Transient),
            ("40P01", ErrorKind::Busy, Retry::Transient),
            ("55P03", ErrorKind::Busy, Retry::Transient),
            ("57014", ErrorKind::Timeout, Retry::Transient),
            ("23505", ErrorKind::Conflict, Retry::Permanent),
            ("22001", ErrorKind::TooLarge, Retry::Permanent),
            ("54000", ErrorKind::TooLarge, Retry::Permanent),
            ("08006", ErrorKind::Connection, Retry::Transient),
            ("28P01", ErrorKind::Auth, Retry::Permanent),
            ("28000", ErrorKind::Auth, Retry::Permanent),
            ("42601", ErrorKind::Rejected, Retry::Permanent),
        ];
        for (code, kind, retry) in cases {
            let e = from_sqlstate(code, Phase::InTransaction);
            assert_eq!((e.kind(), e.retry()), (kind, retry), "{code}");
        }
        assert_eq!(from_sqlstate("57P01", Phase::Commit).retry(), Retry::OutcomeUnknown);
    }
}
