//! Errors from librdkafka name the backend and the operation and keep the client error as their
//! source; secrets in the settings never reach the text.
//!
//! Authentication: refused SASL credentials (`SaslAuthenticationFailed`, `Authentication`) are
//! permanent `Auth` errors (unit tests of the error mapping, by code). They are not exercised
//! against a server here: the test broker (tansu, `scripts/services ensure kafka`) runs without
//! client authentication.

use std::error::Error as _;
use std::time::Duration;

use outbox_broker_kafka::{KafkaBroker, KafkaConfig};
use outbox_core::{ErrorKind, Retry};

#[tokio::test]
async fn an_unreachable_cluster_names_backend_and_operation_and_keeps_its_source() {
    // Port 1 on the loopback: nothing listens, no service needed.
    let config = KafkaConfig::new(["127.0.0.1:1"])
        .with_operation_timeout(Duration::from_millis(500))
        .option("sasl.password", "hunter2-secret");
    let err = KafkaBroker::connect(config).await.expect_err("nothing listens on port 1");
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Connection, Retry::Transient), "{err}");
    assert_eq!(err.backend(), "kafka");
    assert_eq!(err.operation(), Some("connecting to 127.0.0.1:1"));
    assert!(err.to_string().starts_with("kafka: connecting to 127.0.0.1:1 failed: "), "{err}");
    assert!(!format!("{err} {err:?}").contains("hunter2-secret"), "{err:?}");
    assert!(err.source().is_some(), "{err:?}");
}

#[test]
fn a_rejected_setting_names_the_operation() {
    let config = KafkaConfig::new(["127.0.0.1:1"]).option("linger.ms", "not-a-number");
    let err = KafkaBroker::new(config).expect_err("librdkafka rejects the value");
    assert_eq!((err.kind(), err.retry()), (ErrorKind::Config, Retry::Permanent), "{err}");
    assert!(err.to_string().starts_with("kafka: creating the producer failed: "), "{err}");
    assert!(err.to_string().contains("linger.ms"), "{err}");
}
