//! The one metrics endpoint every Tidepool process serves: `GET /metrics`
//! (a [`prometheus_client`] registry, as OpenMetrics text when the scraper
//! asks for it and as Prometheus text 0.0.4 otherwise), `GET /healthz`
//! (alive) and `GET /readyz` (serving), on hyper's HTTP/1.1 server with
//! axum's router.
//!
//! Limits: a connection must send its request head within
//! [`HEADER_READ_TIMEOUT`] and is closed after [`CONNECTION_TIMEOUT`], so a
//! client that connects and says nothing holds a socket no longer; at most
//! [`MAX_CONNECTIONS`] connections are served at once, [`PER_PEER`] of them
//! for one client address, and a connection past either is closed at once
//! (the accept loop never waits: idle connections of one client cannot
//! keep the kubelet's probes, served here too, out). Scrapes are encoded
//! one at a time, and a scrape that arrives while one is encoded takes the
//! next encode's result (never one begun before it arrived): a client
//! asking without pause costs at most one encode at a time.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use prometheus_client::encoding::{prometheus_text, text};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How long a connection may take to send a request head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one connection may stay open, whatever it does.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 256;
/// Connections served at once for one client IP address.
pub const PER_PEER: usize = 16;

/// The `Content-Type` of OpenMetrics text 1.0.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What a process exposes on its metrics endpoint.
pub trait Exposition: Send + Sync + 'static {
    /// The registry to encode; called once per scrape (collectors read
    /// their state then).
    fn registry(&self) -> &Registry;

    /// `Err(why)` when the process should be restarted (`/healthz`).
    fn alive(&self) -> Result<(), String> {
        Ok(())
    }

    /// `Err(why)` while the process should get no traffic (`/readyz`).
    fn ready(&self) -> Result<(), String> {
        Ok(())
    }
}

/// The text exposition format a scrape gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics text 1.0 (asked for with its media type in `Accept`).
    OpenMetrics,
    /// Prometheus text 0.0.4 (everything else: `promtool`, curl, older
    /// scrapers).
    PrometheusText,
}

impl Format {
    /// The format an `Accept` header asks for.
    pub fn negotiate(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::PrometheusText,
        }
    }

    /// Its `Content-Type`.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
            Format::PrometheusText => prometheus_text::CONTENT_TYPE,
        }
    }
}

/// Encodes `registry` in `format`.
pub fn encode(registry: &Registry, format: Format) -> Result<String, std::fmt::Error> {
    let mut out = String::with_capacity(16 << 10);
    match format {
        Format::OpenMetrics => text::encode(&mut out, registry)?,
        Format::PrometheusText => prometheus_text::encode(&mut out, registry)?,
    }
    Ok(out)
}

/// Upper bounds (seconds) of request latency histograms: 100 µs to 10 s.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
        2.5, 5.0, 10.0,
    ]
    .into_iter()
}

/// The endpoint's state: what it exposes, and the last scrape encoded.
struct Endpoint {
    exposition: Arc<dyn Exposition>,
    /// Encodes begun so far.
    begun: AtomicU64,
    /// The last encode: its number, format and text.
    last: tokio::sync::Mutex<Option<(u64, Format, Arc<String>)>>,
}

/// The router of the endpoint (also what tests drive without a socket).
pub fn router(exposition: Arc<dyn Exposition>) -> Router {
    let endpoint = Arc::new(Endpoint {
        exposition,
        begun: AtomicU64::new(0),
        last: tokio::sync::Mutex::new(None),
    });
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(endpoint)
}

async fn metrics(State(endpoint): State<Arc<Endpoint>>, headers: HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = Format::negotiate(accept);
    // Encodes begun before this scrape arrived: their text may predate it.
    let arrived = endpoint.begun.load(Ordering::Acquire);
    let mut last = endpoint.last.lock().await;
    if let Some((number, encoded, text)) = last.as_ref()
        && *number > arrived
        && *encoded == format
    {
        let text = text.as_str().to_owned();
        return ([(header::CONTENT_TYPE, format.content_type())], text).into_response();
    }
    let number = endpoint.begun.fetch_add(1, Ordering::AcqRel) + 1;
    // Collectors read shard and engine state under locks: off the
    // runtime's worker threads.
    let exposition = endpoint.exposition.clone();
    let encoded = tokio::task::spawn_blocking(move || encode(exposition.registry(), format)).await;
    match encoded {
        Ok(Ok(text)) => {
            let text = Arc::new(text);
            *last = Some((number, format, text.clone()));
            drop(last);
            let text = text.as_str().to_owned();
            ([(header::CONTENT_TYPE, format.content_type())], text).into_response()
        }
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics\n").into_response(),
    }
}

fn probe(result: Result<(), String>, ok: &'static str) -> Response {
    match result {
        Ok(()) => (StatusCode::OK, format!("{ok}\n")).into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response(),
    }
}

async fn healthz(State(endpoint): State<Arc<Endpoint>>) -> Response {
    probe(endpoint.exposition.alive(), "ok")
}

async fn readyz(State(endpoint): State<Arc<Endpoint>>) -> Response {
    let exposition = endpoint.exposition.clone();
    let result = tokio::task::spawn_blocking(move || exposition.ready())
        .await
        .unwrap_or_else(|_| Err("readiness check failed".into()));
    probe(result, "ready")
}

/// Serves the endpoint on `listener` until `stop` completes.
pub async fn serve(
    listener: TcpListener,
    exposition: Arc<dyn Exposition>,
    stop: impl Future<Output = ()> + Send,
) {
    let service = TowerToHyperService::new(router(exposition));
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let peers = tidepool_security::tls::PeerLimit::new(PER_PEER);
    let mut stop = std::pin::pin!(stop);
    loop {
        let accepted = tokio::select! {
            () = &mut stop => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((socket, peer)) = accepted else {
            // Out of file descriptors and the like: do not spin.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        // Past either bound the connection is closed at once.
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue;
        };
        let Some(place) = peers.take(peer.ip()) else {
            continue;
        };
        let permit = (slot, place);
        let _ = socket.set_nodelay(true);
        let service = service.clone();
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(socket), service);
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, connection).await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    struct Fixed(Registry);

    impl Exposition for Fixed {
        fn registry(&self) -> &Registry {
            &self.0
        }
        fn ready(&self) -> Result<(), String> {
            Err("no map yet".into())
        }
    }

    fn fixed() -> Arc<Fixed> {
        let mut registry = Registry::default();
        let counter: Counter = Counter::default();
        counter.inc_by(3);
        registry.register("tidepool_test_things", "Things.", counter);
        Arc::new(Fixed(registry))
    }

    #[test]
    fn the_accept_header_picks_the_format() {
        assert_eq!(Format::negotiate(None), Format::PrometheusText);
        assert_eq!(Format::negotiate(Some("*/*")), Format::PrometheusText);
        let prometheus =
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
        assert_eq!(Format::negotiate(Some(prometheus)), Format::OpenMetrics);
        let registry = &fixed().0;
        let classic = encode(registry, Format::PrometheusText).unwrap();
        assert!(classic.contains("# TYPE tidepool_test_things_total counter\n"));
        assert!(!classic.contains("# EOF"));
        let open = encode(registry, Format::OpenMetrics).unwrap();
        assert!(open.ends_with("# EOF\n"), "{open}");
    }

    async fn request(listener_address: std::net::SocketAddr, raw: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut socket = tokio::net::TcpStream::connect(listener_address)
            .await
            .unwrap();
        socket.write_all(raw.as_bytes()).await.unwrap();
        let mut out = String::new();
        socket.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_metrics_and_probes_and_drops_silent_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, fixed(), async move {
            let _ = stop_rx.await;
        }));
        let metrics = request(
            address,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(metrics.contains("text/plain; version=0.0.4"), "{metrics}");
        assert!(
            metrics.contains("tidepool_test_things_total 3"),
            "{metrics}"
        );
        let open = request(
            address,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(open.contains(OPENMETRICS_CONTENT_TYPE), "{open}");
        let alive = request(
            address,
            "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(alive.starts_with("HTTP/1.1 200"), "{alive}");
        let ready = request(
            address,
            "GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(
            ready.starts_with("HTTP/1.1 503") && ready.ends_with("no map yet\n"),
            "{ready}"
        );
        let missing = request(
            address,
            "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let _ = stop_tx.send(());
        server.await.unwrap();
    }

    /// A client holding more idle connections than the endpoint serves at
    /// once keeps nobody else out: past its own [`PER_PEER`] its
    /// connections are closed at once, and a probe from another address
    /// is answered. Before, the accept loop waited for a free connection
    /// slot: 64 silent connections kept every probe waiting 10 s.
    #[tokio::test]
    async fn idle_connections_of_one_client_keep_no_probe_out() {
        use tokio::io::AsyncReadExt as _;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, fixed(), async move {
            let _ = stop_rx.await;
        }));
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS + 8 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            idle.push(socket.connect(address).await.unwrap());
        }
        // Those past the first PER_PEER are closed by the server.
        let mut closed = 0;
        for socket in &mut idle {
            let mut byte = [0u8; 1];
            if let Ok(Ok(0)) =
                tokio::time::timeout(Duration::from_millis(200), socket.read(&mut byte)).await
            {
                closed += 1;
            }
        }
        assert_eq!(closed, idle.len() - PER_PEER);
        let alive = tokio::time::timeout(
            Duration::from_secs(2),
            request(
                address,
                "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            ),
        )
        .await
        .expect("the probe is answered at once");
        assert!(alive.starts_with("HTTP/1.1 200"), "{alive}");
        let _ = stop_tx.send(());
        server.await.unwrap();
    }

    /// Exposes one counter, and counts its encodes.
    struct Counting {
        registry: Registry,
        encodes: std::sync::atomic::AtomicUsize,
    }

    impl Exposition for Counting {
        fn registry(&self) -> &Registry {
            self.encodes.fetch_add(1, Ordering::Relaxed);
            // A slow encode, as a node's with many replicas: the scrapes
            // sent meanwhile wait for the next one.
            std::thread::sleep(Duration::from_millis(50));
            &self.registry
        }
    }

    /// Scrapes share encodes only with scrapes that were waiting for them:
    /// a scrape sees every change made before it was sent, however many
    /// run at once; and eight scrapes at once cost about two encodes, not
    /// eight.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_scrape_sees_every_change_made_before_it() {
        use tower::ServiceExt as _;
        let mut registry = Registry::default();
        let counter: Counter = Counter::default();
        registry.register("tidepool_test_things", "Things.", counter.clone());
        let counting = Arc::new(Counting {
            registry,
            encodes: Default::default(),
        });
        let router = router(counting.clone());
        let scrape = |router: Router| async move {
            let request = axum::http::Request::get("/metrics")
                .body(axum::body::Body::empty())
                .unwrap();
            let response = router.oneshot(request).await.unwrap();
            let body = axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .unwrap();
            String::from_utf8(body.to_vec()).unwrap()
        };
        for round in 1..=20u64 {
            counter.inc();
            let many: Vec<_> = (0..8)
                .map(|_| tokio::spawn(scrape(router.clone())))
                .collect();
            for scraped in many {
                let text = scraped.await.unwrap();
                assert!(
                    text.contains(&format!("tidepool_test_things_total {round}\n")),
                    "round {round}: {text}"
                );
            }
        }
        // 8 a round without sharing; 2 when the other seven arrive during
        // the first encode (a third if one is late).
        let encodes = counting.encodes.load(Ordering::Relaxed);
        assert!((20..=60).contains(&encodes), "{encodes} encodes");
    }
}

/// When the process's TLS material expires, read at each scrape (the
/// files are reloaded when they change):
/// `tidepool_tls_certificate_expiry_timestamp_seconds{certificate="own"|"ca"}`,
/// Unix seconds; and, for a process that also serves TLS to clients
/// outside the cluster with a certificate of its own (the build-cache
/// gateway's, read once at start, as it is served),
/// `{certificate="serving"}`. Certificates are issued for a year by default
/// and nothing renews them while a process runs: the alert
/// `TidepoolCertificateExpiresSoon` watches this.
#[derive(Debug, Default)]
pub struct TlsExpiry {
    /// The cluster TLS material (own certificate and CA), if any.
    pub cluster: Option<Arc<tidepool_security::Tls>>,
    /// When the serving certificate expires, if there is one.
    pub serving: Option<i64>,
}

impl TlsExpiry {
    /// The cluster TLS material's expiry alone.
    pub fn of(tls: Arc<tidepool_security::Tls>) -> Self {
        TlsExpiry {
            cluster: Some(tls),
            serving: None,
        }
    }
}

/// Its metric's name.
pub const TLS_EXPIRY_METRIC: &str = "tidepool_tls_certificate_expiry_timestamp_seconds";

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct CertificateLabel {
    certificate: &'static str,
}

impl prometheus_client::collector::Collector for TlsExpiry {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        let mut values = Vec::new();
        if let Some(tls) = &self.cluster {
            let expiry = tls.expiry();
            values.push(("own", expiry.certificate));
            values.push(("ca", expiry.ca));
        }
        if let Some(at) = self.serving {
            values.push(("serving", at));
        }
        if values.is_empty() {
            return Ok(());
        }
        let mut family = encoder.encode_descriptor(
            TLS_EXPIRY_METRIC,
            "When the process's own TLS certificate, the earliest of its CA certificates, and the certificate it serves clients with, expire (Unix seconds).",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (certificate, at) in values {
            let labels = CertificateLabel { certificate };
            ConstGauge::new(at).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
