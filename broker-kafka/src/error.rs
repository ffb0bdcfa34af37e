//! librdkafka error codes → the contract's kinds and retry classes.
//!
//! The relay decides to retry, park or treat a publish as maybe-sent from these classes alone,
//! so every decision here is made on librdkafka's error *code*, never on its message text.

use outbox_core::{Error, ErrorKind, Retry};
use rdkafka::error::{KafkaError, RDKafkaErrorCode as Code};

use crate::BACKEND;
use crate::config::is_secret;

/// Kind and retry class of a librdkafka / broker error code.
pub(crate) fn classify(code: Code) -> (ErrorKind, Retry) {
    use ErrorKind as K;
    use Retry::{OutcomeUnknown, Permanent, Transient};
    match code {
        // The message is bigger than the producer or the broker accepts: resending cannot help.
        Code::MessageSizeTooLarge | Code::MessageBatchTooLarge | Code::InvalidMessageSize => (K::TooLarge, Permanent),
        // In flight when its delivery timeout passed: it may have been written.
        Code::MessageTimedOut => (K::Timeout, OutcomeUnknown),
        Code::RequestTimedOut | Code::OperationTimedOut | Code::TimedOutQueue => (K::Timeout, Transient),
        Code::UnknownTopicOrPartition | Code::UnknownTopic | Code::UnknownPartition => (K::Unroutable, Transient),
        Code::BrokerTransportFailure
        | Code::AllBrokersDown
        | Code::Resolve
        | Code::NetworkException
        | Code::BrokerNotAvailable
        | Code::LeaderNotAvailable
        | Code::NotLeaderForPartition
        | Code::CoordinatorNotAvailable
        | Code::NotCoordinator
        | Code::WaitingForCoordinator
        | Code::BrokerDestroy
        | Code::DestroyBroker
        | Code::SSL => (K::Connection, Transient),
        Code::QueueFull
        | Code::NotEnoughReplicas
        | Code::NotEnoughReplicasAfterAppend
        | Code::CoordinatorLoadInProgress
        | Code::RebalanceInProgress
        | Code::ThrottlingQuotaExceeded
        | Code::ConcurrentTransactions
        | Code::InProgress
        | Code::PreviousInProgress => (K::Busy, Transient),
        // The group moved on (rebalance, expired member): the commit did not happen, the
        // messages will be redelivered to the partition's new owner.
        Code::IllegalGeneration | Code::UnknownMemberId | Code::FencedInstanceId | Code::AssignmentLost => {
            (K::Rejected, Transient)
        }
        Code::InvalidTopic
        | Code::InvalidPartitions
        | Code::InvalidReplicationFactor
        | Code::InvalidReplicaAssignment
        | Code::InvalidConfig
        | Code::PolicyViolation
        | Code::InvalidRequiredAcks
        | Code::InvalidArgument
        | Code::InvalidGroupId
        | Code::UnsupportedVersion
        | Code::UnsupportedFeature
        | Code::NotImplemented
        | Code::UnsupportedForMessageFormat
        | Code::UnsupportedCompressionType => (K::Config, Permanent),
        Code::TopicAuthorizationFailed
        | Code::GroupAuthorizationFailed
        | Code::ClusterAuthorizationFailed
        | Code::TransactionalIdAuthorizationFailed => (K::Rejected, Permanent),
        // Wrong SASL credentials: the same credentials fail again.
        Code::Authentication | Code::SaslAuthenticationFailed | Code::IllegalSASLState => (K::Auth, Permanent),
        Code::UnsupportedSASLMechanism => (K::Config, Permanent),
        Code::InvalidRecord | Code::InvalidTimestamp | Code::InvalidMessage | Code::BadMessage => {
            (K::Rejected, Permanent)
        }
        // Idempotence broke (sequence gap, fenced epoch): librdkafka raises a fatal error and the
        // producer must be rebuilt; nothing new was written.
        Code::Fatal
        | Code::OutOfOrderSequenceNumber
        | Code::DuplicateSequenceNumber
        | Code::InvalidProducerEpoch
        | Code::UnknownProducerId
        | Code::ProducerFenced
        | Code::InvalidProducerIdMapping => (K::Rejected, Transient),
        _ => (K::Rejected, Transient),
    }
}

/// The librdkafka code inside a client error, if it carries one.
pub(crate) fn code_of(e: &KafkaError) -> Option<Code> {
    e.rdkafka_error_code()
}

/// Convert a client error of `operation` into the contract's error.
pub(crate) fn convert(operation: &str, e: KafkaError) -> Error {
    if let KafkaError::ClientConfig(_, description, key, value) = &e {
        // librdkafka's text repeats the value, which may be a password: rebuild it without.
        let (value, description) = if is_secret(key) && !value.is_empty() {
            ("***", description.replace(value.as_str(), "***"))
        } else {
            (value.as_str(), description.clone())
        };
        return Error::config(BACKEND, format!("property {key:?} = {value:?}: {description}"))
            .with_operation(operation.to_string());
    }
    let (kind, retry) = match &e {
        KafkaError::ClientCreation(_) | KafkaError::Subscription(_) | KafkaError::AdminOpCreation(_) => {
            (ErrorKind::Config, Retry::Permanent)
        }
        KafkaError::Canceled => (ErrorKind::Closed, Retry::Transient),
        KafkaError::Nul(_) => (ErrorKind::InvalidInput, Retry::Permanent),
        KafkaError::NoMessageReceived => (ErrorKind::Timeout, Retry::Transient),
        other => code_of(other).map_or((ErrorKind::Rejected, Retry::Transient), classify),
    };
    let detail = code_of(&e).map(|code| format!("{code:?}")).unwrap_or_default();
    Error::new(kind, retry, BACKEND, detail).with_operation(operation.to_string()).with_source(e)
}

/// An error for a librdkafka / broker code reported outside a [`KafkaError`] (admin results).
pub(crate) fn from_code(operation: &str, code: Code) -> Error {
    let (kind, retry) = classify(code);
    Error::new(kind, retry, BACKEND, format!("{code:?}")).with_operation(operation.to_string()).with_source(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_the_relay_depends_on() {
        assert_eq!(classify(Code::MessageSizeTooLarge), (ErrorKind::TooLarge, Retry::Permanent));
        assert_eq!(classify(Code::MessageTimedOut), (ErrorKind::Timeout, Retry::OutcomeUnknown));
        assert_eq!(classify(Code::UnknownTopicOrPartition), (ErrorKind::Unroutable, Retry::Transient));
        assert_eq!(classify(Code::UnknownTopic), (ErrorKind::Unroutable, Retry::Transient));
        assert_eq!(classify(Code::AllBrokersDown), (ErrorKind::Connection, Retry::Transient));
        assert_eq!(classify(Code::BrokerTransportFailure), (ErrorKind::Connection, Retry::Transient));
        assert_eq!(classify(Code::Fatal).1, Retry::Transient);
        let e = convert("publish", KafkaError::MessageProduction(Code::MessageSizeTooLarge));
        assert_eq!(e.kind(), ErrorKind::TooLarge);
        assert!(e.is_permanent());
        assert_eq!(e.backend(), "kafka");
        assert_eq!(e.operation(), Some("publish"));
        assert!(e.to_string().starts_with("kafka: publish failed: MessageSizeTooLarge"), "{e}");
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(classify(Code::SaslAuthenticationFailed), (ErrorKind::Auth, Retry::Permanent));
    }

    #[test]
    fn config_errors_do_not_repeat_secrets() {
        let e = convert(
            "creating the producer",
            KafkaError::ClientConfig(
                rdkafka::types::RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
                "Invalid value \"hunter2\" for configuration property \"sasl.password\"".into(),
                "sasl.password".into(),
                "hunter2".into(),
            ),
        );
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(!format!("{e} {e:?}").contains("hunter2"), "{e:?}");
    }
}
