//! What every RabbitMQ test file of this crate needs: whether the server is there, its URL, and
//! names no other test (or earlier run) uses.

use std::sync::atomic::{AtomicU32, Ordering};

/// Whether RabbitMQ answers; a test returns early when it does not (under `CI=true` the suite
/// fails instead, see `outbox_conformance_tests::require_service`).
pub(crate) fn server() -> bool {
    outbox_conformance_tests::require_service("RabbitMQ", "rabbitmq", &outbox_conformance_tests::service_addr(&url()))
}

/// The server's URL (`OUTBOX_AMQP_URL`, or the local default).
pub(crate) fn url() -> String {
    outbox_conformance_tests::amqp_url()
}

/// A name unique to this process, this moment and this call, ending in `tag`.
pub(crate) fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("t{}-{nanos:x}-{}-{tag}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}
