//! The whole conformance suite with RabbitMQ as the broker (see
//! `outbox_broker_amqp::conformance`): the outbox store and the inbox are the in-memory reference
//! ones, so every failure here is about the AMQP adapter (or the suite).
//!
//! The server is `OUTBOX_AMQP_URL` (default the local one). The groups' queues are quorum queues
//! unless that URL names an `outbox_queue_type`; add `?outbox_queue_type=classic` to judge
//! classic queues. A batch is spread over every publishing channel unless the URL names an
//! `outbox_batch_channels` (see `AmqpBrokerHarness::from_url`).

use outbox_broker_amqp::conformance::AmqpBrokerHarness;
use outbox_conformance_tests::{Combined, MemoryStoreHarness, amqp_url, require_service, service_addr};

fn main() -> std::process::ExitCode {
    if !require_service("RabbitMQ", "rabbitmq", &service_addr(&amqp_url())) {
        return std::process::ExitCode::SUCCESS;
    }
    match AmqpBrokerHarness::from_url(&amqp_url()) {
        Ok(broker) => outbox_conformance_tests::main(Combined::new(MemoryStoreHarness, broker)),
        Err(e) => {
            eprintln!("conformance harness: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
