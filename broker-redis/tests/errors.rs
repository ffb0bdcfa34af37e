//! Errors from a real Redis: refused credentials are permanent `Auth` errors that name the
//! backend and the operation, keep the driver error as their source, and never show the
//! password.

use std::error::Error as _;
use std::time::{SystemTime, UNIX_EPOCH};

use outbox_broker_redis::{RedisBroker, RedisConfig};
use outbox_conformance_tests::{redis_url, require_service, service_addr};
use outbox_core::{ErrorKind, Retry};

fn service_up() -> bool {
    require_service("Redis", "redis", &service_addr(&redis_url()))
}

fn unique() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default();
    format!("{nanos:x}-{}", std::process::id())
}

/// An ACL user that exists for the test only (deleted on drop, also when the test fails).
struct AclUser {
    admin: redis::Client,
    name: String,
}

impl AclUser {
    fn create(password: &str) -> Self {
        let admin = redis::Client::open(redis_url()).expect("the admin URL");
        let name = format!("outbox-auth-{}", unique());
        let mut conn = admin.get_connection().expect("admin connection");
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(&name)
            .arg("on")
            .arg(format!(">{password}"))
            .arg("~*")
            .arg("+@all")
            .exec(&mut conn)
            .expect("ACL SETUSER");
        Self { admin, name }
    }
}

impl Drop for AclUser {
    fn drop(&mut self) {
        if let Ok(mut conn) = self.admin.get_connection() {
            let _ = redis::cmd("ACL").arg("DELUSER").arg(&self.name).exec(&mut conn);
        }
    }
}

/// `redis://user:password@host:port` from the service URL.
fn url_with(user: &str, password: &str) -> String {
    let mut url = url::Url::parse(&redis_url()).expect("the service URL parses");
    url.set_username(user).expect("a user");
    url.set_password(Some(password)).expect("a password");
    url.to_string()
}

#[tokio::test]
async fn wrong_password_is_a_permanent_auth_error_without_the_password() {
    if !service_up() {
        return;
    }
    let user = AclUser::create("right-horse-battery");
    // The right password works: the user is real and the failure below is the password's.
    let ok = RedisBroker::connect(RedisConfig::from_url(&url_with(&user.name, "right-horse-battery")).unwrap()).await;
    assert!(ok.is_ok(), "the right password connects: {:?}", ok.err());

    let wrong = "wrong-staple-7731";
    let err = RedisBroker::connect(RedisConfig::from_url(&url_with(&user.name, wrong)).unwrap())
        .await
        .expect_err("a wrong password is refused");
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Auth, Retry::Permanent), "{err}");
    assert_eq!(err.backend(), "redis");
    let text = format!("{err} {err:?}");
    assert!(text.starts_with("redis: connect to "), "{text}");
    assert!(!text.contains(wrong), "the password leaks: {text}");
    assert!(err.operation().is_some_and(|op| op.starts_with("connect to")), "{err:?}");
    assert!(err.source().is_some(), "the driver error is kept: {err:?}");

    // An unknown user is refused the same way.
    let err = RedisBroker::connect(RedisConfig::from_url(&url_with(&format!("{}-x", user.name), wrong)).unwrap())
        .await
        .expect_err("an unknown user is refused");
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Auth, Retry::Permanent), "{err}");
    assert!(!format!("{err} {err:?}").contains(wrong));
}

#[tokio::test]
async fn a_connection_error_names_backend_and_operation_and_keeps_its_source() {
    // Port 1 on the loopback: nothing listens, no service needed.
    let config = RedisConfig::from_url("redis://127.0.0.1:1").unwrap();
    let err = RedisBroker::connect(config).await.expect_err("nothing listens on port 1");
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    assert!(err.is_transient(), "{err}");
    assert!(err.to_string().starts_with("redis: connect to redis://127.0.0.1:1"), "{err}");
    assert!(err.source().is_some(), "{err:?}");
}
