//! Errors from a real RabbitMQ: refused credentials are permanent `Auth` errors that name the
//! backend and the operation, keep lapin's error as their source, and never show the password.

use std::error::Error as _;

use outbox_broker_amqp::{AmqpBroker, AmqpConfig};
use outbox_conformance_tests::{amqp_url, require_service, service_addr};
use outbox_core::{ErrorKind, Retry};

fn service_up() -> bool {
    require_service("RabbitMQ", "rabbitmq", &service_addr(&amqp_url()))
}

/// The service URL with its password replaced.
fn url_with_password(password: &str) -> String {
    let url = amqp_url();
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let (userinfo, host) = rest.split_once('@').expect("the service URL carries credentials");
    let user = userinfo.split(':').next().unwrap_or("guest");
    format!("{scheme}://{user}:{password}@{host}")
}

#[tokio::test]
async fn wrong_password_is_a_permanent_auth_error_without_the_password() {
    if !service_up() {
        return;
    }
    let right = AmqpBroker::new(AmqpConfig::from_url(&amqp_url()).unwrap());
    right.connect().await.expect("the service's own credentials connect");
    right.close().await;

    let wrong = "wrong-staple-7731";
    let broker = AmqpBroker::new(AmqpConfig::from_url(&url_with_password(wrong)).unwrap());
    let err = broker.connect().await.expect_err("a wrong password is refused");
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Auth, Retry::Permanent), "{err} / {err:?}");
    assert_eq!(err.backend(), "amqp");
    let text = format!("{err} {err:?}");
    assert!(text.starts_with("amqp: connecting ("), "{text}");
    assert!(!text.contains(wrong), "the password leaks: {text}");
    assert!(err.operation().is_some_and(|op| op.starts_with("connecting")), "{err:?}");
    assert!(err.source().is_some(), "lapin's error is kept: {err:?}");
}

#[tokio::test]
async fn a_connection_error_names_backend_and_operation_and_keeps_its_source() {
    // Port 1 on the loopback: nothing listens, no service needed.
    let broker = AmqpBroker::new(AmqpConfig::from_url("amqp://guest:guest@127.0.0.1:1/%2f").unwrap());
    let err = broker.connect().await.expect_err("nothing listens on port 1");
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    assert!(err.is_transient(), "{err}");
    assert!(err.to_string().starts_with("amqp: connecting ("), "{err}");
    assert!(!err.to_string().contains("guest@"), "{err}");
    assert!(err.source().is_some(), "{err:?}");
}
