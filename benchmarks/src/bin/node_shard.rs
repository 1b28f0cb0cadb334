//! `node-shard`: a 3-replica shard of real nodes — three `tidepool node`
//! servers in this process, each with its own data directory, talking gRPC
//! over loopback — driven by concurrent clients, next to a single engine
//! (the same engine configuration, no Raft, no network) driven the same way
//! in the same run.
//!
//! The shard runs twice per value size, in the same run: plaintext with no
//! credentials (`--insecure`), and as production runs — mutual TLS between
//! the nodes and to the clients, and a bearer token checked on every
//! request — and the ratio of the two is printed.
//!
//! Phases per value size, `--seconds` each: puts of new keys, then
//! linearizable gets of keys written in the put phase (just written, so in
//! the page cache: this measures the serving path, not the disk).
//! Durability is the node default, `synced`: a node put is acknowledged
//! once its entry is fsynced on a majority and applied on the leader; the
//! single engine's puts use `Durability::Synced` (fsynced locally).
//!
//! Tracing (`--trace-pairs N`): the plaintext shard at `--value-bytes`
//! in child processes, N rounds of five variants in rotating order:
//! tracing off as a `tidepool` process runs it (its telemetry installed,
//! logs at `info`, no export), every request traced and exported (100%
//! sampling, or the share `--trace-ratio` gives: each client operation is
//! the root span of a trace that the
//! nodes continue through Raft, exported over OTLP/gRPC to a receiver in
//! this process that counts the spans), the same exporting to a collector
//! that accepts connections and never answers (collector down), the
//! same exporting with no span made by the load generator (traced at the
//! nodes: each request starts its trace at the leader, as one from an
//! untraced client does; the clients' span costs their own machines in a
//! deployment, here it shares the shard's two cores), and no
//! subscriber at all (a floor no `tidepool` process runs at). The medians
//! of traced/off, traced/none, off/none, collector down/off,
//! collector down/traced and traced at the nodes/off are printed, with the CPU seconds of each
//! child and of the receiver (which shares the cores: `--receiver count`,
//! the default, walks the exports' wire format to count spans without
//! building them; `decode` decodes them whole, as a collector does). Child
//! processes, because the tracing subscriber is process-wide.
//!
//! Usage: `cargo run --release -p tidepool-benchmarks --bin node-shard --
//! [--seconds 10] [--clients 32] [--value-bytes 1024,65536]
//! [--dir target/bench-node] [--trace-pairs 3] [--receiver count|decode]`

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use rand::{Rng, SeedableRng as _};
use tidepool_benchmarks::{Latencies, children_cpu_seconds, cpu_seconds, human};
use tidepool_engine::{Durability, Engine};
use tidepool_node::config::{NamespaceSpec, NodeConfig, Peer, StaticCluster, StaticToken};
use tidepool_node::server::{RunningNode, start};
use tidepool_proto::storage_key;
use tidepool_proto::v1::blob_service_client::BlobServiceClient;
use tidepool_proto::v1::node_admin_client::NodeAdminClient;
use tidepool_proto::v1::{
    BlobKind, BlobRef, GetRequest, NodeStatusRequest, PutHeader, PutRequest, ReadConsistency,
    get_response, put_request,
};
use tidepool_security::{Channel, Security, Tls, certs, token};
use tidepool_testkit::free_port;
use tracing::Instrument as _;

#[derive(Debug, Parser)]
struct Args {
    /// Seconds each phase runs.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Concurrent clients (tasks for the shard, threads for the engine).
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Value sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,65536")]
    value_bytes: Vec<usize>,
    /// Scratch directory (emptied first).
    #[arg(long, default_value = "target/bench-node")]
    dir: PathBuf,
    /// Only compare tracing exported at 100% with tracing off (and with no
    /// subscriber): this many rounds of child processes (plaintext shard,
    /// `--value-bytes`).
    #[arg(long)]
    trace_pairs: Option<usize>,
    /// The span receiver of `--trace-pairs`: `count` walks each export's
    /// wire format to the spans and counts them without building them (it
    /// takes as little as it can of the cores the shard shares with it);
    /// `decode` decodes every export whole, as a collector would.
    #[arg(long, default_value = "count", value_parser = ["count", "decode"])]
    receiver: String,
    /// The share of client operations whose traces are sampled in the
    /// exporting variants of `--trace-pairs` (1: every one; production
    /// samples a few percent).
    #[arg(long, default_value_t = 1.0)]
    trace_ratio: f64,
    /// (Child process) one plaintext shard run, exporting every request's
    /// trace to this OTLP endpoint; `off`: telemetry installed, no export;
    /// `none`: no subscriber.
    #[arg(long, hide = true)]
    trace_child: Option<String>,
}

/// One measured phase.
struct Run {
    system: &'static str,
    op: &'static str,
    value_bytes: usize,
    ops: u64,
    elapsed: Duration,
    latencies: Latencies,
    /// CPU seconds this process used during the phase (the shard's
    /// phases only; the machine runs nothing else of the benchmark's).
    cpu_s: f64,
}

impl Run {
    /// CPU microseconds per operation.
    fn cpu_us_per_op(&self) -> f64 {
        self.cpu_s * 1e6 / self.ops.max(1) as f64
    }

    fn row(&mut self, clients: usize) -> String {
        let rate = self.ops as f64 / self.elapsed.as_secs_f64();
        format!(
            "| {} | {} | {} B | {clients} | {rate:.0} | {:.1} | {} | {} |",
            self.system,
            self.op,
            self.value_bytes,
            rate * self.value_bytes as f64 / f64::from(1 << 20),
            human(self.latencies.quantile(0.5)),
            human(self.latencies.quantile(0.99)),
        )
    }
}

/// TLS material and a token for a secured shard (`None`: plaintext).
struct Secured {
    tls_dir: PathBuf,
    token: String,
}

impl Secured {
    fn make(dir: &Path) -> anyhow::Result<Secured> {
        let tls_dir = dir.join("tls");
        certs::ensure_dev(&tls_dir, 3)?;
        Ok(Secured {
            tls_dir,
            token: token::generate(),
        })
    }

    fn security(&self, base: &str, token: bool) -> anyhow::Result<Security> {
        Ok(Security {
            tls: Some(Tls::load(certs::files(&self.tls_dir, base))?),
            token: token.then(|| self.token.clone()),
        })
    }
}

fn secure(config: &mut NodeConfig, secured: &Secured) {
    config.tls = Some(certs::files(
        &secured.tls_dir,
        &format!("node-{}", config.node_id),
    ));
    if let Some(cluster) = &mut config.cluster {
        cluster.tokens = vec![StaticToken {
            name: "bench".into(),
            sha256: token::hash(&secured.token)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            admin: false,
            grants: vec!["bench=read,write".into()],
        }];
    }
}

fn node_config(id: u64, dir: &Path, ports: &[u16]) -> NodeConfig {
    let mut config = NodeConfig::new(id);
    config.listen = format!("127.0.0.1:{}", ports[id as usize - 1])
        .parse()
        .expect("address");
    config.data_dir = dir.join(format!("node-{id}"));
    config.cluster = Some(StaticCluster {
        shards: 1,
        replicas: vec![1, 2, 3],
        peers: (1..=3)
            .map(|id| Peer {
                id,
                address: format!("http://127.0.0.1:{}", ports[id as usize - 1]),
            })
            .collect(),
        namespaces: vec![NamespaceSpec {
            name: "bench".into(),
            id: 1,
            content_addressed: false,
            retain_epochs: None,
        }],
        tokens: Vec::new(),
    });
    config
}

fn key_of(value_bytes: usize, client: usize, n: u64) -> Vec<u8> {
    format!("bench/{value_bytes}/{client}/{n}").into_bytes()
}

/// The single engine: `clients` threads putting, then getting.
fn engine_runs(args: &Args, value_bytes: usize) -> anyhow::Result<Vec<Run>> {
    let dir = args.dir.join("engine");
    let _ = std::fs::remove_dir_all(&dir);
    let config = node_config(1, &args.dir, &[0, 0, 0]).engine_config(dir.clone());
    let engine = Engine::open(config).context("open engine")?;
    let space = engine.key_space(tidepool_node::replica::BLOB_KEY_SPACE)?;
    let duration = Duration::from_secs(args.seconds);
    let value = vec![0xA5u8; value_bytes];
    let put = threaded_run(
        "put",
        value_bytes,
        args.clients,
        duration,
        |client, n, _| {
            let key = storage_key(1, &key_of(value_bytes, client, n));
            engine
                .put(space, &key, &value, Durability::Synced)
                .expect("put");
        },
    );
    let written = put.per_client.clone();
    let get = threaded_run(
        "get",
        value_bytes,
        args.clients,
        duration,
        |client, n, rng| {
            let owner = (client + n as usize) % written.len();
            let index = rng.random_range(0..written[owner].max(1));
            let key = storage_key(1, &key_of(value_bytes, owner, index));
            let value = engine.get(space, &key).expect("get");
            assert!(value.is_some_and(|v| v.len() == value_bytes));
        },
    );
    engine.close()?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(vec![put.run, get.run])
}

/// A single-engine phase and how many operations each client did.
struct Threaded {
    run: Run,
    per_client: Vec<u64>,
}

/// Runs `op(client, n, rng)` in a loop on `clients` threads for `duration`.
fn threaded_run(
    name: &'static str,
    value_bytes: usize,
    clients: usize,
    duration: Duration,
    op: impl Fn(usize, u64, &mut rand::rngs::ThreadRng) + Sync,
) -> Threaded {
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let results: Vec<(u64, Latencies)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..clients)
            .map(|client| {
                let (stop, op) = (&stop, &op);
                s.spawn(move || {
                    let mut rng = rand::rng();
                    let mut latencies = Latencies::default();
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        op(client, n, &mut rng);
                        latencies.record(t.elapsed());
                        n += 1;
                    }
                    (n, latencies)
                })
            })
            .collect();
        std::thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
        workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .collect()
    });
    let mut run = Run {
        system: "single engine",
        op: name,
        value_bytes,
        ops: 0,
        elapsed: start.elapsed(),
        latencies: Latencies::default(),
        cpu_s: 0.0,
    };
    let mut per_client = Vec::new();
    for (n, latencies) in results {
        run.ops += n;
        run.latencies.merge(latencies);
        per_client.push(n);
    }
    Threaded { run, per_client }
}

fn blob(key: Vec<u8>) -> Option<BlobRef> {
    Some(BlobRef {
        namespace: "bench".into(),
        key,
    })
}

async fn put_once(
    client: &mut BlobServiceClient<Channel>,
    key: Vec<u8>,
    value: &[u8],
) -> Result<(), tonic::Status> {
    let messages = vec![
        PutRequest {
            msg: Some(put_request::Msg::Header(PutHeader {
                blob: blob(key),
                size: value.len() as u64,
                kind: BlobKind::Data as i32,
                ..PutHeader::default()
            })),
        },
        PutRequest {
            msg: Some(put_request::Msg::Data(value.to_vec().into())),
        },
    ];
    client.put(tokio_stream::iter(messages)).await.map(|_| ())
}

async fn get_once(
    client: &mut BlobServiceClient<Channel>,
    key: Vec<u8>,
) -> Result<usize, tonic::Status> {
    let mut stream = client
        .get(GetRequest {
            blob: blob(key),
            consistency: ReadConsistency::Linearizable as i32,
            ..GetRequest::default()
        })
        .await?
        .into_inner();
    let mut len = 0;
    while let Some(message) = stream.message().await? {
        if let Some(get_response::Msg::Data(data)) = message.msg {
            len += data.len();
        }
    }
    Ok(len)
}

/// The shard's leader, once there is one (asked as a coordinator would).
async fn leader(urls: &BTreeMap<u64, String>, admin: &Security) -> anyhow::Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        for (id, url) in urls {
            let mut admin = NodeAdminClient::new(admin.connect(&admin.endpoint(url)?).await?);
            let status = admin.status(NodeStatusRequest {}).await?.into_inner();
            if status.replicas.iter().any(|r| r.is_leader) {
                return Ok(*id);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("no leader within 30 s")
}

/// The 3-replica shard: `clients` tasks on the leader, putting then
/// getting; with `tls`, every connection is mutual TLS and every request
/// carries a token the nodes check.
async fn shard_runs(args: &Args, value_bytes: usize, tls: bool) -> anyhow::Result<Vec<Run>> {
    let dir = args.dir.join("shard");
    let _ = std::fs::remove_dir_all(&dir);
    let secured = if tls {
        Some(Secured::make(&dir)?)
    } else {
        None
    };
    let ports = [free_port(), free_port(), free_port()];
    let mut nodes: Vec<RunningNode> = Vec::new();
    for id in 1..=3 {
        let mut config = node_config(id, &dir, &ports);
        if let Some(secured) = &secured {
            secure(&mut config, secured);
        }
        nodes.push(start(config).await?);
    }
    let urls: BTreeMap<u64, String> = (1..=3)
        .map(|id| (id, format!("http://127.0.0.1:{}", ports[id as usize - 1])))
        .collect();
    let (admin, client) = match &secured {
        Some(s) => (
            s.security("coordinator", false)?,
            s.security("client", true)?,
        ),
        None => (Security::insecure(), Security::insecure()),
    };
    let leader = leader(&urls, &admin).await?;
    // A few HTTP/2 connections shared by the clients, as an SDK would pool.
    let mut channels = Vec::new();
    for _ in 0..4 {
        channels.push(client.connect(&client.endpoint(&urls[&leader])?).await?);
    }
    let duration = Duration::from_secs(args.seconds);
    let mut runs = Vec::new();
    let mut written = vec![0u64; args.clients];
    for op in ["put", "get"] {
        let stop = Arc::new(AtomicBool::new(false));
        let written_now = Arc::new(written.clone());
        let start = Instant::now();
        let cpu_start = cpu_seconds(std::process::id());
        let tasks: Vec<_> = (0..args.clients)
            .map(|client| {
                let mut grpc = BlobServiceClient::new(channels[client % channels.len()].clone())
                    .max_decoding_message_size(64 << 20)
                    .max_encoding_message_size(64 << 20);
                let (stop, written) = (stop.clone(), written_now.clone());
                // The load generator's own span, unless only the nodes
                // trace (`nodes=`).
                let traced = tidepool_security::trace_context::exporting()
                    && !args
                        .trace_child
                        .as_deref()
                        .is_some_and(|c| c.starts_with(NODES_PREFIX));
                tokio::spawn(async move {
                    let value = vec![0x5Au8; value_bytes];
                    let mut latencies = Latencies::default();
                    let mut n = 0u64;
                    let mut rng = rand::rngs::SmallRng::from_os_rng();
                    while !stop.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        // With export on, each operation is the root of a
                        // sampled trace (as an SDK call would be).
                        let span = if traced {
                            tracing::info_span!(target: "tidepool_bench", "bench.op", op)
                        } else {
                            tracing::Span::none()
                        };
                        if op == "put" {
                            put_once(&mut grpc, key_of(value_bytes, client, n), &value)
                                .instrument(span)
                                .await?;
                        } else {
                            let owner = (client + n as usize) % written.len();
                            let key = key_of(
                                value_bytes,
                                owner,
                                rng.random_range(0..written[owner].max(1)),
                            );
                            let len = get_once(&mut grpc, key).instrument(span).await?;
                            assert_eq!(len, value_bytes);
                        }
                        latencies.record(t.elapsed());
                        n += 1;
                    }
                    Ok::<_, tonic::Status>((n, latencies))
                })
            })
            .collect();
        tokio::time::sleep(duration).await;
        stop.store(true, Ordering::Relaxed);
        let mut run = Run {
            system: if tls {
                "3-replica shard, TLS + token"
            } else {
                "3-replica shard, plaintext"
            },
            op,
            value_bytes,
            ops: 0,
            elapsed: Duration::ZERO,
            latencies: Latencies::default(),
            cpu_s: 0.0,
        };
        for (client, task) in tasks.into_iter().enumerate() {
            let (n, latencies) = task
                .await?
                .with_context(|| format!("{op} client {client}"))?;
            if op == "put" {
                written[client] = n;
            }
            run.ops += n;
            run.latencies.merge(latencies);
        }
        run.elapsed = start.elapsed();
        run.cpu_s = cpu_seconds(std::process::id()) - cpu_start;
        runs.push(run);
    }
    for node in nodes {
        node.stop().await?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(runs)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(endpoint) = &args.trace_child {
        return trace_child(&args, endpoint);
    }
    if let Some(pairs) = args.trace_pairs {
        return tracing_compare(&args, pairs);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    println!(
        "node-shard: {} clients, {} s per phase, durability synced (majority fsync before ack); \
         gets are linearizable and of keys just written (page cache warm)",
        args.clients, args.seconds
    );
    println!("| system | op | value | clients | ops/s | MiB/s | p50 | p99 |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut ratios = Vec::new();
    for &value_bytes in &args.value_bytes {
        for mut run in engine_runs(&args, value_bytes)? {
            println!("{}", run.row(args.clients));
        }
        let mut rates = Vec::new();
        for tls in [false, true] {
            for mut run in runtime.block_on(shard_runs(&args, value_bytes, tls))? {
                println!("{}", run.row(args.clients));
                rates.push(run.ops as f64 / run.elapsed.as_secs_f64());
            }
        }
        // rates: plaintext put, get; TLS put, get.
        ratios.push(format!(
            "| {value_bytes} B | {:.2} | {:.2} |",
            rates[2] / rates[0],
            rates[3] / rates[1]
        ));
    }
    println!();
    println!("TLS + token / plaintext, same run:");
    println!();
    println!("| value | put | get |");
    println!("|---|---|---|");
    for row in ratios {
        println!("{row}");
    }
    Ok(())
}

/// A child process: one plaintext shard run with tracing as `variant`
/// says (see [`Variant`]); prints its rows and then
/// `RESULT <put/s> <get/s>`.
fn trace_child(args: &Args, variant: &str) -> anyhow::Result<()> {
    // The log filter a `tidepool` process starts with.
    let config = |otlp_endpoint: Option<String>| tidepool_telemetry::TelemetryConfig {
        service_name: "node-shard".into(),
        sampling_ratio: otlp_endpoint.as_ref().map(|_| args.trace_ratio),
        otlp_endpoint,
        default_filter: "info".into(),
        ..Default::default()
    };
    let _telemetry = match Variant::of(variant) {
        Variant::NoSubscriber => None,
        Variant::Off => Some(tidepool_telemetry::init(&config(None))?),
        Variant::Traced => Some(tidepool_telemetry::init(&config(Some(variant.into())))?),
        Variant::CollectorDown => {
            let endpoint = variant.trim_start_matches(DOWN_PREFIX);
            Some(tidepool_telemetry::init(&config(Some(endpoint.into())))?)
        }
        Variant::NodesTraced => {
            let endpoint = variant.trim_start_matches(NODES_PREFIX);
            Some(tidepool_telemetry::init(&config(Some(endpoint.into())))?)
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut runs = runtime.block_on(shard_runs(args, args.value_bytes[0], false))?;
    let mut results = Vec::new();
    for run in &mut runs {
        println!("{}", run.row(args.clients));
        results.push(run.ops as f64 / run.elapsed.as_secs_f64());
    }
    for run in &runs {
        results.push(run.cpu_us_per_op());
    }
    let results: Vec<String> = results.iter().map(f64::to_string).collect();
    println!("RESULT {}", results.join(" "));
    Ok(())
}

/// What a tracing child runs with (`--trace-child`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    /// `none`: no subscriber at all; every span and event is a no-op (no
    /// `tidepool` process runs like this).
    NoSubscriber,
    /// `off`: the telemetry a `tidepool` process installs with export off
    /// (logs at `info`, no OpenTelemetry layer): tracing off in production.
    Off,
    /// An OTLP endpoint: the same, exporting every request's trace there
    /// (100% sampling; `--trace-ratio` of them otherwise).
    Traced,
    /// `down=` and an endpoint: exporting requests' traces (as `Traced`) to
    /// a collector that accepts connections and never answers — what a
    /// node does while its collector hangs.
    CollectorDown,
    /// `nodes=` and an endpoint: exporting as `Traced`, but the load
    /// generator makes no span of its own: each request reaches the leader
    /// without a trace context and starts its trace there (sampled by the
    /// nodes' ratio). What tracing costs the nodes alone; in a deployment
    /// the clients' spans are made on the clients' machines.
    NodesTraced,
}

/// The argument of a [`Variant::CollectorDown`] child: this, then the
/// endpoint.
const DOWN_PREFIX: &str = "down=";

/// The argument of a [`Variant::NodesTraced`] child: this, then the
/// endpoint.
const NODES_PREFIX: &str = "nodes=";

impl Variant {
    fn of(argument: &str) -> Variant {
        match argument {
            "none" => Variant::NoSubscriber,
            "off" => Variant::Off,
            _ if argument.starts_with(DOWN_PREFIX) => Variant::CollectorDown,
            _ if argument.starts_with(NODES_PREFIX) => Variant::NodesTraced,
            _ => Variant::Traced,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Variant::NoSubscriber => "no subscriber",
            Variant::Off => "off",
            Variant::Traced => "traced",
            Variant::CollectorDown => "collector down",
            Variant::NodesTraced => "traced at the nodes",
        }
    }
}

/// Counts the spans exported to it.
#[derive(Clone, Default)]
struct SpanCounter(Arc<std::sync::atomic::AtomicU64>);

#[tonic::async_trait]
impl opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceService
    for SpanCounter
{
    async fn export(
        &self,
        request: tonic::Request<
            opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest,
        >,
    ) -> Result<
        tonic::Response<
            opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse,
        >,
        tonic::Status,
    > {
        let spans: usize = request
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.0.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(Default::default()))
    }
}

/// What the counting receiver reads of an OTLP `ExportTraceServiceRequest`:
/// `resource_spans` (1) → `scope_spans` (2) → `spans` (2). Every other
/// field, and every field of a span, is skipped unread.
#[derive(Clone, PartialEq, prost::Message)]
struct SpanTally {
    #[prost(message, repeated, tag = "1")]
    resource_spans: Vec<ResourceTally>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ResourceTally {
    #[prost(message, repeated, tag = "2")]
    scope_spans: Vec<ScopeTally>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ScopeTally {
    #[prost(message, repeated, tag = "2")]
    spans: Vec<Skipped>,
}

/// A message whose fields are all skipped.
#[derive(Clone, PartialEq, prost::Message)]
struct Skipped {}

/// The OTLP trace service, counting the spans of each export from
/// [`SpanTally`] (tonic's unary machinery with a codec for that type; the
/// generated server would decode every span whole).
#[derive(Clone)]
struct TallyService(Arc<std::sync::atomic::AtomicU64>);

impl tonic::server::NamedService for TallyService {
    const NAME: &'static str = "opentelemetry.proto.collector.trace.v1.TraceService";
}

type ExportResponse = opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;

impl tower::Service<http::Request<tonic::body::Body>> for TallyService {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let counter = self.0.clone();
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<ExportResponse, SpanTally>::default();
            let mut grpc = tonic::server::Grpc::new(codec).max_decoding_message_size(64 << 20);
            let count = tower::service_fn(move |export: tonic::Request<SpanTally>| {
                let spans: usize = export
                    .get_ref()
                    .resource_spans
                    .iter()
                    .flat_map(|r| &r.scope_spans)
                    .map(|s| s.spans.len())
                    .sum();
                counter.fetch_add(spans as u64, Ordering::Relaxed);
                std::future::ready(Ok::<_, tonic::Status>(tonic::Response::new(
                    ExportResponse::default(),
                )))
            });
            Ok(grpc.unary(count, request).await)
        })
    }
}

/// What one child run measured: operations a second and CPU microseconds
/// per operation, puts then gets.
#[derive(Clone, Copy, Debug)]
struct ChildResult {
    rates: [f64; 2],
    cpu_us: [f64; 2],
}

/// One child run.
fn child_run(args: &Args, endpoint: &str) -> anyhow::Result<ChildResult> {
    let output = std::process::Command::new(std::env::current_exe()?)
        .arg("--seconds")
        .arg(args.seconds.to_string())
        .arg("--clients")
        .arg(args.clients.to_string())
        .arg("--value-bytes")
        .arg(args.value_bytes[0].to_string())
        .arg("--dir")
        .arg(&args.dir)
        .arg("--trace-ratio")
        .arg(args.trace_ratio.to_string())
        .arg("--trace-child")
        .arg(endpoint)
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "child failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    for line in stdout.lines().filter(|l| l.starts_with('|')) {
        println!(
            "{} (tracing {})",
            line.trim_end(),
            Variant::of(endpoint).label()
        );
    }
    let result = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .context("no RESULT line")?;
    let numbers: Vec<f64> = result
        .split_whitespace()
        .map(str::parse::<f64>)
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad RESULT line {result:?}"))?;
    let [put, get, put_cpu, get_cpu] = numbers[..] else {
        bail!("bad RESULT line {result:?}");
    };
    Ok(ChildResult {
        rates: [put, get],
        cpu_us: [put_cpu, get_cpu],
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Tracing exported at 100% next to tracing off, `pairs` times.
fn tracing_compare(args: &Args, pairs: usize) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let counter = SpanCounter::default();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    // A collector that accepts connections and never reads or answers.
    let hole = std::net::TcpListener::bind("127.0.0.1:0")?;
    let down = format!("{DOWN_PREFIX}http://{}", hole.local_addr()?);
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for socket in hole.incoming().flatten() {
            held.push(socket);
        }
    });
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let mut server = tonic::transport::Server::builder();
    if args.receiver == "decode" {
        let service = counter.clone();
        runtime.spawn(async move {
            let _ = server
                .add_service(
                    opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceServiceServer::new(service)
                        .max_decoding_message_size(64 << 20),
                )
                .serve_with_incoming(incoming)
                .await;
        });
    } else {
        let service = TallyService(counter.0.clone());
        runtime.spawn(async move {
            let _ = server
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
    }
    println!(
        "node-shard tracing: 3-replica shard (plaintext), {} B values, {} clients, {} s per phase; \
         traced = every operation the root of a sampled trace, exported over OTLP/gRPC to a \
         span receiver in the parent process ({})",
        args.value_bytes[0],
        args.clients,
        args.seconds,
        if args.receiver == "decode" {
            "decoding every export whole"
        } else {
            "counting spans without decoding them"
        }
    );
    println!("| system | op | value | clients | ops/s | MiB/s | p50 | p99 |");
    println!("|---|---|---|---|---|---|---|---|");
    // Per pair of variants — traced/off, traced/none, off/none, collector
    // down/off and collector down/traced (exports that never complete must
    // not slow requests more than exporting does) — the throughput ratios
    // and the CPU-per-operation ratios, puts then gets.
    let comparisons = [
        (Variant::Traced, Variant::Off),
        (Variant::Traced, Variant::NoSubscriber),
        (Variant::Off, Variant::NoSubscriber),
        (Variant::CollectorDown, Variant::Off),
        (Variant::CollectorDown, Variant::Traced),
        (Variant::NodesTraced, Variant::Off),
    ];
    let mut ratios: Vec<[Vec<f64>; 4]> = vec![Default::default(); comparisons.len()];
    for round in 0..pairs {
        // Rotate which runs first, so drift (page cache, disk) does not
        // favour one variant.
        let nodes = format!("{NODES_PREFIX}{endpoint}");
        let mut order = [
            "none",
            "off",
            endpoint.as_str(),
            down.as_str(),
            nodes.as_str(),
        ];
        let variants = order.len();
        order.rotate_left(round % variants);
        let mut results = BTreeMap::new();
        for argument in order {
            let before = counter.0.load(Ordering::Relaxed);
            let cpu_before = (cpu_seconds(std::process::id()), children_cpu_seconds());
            let result = child_run(args, argument)?;
            // Spans still queued in the child are flushed when it exits.
            std::thread::sleep(Duration::from_secs(1));
            let spans = counter.0.load(Ordering::Relaxed) - before;
            // The receiver shares the machine's cores with the child (the
            // shard and its clients): what each used, CPU seconds.
            let variant = Variant::of(argument);
            println!(
                "  tracing {}: child (shard + clients) {:.1} CPU s ({:.0} µs a put, {:.0} µs a get), \
                 receiver {:.1} CPU s, spans exported {spans}",
                variant.label(),
                children_cpu_seconds() - cpu_before.1,
                result.cpu_us[0],
                result.cpu_us[1],
                cpu_seconds(std::process::id()) - cpu_before.0
            );
            results.insert(variant, result);
        }
        let mut line = format!("round {}:", round + 1);
        for ((a, b), series) in comparisons.iter().zip(ratios.iter_mut()) {
            let (a, b, label) = (
                results[a],
                results[b],
                format!("{}/{}", a.label(), b.label()),
            );
            let round_ratios = [
                a.rates[0] / b.rates[0],
                a.rates[1] / b.rates[1],
                a.cpu_us[0] / b.cpu_us[0],
                a.cpu_us[1] / b.cpu_us[1],
            ];
            for (series, ratio) in series.iter_mut().zip(round_ratios) {
                series.push(ratio);
            }
            line += &format!(
                " {label} put {:.2}, get {:.2} (CPU/op {:.2}, {:.2});",
                round_ratios[0], round_ratios[1], round_ratios[2], round_ratios[3]
            );
        }
        println!("{}", line.trim_end_matches(';'));
    }
    println!();
    println!("median of {pairs} rounds, throughput and CPU per operation:");
    for ((a, b), series) in comparisons.iter().zip(ratios) {
        let [puts, gets, put_cpu, get_cpu] = series.map(median);
        println!(
            "  {}/{}: put {puts:.2}, get {gets:.2}; CPU per put {put_cpu:.2}, per get {get_cpu:.2}",
            a.label(),
            b.label(),
        );
    }
    Ok(())
}
