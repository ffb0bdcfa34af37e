//! Errors from a real PostgreSQL: refused credentials are permanent `Auth` errors that name the
//! backend and the operation, keep sqlx's error as their source, and never show the password.
//!
//! The test server trusts every local connection (no password is checked), so the refusal here
//! is of a role that does not exist — SQLSTATE class 28 like a wrong password (`28P01`), which
//! the unit tests of the error mapping cover by code.

mod common;

use std::error::Error as _;

use common::{pg_available, unique_schema};
use outbox_conformance_tests::pg_url;
use outbox_core::{ErrorKind, Retry};
use outbox_store_postgres::{PgConfig, PgStore};

#[tokio::test]
async fn refused_credentials_are_a_permanent_auth_error_without_the_password() {
    if !pg_available() {
        return;
    }
    let wrong = "wrong-staple-7731";
    let mut url = url::Url::parse(&pg_url()).expect("the service URL parses");
    url.set_username(&unique_schema("no_such_role")).expect("a user");
    url.set_password(Some(wrong)).expect("a password");
    let err =
        PgStore::connect(PgConfig::from_url(url.as_str()).unwrap()).await.expect_err("an unknown role is refused");
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Auth, Retry::Permanent), "{err} / {err:?}");
    assert_eq!(err.backend(), "postgres");
    let text = format!("{err} {err:?}");
    assert!(text.starts_with("postgres: connecting to "), "{text}");
    assert!(text.contains("SQLSTATE 28"), "{text}");
    assert!(!text.contains(wrong), "the password leaks: {text}");
    assert!(err.operation().is_some_and(|op| op.starts_with("connecting to")), "{err:?}");
    assert!(err.source().is_some(), "sqlx's error is kept: {err:?}");
}

#[tokio::test]
async fn a_connection_error_names_backend_and_operation_and_keeps_its_source() {
    // Port 1 on the loopback: nothing listens, no service needed.
    let config = PgConfig::from_url("postgres://postgres:hunter2@127.0.0.1:1/test").unwrap();
    let err = PgStore::connect(config).await.expect_err("nothing listens on port 1");
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    assert!(err.is_transient(), "{err}");
    assert!(err.to_string().starts_with("postgres: connecting to "), "{err}");
    assert!(!format!("{err} {err:?}").contains("hunter2"), "{err:?}");
    assert!(err.source().is_some(), "{err:?}");
}
