//! `tidepool`: the server binary. Composes the node and coordinator libraries
//! (which never depend on each other) behind three subcommands.
//!
//! `tidepool node` runs a storage node and `tidepool coordinator` a
//! coordinator, each from a TOML file (`--config`) and/or flags (flags
//! win); see `--help` and the README. `tidepool dev` runs a coordinator
//! (embedded metadata store) and three nodes in one process on localhost:
//! what `make run` starts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};

mod kubernetes;
use tidepool_coordinator::CoordinatorConfig;
use tidepool_node::config::{CoordinatorLink, NamespaceSpec, NodeConfig, Peer, StaticCluster};

/// Tidepool, a distributed replicated blob store.
#[derive(Debug, Parser)]
#[command(name = "tidepool", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines: `text`, or `json` (one object per line, with the trace
    /// and span ids of the request a line belongs to).
    #[arg(long, global = true, default_value = "text")]
    log_format: tidepool_telemetry::LogFormat,
    /// Export traces to this OTLP/gRPC collector (e.g.
    /// `http://127.0.0.1:4317`). Default: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
    /// or `OTEL_EXPORTER_OTLP_ENDPOINT`; neither: no export.
    /// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off.
    #[arg(long, global = true)]
    otlp_endpoint: Option<String>,
    /// Probability (0..=1) of sampling a trace this process starts; a
    /// caller's sampled trace is always followed. Default:
    /// `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`, else every trace.
    #[arg(long, global = true)]
    trace_sampling: Option<f64>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a storage node.
    Node(Box<NodeArgs>),
    /// Run a coordinator.
    Coordinator(Box<CoordinatorArgs>),
    /// Run a coordinator and three nodes in one process (local development).
    Dev(DevArgs),
    /// Serve the build-cache protocols (REAPI v2 + ByteStream over gRPC,
    /// the HTTP cache protocol) on top of a cluster.
    Gateway(Box<GatewayArgs>),
    /// Make a cluster's CA and certificates.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// Before a node process stops (a Kubernetes pre-stop hook): if the
    /// node leaves the cluster for good, wait until it is drained.
    PreStop(PreStopArgs),
    /// What the Helm chart runs inside Kubernetes.
    #[command(subcommand)]
    Kubernetes(KubernetesCommand),
}

/// Settings of `tidepool pre-stop`.
#[derive(Debug, Args)]
struct PreStopArgs {
    /// The node's data directory (where its id is recorded).
    #[arg(long)]
    data_dir: PathBuf,
    /// A coordinator, `https://host:port` (repeat for several).
    #[arg(long = "coordinator", value_name = "URL", required = true)]
    coordinators: Vec<String>,
    /// Stop anyway when no coordinator answered for this long, seconds
    /// (once a drain has begun it is waited for without bound).
    #[arg(long, default_value_t = 20)]
    undecided_s: u64,
    /// A restart that would leave shards without a majority (another of
    /// their members is down) waits this long for it, seconds (within the
    /// pod's termination grace period).
    #[arg(long, default_value_t = 300)]
    hold_quorum_s: u64,
    #[command(flatten)]
    tls: TlsArgs,
}

/// `tidepool kubernetes`.
#[derive(Debug, Subcommand)]
enum KubernetesCommand {
    /// Make the Secrets a cluster needs when they are absent: the CA, the
    /// bootstrap admin token, client certificates (the chart's setup Job).
    Setup {
        /// Namespace of the Secrets.
        #[arg(long)]
        namespace: String,
        /// The CA Secret.
        #[arg(long)]
        ca_secret: String,
        /// Key of the CA certificate in it.
        #[arg(long, default_value = "ca.pem")]
        ca_cert_key: String,
        /// Key of the CA private key in it (PKCS#8 PEM).
        #[arg(long, default_value = "ca-key.pem")]
        ca_key_key: String,
        /// Use the CA Secret as it is; fail when it is absent.
        #[arg(long)]
        existing_ca: bool,
        /// Secret of the bootstrap admin token (key `token`).
        #[arg(long)]
        token_secret: Option<String>,
        /// A client certificate Secret, `NAME=SECRET` (repeat).
        #[arg(long = "client", value_name = "NAME=SECRET")]
        clients: Vec<String>,
        /// Label of the Secrets made, `KEY=VALUE` (repeat).
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
    },
}

/// `tidepool certs`: the material `--tls-*` takes, made with rcgen. Every
/// certificate names its holder as `tidepool://<kind>/<name>`; nodes and
/// coordinators also serve under the `--host` names.
#[derive(Debug, Subcommand)]
enum CertsCommand {
    /// Make a CA: `<dir>/ca.pem` and `<dir>/ca-key.pem` (keep the key
    /// secret; only `ca.pem` is distributed).
    Ca {
        /// Where to write.
        #[arg(long)]
        dir: PathBuf,
        /// The cluster's name, in the CA's subject.
        #[arg(long, default_value = "tidepool")]
        name: String,
    },
    /// Issue a certificate signed by `<ca-dir>/ca.pem`: `<dir>/<out>.pem`
    /// and `<dir>/<out>-key.pem`.
    Issue {
        /// Where the certificate is written (and the CA read from, unless
        /// `--ca-dir` says otherwise).
        #[arg(long)]
        dir: PathBuf,
        /// Directory holding `ca.pem` and `ca-key.pem` (default: `--dir`).
        #[arg(long)]
        ca_dir: Option<PathBuf>,
        /// `node`, `coordinator`, `client`, or `server` (a TLS server
        /// outside Tidepool, such as etcd: no rights in Tidepool).
        kind: String,
        /// The holder's name (a node's is bound to its id at first
        /// registration).
        name: String,
        /// DNS name or IP address it serves under (repeat).
        #[arg(long = "host")]
        hosts: Vec<String>,
        /// File base name (default `<kind>-<name>`).
        #[arg(long)]
        out: Option<String>,
        /// Validity in days.
        #[arg(long, default_value_t = 365)]
        days: u64,
    },
}

/// TLS material flags shared by `node` and `coordinator`.
#[derive(Debug, Args)]
struct TlsArgs {
    /// PEM certificate chain of this process (re-read when it changes).
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// PEM private key.
    #[arg(long, requires_all = ["tls_cert", "tls_ca"])]
    tls_key: Option<PathBuf>,
    /// PEM bundle of the cluster's CA.
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// Run without TLS: plaintext, and every caller may call every method
    /// (development and tests only).
    #[arg(long, conflicts_with = "tls_cert")]
    insecure: bool,
}

impl TlsArgs {
    fn files(&self) -> Option<tidepool_security::TlsFiles> {
        Some(tidepool_security::TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            ca: self.tls_ca.clone()?,
        })
    }

    /// The TLS files to run with, or an error if there are none and
    /// `--insecure` was not given.
    fn require(
        &self,
        configured: Option<tidepool_security::TlsFiles>,
        insecure_configured: bool,
    ) -> anyhow::Result<Option<tidepool_security::TlsFiles>> {
        match self.files().or(configured) {
            Some(files) => Ok(Some(files)),
            None if self.insecure || insecure_configured => {
                tracing::warn!(
                    "running INSECURE (--insecure): no TLS, no authentication; never expose this process to an untrusted network"
                );
                Ok(None)
            }
            None => bail!(
                "no TLS material: give --tls-cert, --tls-key and --tls-ca (or [tls] in the config file; `tidepool certs` makes them), or --insecure to run without TLS"
            ),
        }
    }
}

/// Settings of `tidepool node`; each flag overrides the config file.
#[derive(Debug, Args)]
struct NodeArgs {
    /// TOML configuration file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Node id (required without a config file).
    #[arg(long)]
    node_id: Option<u64>,
    /// gRPC listen address.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// URL other nodes and clients use to reach this node.
    #[arg(long)]
    advertise: Option<String>,
    /// Data directory.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Prometheus metrics listen address.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// A fixed cluster's peer, `ID=URL` (repeat for each node, this one
    /// included).
    #[arg(long = "peer", value_name = "ID=URL")]
    peers: Vec<String>,
    /// A fixed cluster's shard count.
    #[arg(long)]
    shards: Option<u32>,
    /// A fixed cluster's replica nodes, comma-separated ids (default: every
    /// peer).
    #[arg(long, value_delimiter = ',')]
    replicas: Vec<u64>,
    /// A fixed cluster's namespace, `NAME=ID`; `:cas` makes it
    /// content-addressed, `:retain=EPOCHS` expires its blobs that many
    /// epochs after their last write (default: durable). Default:
    /// `default=1`.
    #[arg(long = "namespace", value_name = "NAME=ID[:cas][:retain=EPOCHS]")]
    namespaces: Vec<String>,
    /// A coordinator to register with, `http://host:port` (repeat for
    /// several); instead of a fixed cluster. The node id is then optional:
    /// the coordinator assigns one and the data directory keeps it.
    #[arg(long = "coordinator", value_name = "URL")]
    coordinators: Vec<String>,
    /// Failure-domain label reported to the coordinator.
    #[arg(long)]
    zone: Option<String>,
    /// Disk bytes offered to the cluster (default: the data volume's size).
    #[arg(long)]
    capacity_bytes: Option<u64>,
    /// Send Raft traffic for peer ID to URL instead of the map's address
    /// (repeat per peer).
    #[arg(long = "peer-address", value_name = "ID=URL")]
    peer_addresses: Vec<String>,
    #[command(flatten)]
    tls: TlsArgs,
}

/// Settings of `tidepool dev`.
#[derive(Debug, Args)]
struct DevArgs {
    /// Where the metadata and the nodes' data live (kept across restarts).
    #[arg(long, default_value = "tidepool-dev")]
    data_dir: PathBuf,
    /// Coordinator port; the nodes take the next ones, the gateway and
    /// metrics up to 94 above it (0: any free ports).
    #[arg(long, default_value_t = 7400, value_parser = clap::value_parser!(u16).range(0..=65_441))]
    port: u16,
    /// Shards of the cluster when it is created [default: 4]; a cluster
    /// that exists keeps its own (it grows by splits).
    #[arg(long)]
    shards: Option<u32>,
    /// Split a shard whose values pass this many MiB (0: never).
    #[arg(long, default_value_t = tidepool_coordinator::config::DEFAULT_SPLIT_MIB)]
    split_mib: u64,
    /// Split a shard whose leader serves more than this many requests per
    /// second for a minute (0: never split by load).
    #[arg(long, default_value_t = tidepool_coordinator::config::DEFAULT_SPLIT_RPS)]
    split_rps: u64,
    /// Without TLS and tokens (plaintext; every caller may do anything).
    #[arg(long)]
    insecure: bool,
    /// What the nodes' writes wait for unless a request asks for more
    /// (`raft.durability`): `synced` (fsync on a majority) or `buffered`
    /// (written on a majority, synced within 100 ms: a crash of the
    /// machine can lose the last acknowledged writes).
    #[arg(long, value_enum, default_value_t = DevDurability::Synced)]
    durability: DevDurability,
}

/// `tidepool dev --durability`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DevDurability {
    Synced,
    Buffered,
}

impl DevDurability {
    fn name(self) -> &'static str {
        match self {
            DevDurability::Synced => "synced",
            DevDurability::Buffered => "buffered",
        }
    }
}

/// Settings of `tidepool gateway`.
#[derive(Debug, Args)]
struct GatewayArgs {
    /// Coordinator address (repeat for each).
    #[arg(long = "coordinator", required = true)]
    coordinators: Vec<String>,
    /// Where gRPC (REAPI, ByteStream) is served.
    #[arg(long, default_value = "127.0.0.1:7480")]
    grpc_listen: SocketAddr,
    /// Where the HTTP cache is served.
    #[arg(long, default_value = "127.0.0.1:7481")]
    http_listen: SocketAddr,
    /// File holding the gateway's own token (it follows the cluster map
    /// with it; callers use their own tokens).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Requests without credentials act with the gateway's own token.
    #[arg(long)]
    anonymous: bool,
    /// Largest blob accepted, bytes.
    #[arg(long, default_value_t = 64 << 30)]
    max_blob_bytes: u64,
    /// Create instance NAME (namespaces NAME and NAME.ac, kept
    /// `--retain` epochs after their last use) if it does not exist;
    /// needs an admin token. Repeatable.
    #[arg(long = "create-instance")]
    create_instances: Vec<String>,
    /// Epochs an instance created by `--create-instance` keeps unused
    /// entries.
    #[arg(long, default_value_t = 7)]
    retain: u32,
    /// Serve gRPC and HTTP over TLS with this certificate chain (PEM;
    /// build tools then use `grpcs://` and `https://`). Clients present no
    /// certificate: they authenticate with tokens.
    #[arg(long, requires = "serve_tls_key")]
    serve_tls_cert: Option<PathBuf>,
    /// The private key of `--serve-tls-cert`.
    #[arg(long, requires = "serve_tls_cert")]
    serve_tls_key: Option<PathBuf>,
    /// Also serve restic's REST protocol here (`restic -r
    /// rest:http://HOST:PORT/REPO/`).
    #[arg(long)]
    restic_listen: Option<SocketAddr>,
    /// The namespace holding restic repositories (locks in NAMESPACE.locks);
    /// created, durable, when missing (needs an admin token then).
    #[arg(long, default_value = "restic")]
    restic_namespace: String,
    /// restic: refuse every DELETE but of locks, and every overwrite.
    #[arg(long)]
    restic_append_only: bool,
    /// restic: a repository's first path segment must be the Basic user name.
    #[arg(long)]
    restic_private_repos: bool,
    /// Serve `/metrics`, `/healthz` and `/readyz` here.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// HTTP endpoints (cache, restic): seconds a connection may take to
    /// send a request's headers, counted from when it is ready for one
    /// (an idle keep-alive connection is closed after as long).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_header_timeout_s: u64,
    /// HTTP endpoints: seconds a request's body may send nothing before
    /// the request fails (`TIMEOUT`) and nothing of it is stored.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_body_idle_s: u64,
    /// Connections served at once by each endpoint (HTTP, restic and
    /// gRPC); more wait in the listen backlog.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    http_max_connections: u64,
    /// MiB the uploads being received (HTTP and restic PUTs, ByteStream
    /// writes) may buffer at once; past it a write waits, then fails
    /// `OVERLOADED` (HTTP 503).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    upload_memory_mib: u64,
    /// MiB the blob reads being served (GETs, ByteStream and batch reads)
    /// may hold at once, slow clients' included; past it a read waits,
    /// then fails `OVERLOADED` (HTTP 503).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    read_memory_mib: u64,
    #[command(flatten)]
    tls: TlsArgs,
}

/// Settings of `tidepool coordinator`; each flag overrides the config file.
#[derive(Debug, Args)]
struct CoordinatorArgs {
    /// TOML configuration file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Name of this coordinator replica.
    #[arg(long)]
    id: Option<String>,
    /// gRPC listen address.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// URL nodes and clients use to reach this coordinator.
    #[arg(long)]
    advertise: Option<String>,
    /// Prometheus metrics listen address.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// etcd endpoints, comma-separated (`http://host:2379`); without them
    /// the embedded store is used.
    #[arg(long, value_delimiter = ',')]
    etcd: Vec<String>,
    /// File of the embedded metadata store (single coordinator only).
    #[arg(long)]
    embedded_path: Option<PathBuf>,
    /// Prefix of this cluster's keys in etcd.
    #[arg(long)]
    key_prefix: Option<String>,
    /// Shards of a new cluster.
    #[arg(long)]
    shards: Option<u32>,
    /// Replicas per shard of a new cluster.
    #[arg(long)]
    replication_factor: Option<u32>,
    /// Node heartbeat lease, milliseconds.
    #[arg(long)]
    node_lease_ms: Option<u64>,
    /// Coordinator leadership lease, milliseconds.
    #[arg(long)]
    leader_lease_ms: Option<u64>,
    /// How long a node may be down before its replicas are re-created
    /// elsewhere, milliseconds.
    #[arg(long)]
    down_grace_ms: Option<u64>,
    /// Most shards changing membership at once.
    #[arg(long)]
    max_concurrent_moves: Option<usize>,
    /// Pause between reconcile rounds, milliseconds.
    #[arg(long)]
    reconcile_interval_ms: Option<u64>,
    /// Advance the epoch this often, seconds (0: only on request).
    #[arg(long)]
    epoch_interval_s: Option<u64>,
    /// Split a shard whose values pass this many MiB (0: never
    /// automatically; default 4096).
    #[arg(long)]
    split_mib: Option<u64>,
    /// Split a shard whose leader serves more than this many requests per
    /// second for --split-load-secs (0: never split by load; default
    /// 10000).
    #[arg(long)]
    split_rps: Option<u64>,
    /// How long a shard must stay over --split-rps before it splits
    /// (default 60).
    #[arg(long)]
    split_load_secs: Option<u64>,
    #[command(flatten)]
    tls: TlsArgs,
    /// Client certificate for etcd (with --etcd-key and --etcd-ca).
    #[arg(long, requires_all = ["etcd_key", "etcd_ca"])]
    etcd_cert: Option<PathBuf>,
    /// Its key.
    #[arg(long, requires_all = ["etcd_cert", "etcd_ca"])]
    etcd_key: Option<PathBuf>,
    /// The CA etcd's server certificate chains to.
    #[arg(long, requires_all = ["etcd_cert", "etcd_key"])]
    etcd_ca: Option<PathBuf>,
    /// File with the bootstrap admin token (adopted while the cluster has
    /// no token); or set TIDEPOOL_BOOTSTRAP_TOKEN.
    #[arg(long)]
    bootstrap_token_file: Option<PathBuf>,
    /// Under Kubernetes: the node StatefulSet's namespace (with
    /// --kubernetes-statefulset): zones from the Kubernetes nodes, drains
    /// of pods scaled away.
    #[arg(long, requires = "kubernetes_statefulset")]
    kubernetes_namespace: Option<String>,
    /// Under Kubernetes: the node StatefulSet's name.
    #[arg(long, requires = "kubernetes_namespace")]
    kubernetes_statefulset: Option<String>,
    /// Under Kubernetes: do not read zones (no permission on nodes).
    #[arg(long)]
    kubernetes_no_zones: bool,
}

impl CoordinatorArgs {
    fn into_config(self) -> anyhow::Result<CoordinatorConfig> {
        let mut c = match &self.config {
            Some(path) => CoordinatorConfig::from_file(path)?,
            None => CoordinatorConfig::default(),
        };
        macro_rules! set {
            ($($field:ident).+ = $value:expr) => {
                if let Some(v) = $value {
                    c.$($field).+ = v;
                }
            };
        }
        c.id = self.id.or(c.id);
        set!(listen = self.listen);
        c.advertise = self.advertise.or(c.advertise);
        c.metrics_listen = self.metrics_listen.or(c.metrics_listen);
        if !self.etcd.is_empty() {
            c.etcd = self.etcd;
        }
        c.embedded_path = self.embedded_path.or(c.embedded_path);
        set!(key_prefix = self.key_prefix);
        set!(cluster.shards = self.shards);
        set!(cluster.replication_factor = self.replication_factor);
        set!(node_lease_ms = self.node_lease_ms);
        set!(leader_lease_ms = self.leader_lease_ms);
        set!(down_grace_ms = self.down_grace_ms);
        set!(max_concurrent_moves = self.max_concurrent_moves);
        set!(reconcile_interval_ms = self.reconcile_interval_ms);
        set!(epoch_interval_s = self.epoch_interval_s);
        set!(split_mib = self.split_mib);
        set!(split_rps = self.split_rps);
        set!(split_load_secs = self.split_load_secs);
        c.tls = self.tls.require(c.tls.take(), c.insecure)?;
        if let (Some(cert), Some(key), Some(ca)) = (self.etcd_cert, self.etcd_key, self.etcd_ca) {
            c.etcd_tls = Some(tidepool_security::TlsFiles { cert, key, ca });
        }
        c.bootstrap_token_file = self.bootstrap_token_file.or(c.bootstrap_token_file);
        if let (Some(namespace), Some(statefulset)) =
            (self.kubernetes_namespace, self.kubernetes_statefulset)
        {
            c.kubernetes = Some(tidepool_coordinator::kubernetes::KubernetesConfig {
                namespace,
                statefulset,
                zones: !self.kubernetes_no_zones,
            });
        }
        if let Ok(token) = std::env::var("TIDEPOOL_BOOTSTRAP_TOKEN")
            && !token.trim().is_empty()
        {
            c.bootstrap_token = Some(token.trim().to_string());
        }
        c.validate()?;
        Ok(c)
    }
}

impl NodeArgs {
    fn into_config(self) -> anyhow::Result<NodeConfig> {
        let mut config = match (&self.config, self.node_id) {
            (Some(path), _) => NodeConfig::from_file(path)?,
            (None, Some(id)) => NodeConfig::new(id),
            (None, None) if !self.coordinators.is_empty() => NodeConfig::new(0),
            (None, None) => bail!("give --config, --node-id or --coordinator"),
        };
        if let Some(id) = self.node_id {
            config.node_id = id;
        }
        if let Some(listen) = self.listen {
            config.listen = listen;
        }
        if self.advertise.is_some() {
            config.advertise = self.advertise;
        }
        if let Some(dir) = self.data_dir {
            config.data_dir = dir;
        }
        if self.metrics_listen.is_some() {
            config.metrics_listen = self.metrics_listen;
        }
        if !self.peers.is_empty() || self.shards.is_some() {
            let peers = self
                .peers
                .iter()
                .map(|p| {
                    let (id, address) = p.split_once('=').context("--peer takes ID=URL")?;
                    Ok(Peer {
                        id: id.parse().with_context(|| format!("--peer {p}: bad id"))?,
                        address: address.to_string(),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            // Each flag replaces its own field of the file's `[cluster]`,
            // never the rest (a `--peer` dropped the file's shards,
            // namespaces and tokens).
            let file = config.cluster.take();
            let peers = match &file {
                Some(file) if peers.is_empty() => file.peers.clone(),
                _ => peers,
            };
            let replicas = if !self.replicas.is_empty() {
                self.replicas
            } else if let Some(file) = &file {
                file.replicas.clone()
            } else {
                peers.iter().map(|p| p.id).collect()
            };
            let namespaces = if self.namespaces.is_empty() {
                file.as_ref().map_or_else(
                    || {
                        vec![NamespaceSpec {
                            name: "default".into(),
                            id: 1,
                            content_addressed: false,
                            retain_epochs: None,
                        }]
                    },
                    |f| f.namespaces.clone(),
                )
            } else {
                self.namespaces
                    .iter()
                    .map(|n| {
                        let (name, rest) = n
                            .split_once('=')
                            .context("--namespace takes NAME=ID[:cas][:retain=EPOCHS]")?;
                        let mut parts = rest.split(':');
                        let id = parts.next().unwrap_or_default();
                        let mut spec = NamespaceSpec {
                            name: name.into(),
                            id: id
                                .parse()
                                .with_context(|| format!("--namespace {n}: bad id"))?,
                            content_addressed: false,
                            retain_epochs: None,
                        };
                        for flag in parts {
                            match flag.split_once('=') {
                                None if flag == "cas" => spec.content_addressed = true,
                                Some(("retain", epochs)) => {
                                    spec.retain_epochs =
                                        Some(epochs.parse().with_context(|| {
                                            format!("--namespace {n}: bad retain epochs")
                                        })?)
                                }
                                _ => bail!("--namespace {n}: flags are :cas and :retain=EPOCHS"),
                            }
                        }
                        Ok(spec)
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?
            };
            config.cluster = Some(StaticCluster {
                shards: self.shards.or(file.as_ref().map(|f| f.shards)).unwrap_or(1),
                replicas,
                peers,
                namespaces,
                tokens: file.map(|f| f.tokens).unwrap_or_default(),
            });
        }
        for p in &self.peer_addresses {
            let (id, address) = p.split_once('=').context("--peer-address takes ID=URL")?;
            config.peer_addresses.push(Peer {
                id: id
                    .parse()
                    .with_context(|| format!("--peer-address {p}: bad id"))?,
                address: address.to_string(),
            });
        }
        if !self.coordinators.is_empty() {
            // The addresses only: the file's zone and capacity stay.
            match &mut config.coordinator {
                Some(link) => link.addresses = self.coordinators,
                None => {
                    config.coordinator = Some(CoordinatorLink {
                        addresses: self.coordinators,
                        zone: String::new(),
                        capacity_bytes: 0,
                    })
                }
            }
        }
        config.tls = self.tls.require(config.tls.take(), config.insecure)?;
        if let Some(link) = &mut config.coordinator {
            if let Some(zone) = self.zone {
                link.zone = zone;
            }
            if let Some(bytes) = self.capacity_bytes {
                link.capacity_bytes = bytes;
            }
        }
        config.validate()?;
        Ok(config)
    }
}

fn runtime(name: &str) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name(name)
        .build()
        .context("cannot start the async runtime")
}

fn run_coordinator(args: CoordinatorArgs) -> anyhow::Result<()> {
    let config = args.into_config()?;
    runtime("tidepool-coordinator")?.block_on(async {
        let mut stop = Stop::catch()?;
        // etcd may still be starting (under Kubernetes both start
        // together): retry an unreachable store for a while instead of
        // exiting into a crash-loop back-off.
        let starting = async {
            let mut waited = std::time::Duration::ZERO;
            loop {
                match tidepool_coordinator::start(config.clone()).await {
                    Ok(running) => return Ok(running),
                    Err(tidepool_coordinator::CoordinatorError::Meta(e)) if waited < STORE_WAIT => {
                        tracing::warn!(error = %e, "metadata store unavailable; retrying");
                        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                        waited += std::time::Duration::from_secs(2);
                    }
                    Err(e) => return Err(anyhow::Error::from(e)),
                }
            }
        };
        let mut running = tokio::select! {
            running = starting => running?,
            () = stop.requested() => {
                tracing::info!("stopped while starting");
                return Ok(());
            }
        };
        tracing::info!(
            "tidepool coordinator {} serving on {}",
            running.shared.id,
            running.address
        );
        tokio::select! {
            result = running.wait() => result?,
            () = stop.requested() => {
                tracing::info!("shutting down");
                running.stop().await?;
            }
        }
        Ok(())
    })
}

/// How long a coordinator waits for its metadata store at start-up.
const STORE_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Nodes in dev mode.
const DEV_NODES: u16 = 3;
/// Each dev node's memory budget (indexes and value caches of all its
/// replicas), MiB: dev mode shares one machine among three nodes.
const DEV_MEMORY_MIB: u64 = 256;

/// `tidepool dev` serves metrics on `--port` + 90 (coordinator), + 91..=93
/// (nodes) and + 94 (gateway).
const DEV_METRICS_OFFSET: u16 = 90;

/// Shards of a new dev cluster unless `--shards` says otherwise.
const DEV_SHARDS: u32 = 4;

/// Epochs dev mode's build cache keeps unused entries.
const DEV_CACHE_RETAIN: u32 = 7;

fn run_dev(args: DevArgs) -> anyhow::Result<()> {
    use std::sync::Arc;
    use tidepool_coordinator::meta::{EmbeddedStore, MetaStore};
    use tidepool_node::config::CoordinatorLink;

    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create {}", args.data_dir.display()))?;
    let data_dir = std::fs::canonicalize(&args.data_dir)?;
    // TLS and an admin token of its own, kept across restarts, unless told
    // otherwise.
    let tls_dir = data_dir.join("tls");
    let token_file = data_dir.join("admin.token");
    // A token file made anew on a directory that held a cluster (deleted:
    // the way to reset dev mode's admin token) replaces the cluster's
    // bootstrap token: before, the store kept the old one's hash and every
    // call of this run, dev mode's own included, was UNAUTHENTICATED.
    let mut token_made = false;
    let had_cluster = data_dir.join("metadata.json").exists();
    if !args.insecure {
        for replaced in tidepool_security::certs::ensure_dev(&tls_dir, u32::from(DEV_NODES))? {
            tracing::warn!(dir = %tls_dir.display(), "{replaced}");
        }
        if !token_file.exists() {
            // Whole or not at all: the store adopts the token's hash, and
            // a file a crash left empty locked the admin out for good.
            use std::io::Write as _;
            use std::os::unix::fs::OpenOptionsExt as _;
            let tmp = token_file.with_extension("token.tmp");
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .with_context(|| format!("cannot create {}", tmp.display()))?;
            writeln!(file, "{}", tidepool_security::token::generate())?;
            file.sync_all()?;
            std::fs::rename(&tmp, &token_file)
                .with_context(|| format!("cannot create {}", token_file.display()))?;
            std::fs::File::open(&data_dir)?.sync_all()?;
            token_made = true;
        }
    }
    let files =
        |base: &str| (!args.insecure).then(|| tidepool_security::certs::files(&tls_dir, base));
    runtime("tidepool-dev")?.block_on(async {
        let mut stop = Stop::catch()?;
        let store: Arc<dyn MetaStore> =
            Arc::new(EmbeddedStore::open(&data_dir.join("metadata.json"))?);
        let port = |offset: u16| if args.port == 0 { 0 } else { args.port + offset };
        let mut config = CoordinatorConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], args.port)),
            metrics_listen: Some(SocketAddr::from(([127, 0, 0, 1], port(DEV_METRICS_OFFSET)))),
            node_lease_ms: 3_000,
            split_mib: args.split_mib,
            split_rps: args.split_rps,
            ..CoordinatorConfig::default()
        };
        config.cluster.shards = args.shards.unwrap_or(DEV_SHARDS);
        if had_cluster && let Some(asked) = args.shards {
            tracing::warn!(
                dir = %data_dir.display(),
                "--shards {asked} is for a new cluster: the one in this directory keeps its shards (a shard splits as it grows; `tidectl shard split` splits one by hand)"
            );
        }
        config.cluster.replication_factor = u32::from(DEV_NODES);
        config.tls = files("coordinator");
        if !args.insecure {
            config.bootstrap_token_file = Some(token_file.clone());
            // Always: a start that failed after making the file (a port
            // taken, Ctrl-C) left it there, and the next start, finding
            // it, did not reset. The token named `bootstrap` follows the
            // file (a no-op when it already holds its hash).
            config.bootstrap_token_resets = true;
            if token_made && had_cluster {
                tracing::warn!(
                    file = %token_file.display(),
                    "the admin token file was missing: made a new one, which replaces the cluster's bootstrap admin token"
                );
            }
        }
        let coordinator = tidepool_coordinator::start_with_store(config, store).await?;
        let scheme = if args.insecure { "http" } else { "https" };
        let coordinator_url = format!("{scheme}://{}", coordinator.address);
        let mut nodes = Vec::new();
        let mut gateway = None;
        // Start-up, which a stop ends at its next wait (a registration the
        // coordinator keeps refusing, the wait for leaders: before, Ctrl-C
        // waited for all of it; a node opening its replicas is not
        // interrupted); whatever started is stopped below, after an error
        // too (before, an error left the nodes and the coordinator
        // unstopped).
        let started = async {
            for i in 1..=DEV_NODES {
                let mut node = NodeConfig::new(0);
                node.listen = SocketAddr::from(([127, 0, 0, 1], port(i)));
                node.metrics_listen = Some(SocketAddr::from((
                    [127, 0, 0, 1],
                    port(DEV_METRICS_OFFSET + i),
                )));
                node.data_dir = data_dir.join(format!("node-{i}"));
                node.engine.wal_segment_mib = 16;
                node.memory.budget_mib = DEV_MEMORY_MIB;
                node.raft.durability = args.durability.name().into();
                node.tls = files(&format!("node-{i}"));
                node.coordinator = Some(CoordinatorLink {
                    addresses: vec![coordinator_url.clone()],
                    zone: String::new(),
                    capacity_bytes: 0,
                });
                nodes.push(tidepool_node::server::start(node).await?);
            }
            // Ready once every shard has a leader in this run: one of the nodes
            // here leads it, and the map names a leader for clients. (The map
            // alone said ready at once on a restart: its leader hints are
            // saved with it, and a hint is not cleared when its leader goes.)
            let waiting_since = std::time::Instant::now();
            let mut warned_at = waiting_since;
            loop {
                let map = coordinator.shared.map();
                let led_here = |shard_id: u32| {
                    nodes.iter().any(|n| {
                        n.node
                            .shard(shard_id)
                            .and_then(|shard| shard.state().status)
                            .is_some_and(|status| status.is_leader)
                    })
                };
                if !map.shards.is_empty()
                    && map
                        .shards
                        .iter()
                        .all(|s| s.leader_hint != 0 && led_here(s.shard_id))
                {
                    break;
                }
                // Never a silent wait: every 30 s, the shards still without
                // a leader (a replica that cannot open, node directories
                // wiped).
                if warned_at.elapsed() >= std::time::Duration::from_secs(30) {
                    warned_at = std::time::Instant::now();
                    let leaderless: Vec<u32> = map
                        .shards
                        .iter()
                        .filter(|s| s.leader_hint == 0 || !led_here(s.shard_id))
                        .map(|s| s.shard_id)
                        .collect();
                    tracing::warn!(
                        waited_s = waiting_since.elapsed().as_secs(),
                        ?leaderless,
                        shards = map.shards.len(),
                        "not ready yet: shards without a leader here or in the map, or no map yet (Ctrl-C stops)"
                    );
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            // The build-cache gateway, with the admin token as its own,
            // and the default instance (`cache`).
            let mut client = tidepool_client::ClientConfig::new(std::slice::from_ref(&coordinator_url));
            if !args.insecure {
                client = client.with_dev_credentials(&data_dir);
            }
            let mut config = tidepool_gateway::GatewayConfig::new(client);
            config.metrics_listen = Some(SocketAddr::from((
                [127, 0, 0, 1],
                port(DEV_METRICS_OFFSET + 1 + DEV_NODES),
            )));
            config.grpc_listen = SocketAddr::from(([127, 0, 0, 1], port(80)));
            config.http_listen = SocketAddr::from(([127, 0, 0, 1], port(81)));
            config.restic = Some(tidepool_gateway::ResticConfig::new(SocketAddr::from((
                [127, 0, 0, 1],
                port(82),
            ))));
            config.anonymous = args.insecure;
            let started = gateway.insert(tidepool_gateway::start(config).await?);
            started
                .create_instance(tidepool_gateway::DEFAULT_INSTANCE, DEV_CACHE_RETAIN)
                .await?;
            started.create_restic_namespaces().await?;
            started.check_restic_namespaces()?;
            anyhow::Ok(())
        };
        let outcome = tokio::select! {
            result = started => Some(result),
            () = stop.requested() => None,
        };
        let mut failure = None;
        match outcome {
            Some(Err(error)) => {
                // Said now: a second stop during the shutdown exits at once.
                tracing::error!(error = format!("{error:#}"), "start-up failed; stopping");
                failure = Some(error);
            }
            None => {}
            Some(Ok(())) => {
                let gateway = gateway.as_ref().expect("started");
                let node_list: Vec<String> = nodes.iter().map(|n| n.address.to_string()).collect();
                let security = if args.insecure {
                    "INSECURE: no TLS, no tokens".to_string()
                } else {
                    format!(
                        "TLS material in {}, admin token in {} (tidectl finds both in its --dev-dir)",
                        tls_dir.display(),
                        token_file.display(),
                    )
                };
                let tidectl = tidectl_command(&coordinator_url, args.port, args.insecure, &data_dir);
                let header = if args.insecure {
                    String::new()
                } else {
                    format!(
                        " --remote_header=authorization=\"Bearer $(cat {})\"",
                        shell_word(&token_file)
                    )
                };
                let restic_auth = if args.insecure {
                    String::new()
                } else {
                    format!("restic:$(cat {})@", shell_word(&token_file))
                };
                let http_auth = if args.insecure {
                    String::new()
                } else {
                    format!("|bearer-token=$(cat {})", shell_word(&token_file))
                };
                let writes = match args.durability {
                    DevDurability::Synced => "Writes acknowledged once fsynced on a majority (synced)",
                    DevDurability::Buffered => {
                        "BUFFERED: writes acknowledged before they are fsynced (synced within 100 ms; \
                         a crash of the machine can lose the last ones)"
                    }
                };
                let mut metrics: Vec<String> = Vec::new();
                metrics.extend(coordinator.metrics_address.map(|a| format!("coordinator http://{a}/metrics")));
                for (i, node) in nodes.iter().enumerate() {
                    metrics.extend(node.metrics_address.map(|a| format!("node {} http://{a}/metrics", i + 1)));
                }
                metrics.extend(gateway.metrics_address.map(|a| format!("gateway http://{a}/metrics")));
                println!(
                    "Tidepool dev cluster ready: coordinator {coordinator_url}, nodes {}, data in {}.\n\
                 {security}.\n\
                 {writes}.\n\
                 Metrics (Prometheus):\n  {}\n\
                 Build cache (instance `cache`, entries kept {DEV_CACHE_RETAIN} epochs after their last use):\n  \
                   bazel build --remote_cache=grpc://{grpc}{header} //...\n  \
                   bazel build --remote_cache=http://{http}{header} //...\n  \
                   ccache: remote_storage=\"http://{http}/ccache{http_auth}\"\n\
                 Backups (namespace `restic`):\n  \
                   restic -r rest:http://{restic_auth}{restic}/REPO/ init\n\
                 Try, in another shell:\n  \
                   {tidectl} put default hello README.md\n  \
                   {tidectl} get default hello\n  \
                   {tidectl} cluster status\n\
                 Ctrl-C stops it; starting it again keeps the data.",
                    node_list.join(", "),
                    data_dir.display(),
                    metrics.join("\n  "),
                    grpc = gateway.grpc_address,
                    http = gateway.http_address,
                    restic = gateway
                        .restic_address
                        .map(|a| a.to_string())
                        .unwrap_or_default(),
                );
                stop.requested().await;
            }
        }
        tracing::info!("stopping");
        let shutdown = async {
            if let Some(gateway) = gateway {
                gateway.stop().await;
            }
            for node in nodes {
                if let Err(error) = node.stop().await {
                    failure.get_or_insert(error.into());
                }
            }
            if let Err(error) = coordinator.stop().await {
                failure.get_or_insert(error.into());
            }
        };
        // A second stop ends the process at once.
        tokio::select! {
            () = shutdown => {}
            () = stop.requested() => {
                eprintln!("tidepool dev: stopped again during shutdown; exiting at once");
                std::process::exit(130);
            }
        }
        failure.map_or(Ok(()), Err)
    })
}

/// The `tidectl` command line that reaches a dev cluster from the current
/// directory: the flags its defaults (coordinator on port 7400, material
/// in `./tidepool-dev`, TLS when that holds a CA) do not give. Before, the
/// banner printed none, and its commands failed for a cluster on another
/// port or directory, or an insecure one started where a secure one had
/// left its CA.
fn tidectl_command(
    coordinator_url: &str,
    port: u16,
    insecure: bool,
    data_dir: &std::path::Path,
) -> String {
    let mut command = String::from("target/release/tidectl");
    if port != 7400 {
        command.push_str(&format!(" --coordinator {coordinator_url}"));
    }
    if insecure {
        command.push_str(" --insecure");
    } else if std::fs::canonicalize("tidepool-dev").ok().as_deref() != Some(data_dir) {
        command.push_str(&format!(" --dev-dir {}", shell_word(data_dir)));
    }
    command
}

/// `path` as one word of a POSIX shell command line: as it is when that
/// is safe, else single-quoted.
fn shell_word(path: &std::path::Path) -> String {
    let text = path.display().to_string();
    let plain = text
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+,:@".contains(c));
    if plain {
        text
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

fn run_gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let mut client = tidepool_client::ClientConfig::new(&args.coordinators);
    client.tls = args.tls.require(None, false)?;
    if let Some(file) = &args.token_file {
        client.token = Some(
            tidepool_security::token::read_file(file)
                .with_context(|| format!("cannot read the token in {}", file.display()))?,
        );
    }
    let mut config = tidepool_gateway::GatewayConfig::new(client);
    config.grpc_listen = args.grpc_listen;
    config.http_listen = args.http_listen;
    config.anonymous = args.anonymous;
    config.max_blob_bytes = args.max_blob_bytes;
    config.metrics_listen = args.metrics_listen;
    config.http_limits = tidepool_gateway::HttpLimits {
        header_timeout: std::time::Duration::from_secs(args.http_header_timeout_s),
        body_idle: std::time::Duration::from_secs(args.http_body_idle_s),
        max_connections: args.http_max_connections as usize,
    };
    config.upload_memory_bytes = args.upload_memory_mib << 20;
    config.read_memory_bytes = args.read_memory_mib << 20;
    if let Some(listen) = args.restic_listen {
        let mut restic = tidepool_gateway::ResticConfig::new(listen);
        restic.namespace = args.restic_namespace.clone();
        restic.append_only = args.restic_append_only;
        restic.private_repos = args.restic_private_repos;
        config.restic = Some(restic);
    }
    if let (Some(cert), Some(key)) = (&args.serve_tls_cert, &args.serve_tls_key) {
        config.serve_tls = Some(tidepool_gateway::ServeTls {
            cert: cert.clone(),
            key: key.clone(),
        });
    }
    let scheme = if config.serve_tls.is_some() { "s" } else { "" };
    runtime("tidepool-gateway")?.block_on(async {
        let mut stop = Stop::catch()?;
        // The coordinators may still be starting (under Kubernetes
        // everything starts together): retry for a while rather than exit
        // into a crash-loop back-off.
        let starting = async {
            let mut waited = std::time::Duration::ZERO;
            loop {
                match tidepool_gateway::start(config.clone()).await {
                    Ok(gateway) => return Ok(gateway),
                    Err(e) if waited < STORE_WAIT => {
                        tracing::warn!(error = %e, "cannot start the gateway yet; retrying");
                        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                        waited += std::time::Duration::from_secs(2);
                    }
                    Err(e) => return Err(anyhow::Error::from(e)),
                }
            }
        };
        let gateway = tokio::select! {
            gateway = starting => gateway?,
            () = stop.requested() => {
                tracing::info!("stopped while starting");
                return Ok(());
            }
        };
        for name in &args.create_instances {
            gateway.create_instance(name, args.retain).await?;
        }
        if let Err(e) = gateway.create_restic_namespaces().await {
            tracing::warn!(error = %e, "restic namespaces not created (create them with an admin token)");
        }
        if let Err(e) = gateway.check_restic_namespaces() {
            gateway.stop().await;
            return Err(anyhow::Error::from(e));
        }
        let restic = gateway
            .restic_address
            .map(|a| format!(", restic rest:http{scheme}://{a}/"))
            .unwrap_or_default();
        tracing::info!(
            "tidepool gateway serving: REAPI/ByteStream grpc{scheme}://{}, HTTP cache http{scheme}://{}{restic}",
            gateway.grpc_address,
            gateway.http_address
        );
        stop.requested().await;
        gateway.stop().await;
        Ok(())
    })
}

fn run_node(args: NodeArgs) -> anyhow::Result<()> {
    let config = args.into_config()?;
    runtime("tidepool-node")?.block_on(async {
        let mut stop = Stop::catch()?;
        // A stop asked for while the node starts (its logs replayed, its
        // registration retried) ends the process there: nothing was
        // served yet, and every engine is crash-safe at any point.
        let mut running = tokio::select! {
            running = tidepool_node::server::start(config) => running?,
            () = stop.requested() => {
                tracing::info!("stopped while starting");
                return Ok(());
            }
        };
        tracing::info!(
            "tidepool node {} serving on {}",
            running.node.config.node_id,
            running.address
        );
        tokio::select! {
            result = running.wait() => result?,
            () = stop.requested() => {
                tracing::info!("shutting down");
                running.stop().await?;
            }
        }
        Ok(())
    })
}

fn run_certs(command: CertsCommand) -> anyhow::Result<()> {
    use tidepool_security::certs;
    match command {
        CertsCommand::Ca { dir, name } => {
            if dir.join("ca.pem").exists() {
                bail!(
                    "{} exists; not overwriting a CA",
                    dir.join("ca.pem").display()
                );
            }
            let ca = certs::new_ca(&name, certs::CA_VALIDITY)?;
            let (cert, key) = certs::write(&dir, "ca", &ca)?;
            println!("{}\n{}", cert.display(), key.display());
        }
        CertsCommand::Issue {
            dir,
            ca_dir,
            kind,
            name,
            hosts,
            out,
            days,
        } => {
            let identity = tidepool_security::Identity::parse(&format!("tidepool://{kind}/{name}"))
                .with_context(|| {
                    format!("kind is node, coordinator, client or server, and the name 1-64 of [A-Za-z0-9._-]; not {kind} {name:?}")
                })?;
            let ca = certs::read(ca_dir.as_deref().unwrap_or(&dir), "ca")?;
            let issued = certs::issue(
                &ca,
                &certs::Request {
                    identity,
                    hosts,
                    valid_for: std::time::Duration::from_secs(days.saturating_mul(86_400)),
                    expired: false,
                },
            )?;
            let base = out.unwrap_or_else(|| format!("{kind}-{name}"));
            let (cert, key) = certs::write(&dir, &base, &issued)?;
            println!("{}\n{}", cert.display(), key.display());
        }
    }
    Ok(())
}

fn run_pre_stop(args: PreStopArgs) -> anyhow::Result<()> {
    let tls = match args.tls.require(None, false)? {
        Some(files) => Some(tidepool_security::Tls::load(files)?),
        None => None,
    };
    let security = tidepool_security::Security { tls, token: None };
    runtime("tidepool-pre-stop")?.block_on(async {
        let outcome = tidepool_node::server::prepare_stop(
            &args.data_dir,
            args.coordinators,
            security,
            std::time::Duration::from_secs(args.undecided_s),
            std::time::Duration::from_secs(args.hold_quorum_s),
        )
        .await?;
        eprintln!("tidepool pre-stop: {outcome}");
        Ok(())
    })
}

fn run_kubernetes(command: KubernetesCommand) -> anyhow::Result<()> {
    let KubernetesCommand::Setup {
        namespace,
        ca_secret,
        ca_cert_key,
        ca_key_key,
        existing_ca,
        token_secret,
        clients,
        labels,
    } = command;
    let pair = |what: &str, text: &str| -> anyhow::Result<(String, String)> {
        text.split_once('=')
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .with_context(|| format!("{what} is KEY=VALUE, not {text:?}"))
    };
    let setup = kubernetes::Setup {
        namespace,
        ca_secret,
        ca_cert_key,
        ca_key_key,
        create_ca: !existing_ca,
        token_secret,
        clients: clients
            .iter()
            .map(|c| pair("--client", c))
            .collect::<anyhow::Result<_>>()?,
        labels: labels
            .iter()
            .map(|l| pair("--label", l))
            .collect::<anyhow::Result<_>>()?,
    };
    runtime("tidepool-kubernetes")?.block_on(kubernetes::setup(setup))
}

/// SIGTERM and SIGINT, caught from the moment this is made — first thing
/// in each long-running command, before any start-up work — and
/// remembered until asked for. Caught only once a start-up had finished
/// (WAL replay, the wait for the store), a signal before was the default
/// action's: the process died unannounced; as a container's PID 1 (the
/// image's entrypoint), which has no default action, it was ignored, and
/// the pod waited out its whole grace period. And one `Stop` for the whole
/// process, so a signal between two waits is not lost.
struct Stop {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl Stop {
    /// Catches the signals from now on (inside the runtime).
    fn catch() -> anyhow::Result<Stop> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Stop {
            terminate: signal(SignalKind::terminate()).context("cannot catch SIGTERM")?,
            interrupt: signal(SignalKind::interrupt()).context("cannot catch SIGINT")?,
        })
    }

    /// Until a stop is asked for (at once if one was since the last ask).
    async fn requested(&mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let service = match &cli.command {
        Command::Node(_) => "tidepool-node",
        Command::Coordinator(_) => "tidepool-coordinator",
        Command::Gateway(_) => "tidepool-gateway",
        Command::Dev(_) => "tidepool-dev",
        _ => "tidepool",
    };
    // Kept to the end: dropping it flushes the spans still queued.
    let _telemetry = match tidepool_telemetry::init(&tidepool_telemetry::TelemetryConfig {
        service_name: service.into(),
        log_format: cli.log_format,
        otlp_endpoint: cli.otlp_endpoint.clone(),
        sampling_ratio: cli.trace_sampling,
        default_filter: "info".into(),
    }) {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("tidepool: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    let json_logs = cli.log_format == tidepool_telemetry::LogFormat::Json;
    let result = match cli.command {
        Command::Node(args) => run_node(*args),
        Command::Coordinator(args) => run_coordinator(*args),
        Command::Dev(args) => run_dev(args),
        Command::Gateway(args) => run_gateway(*args),
        Command::Certs(command) => run_certs(command),
        Command::PreStop(args) => run_pre_stop(args),
        Command::Kubernetes(command) => run_kubernetes(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // In JSON, as one more log line (every line of stderr is JSON).
        Err(error) if json_logs => {
            tracing::error!(error = %format!("{error:#}"), "tidepool failed");
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("tidepool: {error:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node_config(file: &str, flags: &[&str]) -> NodeConfig {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.toml");
        std::fs::write(&path, file).unwrap();
        let mut args = vec![
            "tidepool",
            "node",
            "--insecure",
            "--config",
            path.to_str().unwrap(),
        ];
        args.extend_from_slice(flags);
        match Cli::try_parse_from(args).unwrap().command {
            Command::Node(args) => args.into_config().unwrap(),
            _ => unreachable!(),
        }
    }

    /// A flag replaces its own setting of the file, not the file's whole
    /// section: `--coordinator` kept no zone or capacity, `--peer` no
    /// shards, namespaces or tokens.
    #[test]
    fn flags_override_single_settings_of_the_file() {
        let linked = node_config(
            "[coordinator]\naddresses = [\"http://a:1\"]\nzone = \"zone-a\"\ncapacity_bytes = 1000\n",
            &["--coordinator", "http://b:2"],
        );
        let link = linked.coordinator.unwrap();
        assert_eq!(link.addresses, ["http://b:2"]);
        assert_eq!((link.zone.as_str(), link.capacity_bytes), ("zone-a", 1000));

        let fixed = node_config(
            "node_id = 1\n[cluster]\nshards = 4\nreplicas = [1]\npeers = [{ id = 1, address = \"http://a:1\" }]\nnamespaces = [{ name = \"ci\", id = 3, retain_epochs = 2 }]\n",
            &["--peer", "1=http://b:2"],
        );
        let cluster = fixed.cluster.unwrap();
        assert_eq!(cluster.peers[0].address, "http://b:2");
        assert_eq!(cluster.shards, 4);
        assert_eq!(cluster.namespaces[0].name, "ci");
        assert_eq!(cluster.replicas, [1]);
    }
}
