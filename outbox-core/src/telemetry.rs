//! Following one business event from enqueue to effect.
//!
//! An event crosses three processes (the service that enqueues it, a relay, a consumer) and two
//! durable hops (the outbox row, the broker). Its W3C trace context travels in its headers
//! ([`TRACEPARENT_HEADER`], [`TRACESTATE_HEADER`]), so the relay's publish span and the
//! consumer's handle span continue the trace the enqueue ran in, however long the row waited and
//! whichever relay or consumer picked it up. Without the `opentelemetry` feature the spans are
//! plain `tracing` spans, nothing is written into headers and [`with_trace_context`] borrows:
//! tracing costs nothing that is not used.
//!
//! With the feature, the context is the one of the current `tracing` span as seen by a
//! `tracing_opentelemetry::OpenTelemetryLayer` (or, when the current span has none, the current
//! OpenTelemetry `Context`), written and read with the W3C
//! `TraceContextPropagator`. The application installs the layer and its exporter; this crate
//! only propagates.
//!
//! The trace headers are transport metadata, not content: [`Event::fingerprint`] leaves them
//! out, so the same event enqueued again from another trace (a retried request) is a duplicate
//! for an inbox, not a conflict.

use std::borrow::Cow;

use crate::event::Event;

/// W3C `traceparent` header name.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// W3C `tracestate` header name.
pub const TRACESTATE_HEADER: &str = "tracestate";

/// `true` when `name` is one of the trace-context headers ([`TRACEPARENT_HEADER`],
/// [`TRACESTATE_HEADER`]), which are metadata and not part of an event's content.
pub fn is_trace_header(name: &str) -> bool {
    name == TRACEPARENT_HEADER || name == TRACESTATE_HEADER
}

/// Write the current span's trace context into `event`'s headers (enqueue side).
///
/// # Behavior
/// - with the `opentelemetry` feature and a current span that has a valid context: sets
///   [`TRACEPARENT_HEADER`] (and [`TRACESTATE_HEADER`] when not empty);
/// - an event that already carries a `traceparent` keeps it (and its `tracestate`);
/// - otherwise changes nothing.
pub fn inject(event: &mut Event) {
    #[cfg(feature = "opentelemetry")]
    if let Some(context) = otel::current() {
        context.write(event);
    }
    #[cfg(not(feature = "opentelemetry"))]
    let _ = event;
}

/// `events` with the current span's trace context [`inject`]ed, for a store's enqueue path.
///
/// # Behavior
/// - borrows `events` unchanged when the `opentelemetry` feature is off, when there is no valid
///   current context, or when every event already carries a `traceparent`;
/// - otherwise returns copies, each event injected as [`inject`] does (one context for all).
pub fn with_trace_context(events: &[Event]) -> Cow<'_, [Event]> {
    #[cfg(feature = "opentelemetry")]
    if events.iter().any(|e| !e.headers.contains_key(TRACEPARENT_HEADER))
        && let Some(context) = otel::current()
    {
        let mut owned = events.to_vec();
        for event in &mut owned {
            context.write(event);
        }
        return Cow::Owned(owned);
    }
    Cow::Borrowed(events)
}

/// The relay's span for publishing `event`, a child of the trace in its headers.
///
/// # Behavior
/// - an `INFO` span named `outbox.publish` with `event_id`, `destination` and
///   `otel.kind = "producer"`;
/// - with the `opentelemetry` feature and a valid `traceparent` header: its OpenTelemetry
///   parent is that remote context (the enqueue's span), not the current span;
/// - otherwise its parent is the current span, as for any `tracing` span.
pub fn publish_span(event: &Event) -> tracing::Span {
    let span = tracing::info_span!(
        "outbox.publish",
        event_id = %event.id,
        destination = %event.destination,
        otel.kind = "producer",
        outcome = tracing::field::Empty,
    );
    #[cfg(feature = "opentelemetry")]
    otel::continue_trace(&span, event);
    span
}

/// The consumer's span for handling `event` as `consumer`, a child of the trace in its headers.
///
/// # Behavior
/// - an `INFO` span named `outbox.handle` with `consumer`, `event_id`, `destination` and
///   `otel.kind = "consumer"`;
/// - parents as for [`publish_span`]: the remote context of the event's `traceparent` when the
///   feature is on and the header is valid, the current span otherwise.
pub fn handle_span(consumer: &str, event: &Event) -> tracing::Span {
    let span = tracing::info_span!(
        "outbox.handle",
        consumer = %consumer,
        event_id = %event.id,
        destination = %event.destination,
        otel.kind = "consumer",
    );
    #[cfg(feature = "opentelemetry")]
    otel::continue_trace(&span, event);
    span
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::Context;
    use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::{TRACEPARENT_HEADER, TRACESTATE_HEADER};
    use crate::event::{Event, Headers};

    /// The current context, rendered once as W3C headers.
    pub(super) struct Rendered {
        traceparent: String,
        tracestate: Option<String>,
    }

    impl Rendered {
        /// Set the headers on `event` unless it already has a `traceparent`.
        pub(super) fn write(&self, event: &mut Event) {
            if event.headers.contains_key(TRACEPARENT_HEADER) {
                return;
            }
            event.headers.insert(TRACEPARENT_HEADER.to_owned(), self.traceparent.clone().into_bytes());
            match &self.tracestate {
                Some(state) => event.headers.insert(TRACESTATE_HEADER.to_owned(), state.clone().into_bytes()),
                // A stale `tracestate` would describe another trace.
                None => event.headers.remove(TRACESTATE_HEADER),
            };
        }
    }

    /// The current span's context (falling back to OpenTelemetry's current context), if valid.
    pub(super) fn current() -> Option<Rendered> {
        let mut context = tracing::Span::current().context();
        if !context.span().span_context().is_valid() {
            context = Context::current();
            if !context.span().span_context().is_valid() {
                return None;
            }
        }
        let mut carrier = Carrier::default();
        TraceContextPropagator::new().inject_context(&context, &mut carrier);
        Some(Rendered { traceparent: carrier.traceparent?, tracestate: carrier.tracestate })
    }

    /// Make the context in `event`'s headers the OpenTelemetry parent of `span`, when valid.
    pub(super) fn continue_trace(span: &tracing::Span, event: &Event) {
        let parent = TraceContextPropagator::new().extract(&HeaderExtractor(&event.headers));
        if parent.span().span_context().is_valid() {
            // Fails only when no OpenTelemetry layer sees the span: then there is no trace to
            // continue and the plain `tracing` span is all there is.
            let _ = span.set_parent(parent);
        }
    }

    #[derive(Default)]
    struct Carrier {
        traceparent: Option<String>,
        tracestate: Option<String>,
    }

    impl Injector for Carrier {
        fn set(&mut self, key: &str, value: String) {
            if key == TRACEPARENT_HEADER {
                self.traceparent = Some(value);
            } else if key == TRACESTATE_HEADER && !value.is_empty() {
                self.tracestate = Some(value);
            }
        }
    }

    struct HeaderExtractor<'a>(&'a Headers);

    impl Extractor for HeaderExtractor<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|value| std::str::from_utf8(value).ok())
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }
}

#[cfg(all(test, feature = "opentelemetry"))]
mod tests {
    use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;
    use crate::event::{Destination, EventId};

    fn event(id: &str) -> Event {
        Event::new(EventId::new(id).unwrap(), Destination::new("orders").unwrap(), b"{}".to_vec())
    }

    /// Run `f` under a subscriber that exports OpenTelemetry spans into memory; the finished
    /// spans come back.
    fn traced(f: impl FnOnce()) -> Vec<SpanData> {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-core-test")));
        tracing::subscriber::with_default(subscriber, f);
        provider.force_flush().unwrap();
        exporter.get_finished_spans().unwrap()
    }

    fn named<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no span {name:?} among {:?}", spans.iter().map(|s| &s.name).collect::<Vec<_>>()))
    }

    #[test]
    fn publish_and_handle_continue_the_trace_of_the_enqueue() {
        let mut e = event("ev-1");
        let spans = traced(|| {
            tracing::info_span!("enqueue").in_scope(|| inject(&mut e));
            // The relay and the consumer run elsewhere: under spans of their own trace.
            tracing::info_span!("relay batch").in_scope(|| publish_span(&e).in_scope(|| ()));
            tracing::info_span!("consumer poll").in_scope(|| handle_span("billing", &e).in_scope(|| ()));
        });
        let enqueue = named(&spans, "enqueue");
        let publish = named(&spans, "outbox.publish");
        let handle = named(&spans, "outbox.handle");
        let trace = enqueue.span_context.trace_id();
        assert_ne!(trace, TraceId::INVALID);
        assert_eq!(publish.span_context.trace_id(), trace, "publish continues the enqueue's trace");
        assert_eq!(handle.span_context.trace_id(), trace, "handle continues the enqueue's trace");
        assert_eq!(publish.parent_span_id, enqueue.span_context.span_id());
        assert_eq!(handle.parent_span_id, enqueue.span_context.span_id());
        assert_ne!(named(&spans, "relay batch").span_context.trace_id(), trace);
        let header = std::str::from_utf8(&e.headers[TRACEPARENT_HEADER]).unwrap();
        assert_eq!(header, format!("00-{trace}-{}-01", enqueue.span_context.span_id()));
        assert!(!e.headers.contains_key(TRACESTATE_HEADER), "an empty tracestate is not written");
    }

    #[test]
    fn an_existing_traceparent_is_kept_and_an_untraced_enqueue_writes_nothing() {
        let foreign = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let mut kept = event("ev-kept").with_header(TRACEPARENT_HEADER, foreign);
        let mut outside = event("ev-outside");
        let spans = traced(|| {
            inject(&mut outside);
            tracing::info_span!("enqueue").in_scope(|| inject(&mut kept));
            publish_span(&kept).in_scope(|| ());
        });
        assert_eq!(kept.headers[TRACEPARENT_HEADER], foreign.as_bytes());
        assert!(outside.headers.is_empty(), "no current span, no header: {:?}", outside.headers);
        let publish = named(&spans, "outbox.publish");
        assert_eq!(publish.span_context.trace_id(), TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap());
        assert_eq!(publish.parent_span_id, SpanId::from_hex("b7ad6b7169203331").unwrap());
    }

    #[test]
    fn with_trace_context_borrows_unless_it_has_something_to_add() {
        let events = vec![event("a"), event("b")];
        traced(|| {
            assert!(matches!(with_trace_context(&events), Cow::Borrowed(_)), "no current span");
            let injected = tracing::info_span!("enqueue").in_scope(|| with_trace_context(&events).into_owned());
            assert!(injected.iter().all(|e| e.headers.contains_key(TRACEPARENT_HEADER)), "{injected:?}");
            assert_eq!(injected[0].headers, injected[1].headers, "one context for the batch");
            assert_eq!(injected[0].fingerprint(), events[0].fingerprint(), "trace headers are not content");
            tracing::info_span!("again").in_scope(|| {
                assert!(matches!(with_trace_context(&injected), Cow::Borrowed(_)), "already traced");
            });
        });
    }

    #[test]
    fn a_malformed_traceparent_leaves_the_span_where_it_is() {
        let bad = event("ev-bad").with_header(TRACEPARENT_HEADER, "00-zz-not-a-context");
        let spans = traced(|| tracing::info_span!("relay batch").in_scope(|| publish_span(&bad).in_scope(|| ())));
        let batch = named(&spans, "relay batch");
        let publish = named(&spans, "outbox.publish");
        assert_eq!(publish.span_context.trace_id(), batch.span_context.trace_id());
        assert_eq!(publish.parent_span_id, batch.span_context.span_id());
    }
}
