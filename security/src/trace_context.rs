//! W3C trace context (`traceparent`, `tracestate`) on the wire: what a
//! [`crate::Channel`] adds to every request from the caller's current span,
//! and what a server takes out of a request to parent its own span.
//!
//! The format is OpenTelemetry's W3C propagator; spans are `tracing` spans
//! made OpenTelemetry spans by `tracing-opentelemetry` when the process
//! installed that layer. Without it every helper here is a no-op: no header
//! is sent and no context is read.
//!
//! Two process-wide switches, set by the binary's telemetry setup, let hot
//! paths skip the span lookups entirely when nothing uses them:
//! [`tracking`] (OpenTelemetry contexts are kept) and [`exporting`] (spans
//! leave the process).

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

static TRACKING: AtomicBool = AtomicBool::new(false);
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Records that this process keeps OpenTelemetry contexts for its spans.
pub fn set_tracking(on: bool) {
    TRACKING.store(on, Ordering::Relaxed);
}

/// Whether this process keeps OpenTelemetry contexts for its spans.
pub fn tracking() -> bool {
    TRACKING.load(Ordering::Relaxed)
}

/// Records that this process exports its spans.
pub fn set_exporting(on: bool) {
    EXPORTING.store(on, Ordering::Relaxed);
}

/// Whether this process exports its spans.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

struct Headers<'a>(&'a mut http::HeaderMap);

impl Injector for Headers<'_> {
    fn set(&mut self, key: &str, value: String) {
        use http::header::HeaderName;
        // The propagator sets `tracestate` even when it is empty, which says
        // nothing (W3C: a missing header is the same): not sent.
        if value.is_empty() {
            return;
        }
        let name = match key {
            "traceparent" => HeaderName::from_static("traceparent"),
            "tracestate" => HeaderName::from_static("tracestate"),
            other => match HeaderName::from_bytes(other.as_bytes()) {
                Ok(name) => name,
                Err(_) => return,
            },
        };
        // Takes the string's buffer as it is (checked, not copied).
        if let Ok(value) = http::HeaderValue::try_from(value) {
            self.0.insert(name, value);
        }
    }
}

struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        Vec::new()
    }
}

struct HeaderReader<'a>(&'a http::HeaderMap);

impl Extractor for HeaderReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        Vec::new()
    }
}

struct Single<'a>(&'a str);

impl Extractor for Single<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (key == "traceparent").then_some(self.0)
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent"]
    }
}

struct One(Option<String>);

impl Injector for One {
    fn set(&mut self, key: &str, value: String) {
        if key == "traceparent" {
            self.0 = Some(value);
        }
    }
}

/// Adds the trace context of `span` to `headers` (nothing if the span is
/// not part of a trace).
pub fn inject(span: &tracing::Span, headers: &mut http::HeaderMap) {
    if span.is_none() {
        return;
    }
    let context = span.context();
    if context.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&context, &mut Headers(headers));
    }
}

/// The caller's trace context in a request's metadata, if it sent one.
pub fn extract(metadata: &tonic::metadata::MetadataMap) -> Option<Context> {
    metadata.get("traceparent")?;
    let context = TraceContextPropagator::new().extract(&Metadata(metadata));
    context.span().span_context().is_valid().then_some(context)
}

/// Makes `span` a child of the caller's span named in `metadata` (a
/// request without one leaves `span` a root).
pub fn set_remote_parent(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    if let Some(context) = extract(metadata) {
        let _ = span.set_parent(context);
    }
}

/// [`set_remote_parent`] for plain HTTP headers.
pub fn set_remote_parent_from_headers(span: &tracing::Span, headers: &http::HeaderMap) {
    if !headers.contains_key("traceparent") {
        return;
    }
    let context = TraceContextPropagator::new().extract(&HeaderReader(headers));
    if context.span().span_context().is_valid() {
        let _ = span.set_parent(context);
    }
}

/// The `traceparent` of `span` if it is sampled (what travels in a Raft
/// entry).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    if span.is_none() {
        return None;
    }
    let context = span.context();
    if !context.span().span_context().is_sampled() {
        return None;
    }
    let mut one = One(None);
    TraceContextPropagator::new().inject_context(&context, &mut one);
    one.0
}

/// The context named by a `traceparent` value (`None` if malformed).
pub fn from_traceparent(bytes: &[u8]) -> Option<Context> {
    let value = std::str::from_utf8(bytes).ok()?;
    let context = TraceContextPropagator::new().extract(&Single(value));
    context.span().span_context().is_valid().then_some(context)
}

/// Makes `span` a child of the span named by `traceparent`.
pub fn set_parent_from(span: &tracing::Span, traceparent: &[u8]) {
    if let Some(context) = from_traceparent(traceparent) {
        let _ = span.set_parent(context);
    }
}

/// Links `span` to the span `other` (both in traces).
pub fn link(span: &tracing::Span, other: &tracing::Span) {
    let context = other.context();
    let linked = context.span().span_context().clone();
    if linked.is_valid() {
        span.add_link(linked);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_traceparent_names_no_context() {
        assert!(from_traceparent(b"garbage").is_none());
        assert!(from_traceparent(&[0xff, 0xfe]).is_none());
        let good = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = from_traceparent(good).unwrap();
        assert_eq!(
            context.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
    }

    #[test]
    fn without_an_opentelemetry_layer_nothing_is_sent() {
        let span = tracing::info_span!("no_layer");
        let mut headers = http::HeaderMap::new();
        inject(&span, &mut headers);
        assert!(headers.is_empty());
        assert!(traceparent(&span).is_none());
        let mut metadata = tonic::metadata::MetadataMap::new();
        assert!(extract(&metadata).is_none());
        metadata.insert("traceparent", "not-a-context".parse().unwrap());
        assert!(extract(&metadata).is_none());
    }
}
