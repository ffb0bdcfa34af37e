//! The whole conformance suite with this adapter as the broker (see
//! `outbox_broker_kafka::conformance`), against a real Kafka-protocol broker (tansu locally:
//! `scripts/services ensure kafka`); the outbox store and the inbox are the in-memory reference
//! ones.

use outbox_broker_kafka::conformance::KafkaBrokerHarness;
use outbox_conformance_tests::{Combined, MemoryStoreHarness, kafka_url, require_service, service_addr};

fn main() -> std::process::ExitCode {
    if !require_service("Kafka-protocol broker (tansu)", "kafka", &service_addr(&kafka_url())) {
        return std::process::ExitCode::SUCCESS;
    }
    match KafkaBrokerHarness::from_url(&kafka_url()) {
        Ok(broker) => outbox_conformance_tests::main(Combined::new(MemoryStoreHarness, broker)),
        Err(e) => {
            eprintln!("cannot configure the Kafka broker: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
