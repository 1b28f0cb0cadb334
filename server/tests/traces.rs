//! Traces across processes: an in-process OTLP receiver (the
//! `TraceService` of `opentelemetry-proto`) collects the spans of this test
//! process (the SDK's) and of a `tidepool dev` cluster (three nodes and a
//! gateway) that exports to it.
//!
//! - One SDK put yields one trace: the SDK's span, the leader's request
//!   span (its child, across the gRPC hop), `raft.propose` on the leader,
//!   `raft.append` on both followers and `raft.apply` on all three
//!   replicas (children of `raft.propose`, across the Raft hop).
//! - An HTTP cache miss on the gateway starts a trace that reaches the
//!   node's request span (with `error_code` NOT_FOUND).
//! - A caller that does not sample: no span anywhere.
//! - A collector that accepts connections and never answers: puts are not
//!   held (exports never block requests), and `--log-format json` lines
//!   all parse, those inside traces with their ids.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tidepool_client::{Client, ClientConfig};
use tracing::Instrument as _;

/// A span as received, with the service that sent it.
#[derive(Clone, Debug)]
struct Received {
    service: String,
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent: Vec<u8>,
    links: Vec<Vec<u8>>,
    attributes: BTreeMap<String, String>,
}

#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Received>>>,
}

fn text(value: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .map(|kv| text(&kv.value))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(Received {
                        service: service.clone(),
                        name: span.name,
                        trace_id: span.trace_id,
                        span_id: span.span_id,
                        parent: span.parent_span_id,
                        links: span.links.into_iter().map(|l| l.span_id).collect(),
                        attributes: span
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), text(&kv.value)))
                            .collect(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Receiver {
    fn all(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits until `done` holds for the spans received (or 30 s).
    fn wait(&self, what: &str, done: impl Fn(&[Received]) -> bool) -> Vec<Received> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let spans = self.all();
            if done(&spans) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not seen in 30 s; spans received:\n{spans:#?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The receiver, and this process's telemetry exporting to it (once per
/// test binary: the subscriber is global).
fn receiver() -> &'static (Receiver, SocketAddr) {
    static RECEIVER: OnceLock<(Receiver, SocketAddr)> = OnceLock::new();
    RECEIVER.get_or_init(|| {
        let receiver = Receiver::default();
        let (tx, rx) = std::sync::mpsc::channel();
        let service = receiver.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                tonic::transport::Server::builder()
                    .add_service(TraceServiceServer::new(service))
                    .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                    .await
                    .unwrap();
            });
        });
        let address = rx.recv().unwrap();
        let guard = tidepool_telemetry::init(&tidepool_telemetry::TelemetryConfig {
            service_name: "traces-test".into(),
            otlp_endpoint: Some(format!("http://{address}")),
            default_filter: "warn".into(),
            ..Default::default()
        })
        .unwrap();
        // Exports for the rest of the process.
        std::mem::forget(guard);
        (receiver, address)
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn named<'a>(spans: &'a [Received], name: &str, trace: &[u8]) -> Vec<&'a Received> {
    spans
        .iter()
        .filter(|s| s.name == name && s.trace_id == trace)
        .collect()
}

#[test]
fn one_put_is_one_trace_through_the_leader_and_both_followers() {
    let (receiver, collector) = receiver();
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{collector}");
    let (child, banner) =
        support::start_dev_banner(dir.path(), &["--insecure", "--otlp-endpoint", &endpoint]);
    let url = support::banner_url(&banner);
    let http_cache = support::banner_http_cache(&banner);
    let runtime = runtime();
    let client = runtime.block_on(async {
        Client::with_config(ClientConfig::new(&[url]))
            .await
            .unwrap()
    });

    // One traced put, under a span of this test: the other test of this
    // binary runs at the same time and its SDK spans reach this receiver
    // too, so the trace is told by its id, not by its name.
    let caller = tracing::info_span!(target: "tidepool_test", "traced caller");
    let trace = trace_of(&caller);
    runtime
        .block_on(
            client
                .put("default", b"traced", b"hello")
                .instrument(caller),
        )
        .unwrap();
    receiver.wait("the SDK's put span", |spans| {
        spans
            .iter()
            .any(|s| s.name == "tidepool.put" && s.service == "traces-test" && s.trace_id == trace)
    });
    let spans = receiver.wait("raft.apply on the three replicas", |spans| {
        named(spans, "raft.apply", &trace).len() >= 3
            && named(spans, "raft.append", &trace).len() >= 2
    });
    let propose = named(&spans, "raft.propose", &trace);
    assert_eq!(propose.len(), 1, "one entry: {spans:#?}");
    let propose = propose[0];
    assert_eq!(propose.service, "tidepool-dev");
    // The leader's request span is raft.propose's parent, and a child of
    // the SDK's span (or of a span under it in the test process).
    let request = spans
        .iter()
        .find(|s| s.span_id == propose.parent)
        .expect("raft.propose has a received parent");
    assert_eq!(request.name, "request");
    assert_eq!(
        request.attributes.get("op").map(String::as_str),
        Some("put")
    );
    let leader: u64 = request.attributes["node_id"].parse().unwrap();
    // Routed: the shard (raft.propose's), its term, the namespace.
    assert_eq!(
        request.attributes["shard_id"],
        propose.attributes["shard_id"]
    );
    assert_eq!(request.attributes["namespace"], "default");
    let term: u64 = request.attributes["term"].parse().unwrap();
    assert!(term > 0, "{request:#?}");
    let client_side: BTreeSet<&[u8]> = spans
        .iter()
        .filter(|s| s.service == "traces-test" && s.trace_id == trace)
        .map(|s| s.span_id.as_slice())
        .collect();
    assert!(
        client_side.contains(request.parent.as_slice()),
        "the node's request span continues the SDK's: {spans:#?}"
    );
    // Followers append, everyone applies, all under raft.propose.
    let appends = named(&spans, "raft.append", &trace);
    let appenders: BTreeSet<u64> = appends
        .iter()
        .map(|s| s.attributes["node_id"].parse().unwrap())
        .collect();
    assert_eq!(appenders.len(), 2, "{appends:#?}");
    assert!(
        !appenders.contains(&leader),
        "the leader appends in raft.propose"
    );
    let applies = named(&spans, "raft.apply", &trace);
    let appliers: BTreeSet<u64> = applies
        .iter()
        .map(|s| s.attributes["node_id"].parse().unwrap())
        .collect();
    assert_eq!(appliers.len(), 3, "{applies:#?}");
    // The proposing node and term are the leader's; each replica's append
    // and apply name the entry's term, the one it was proposed in.
    assert_eq!(propose.attributes["node_id"], leader.to_string());
    assert_eq!(propose.attributes["term"], term.to_string());
    for span in appends.iter().chain(&applies) {
        assert_eq!(span.parent, propose.span_id, "{span:#?}");
        assert_eq!(span.attributes["shard_id"], propose.attributes["shard_id"]);
        assert_eq!(span.attributes["term"], term.to_string(), "{span:#?}");
    }
    // Every span of the trace is parented inside it (one tree).
    let ids: BTreeSet<&[u8]> = spans
        .iter()
        .filter(|s| s.trace_id == trace)
        .map(|s| s.span_id.as_slice())
        .collect();
    for span in spans.iter().filter(|s| s.trace_id == trace) {
        assert!(
            span.parent.is_empty() || ids.contains(span.parent.as_slice()),
            "{span:#?}"
        );
    }

    // Concurrent traced puts to one shard: group commit puts several in
    // one entry, whose raft.propose links the other requests' spans.
    let mut linked = false;
    for round in 0..5 {
        runtime.block_on(async {
            let mut puts = tokio::task::JoinSet::new();
            for i in 0..32 {
                let client = client.clone();
                puts.spawn(async move {
                    let value = format!("v{round}-{i}");
                    client.put("default", b"traced", value.as_bytes()).await
                });
            }
            while let Some(result) = puts.join_next().await {
                result.unwrap().unwrap();
            }
        });
        std::thread::sleep(Duration::from_secs(1));
        let spans = receiver.all();
        linked = spans.iter().any(|p| {
            p.name == "raft.propose"
                && !p.links.is_empty()
                && p.links.iter().all(|l| {
                    spans
                        .iter()
                        .any(|r| r.span_id == *l && r.name == "request" && r.trace_id != p.trace_id)
                })
        });
        if linked {
            break;
        }
    }
    assert!(
        linked,
        "no raft.propose linked the other requests of its batch"
    );

    // An HTTP cache miss through the gateway: gateway span -> SDK span ->
    // node request span, NOT_FOUND.
    let missing = "0".repeat(64);
    let response = http_get(http_cache, &format!("/cas/{missing}"));
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    let spans = receiver.wait("the gateway's miss reaches a node", |spans| {
        spans.iter().any(|s| {
            s.name == "request"
                && s.attributes.get("error_code").map(String::as_str) == Some("NOT_FOUND")
                && spans.iter().any(|g| {
                    g.trace_id == s.trace_id
                        && g.attributes.get("protocol").map(String::as_str) == Some("http_cache")
                })
        })
    });
    let node = spans
        .iter()
        .find(|s| {
            s.name == "request"
                && s.attributes.get("error_code").map(String::as_str) == Some("NOT_FOUND")
                && spans.iter().any(|g| {
                    g.trace_id == s.trace_id
                        && g.attributes.get("protocol").map(String::as_str) == Some("http_cache")
                })
        })
        .unwrap();
    let gateway = spans
        .iter()
        .find(|g| {
            g.trace_id == node.trace_id
                && g.attributes.get("protocol").map(String::as_str) == Some("http_cache")
        })
        .unwrap();
    assert!(gateway.parent.is_empty(), "the gateway starts the trace");
    assert_eq!(gateway.attributes["code"], "404");
    let sdk = spans
        .iter()
        .find(|s| s.span_id == node.parent)
        .expect("the node's span has the SDK's as parent");
    assert!(sdk.name.starts_with("tidepool."), "{sdk:#?}");
    assert_eq!(sdk.parent, gateway.span_id);

    // A failed SDK call: its span names the code, as the node's does.
    let failed = tracing::info_span!(target: "tidepool_test", "failing caller");
    let failed_trace = trace_of(&failed);
    let error = runtime
        .block_on(client.get("default", b"never written").instrument(failed))
        .unwrap_err();
    assert!(error.is_not_found(), "{error}");
    let spans = receiver.wait("the failed get's SDK span", |spans| {
        spans
            .iter()
            .any(|s| s.trace_id == failed_trace && s.name == "tidepool.get")
    });
    let get = spans
        .iter()
        .find(|s| s.trace_id == failed_trace && s.name == "tidepool.get")
        .unwrap();
    assert_eq!(
        get.attributes.get("error_code").map(String::as_str),
        Some("NOT_FOUND"),
        "{get:#?}"
    );

    // A caller that decided not to sample: nothing anywhere.
    let unsampled = unsampled_span();
    let unsampled_trace = trace_of(&unsampled);
    runtime
        .block_on(
            client
                .put("default", b"untraced", b"x")
                .instrument(unsampled),
        )
        .unwrap();
    // Something later is seen, so the export of the unsampled put would
    // have been too.
    runtime
        .block_on(client.put("default", b"after", b"y"))
        .unwrap();
    receiver.wait("a later put", |spans| {
        spans.iter().any(|s| {
            s.name == "tidepool.put" && s.attributes.get("bytes").map(String::as_str) == Some("1")
        })
    });
    std::thread::sleep(Duration::from_secs(2));
    let leaked: Vec<Received> = receiver
        .all()
        .into_iter()
        .filter(|s| s.trace_id == unsampled_trace)
        .collect();
    assert!(leaked.is_empty(), "unsampled spans exported: {leaked:#?}");
    drop(client);
    drop(runtime);
    drop(child);
}

/// The trace id of a span of this process.
fn trace_of(span: &tracing::Span) -> Vec<u8> {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    span.context()
        .span()
        .span_context()
        .trace_id()
        .to_bytes()
        .to_vec()
}

/// A span whose (remote) parent decided not to sample.
fn unsampled_span() -> tracing::Span {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let context = opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
        TraceId::from_bytes(rand::random()),
        SpanId::from_bytes(rand::random()),
        TraceFlags::default(),
        true,
        TraceState::default(),
    ));
    let span = tracing::info_span!(target: "tidepool_test", "unsampled caller");
    span.set_parent(context).unwrap();
    span
}

fn http_get(address: SocketAddr, path: &str) -> String {
    http_get_with(address, path, "")
}

/// [`http_get`] with extra header lines (each ending in CRLF).
fn http_get_with(address: SocketAddr, path: &str, headers: &str) -> String {
    http_request(address, "GET", path, headers, b"")
}

/// One HTTP/1.1 request on a connection of its own; the whole response.
fn http_request(
    address: SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &[u8],
) -> String {
    let mut socket = std::net::TcpStream::connect(address).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        socket,
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    socket.write_all(body).unwrap();
    let mut out = String::new();
    socket.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn a_collector_that_never_answers_holds_no_request() {
    // Accepts connections, reads nothing, answers nothing.
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = hole.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = held.clone();
    std::thread::spawn(move || {
        for socket in hole.incoming().flatten() {
            keep.lock().unwrap().push(socket);
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{address}");
    // Every answered request is logged (at debug) inside its span.
    let (child, banner) = support::start_dev_banner_with(
        dir.path(),
        &[
            "--insecure",
            "--otlp-endpoint",
            &endpoint,
            "--log-format",
            "json",
        ],
        &[("RUST_LOG", "info,tidepool_node::server::blobs=debug")],
        Duration::from_secs(60),
    );
    let url = support::banner_url(&banner);
    let runtime = runtime();
    let slowest = runtime.block_on(async {
        let client = Client::with_config(ClientConfig::new(&[url]))
            .await
            .unwrap();
        let mut slowest = Duration::ZERO;
        for i in 0..300u32 {
            let started = Instant::now();
            client
                .put("default", format!("k{i}").as_bytes(), b"value")
                .await
                .unwrap();
            slowest = slowest.max(started.elapsed());
        }
        slowest
    });
    // An export waits up to 5 s for the collector; a put that waited for
    // one would take that long.
    assert!(
        slowest < Duration::from_secs(4),
        "a put took {slowest:?}: exports held requests"
    );
    assert!(
        !held.lock().unwrap().is_empty(),
        "the exporter did connect to the collector"
    );
    drop(runtime);
    drop(child);
    // Every log line is one JSON object; a line logged inside a request
    // (the access line) carries the ids of the request's trace, and lines
    // outside any trace (the shard owners', whose span only scopes their
    // lines) carry none.
    let log = std::fs::read_to_string(dir.path().join("dev.log")).unwrap();
    let (mut answered, mut traces) = (0, std::collections::HashSet::new());
    for line in log.lines() {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        for field in ["timestamp", "level", "target", "fields"] {
            assert!(value.get(field).is_some(), "{field} missing: {line}");
        }
        let spans: Vec<&str> = value["spans"]
            .as_array()
            .map(|s| s.iter().filter_map(|s| s["name"].as_str()).collect())
            .unwrap_or_default();
        let trace_id = value.get("trace_id").and_then(|v| v.as_str());
        if value["fields"]["message"] == "request answered" {
            let trace_id = trace_id.unwrap_or_else(|| panic!("no trace id: {line}"));
            let span_id = value["span_id"].as_str().unwrap();
            assert_eq!(trace_id.len(), 32, "{line}");
            assert_eq!(span_id.len(), 16, "{line}");
            assert_eq!(spans.last(), Some(&"request"), "{line}");
            traces.insert(trace_id.to_string());
            answered += 1;
        } else if spans == ["shard"] {
            assert!(
                trace_id.is_none(),
                "a shard owner's line in a trace: {line}"
            );
        }
    }
    // Puts and the SDK's own calls (its map, leader lookups) were logged.
    assert!(answered >= 300, "{answered} requests logged:\n{log}");
    assert!(
        traces.len() >= 300,
        "each put is a trace of its own: {}",
        traces.len()
    );
}

/// Export configured by the standard `OTEL_*` variables alone (no flag),
/// and a process sampling none of the traces it starts: requests that come
/// without a sampled `traceparent` leave no span, a request whose caller
/// sampled it is still traced (parent-based) — which also shows export is
/// on in that process — and a sampled write group-committed with
/// unsampled ones is traced through Raft on every replica.
#[test]
fn with_sampling_off_only_callers_sampled_traces_are_exported() {
    let (receiver, collector) = receiver();
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{collector}");
    let service = "sampling-off";
    let (child, banner) = support::start_dev_banner_with(
        dir.path(),
        &["--insecure", "--trace-sampling", "0"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_SERVICE_NAME", service),
        ],
        Duration::from_secs(60),
    );
    let http_cache = support::banner_http_cache(&banner);
    // Requests no caller sampled: the gateway starts their traces, and
    // samples none.
    for i in 0..20 {
        let missing = format!("{i:064x}");
        let response = http_get(http_cache, &format!("/cas/{missing}"));
        assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    }
    // One whose caller sampled it.
    let trace: [u8; 16] = rand::random();
    let parent: [u8; 8] = rand::random();
    let traceparent = format!(
        "traceparent: 00-{}-{}-01\r\n",
        tidepool_client::hex(&trace),
        tidepool_client::hex(&parent)
    );
    let missing = "f".repeat(64);
    let response = http_get_with(http_cache, &format!("/cas/{missing}"), &traceparent);
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    let spans = receiver.wait("the sampled request's spans, gateway and node", |spans| {
        let ours: Vec<&Received> = spans
            .iter()
            .filter(|s| s.service == service && s.trace_id == trace)
            .collect();
        ours.iter().any(|s| s.attributes.contains_key("protocol"))
            && ours
                .iter()
                .any(|s| s.name == "request" && s.attributes.contains_key("node_id"))
    });
    // Writes at once, a few sampled among many that are not: whatever
    // batch a sampled write is group-committed in, and wherever it stands
    // in it, its trace goes through Raft on every replica.
    let mut sampled_writes = Vec::new();
    for round in 0..5 {
        let writers: Vec<_> = (0..17)
            .map(|i| {
                let sampled = i == 8;
                let trace: [u8; 16] = rand::random();
                let header = format!(
                    "traceparent: 00-{}-{}-{}\r\n",
                    tidepool_client::hex(&trace),
                    tidepool_client::hex(&rand::random::<[u8; 8]>()),
                    if sampled { "01" } else { "00" }
                );
                let key = format!("{:064x}", round * 100 + i);
                std::thread::spawn(move || {
                    let response =
                        http_request(http_cache, "PUT", &format!("/ac/{key}"), &header, b"value");
                    assert!(response.starts_with("HTTP/1.1 2"), "{response}");
                    (sampled, trace)
                })
            })
            .collect();
        for writer in writers {
            let (sampled, trace) = writer.join().unwrap();
            if sampled {
                sampled_writes.push(trace);
            }
        }
    }
    for trace in &sampled_writes {
        receiver.wait("a sampled write's spans through Raft", |spans| {
            let count = |name: &str| {
                spans
                    .iter()
                    .filter(|s| s.service == service && s.trace_id == *trace && s.name == name)
                    .count()
            };
            count("raft.propose") == 1 && count("raft.append") == 2 && count("raft.apply") == 3
        });
    }
    // Exports are batched: give any straggler of the unsampled requests
    // time to arrive.
    std::thread::sleep(Duration::from_secs(2));
    let others: Vec<Received> = receiver
        .all()
        .into_iter()
        .filter(|s| {
            s.service == service
                && s.trace_id != trace
                && !sampled_writes.iter().any(|t| s.trace_id == *t)
        })
        .collect();
    assert!(others.is_empty(), "unsampled traces exported: {others:#?}");
    assert!(spans.iter().any(|s| s.service == service));
    drop(child);
}
