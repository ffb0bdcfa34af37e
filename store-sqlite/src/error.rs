//! SQLite failures as the contract's error, decided by SQLite's result codes.
//!
//! The relay and the consumer runtime branch only on [`ErrorKind`] and [`Retry`], so this is
//! where a lock held by another writer becomes "transient, try again", a damaged file becomes
//! "permanent", and a `COMMIT` that failed part-way becomes "outcome unknown".

use outbox_core::{Error, ErrorKind, Result, Retry};
use rusqlite::ErrorCode;
use rusqlite::ffi;

/// Backend name carried by every error of this crate.
pub(crate) const BACKEND: &str = "sqlite";

/// Convert a `rusqlite` error into the contract's error, for code that runs its own SQL on a
/// [`SqliteTx`](crate::SqliteTx) (see [`SqliteTx::run_with`](crate::SqliteTx::run_with)).
///
/// Busy or locked is [`ErrorKind::Busy`] (transient); a unique or primary-key violation is
/// [`ErrorKind::Conflict`] and another constraint [`ErrorKind::Rejected`] (permanent); a
/// corrupt file or one that is not a database is [`ErrorKind::Corrupt`] (permanent); an I/O
/// failure is [`ErrorKind::Connection`] (transient); a value that does not decode is
/// [`ErrorKind::Corrupt`].
pub fn sqlite_error(e: rusqlite::Error) -> Error {
    map("statement", e)
}

fn classify_code(error: &ffi::Error) -> (ErrorKind, Retry) {
    match error.code {
        ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked | ErrorCode::SchemaChanged => {
            (ErrorKind::Busy, Retry::Transient)
        }
        ErrorCode::ConstraintViolation => {
            if error.extended_code == ffi::SQLITE_CONSTRAINT_UNIQUE
                || error.extended_code == ffi::SQLITE_CONSTRAINT_PRIMARYKEY
            {
                (ErrorKind::Conflict, Retry::Permanent)
            } else {
                (ErrorKind::Rejected, Retry::Permanent)
            }
        }
        ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase => (ErrorKind::Corrupt, Retry::Permanent),
        ErrorCode::SystemIoFailure if error.extended_code == ffi::SQLITE_IOERR_CORRUPTFS => {
            (ErrorKind::Corrupt, Retry::Permanent)
        }
        ErrorCode::SystemIoFailure | ErrorCode::CannotOpen | ErrorCode::FileLockingProtocolFailed => {
            (ErrorKind::Connection, Retry::Transient)
        }
        ErrorCode::DiskFull | ErrorCode::OutOfMemory => (ErrorKind::Rejected, Retry::Transient),
        ErrorCode::TooBig => (ErrorKind::TooLarge, Retry::Permanent),
        ErrorCode::OperationInterrupted => (ErrorKind::Timeout, Retry::Transient),
        _ => (ErrorKind::Rejected, Retry::Permanent),
    }
}

fn classify(e: &rusqlite::Error) -> (ErrorKind, Retry) {
    match e {
        rusqlite::Error::SqliteFailure(error, _) => classify_code(error),
        rusqlite::Error::SqlInputError { error, .. } => classify_code(error),
        rusqlite::Error::FromSqlConversionFailure(..)
        | rusqlite::Error::IntegralValueOutOfRange(..)
        | rusqlite::Error::InvalidColumnType(..)
        | rusqlite::Error::Utf8Error(..) => (ErrorKind::Corrupt, Retry::Permanent),
        _ => (ErrorKind::Rejected, Retry::Permanent),
    }
}

/// Convert with a short description of what was being done: the error names it as its
/// operation and keeps the rusqlite error as its source.
pub(crate) fn map(context: &str, e: rusqlite::Error) -> Error {
    let (kind, retry) = classify(&e);
    Error::new(kind, retry, BACKEND, "").with_operation(context.to_string()).with_source(e)
}

/// Convert a failed `COMMIT`: busy means SQLite kept the transaction open and nothing is
/// durable (transient); anything else may have reached the disk or not.
pub(crate) fn map_commit(context: &str, e: rusqlite::Error) -> Error {
    let (kind, retry) = classify(&e);
    let retry = if kind == ErrorKind::Busy { retry } else { Retry::OutcomeUnknown };
    Error::new(kind, retry, BACKEND, "").with_operation(format!("{context} (commit)")).with_source(e)
}

/// `.ctx("what")` on a `rusqlite` result.
pub(crate) trait ResultExt<T> {
    fn ctx(self, context: &str) -> Result<T>;
}

impl<T> ResultExt<T> for rusqlite::Result<T> {
    fn ctx(self, context: &str) -> Result<T> {
        self.map_err(|e| map(context, e))
    }
}

/// A stored value that does not decode into the contract's types.
pub(crate) fn corrupt(message: String) -> Error {
    Error::permanent(ErrorKind::Corrupt, BACKEND, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(code: i32) -> rusqlite::Error {
        rusqlite::Error::SqliteFailure(ffi::Error::new(code), None)
    }

    #[test]
    fn codes_map_to_kinds() {
        let cases = [
            (ffi::SQLITE_BUSY, ErrorKind::Busy, Retry::Transient),
            (ffi::SQLITE_LOCKED, ErrorKind::Busy, Retry::Transient),
            (ffi::SQLITE_CONSTRAINT_UNIQUE, ErrorKind::Conflict, Retry::Permanent),
            (ffi::SQLITE_CONSTRAINT_NOTNULL, ErrorKind::Rejected, Retry::Permanent),
            (ffi::SQLITE_CORRUPT, ErrorKind::Corrupt, Retry::Permanent),
            (ffi::SQLITE_NOTADB, ErrorKind::Corrupt, Retry::Permanent),
            (ffi::SQLITE_IOERR_WRITE, ErrorKind::Connection, Retry::Transient),
            (ffi::SQLITE_FULL, ErrorKind::Rejected, Retry::Transient),
        ];
        for (code, kind, retry) in cases {
            let e = map("x", failure(code));
            assert_eq!((e.kind(), e.retry()), (kind, retry), "code {code}");
            assert_eq!(e.backend(), BACKEND);
        }
        assert_eq!(map_commit("x", failure(ffi::SQLITE_IOERR_FSYNC)).retry(), Retry::OutcomeUnknown);
        assert_eq!(map_commit("x", failure(ffi::SQLITE_BUSY)).retry(), Retry::Transient);
        let e = map("claim", failure(ffi::SQLITE_BUSY));
        assert_eq!(e.operation(), Some("claim"));
        assert!(e.to_string().starts_with("sqlite: claim failed: "), "{e}");
        assert!(std::error::Error::source(&e).is_some());
    }
}
