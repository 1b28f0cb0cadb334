//! The coordinator's settings (TOML file and/or `tidepool coordinator`
//! flags).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::CoordinatorError;

/// The default `split_mib`: 4 GiB of values per shard. A shard that size
/// relocates, snapshots and splits in minutes, not hours, and a node with a
/// few TiB holds hundreds of them — cheap since replicas share their node's
/// threads and memory (`docs/design/scale-out.md`).
pub const DEFAULT_SPLIT_MIB: u64 = 4096;

/// The default `split_rps`: a shard whose leader serves more than 10,000
/// requests a second for a minute splits. A whole three-node cluster on
/// the two-core test host serves about 18,000 1 KiB gets a second
/// (`benchmarks/RESULTS.md`), so under a spread load no shard of a
/// default 16 comes near it; a shard that does is a hot spot worth a
/// leader of its own on another node. Splits never merge, so the limit
/// errs high and the load must last.
pub const DEFAULT_SPLIT_RPS: u64 = 10_000;

/// Everything a coordinator is configured with.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// Name of this coordinator replica (shown in status and leader hints);
    /// default `coordinator@<advertise>`.
    pub id: Option<String>,
    /// Address the gRPC server binds.
    pub listen: SocketAddr,
    /// URL nodes and clients use to reach this coordinator (default
    /// `http://<bound address>`).
    pub advertise: Option<String>,
    /// Address of the Prometheus `/metrics` endpoint; none by default.
    pub metrics_listen: Option<SocketAddr>,
    /// etcd endpoints (`http://host:port`); empty to use the embedded store.
    pub etcd: Vec<String>,
    /// File of the embedded store (dev mode); in memory when unset.
    pub embedded_path: Option<PathBuf>,
    /// Prefix of every key this cluster keeps in the metadata store, so
    /// several clusters can share one etcd.
    pub key_prefix: String,
    /// The cluster this coordinator creates if the store holds none.
    pub cluster: ClusterSettings,
    /// Node heartbeat lease, milliseconds (nodes beat every third of it).
    pub node_lease_ms: u64,
    /// Coordinator leadership lease, milliseconds.
    pub leader_lease_ms: u64,
    /// How long a node may be down before its replicas are re-created
    /// elsewhere, milliseconds.
    pub down_grace_ms: u64,
    /// Pause between reconcile rounds, milliseconds.
    pub reconcile_interval_ms: u64,
    /// Most shards changing membership at once (the move rate limit).
    pub max_concurrent_moves: usize,
    /// A learner is promoted once it has applied up to this many entries
    /// behind the leader's commit index.
    pub catch_up_slack: u64,
    /// A learner that makes no progress catching up (its applied index
    /// and the snapshot bytes it received stay where they were) for this
    /// long is removed, milliseconds; its move is planned elsewhere.
    pub learner_stall_ms: u64,
    /// A node whose learner was removed for making no progress gets no
    /// replica of that shard for this long, milliseconds.
    pub learner_bar_ms: u64,
    /// Advance the cluster epoch this often, seconds; 0 advances only on
    /// request (`AdvanceEpoch`).
    pub epoch_interval_s: u64,
    /// A leadership transfer the balancer asked for that has not completed
    /// after this long counts as failed, milliseconds.
    pub transfer_timeout_ms: u64,
    /// After a failed or refused transfer, the balancer does not ask again
    /// for that shard and target for this long, milliseconds.
    pub transfer_backoff_ms: u64,
    /// A node that comes back (restarted, resumed, reachable again) is no
    /// target of leader balancing for this long, milliseconds.
    pub balance_settle_ms: u64,
    /// A shard whose leader's engine holds more than this many MiB of
    /// values is split in two (`docs/design/splits.md`); 0: never split
    /// automatically.
    pub split_mib: u64,
    /// A shard whose leader serves more than this many requests per second
    /// (keys read, written or checked; a moving average over about five
    /// seconds) for `split_load_secs` is split where its recent requests
    /// divide evenly (`docs/design/splits.md`, splits by load); 0: never
    /// split by load.
    pub split_rps: u64,
    /// How long a shard must stay over `split_rps` before it splits.
    pub split_load_secs: u64,
    /// Mutual TLS for the coordinator's gRPC listener and its calls to
    /// nodes (`[tls]`: `cert`, `key`, `ca`; re-read when they change).
    /// Without it the coordinator speaks plaintext and admits every caller
    /// (`tidepool coordinator` refuses that unless given `--insecure`).
    pub tls: Option<tidepool_security::TlsFiles>,
    /// TLS to etcd (`[etcd_tls]`: the client certificate and key etcd
    /// accepts, and the CA etcd's server certificate chains to); the etcd
    /// URLs are then `https://`.
    pub etcd_tls: Option<tidepool_security::TlsFiles>,
    /// A file holding the bootstrap admin token: while the cluster has no
    /// token at all, its hash is stored as the admin token `bootstrap`.
    pub bootstrap_token_file: Option<PathBuf>,
    /// The bootstrap token itself (from `TIDEPOOL_BOOTSTRAP_TOKEN`; never
    /// read from a file's TOML).
    #[serde(skip)]
    pub bootstrap_token: Option<String>,
    /// Make the bootstrap token the admin token `bootstrap` even when the
    /// cluster holds tokens (replacing the one of that name): dev mode,
    /// whose token file is its owner's and is made anew when deleted — the
    /// new token must admit (never from a file's TOML).
    #[serde(skip)]
    pub bootstrap_token_resets: bool,
    /// Run without `[tls]` on purpose (what `--insecure` says); the
    /// `tidepool coordinator` binary refuses to start with neither.
    pub insecure: bool,
    /// Running under Kubernetes (`[kubernetes]`: the node StatefulSet):
    /// zones from the Kubernetes nodes, drains on scale-down.
    pub kubernetes: Option<crate::kubernetes::KubernetesConfig>,
}

/// The shape of a new cluster.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSettings {
    /// Shards splitting the 64-bit hash space evenly.
    pub shards: u32,
    /// Replicas per shard.
    pub replication_factor: u32,
    /// Largest value a node accepts, bytes (must match the nodes'
    /// `raft.max_value_bytes`).
    pub max_value_bytes: u64,
}

impl Default for ClusterSettings {
    fn default() -> Self {
        Self {
            shards: 16,
            replication_factor: 3,
            max_value_bytes: 4 << 20,
        }
    }
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            id: None,
            listen: "127.0.0.1:7400".parse().expect("valid"),
            advertise: None,
            metrics_listen: None,
            etcd: Vec::new(),
            embedded_path: None,
            key_prefix: "/tidepool/".into(),
            cluster: ClusterSettings::default(),
            node_lease_ms: 6_000,
            leader_lease_ms: 6_000,
            down_grace_ms: 60_000,
            reconcile_interval_ms: 500,
            max_concurrent_moves: 2,
            catch_up_slack: 64,
            learner_stall_ms: 300_000,
            learner_bar_ms: 1_800_000,
            epoch_interval_s: 0,
            transfer_timeout_ms: 3_000,
            transfer_backoff_ms: 30_000,
            balance_settle_ms: 10_000,
            split_mib: DEFAULT_SPLIT_MIB,
            split_rps: DEFAULT_SPLIT_RPS,
            split_load_secs: 60,
            tls: None,
            etcd_tls: None,
            bootstrap_token_file: None,
            bootstrap_token: None,
            bootstrap_token_resets: false,
            insecure: false,
            kubernetes: None,
        }
    }
}

impl CoordinatorConfig {
    /// Reads a TOML file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, CoordinatorError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            CoordinatorError::Config(format!("cannot read {}: {e}", path.display()))
        })?;
        toml::from_str(&text)
            .map_err(|e| CoordinatorError::Config(format!("{}: {e}", path.display())))
    }

    /// Checks the settings; the error names the first bad one.
    pub fn validate(&self) -> Result<(), CoordinatorError> {
        let bad = |m: &str| Err(CoordinatorError::Config(m.to_string()));
        if self.cluster.shards == 0 {
            return bad("cluster.shards must be positive");
        }
        if self.cluster.replication_factor == 0 {
            return bad("cluster.replication_factor must be positive");
        }
        if self.cluster.max_value_bytes == 0 {
            return bad("cluster.max_value_bytes must be positive");
        }
        if !self.key_prefix.starts_with('/') || !self.key_prefix.ends_with('/') {
            return bad("key_prefix must start and end with '/'");
        }
        if self.node_lease_ms < 300 || self.leader_lease_ms < 300 {
            return bad("node_lease_ms and leader_lease_ms must be at least 300");
        }
        if self.reconcile_interval_ms == 0 || self.max_concurrent_moves == 0 {
            return bad("reconcile_interval_ms and max_concurrent_moves must be positive");
        }
        if self.learner_stall_ms == 0 {
            return bad("learner_stall_ms must be positive");
        }
        if self.split_rps > 0 && self.split_load_secs == 0 {
            return bad("split_load_secs must be positive when split_rps is set");
        }
        if !self.etcd.is_empty() && self.embedded_path.is_some() {
            return bad("give either etcd endpoints or an embedded_path, not both");
        }
        Ok(())
    }

    pub(crate) fn node_lease(&self) -> Duration {
        Duration::from_millis(self.node_lease_ms)
    }

    pub(crate) fn leader_lease(&self) -> Duration {
        Duration::from_millis(self.leader_lease_ms)
    }

    pub(crate) fn down_grace(&self) -> Duration {
        Duration::from_millis(self.down_grace_ms)
    }

    /// The leader balancer's rules (`transfers.rs`).
    pub(crate) fn transfers(&self) -> crate::transfers::Transfers {
        crate::transfers::Transfers::new(
            Duration::from_millis(self.transfer_timeout_ms),
            Duration::from_millis(self.transfer_backoff_ms),
            Duration::from_millis(self.balance_settle_ms),
        )
    }

    pub(crate) fn reconcile_interval(&self) -> Duration {
        Duration::from_millis(self.reconcile_interval_ms)
    }
}
