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

/// Adds the trace context of `span` to `headers` (nothing if the span is
/// not part of a trace).
pub fn inject(span: &tracing::Span, headers: &mut http::HeaderMap) {
    if span.is_none() {
        return;
    }
    let name = http::header::HeaderName::from_static("traceparent");
    let context = span.context();
    let span_context = context.span().span_context().clone();
    if span_context.is_valid() {
        if span_context.trace_state().header().is_empty() {
            let bytes = traceparent_bytes(
                &span_context.trace_id().to_bytes(),
                &span_context.span_id().to_bytes(),
                span_context.is_sampled(),
            );
            if let Ok(value) = http::HeaderValue::from_bytes(&bytes) {
                headers.insert(name, value);
            }
        } else {
            TraceContextPropagator::new().inject_context(&context, &mut Headers(headers));
        }
    } else if let Some(ids) = untraced(span) {
        // The caller's decision travels on: the next process does not
        // start a trace of its own for this request.
        let bytes = traceparent_bytes(&ids.trace_id, &ids.span_id, false);
        if let Ok(value) = http::HeaderValue::from_bytes(&bytes) {
            headers.insert(name, value);
        }
    }
}

/// The caller's trace context in a request's metadata, if it sent one.
pub fn extract(metadata: &tonic::metadata::MetadataMap) -> Option<Context> {
    metadata.get("traceparent")?;
    let context = TraceContextPropagator::new().extract(&Metadata(metadata));
    context.span().span_context().is_valid().then_some(context)
}

/// The caller's trace context in plain HTTP headers, if it sent one.
pub fn extract_from_headers(headers: &http::HeaderMap) -> Option<Context> {
    headers.get("traceparent")?;
    let context = TraceContextPropagator::new().extract(&HeaderReader(headers));
    context.span().span_context().is_valid().then_some(context)
}

/// The caller's trace a span made on this thread continues, as the
/// sampling layer of the process's subscriber reads it when that span is
/// made (`tidepool_telemetry`): the caller's trace id and whether the
/// caller sampled it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteParent {
    /// The caller's trace id.
    pub trace_id: [u8; 16],
    /// Whether the caller sampled the trace (the `traceparent` flag).
    pub sampled: bool,
}

thread_local! {
    static NEXT_ROOT: std::cell::Cell<Option<RemoteParent>> = const { std::cell::Cell::new(None) };
}

/// The span `make` makes, continuing the caller's trace `parent` (`None`:
/// the caller sent none, the span starts a trace). The sampling decision
/// is taken as the span is made, from the caller's flag (or, for a new
/// trace, the process's ratio): a span not sampled never reaches the
/// OpenTelemetry layer, nor do the spans made inside it. `make` must make
/// the span with `parent: None` (or where no traced span is current).
pub fn continued(parent: Option<Context>, make: impl FnOnce() -> tracing::Span) -> tracing::Span {
    let Some(parent) = parent else {
        return make();
    };
    let span_context = parent.span().span_context().clone();
    NEXT_ROOT.set(Some(RemoteParent {
        trace_id: span_context.trace_id().to_bytes(),
        sampled: span_context.is_sampled(),
    }));
    let span = make();
    // Nothing took it if the span is disabled.
    NEXT_ROOT.set(None);
    // A span the sampling layer kept from OpenTelemetry has no context to
    // set: a no-op.
    let _ = span.set_parent(parent);
    span
}

/// What [`continued`] says of the span being made on this thread (taken:
/// a later span gets `None`). For the sampling layer.
pub fn take_remote_parent() -> Option<RemoteParent> {
    NEXT_ROOT.take()
}

/// Whether `span` is part of a sampled trace (its spans are exported).
pub fn sampled(span: &tracing::Span) -> bool {
    !span.is_none() && span.context().span().span_context().is_sampled()
}

/// The ids of a span the sampling layer kept from OpenTelemetry (its
/// trace was not sampled): the trace it belongs to — the caller's, its
/// parent's or a new one — and an id of its own. What log lines inside it
/// carry, and what it passes on (`traceparent` with the sampled flag
/// clear), as an unsampled OpenTelemetry span would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Untraced {
    /// The trace.
    pub trace_id: [u8; 16],
    /// The span.
    pub span_id: [u8; 8],
}

/// How the sampling layer answers "is this span kept back, and with which
/// ids": found through the subscriber (`Dispatch::downcast_ref`), as
/// `tracing-opentelemetry` finds its contexts.
#[derive(Clone, Copy, Debug)]
pub struct UntracedLookup(pub fn(&tracing::Dispatch, &tracing::span::Id) -> Option<Untraced>);

/// The ids of `span` if the sampling layer kept it back.
pub fn untraced(span: &tracing::Span) -> Option<Untraced> {
    span.with_subscriber(|(id, dispatch)| {
        let lookup = dispatch.downcast_ref::<UntracedLookup>()?;
        (lookup.0)(dispatch, id)
    })
    .flatten()
}

/// Writes `bytes` into `out` (twice as long) in lower-case hex.
fn write_hex(out: &mut [u8], bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(byte >> 4)];
        pair[1] = DIGITS[usize::from(byte & 0xf)];
    }
}

/// `bytes` in lower-case hex, as trace and span ids are written.
pub fn hex(bytes: &[u8]) -> String {
    let mut out = vec![0; bytes.len() * 2];
    write_hex(&mut out, bytes);
    String::from_utf8(out).expect("hex digits are ASCII")
}

/// The W3C `traceparent` value (version 00) of these ids: 55 ASCII bytes,
/// written without the propagator's string formatting (every request of
/// an exporting process sends one).
fn traceparent_bytes(trace_id: &[u8; 16], span_id: &[u8; 8], sampled: bool) -> [u8; 55] {
    let mut out = [b'-'; 55];
    out[..2].copy_from_slice(b"00");
    write_hex(&mut out[3..35], trace_id);
    write_hex(&mut out[36..52], span_id);
    out[53..].copy_from_slice(if sampled { b"01" } else { b"00" });
    out
}

/// The `traceparent` of `span` if it is sampled (what travels in a Raft
/// entry; written without the propagator's formatting, as for requests).
pub fn traceparent(span: &tracing::Span) -> Option<Vec<u8>> {
    if span.is_none() {
        return None;
    }
    let context = span.context();
    let span = context.span();
    let span_context = span.span_context();
    if !span_context.is_sampled() {
        return None;
    }
    let bytes = traceparent_bytes(
        &span_context.trace_id().to_bytes(),
        &span_context.span_id().to_bytes(),
        true,
    );
    Some(bytes.to_vec())
}

/// The value of one lower-case hex digit.
fn hex_digit(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        _ => None,
    }
}

/// Reads `out.len()` bytes from twice as many lower-case hex digits.
fn read_hex(out: &mut [u8], digits: &[u8]) -> Option<()> {
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = hex_digit(pair[0])? << 4 | hex_digit(pair[1])?;
    }
    Some(())
}

/// The context named by a `traceparent` value of version 00, what this
/// process and every Tidepool node write into Raft entries (`None` if
/// malformed or naming an invalid context). Read without the propagator's
/// string parsing: every replica reads it for each traced entry it appends
/// and applies.
pub fn from_traceparent(bytes: &[u8]) -> Option<Context> {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    if bytes.len() != 55 || &bytes[..3] != b"00-" || bytes[35] != b'-' || bytes[52] != b'-' {
        return None;
    }
    let (mut trace_id, mut span_id, mut flags) = ([0u8; 16], [0u8; 8], [0u8; 1]);
    read_hex(&mut trace_id, &bytes[3..35])?;
    read_hex(&mut span_id, &bytes[36..52])?;
    read_hex(&mut flags, &bytes[53..55])?;
    let span_context = SpanContext::new(
        TraceId::from_bytes(trace_id),
        SpanId::from_bytes(span_id),
        TraceFlags::new(flags[0]) & TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    span_context
        .is_valid()
        .then(|| Context::new().with_remote_span_context(span_context))
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
    fn traceparent_bytes_are_what_the_propagator_writes() {
        use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
        for sampled in [false, true] {
            let (trace_id, span_id) = (
                [
                    0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e,
                    0x0e, 0x47, 0x36,
                ],
                [0, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7],
            );
            let flags = if sampled {
                TraceFlags::SAMPLED
            } else {
                TraceFlags::default()
            };
            let context = Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from_bytes(trace_id),
                SpanId::from_bytes(span_id),
                flags,
                true,
                TraceState::default(),
            ));
            let mut one = One(None);
            TraceContextPropagator::new().inject_context(&context, &mut one);
            let ours = traceparent_bytes(&trace_id, &span_id, sampled);
            assert_eq!(std::str::from_utf8(&ours).unwrap(), one.0.unwrap());
        }
        assert_eq!(hex(&[0x00, 0xab, 0xff]), "00abff");
    }

    /// What the propagator reads from `value` (`None`: no valid context).
    fn propagator_reads(value: &[u8]) -> Option<(String, String, bool)> {
        let value = std::str::from_utf8(value).ok()?;
        let context = TraceContextPropagator::new().extract(&Single(value));
        let span_context = context.span().span_context().clone();
        span_context.is_valid().then(|| {
            (
                span_context.trace_id().to_string(),
                span_context.span_id().to_string(),
                span_context.is_sampled(),
            )
        })
    }

    fn ours_reads(value: &[u8]) -> Option<(String, String, bool)> {
        from_traceparent(value).map(|context| {
            let span_context = context.span().span_context().clone();
            assert!(span_context.is_remote());
            (
                span_context.trace_id().to_string(),
                span_context.span_id().to_string(),
                span_context.is_sampled(),
            )
        })
    }

    /// `from_traceparent` reads a version-00 value as the propagator does,
    /// over random values and random corruptions of them (one byte
    /// replaced, or cut short): where it finds a context, the propagator
    /// finds the same one; on a value of version 00 in its canonical shape
    /// (hex digits, dashes in place) they agree on whether there is one.
    /// Other versions, and the spaces and dangling dashes the propagator
    /// lets pass, are not what entries hold. The seed is printed.
    #[test]
    fn traceparent_is_read_as_the_propagator_reads_it() {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            | 1;
        println!("seed {seed}");
        let mut state = seed;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        const ALPHABET: &[u8] = b"0123456789abcdefABCDEF-xz 0";
        let mut agreed_some = 0;
        for _ in 0..20_000 {
            let mut trace_id = [0u8; 16];
            let mut span_id = [0u8; 8];
            trace_id.iter_mut().for_each(|b| *b = next() as u8);
            span_id.iter_mut().for_each(|b| *b = next() as u8);
            // Sometimes an all-zero id: invalid.
            if next() % 50 == 0 {
                trace_id = [0; 16];
            }
            if next() % 50 == 0 {
                span_id = [0; 8];
            }
            let mut value = traceparent_bytes(&trace_id, &span_id, next() % 2 == 0).to_vec();
            match next() % 4 {
                0 => {}
                1 => value[53..].copy_from_slice(&[
                    b"0123456789abcdef"[next() as usize % 16],
                    b"0123456789abcdef"[next() as usize % 16],
                ]),
                2 => {
                    let at = next() as usize % value.len();
                    value[at] = ALPHABET[next() as usize % ALPHABET.len()];
                }
                _ => value.truncate(next() as usize % value.len()),
            }
            let (ours, theirs) = (ours_reads(&value), propagator_reads(&value));
            if ours.is_some() {
                assert_eq!(ours, theirs, "{:?}", String::from_utf8_lossy(&value));
                agreed_some += 1;
            } else if value.len() == 55
                && value.starts_with(b"00-")
                && value.iter().enumerate().all(|(at, b)| match at {
                    2 | 35 | 52 => *b == b'-',
                    _ => b.is_ascii_hexdigit(),
                })
            {
                assert_eq!(theirs, None, "{:?}", String::from_utf8_lossy(&value));
            }
        }
        assert!(agreed_some > 5_000, "{agreed_some} valid values read");
    }

    #[test]
    fn a_traceparent_written_for_an_entry_reads_back() {
        let good = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            ours_reads(good),
            Some((
                "4bf92f3577b34da6a3ce929d0e0e4736".into(),
                "00f067aa0ba902b7".into(),
                true
            ))
        );
        // Other versions and forms are not what entries hold.
        assert!(
            from_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").is_none()
        );
        assert!(
            from_traceparent(b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01").is_none()
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
