//! Requests counted at the door: a tower layer in front of a server (gRPC or
//! HTTP) that counts every request by protocol, method and result code and
//! records its latency.
//!
//! Labels are bounded: the method label is one of the names the server
//! declared (its gRPC paths, or HTTP verbs), anything else counts as
//! `other`, so a client inventing paths cannot grow the series. The code is
//! the gRPC status of a trailers-only response (how tonic answers an
//! error); for a gRPC response whose status comes later, the status in its
//! trailers, counted when they are sent (a stream that fails midway counts
//! as its error, not `OK`; one the client abandons before its end counts
//! as `CANCELLED`); for plain HTTP, the status code. Latency runs until the
//! response head: for streamed responses, until the stream starts.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tracing::Instrument as _;

use crate::metrics::latency_buckets;

/// Labels of a counted request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `grpc`, `reapi`, `http_cache`, `restic`, ...
    pub protocol: &'static str,
    /// The method: a gRPC method name, an HTTP verb, or `other`.
    pub method: &'static str,
    /// The gRPC status name or the HTTP status code.
    pub code: &'static str,
}

/// Labels of a latency histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    /// As in [`RequestLabels`].
    pub protocol: &'static str,
    /// As in [`RequestLabels`].
    pub method: &'static str,
}

fn new_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

/// The request families, shared by every layer of a process.
#[derive(Clone, Debug)]
pub struct RequestMetrics {
    requests: Family<RequestLabels, Counter>,
    latency: Family<MethodLabels, Histogram, fn() -> Histogram>,
}

impl Default for RequestMetrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            latency: Family::new_with_constructor(new_histogram),
        }
    }
}

impl RequestMetrics {
    /// Registers the families in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tidepool_rpc_requests",
            "Requests served, by protocol, method and result code.",
            self.requests.clone(),
        );
        registry.register_with_unit(
            "tidepool_rpc_request_duration",
            "Time from a request's arrival to its response head, by protocol and method.",
            prometheus_client::registry::Unit::Seconds,
            self.latency.clone(),
        );
    }

    /// Counts one request.
    pub fn record(&self, labels: RequestLabels, start: Instant) {
        self.observe_latency(labels.protocol, labels.method, start);
        self.count_one(labels);
    }

    fn observe_latency(&self, protocol: &'static str, method: &'static str, start: Instant) {
        self.latency
            .get_or_create(&MethodLabels { protocol, method })
            .observe(start.elapsed().as_secs_f64());
    }

    fn count_one(&self, labels: RequestLabels) {
        self.requests.get_or_create(&labels).inc();
    }

    /// The count of one label set (tests).
    pub fn count(&self, labels: &RequestLabels) -> u64 {
        self.requests.get(labels).map_or(0, |c| c.get())
    }

    /// A layer counting requests of `protocol` whose method label comes
    /// from `methods` (`None`: `other`).
    pub fn layer(&self, protocol: &'static str, methods: MethodNames) -> RequestLayer {
        RequestLayer {
            metrics: self.clone(),
            protocol,
            methods,
            traced: false,
        }
    }
}

/// How a request is named: from its path (gRPC) or its verb (HTTP).
#[derive(Clone)]
pub enum MethodNames {
    /// gRPC: the last segment of a path in this list.
    Grpc(Arc<[&'static str]>),
    /// HTTP: the verb, if it is one of these.
    Http(&'static [&'static str]),
}

impl MethodNames {
    /// gRPC methods, by full path (`/pkg.Service/Method`).
    pub fn grpc(paths: impl IntoIterator<Item = &'static str>) -> Self {
        Self::Grpc(paths.into_iter().collect())
    }

    fn of<B>(&self, request: &http::Request<B>) -> &'static str {
        match self {
            MethodNames::Grpc(paths) => paths
                .iter()
                .find(|p| **p == request.uri().path())
                .and_then(|p| p.rsplit('/').next())
                .unwrap_or("other"),
            MethodNames::Http(verbs) => verbs
                .iter()
                .find(|v| **v == request.method().as_str())
                .copied()
                .unwrap_or("other"),
        }
    }

    fn is_grpc(&self) -> bool {
        matches!(self, MethodNames::Grpc(_))
    }
}

impl std::fmt::Debug for MethodNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_grpc() { "Grpc" } else { "Http" })
    }
}

/// The tower layer; see [`RequestMetrics::layer`].
#[derive(Clone, Debug)]
pub struct RequestLayer {
    metrics: RequestMetrics,
    protocol: &'static str,
    methods: MethodNames,
    traced: bool,
}

impl RequestLayer {
    /// Also runs every request in a span of its own (`request`, with
    /// `protocol`, `method` and `code`), a child of the caller's span when
    /// it sent a `traceparent`, else the root of a new trace: for servers
    /// whose handlers make no spans themselves (the gateway's).
    pub fn traced(mut self) -> Self {
        self.traced = true;
        self
    }
}

impl<S> tower::Layer<S> for RequestLayer {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            layer: self.clone(),
        }
    }
}

/// A service whose requests are counted.
#[derive(Clone, Debug)]
pub struct Counted<S> {
    inner: S,
    layer: RequestLayer,
}

/// gRPC status names by code (`grpc-status` 0..=16).
const GRPC_CODES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// The gRPC status name of a `grpc-status` value.
fn grpc_code(value: &http::HeaderValue) -> &'static str {
    value
        .to_str()
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .and_then(|c| GRPC_CODES.get(c).copied())
        .unwrap_or("UNKNOWN")
}

/// The code label of a response head; `None` for a gRPC response whose
/// status is still to come (in its trailers).
fn code_of<B>(grpc: bool, response: &http::Response<B>) -> Option<&'static str> {
    if grpc {
        return match response.headers().get("grpc-status") {
            None if response.status().is_success() => None,
            None => Some("UNKNOWN"),
            Some(value) => Some(grpc_code(value)),
        };
    }
    Some(http_code(response))
}

/// The label of an HTTP status code (a bounded set).
fn http_code<B>(response: &http::Response<B>) -> &'static str {
    match response.status().as_u16() {
        200 => "200",
        201 => "201",
        204 => "204",
        206 => "206",
        304 => "304",
        400 => "400",
        401 => "401",
        403 => "403",
        404 => "404",
        405 => "405",
        409 => "409",
        413 => "413",
        416 => "416",
        429 => "429",
        500 => "500",
        503 => "503",
        s if s < 300 => "2xx",
        s if s < 400 => "3xx",
        s if s < 500 => "4xx",
        _ => "5xx",
    }
}

/// A request whose count waits for its status: the gRPC trailers at the
/// end of its response body.
#[derive(Debug)]
struct Pending {
    metrics: RequestMetrics,
    protocol: &'static str,
    method: &'static str,
    span: tracing::Span,
}

impl Pending {
    fn finish(self, code: &'static str) {
        self.span.record("code", code);
        self.metrics.count_one(RequestLabels {
            protocol: self.protocol,
            method: self.method,
            code,
        });
    }
}

/// A request not answered yet, and when it began: counted `CANCELLED` if
/// dropped so.
struct Unanswered(Option<(Pending, Instant)>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some((pending, start)) = self.0.take() {
            pending
                .metrics
                .observe_latency(pending.protocol, pending.method, start);
            pending.finish("CANCELLED");
        }
    }
}

/// A response body that counts its request when its status is known: the
/// trailers' `grpc-status`, or `CANCELLED` if the body is dropped before
/// its end (the client went away, or the stream was reset).
#[derive(Debug)]
pub struct CountedBody<B> {
    inner: B,
    pending: Option<Pending>,
}

impl<B> CountedBody<B> {
    fn finish(&mut self, code: &'static str) {
        if let Some(pending) = self.pending.take() {
            pending.finish(code);
        }
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for CountedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(trailers) = frame.trailers_ref() {
                    let code = trailers.get("grpc-status").map_or("UNKNOWN", grpc_code);
                    this.finish(code);
                }
            }
            // The body failed: the stream is reset without a status.
            Poll::Ready(Some(Err(_))) => this.finish("UNKNOWN"),
            // Ended without trailers: no status was sent.
            Poll::Ready(None) => this.finish("UNKNOWN"),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for CountedBody<B> {
    fn drop(&mut self) {
        self.finish("CANCELLED");
    }
}

impl<S, B, R> tower::Service<http::Request<B>> for Counted<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    R: http_body::Body + Unpin + 'static,
{
    type Response = http::Response<CountedBody<R>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let start = Instant::now();
        let method = self.layer.methods.of(&request);
        let grpc = self.layer.methods.is_grpc();
        let protocol = self.layer.protocol;
        let metrics = self.layer.metrics.clone();
        let span = if self.layer.traced && tidepool_security::trace_context::tracking() {
            let parent = tidepool_security::trace_context::extract_from_headers(request.headers());
            tidepool_security::trace_context::continued(parent, || {
                tracing::info_span!(
                    target: "tidepool_gateway::request",
                    parent: None,
                    "request",
                    protocol,
                    method,
                    code = tracing::field::Empty
                )
            })
        } else {
            tracing::Span::none()
        };
        let future = span.in_scope(|| self.inner.call(request));
        Box::pin(async move {
            // Counted `CANCELLED` if this future is dropped before the
            // response head: tonic's `grpc-timeout` layer, outside this
            // one, drops it when the caller's deadline passes, and hyper
            // when the caller resets the stream (before, such requests were
            // counted nowhere: a shard without quorum hid its failures).
            let mut unanswered = Unanswered(Some((
                Pending {
                    metrics: metrics.clone(),
                    protocol,
                    method,
                    span: span.clone(),
                },
                start,
            )));
            let result = future.instrument(span.clone()).await;
            let _ = unanswered.0.take();
            metrics.observe_latency(protocol, method, start);
            let response = match result {
                Ok(response) => response,
                Err(error) => {
                    let code = if grpc { "UNAVAILABLE" } else { "500" };
                    span.record("code", code);
                    metrics.count_one(RequestLabels {
                        protocol,
                        method,
                        code,
                    });
                    return Err(error);
                }
            };
            let mut pending = Some(Pending {
                metrics,
                protocol,
                method,
                span,
            });
            if let Some(code) = code_of(grpc, &response) {
                pending.take().expect("just made").finish(code);
            }
            Ok(response.map(|inner| CountedBody { inner, pending }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use tower::{Layer, Service, ServiceExt};

    /// A response body of these frames, then its end.
    struct Frames(std::collections::VecDeque<http_body::Frame<bytes::Bytes>>);

    impl Frames {
        /// Some data, then trailers with `grpc-status` `status` (none:
        /// no trailers).
        fn grpc(status: Option<&'static str>) -> Frames {
            let mut frames = std::collections::VecDeque::new();
            frames.push_back(http_body::Frame::data(bytes::Bytes::from_static(b"piece")));
            if let Some(status) = status {
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static(status));
                frames.push_back(http_body::Frame::trailers(trailers));
            }
            Frames(frames)
        }
    }

    impl http_body::Body for Frames {
        type Data = bytes::Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    /// Reads `body` to its end (as the server sends it).
    async fn drain<B: http_body::Body + Unpin>(mut body: B) {
        while std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
            .await
            .is_some()
        {}
    }

    fn grpc_labels(method: &'static str, code: &'static str) -> RequestLabels {
        RequestLabels {
            protocol: "grpc",
            method,
            code,
        }
    }

    #[tokio::test]
    async fn counts_by_method_and_code_and_bounds_the_labels() {
        let metrics = RequestMetrics::default();
        let layer = metrics.layer("grpc", MethodNames::grpc(["/p.S/Get", "/p.S/Put"]));
        let mut service = layer.layer(tower::service_fn(|request: http::Request<()>| async move {
            if request.uri().path() == "/p.S/Put" {
                // Trailers-only: the status in the head, no body.
                let mut response = http::Response::new(Frames(Default::default()));
                response
                    .headers_mut()
                    .insert("grpc-status", http::HeaderValue::from_static("5"));
                return Ok::<_, std::convert::Infallible>(response);
            }
            Ok(http::Response::new(Frames::grpc(Some("0"))))
        }));
        for path in ["/p.S/Get", "/p.S/Put", "/p.S/Invented1", "/p.S/Invented2"] {
            let request = http::Request::builder().uri(path).body(()).unwrap();
            let response = service.ready().await.unwrap().call(request).await.unwrap();
            drain(response.into_body()).await;
        }
        assert_eq!(metrics.count(&grpc_labels("Get", "OK")), 1);
        assert_eq!(metrics.count(&grpc_labels("Put", "NOT_FOUND")), 1);
        assert_eq!(metrics.count(&grpc_labels("other", "OK")), 2);
    }

    /// A stream's status is in its trailers: one that fails after sending
    /// data is counted as its error, not as the `OK` its head implied; one
    /// dropped before its end (the client went away) as `CANCELLED`; each
    /// exactly once.
    #[tokio::test]
    async fn a_stream_is_counted_by_the_status_it_ends_with() {
        let metrics = RequestMetrics::default();
        let layer = metrics.layer("grpc", MethodNames::grpc(["/p.S/Read"]));
        let mut service = layer.layer(tower::service_fn(|request: http::Request<()>| async move {
            let status = match request.uri().query() {
                Some("fail") => Some("14"),
                Some("bare") => None,
                _ => Some("0"),
            };
            Ok::<_, std::convert::Infallible>(http::Response::new(Frames::grpc(status)))
        }));
        let mut call = async |uri: &str| {
            let request = http::Request::builder().uri(uri).body(()).unwrap();
            service.ready().await.unwrap().call(request).await.unwrap()
        };
        let failed = call("/p.S/Read?fail").await;
        assert_eq!(
            metrics.count(&grpc_labels("Read", "OK")),
            0,
            "counted before its status was known"
        );
        drain(failed.into_body()).await;
        assert_eq!(metrics.count(&grpc_labels("Read", "UNAVAILABLE")), 1);
        assert_eq!(metrics.count(&grpc_labels("Read", "OK")), 0);

        drain(call("/p.S/Read").await.into_body()).await;
        assert_eq!(metrics.count(&grpc_labels("Read", "OK")), 1);

        // Abandoned after its first piece.
        let mut body = call("/p.S/Read").await.into_body();
        std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
            .await
            .unwrap()
            .unwrap();
        drop(body);
        assert_eq!(metrics.count(&grpc_labels("Read", "CANCELLED")), 1);

        // Ended without any status.
        drain(call("/p.S/Read?bare").await.into_body()).await;
        assert_eq!(metrics.count(&grpc_labels("Read", "UNKNOWN")), 1);
        // Nothing counted twice (every body is gone by now).
        assert_eq!(metrics.count(&grpc_labels("Read", "OK")), 1);
        assert_eq!(metrics.count(&grpc_labels("Read", "UNAVAILABLE")), 1);
    }

    /// A request whose handler is dropped before it answers (the caller's
    /// deadline passed, or it reset the stream) is counted `CANCELLED`,
    /// once, with its latency.
    #[tokio::test]
    async fn a_request_dropped_before_its_answer_is_counted_cancelled() {
        let metrics = RequestMetrics::default();
        let layer = metrics.layer("grpc", MethodNames::grpc(["/p.S/Put"]));
        let mut service = layer.layer(tower::service_fn(|_: http::Request<()>| async {
            std::future::pending::<Result<http::Response<Frames>, std::convert::Infallible>>().await
        }));
        let request = http::Request::builder().uri("/p.S/Put").body(()).unwrap();
        let call = service.ready().await.unwrap().call(request);
        let waited = tokio::time::timeout(std::time::Duration::from_millis(20), call).await;
        assert!(waited.is_err(), "the handler never answers");
        assert_eq!(metrics.count(&grpc_labels("Put", "CANCELLED")), 1);
        assert_eq!(metrics.count(&grpc_labels("Put", "OK")), 0);
    }

    #[test]
    fn http_codes_keep_a_bounded_set() {
        let response = |s: u16| {
            let mut r = http::Response::new(());
            *r.status_mut() = http::StatusCode::from_u16(s).unwrap();
            r
        };
        assert_eq!(code_of(false, &response(404)), Some("404"));
        assert_eq!(code_of(false, &response(418)), Some("4xx"));
        assert_eq!(code_of(false, &response(599)), Some("5xx"));
        // A gRPC head without a status: the trailers will tell.
        assert_eq!(code_of(true, &response(200)), None);
        assert_eq!(code_of(true, &response(500)), Some("UNKNOWN"));
    }
}
