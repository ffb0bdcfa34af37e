//! lapin's errors, sorted into the contract's kinds and retry classes.
//!
//! The decision rests on lapin's error variant and the AMQP reply code, plus *where* the error
//! happened: a `404 NOT_FOUND` that closes the channel while a publish waits for its confirm
//! means the exchange is missing (unroutable, nothing was delivered), while the connection
//! breaking at that moment means the message may or may not have been routed.
//!
//! Failures caused by the event itself are permanent (the relay parks those rows), and so are
//! refused credentials while connecting ([`ErrorKind::Auth`]): retrying a wrong password cannot
//! succeed and may lock the account, so the process should stop and say so. Other refusals
//! caused by the server's set-up (permissions on an exchange or queue, a missing exchange) are
//! transient: they are not the event's fault, and an operator can fix them while the relay
//! retries.

use lapin::ErrorKind as LapinKind;
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use outbox_core::{Error, ErrorKind, Retry};

/// The backend name in every error of this crate.
pub(crate) const BACKEND: &str = "amqp";

/// What was being done when lapin failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Opening a connection.
    Connect,
    /// Opening or configuring a channel.
    Channel,
    /// Sending a publish (nothing reached the server if this fails).
    Publish,
    /// Waiting for the confirm of a publish that was sent.
    Confirm,
    /// Declaring, checking or deleting exchanges and queues.
    Topology,
    /// Consuming.
    Consume,
    /// Acknowledging a delivery.
    Ack,
}

impl Op {
    fn describe(self) -> &'static str {
        match self {
            Self::Connect => "connecting",
            Self::Channel => "opening a channel",
            Self::Publish => "publishing",
            Self::Confirm => "waiting for the publisher confirm",
            Self::Topology => "declaring topology",
            Self::Consume => "consuming",
            Self::Ack => "acknowledging",
        }
    }
}

/// Convert a lapin error raised during `op`; `what` names the object (exchange, queue, event).
pub(crate) fn from_lapin(err: lapin::Error, op: Op, what: &str) -> Error {
    let (kind, retry) = classify(&err, op);
    let operation = if what.is_empty() { op.describe().to_string() } else { format!("{} ({what})", op.describe()) };
    let detail = if kind == ErrorKind::Auth { "the server refused the credentials" } else { "" };
    Error::new(kind, retry, BACKEND, detail).with_operation(operation).with_source(err)
}

fn classify(err: &lapin::Error, op: Op) -> (ErrorKind, Retry) {
    // A broken connection while a confirm is outstanding: the message may have been routed.
    let lost = |kind| if op == Op::Confirm { (kind, Retry::OutcomeUnknown) } else { (kind, Retry::Transient) };
    match err.kind() {
        LapinKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(soft) => soft_error(soft, op),
            AMQPErrorKind::Hard(hard) => match hard {
                // The server closed the connection (shutdown, `rabbitmqctl close_connection`).
                AMQPHardError::CONNECTIONFORCED | AMQPHardError::INTERNALERROR | AMQPHardError::RESOURCEERROR => {
                    lost(ErrorKind::Connection)
                }
                // Unknown vhost: set-up, not the event.
                AMQPHardError::INVALIDPATH | AMQPHardError::NOTALLOWED => (ErrorKind::Config, Retry::Transient),
                // Protocol violations kill the connection; a fresh one may work.
                _ => lost(ErrorKind::Connection),
            },
        },
        LapinKind::IOError(_)
        | LapinKind::InvalidConnectionState(_)
        | LapinKind::InvalidChannelState(..)
        | LapinKind::InvalidChannel(_)
        | LapinKind::MissingHeartbeatError
        | LapinKind::ParsingError(_)
        | LapinKind::SerialisationError(_) => lost(ErrorKind::Connection),
        LapinKind::ChannelsLimitReached => (ErrorKind::Busy, Retry::Transient),
        LapinKind::RuntimeShutdownError(_) => (ErrorKind::Closed, Retry::Transient),
        LapinKind::AuthProviderError(_) => (ErrorKind::Auth, Retry::Permanent),
        LapinKind::InvalidProtocolVersion(_) | LapinKind::NoDefaultRuntime => (ErrorKind::Config, Retry::Permanent),
        LapinKind::FutureCompleted => lost(ErrorKind::Rejected),
        _ => lost(ErrorKind::Connection),
    }
}

fn soft_error(soft: &AMQPSoftError, op: Op) -> (ErrorKind, Retry) {
    let publishing = matches!(op, Op::Publish | Op::Confirm);
    match soft {
        // The exchange does not exist: the broker can tell nothing will receive the message.
        AMQPSoftError::NOTFOUND if publishing => (ErrorKind::Unroutable, Retry::Transient),
        AMQPSoftError::NOTFOUND => (ErrorKind::Config, Retry::Transient),
        AMQPSoftError::NOROUTE | AMQPSoftError::NOCONSUMERS => (ErrorKind::Unroutable, Retry::Transient),
        AMQPSoftError::CONTENTTOOLARGE => (ErrorKind::TooLarge, Retry::Permanent),
        // On a publish, the only precondition the server checks is the message itself (its size
        // against `max_message_size`): retrying the same message fails the same way.
        AMQPSoftError::PRECONDITIONFAILED if publishing => (ErrorKind::Rejected, Retry::Permanent),
        // A declaration that conflicts with what exists (another queue type, exchange type or
        // durability): an operator has to resolve it.
        AMQPSoftError::PRECONDITIONFAILED => (ErrorKind::Config, Retry::Permanent),
        // While connecting: the credentials were refused (RabbitMQ closes the connection with
        // 403 when it can tell the client so). Later: no permission on an exchange or queue.
        AMQPSoftError::ACCESSREFUSED if op == Op::Connect => (ErrorKind::Auth, Retry::Permanent),
        AMQPSoftError::ACCESSREFUSED => (ErrorKind::Config, Retry::Transient),
        // An exclusive queue held by another connection.
        AMQPSoftError::RESOURCELOCKED => (ErrorKind::Busy, Retry::Transient),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::AMQPError;

    fn amqp(kind: AMQPErrorKind) -> lapin::Error {
        LapinKind::ProtocolError(AMQPError::new(kind, "test".into())).into()
    }

    #[test]
    fn not_found_depends_on_the_operation() {
        let e = amqp(AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND));
        assert_eq!(classify(&e, Op::Confirm), (ErrorKind::Unroutable, Retry::Transient));
        assert_eq!(classify(&e, Op::Consume), (ErrorKind::Config, Retry::Transient));
    }

    #[test]
    fn connection_loss_during_confirm_is_outcome_unknown() {
        let io: lapin::Error = std::io::Error::from(std::io::ErrorKind::ConnectionReset).into();
        assert_eq!(classify(&io, Op::Confirm), (ErrorKind::Connection, Retry::OutcomeUnknown));
        assert_eq!(classify(&io, Op::Publish), (ErrorKind::Connection, Retry::Transient));
        let forced = amqp(AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED));
        assert_eq!(classify(&forced, Op::Confirm).1, Retry::OutcomeUnknown);
        assert_eq!(classify(&forced, Op::Consume), (ErrorKind::Connection, Retry::Transient));
    }

    #[test]
    fn message_is_named_and_source_kept() {
        let e = from_lapin(amqp(AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)), Op::Topology, "queue q");
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.is_permanent());
        assert_eq!(e.backend(), "amqp");
        assert!(e.to_string().starts_with("amqp: declaring topology (queue q) failed: "), "{e}");
    }
}
