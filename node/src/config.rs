//! The node's configuration: a TOML file, with command-line flags on top
//! (the server binary merges them). Every field has a default except the
//! node id.
//!
//! ```toml
//! node_id = 1
//! listen = "127.0.0.1:7401"            # gRPC: clients, peers, coordinator
//! advertise = "http://127.0.0.1:7401"  # how others reach it (default: from listen)
//! data_dir = "/var/lib/tidepool"
//! metrics_listen = "127.0.0.1:9401"    # Prometheus text at /metrics (optional)
//!
//! [raft]
//! tick_ms = 100
//! durability = "synced"                # or "buffered"
//! max_value_bytes = 4194304            # largest blob content per put
//! lease_reads = true                   # linearizable reads on the leader's lease
//! quiesce_ticks = 20                   # idle shards stop ticking after this many (0: never)
//!
//! [engine]                             # per shard replica
//! wal_segment_mib = 64
//! append_pwrite_min_kib = 32           # larger Raft entries: pwritev, not the mapping
//!
//! [memory]                             # for all of the node's replicas
//! budget_mib = 0                       # 0: half the container's memory limit,
//!                                      # else a quarter of the machine's memory
//! index_percent = 50                   # for indexes; the rest caches values
//!
//! # A fixed cluster without a coordinator: every listed node hosts every
//! # shard. (With a coordinator, shards come from `NodeAdmin.OpenReplica`.)
//! [cluster]
//! shards = 4
//! replicas = [1, 2, 3]
//! peers = [{ id = 1, address = "http://127.0.0.1:7401" },
//!          { id = 2, address = "http://127.0.0.1:7402" },
//!          { id = 3, address = "http://127.0.0.1:7403" }]
//! namespaces = [{ name = "default", id = 1 },
//!               { name = "cas", id = 2, content_addressed = true }]
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use tidepool_engine::{CellLayout, Config as EngineConfig, Durability, KeySpaceConfig};
use tidepool_proto::v1::{
    ClusterMap, Namespace, NodeInfo, NodeState, ReplicaInfo, ReplicaRole, Retention, ShardInfo,
    retention,
};

use crate::error::{NodeError, Result};
use crate::replica::{BLOB_KEY_SPACE, ReplicaConfig};
use crate::shard::DriverConfig;

/// Everything a node is configured with.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Cluster-unique id, never 0. With a `[coordinator]` it may be left
    /// out: the coordinator assigns one and the data directory keeps it.
    #[serde(default)]
    pub node_id: u64,
    /// Address the gRPC server binds.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// URL others use to reach this node (default: `http://<listen>`).
    #[serde(default)]
    pub advertise: Option<String>,
    /// Where shard replicas live (one subdirectory each).
    #[serde(default = "default_data_dir")]
    pub data_dir: PathBuf,
    /// Address of the Prometheus `/metrics` endpoint; none by default.
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// Raft settings.
    #[serde(default)]
    pub raft: RaftSettings,
    /// Engine settings, per shard replica.
    #[serde(default)]
    pub engine: EngineSettings,
    /// Limits on what one client may hold of the node.
    #[serde(default)]
    pub limits: LimitSettings,
    /// The memory the replicas' indexes and value caches share.
    #[serde(default)]
    pub memory: MemorySettings,
    /// A fixed cluster (no coordinator).
    #[serde(default)]
    pub cluster: Option<StaticCluster>,
    /// Coordinators to register with (instead of a fixed `cluster`).
    #[serde(default)]
    pub coordinator: Option<CoordinatorLink>,
    /// Where this node sends Raft traffic for the given peers, instead of
    /// the address in the cluster map (a sidecar, a NAT, or a test
    /// harness's fault-injecting proxy). Clients are still sent to the
    /// map's addresses.
    #[serde(default)]
    pub peer_addresses: Vec<Peer>,
    /// Mutual TLS for every connection, in and out (`[tls]`: `cert`,
    /// `key`, `ca`, PEM files re-read when they change). Without it the
    /// node speaks plaintext and admits every caller: only for development
    /// and tests (`tidepool node` refuses to start so unless given
    /// `--insecure`).
    #[serde(default)]
    pub tls: Option<tidepool_security::TlsFiles>,
    /// Run without `[tls]` on purpose (what `--insecure` says); the
    /// `tidepool node` binary refuses to start with neither.
    #[serde(default)]
    pub insecure: bool,
}

/// How a node joins a coordinated cluster.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorLink {
    /// Coordinator URLs (`http://host:port`); any one of them will do.
    pub addresses: Vec<String>,
    /// Failure-domain label (for example the Kubernetes zone).
    #[serde(default)]
    pub zone: String,
    /// Disk bytes offered to the cluster; 0 means the data volume's size.
    #[serde(default)]
    pub capacity_bytes: u64,
}

fn default_listen() -> SocketAddr {
    "127.0.0.1:7401".parse().expect("valid")
}

fn default_data_dir() -> PathBuf {
    PathBuf::from("tidepool-data")
}

/// Raft and replication settings.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RaftSettings {
    /// Milliseconds per Raft tick.
    pub tick_ms: u64,
    /// Ticks without a leader before an election.
    pub election_ticks: usize,
    /// Each follower draws its election timeout from `election_ticks` to
    /// `election_ticks + election_spread_ticks - 1` ticks: a narrow spread
    /// bounds how long a shard whose leader froze stays without one (the
    /// leader lease depends on `election_ticks` alone, not on this).
    pub election_spread_ticks: usize,
    /// Ticks between heartbeats.
    pub heartbeat_ticks: usize,
    /// `synced` (fsync on a majority before an ack) or `buffered`.
    pub durability: String,
    /// Largest blob content a put may carry.
    pub max_value_bytes: u64,
    /// Compact the log past this many entries.
    pub compact_log_entries: u64,
    /// Most puts group-committed into one entry.
    pub max_batch_ops: usize,
    /// Most value bytes group-committed into one entry.
    pub max_batch_bytes: usize,
    /// Serve linearizable reads on the leader's lease (no heartbeat round
    /// per read batch) for `(election_ticks - 2) x tick_ms x 0.9` after a
    /// majority confirmed the leadership; `false`: a round per batch.
    pub lease_reads: bool,
    /// A shard whose leader had nothing in flight for this many ticks
    /// stops ticking and heartbeating on every replica until a request or
    /// message wakes it (`docs/design/quiescence.md`); the node wakes its
    /// followers if the leader's node goes silent. 0: never. Set the same
    /// on every node.
    pub quiesce_ticks: u32,
}

impl Default for RaftSettings {
    fn default() -> Self {
        Self {
            tick_ms: 100,
            election_ticks: 10,
            election_spread_ticks: 3,
            heartbeat_ticks: 2,
            durability: "synced".into(),
            max_value_bytes: 4 << 20,
            compact_log_entries: 10_000,
            max_batch_ops: 256,
            max_batch_bytes: 4 << 20,
            lease_reads: true,
            quiesce_ticks: 20,
        }
    }
}

/// Limits that keep one client (or many) from exhausting a node.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitSettings {
    /// A put stream that sends nothing for this long is dropped (its
    /// buffered bytes freed), milliseconds.
    pub put_idle_timeout_ms: u64,
    /// A put that would open its write session (`opens`) but that reached
    /// its proposal longer than this after its call began (a slow body,
    /// a slow content-addressed check) may not open it: it applies only if
    /// the shard knows the session (else `SESSION_EXPIRED`, nothing
    /// applied), milliseconds; at most 120,000. Exactly-once rests on it:
    /// the SDK opens a session again only within 2 minutes of a write's
    /// start, and a crowded shard may forget a session idle for 5; an
    /// attempt proposed later than that, after an earlier attempt applied
    /// and the session was forgotten, would apply a second time.
    pub opening_put_ms: u64,
    /// Most requests (HTTP/2 streams) in flight on one connection.
    pub max_streams_per_connection: u32,
    /// Largest client request message, bytes: a put chunk is 1 MiB; a
    /// batch-exists must fit (100,000 keys of up to 80 bytes do).
    pub max_request_bytes: usize,
    /// HTTP/2 keepalive: a ping after this long without traffic, and the
    /// connection is closed if the ping is not answered within as long
    /// again, milliseconds.
    pub keepalive_ms: u64,
    /// Bytes of blob content all requests of the node may hold at once
    /// (puts being received, gets being sent), MiB; a request that would
    /// exceed it is refused `OVERLOADED` instead of growing the node's
    /// memory. Requests made with one token hold at most half of it.
    pub in_flight_mib: u64,
    /// Write sessions one token may open each second on one shard this
    /// node leads, once its burst is spent (a shard remembers at most
    /// 100,000 sessions, shared by every client; beyond: `OVERLOADED`).
    pub session_opens_per_second: u64,
    /// Write sessions one token may open at once on one shard.
    pub session_opens_burst: u64,
}

/// Smallest `limits.max_request_bytes`: a put's 1 MiB piece and its
/// message framing.
const MIN_REQUEST_BYTES: usize = (1 << 20) + 4096;

impl Default for LimitSettings {
    fn default() -> Self {
        Self {
            put_idle_timeout_ms: 30_000,
            opening_put_ms: 60_000,
            max_streams_per_connection: 1024,
            max_request_bytes: 8 << 20,
            keepalive_ms: 30_000,
            in_flight_mib: 1024,
            session_opens_per_second: 100,
            session_opens_burst: 2_000,
        }
    }
}

/// Engine settings for each shard replica.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSettings {
    /// WAL segment size, MiB (every node of a cluster must use the same).
    pub wal_segment_mib: u64,
    /// Index log segment size, MiB (same on every node).
    pub index_segment_mib: u64,
    /// No longer read: the indexes' and value caches' memory is the node's
    /// (`[memory]`); set, the configuration is refused with that message.
    pub index_memory_mib: Option<u64>,
    /// Likewise.
    pub value_cache_mib: Option<u64>,
    /// Index cells (parallelism of index flushes; same on every node).
    pub cells: u32,
    /// Background relocation (space reclamation).
    pub relocation: bool,
    /// How often background relocation looks for segments to reclaim,
    /// milliseconds.
    pub relocation_interval_ms: u64,
    /// Threads of the node's worker pool, which runs the background work
    /// (allocation, periodic syncs, index flushes, maintenance) of every
    /// replica's engine; 0: twice the cores, at least 4. Relocation runs on
    /// a lane of its own at a lower CPU priority, with a quarter as many
    /// threads (at least one), and the logs' syncs on a lane of as many
    /// threads again. The replicas' Raft owners run on as many threads
    /// again, each owner always on the same one.
    pub workers: usize,
    /// Raft entries at least this long, KiB, are written to the WAL with
    /// one `pwritev` rather than copied into its mapping (0: every entry
    /// through the mapping). Through the file the kernel neither
    /// zero-fills the pages first nor takes a fault per page
    /// (`docs/design/wal-format.md`, "Large records through the file").
    pub append_pwrite_min_kib: u64,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            wal_segment_mib: 64,
            index_segment_mib: 16,
            index_memory_mib: None,
            value_cache_mib: None,
            cells: 1_024,
            relocation: true,
            relocation_interval_ms: 30_000,
            workers: 0,
            append_pwrite_min_kib: tidepool_engine::DEFAULT_APPEND_PWRITE_MIN_BYTES >> 10,
        }
    }
}

/// The node's memory budget: every replica's in-memory index and cached
/// values count against it together, so memory follows the data and the
/// hot set, not the number of replicas.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemorySettings {
    /// MiB for all replicas' indexes and value caches; 0: derived from the
    /// memory the node may use — half of its cgroup's (container's) memory
    /// limit, or without one a quarter of the machine's memory.
    pub budget_mib: u64,
    /// The indexes' share of the budget, percent (1–100); the value cache
    /// has the rest.
    pub index_percent: u64,
}

impl Default for MemorySettings {
    fn default() -> Self {
        Self {
            budget_mib: 0,
            index_percent: 50,
        }
    }
}

impl MemorySettings {
    /// The budget, bytes: configured, or derived from `limit` (the cgroup's
    /// memory limit, if any) and `total` (the machine's memory).
    pub fn budget_bytes_of(&self, limit: Option<u64>, total: u64) -> u64 {
        match (self.budget_mib, limit) {
            (0, Some(limit)) => limit.min(total) / 2,
            (0, None) => total / 4,
            (mib, _) => mib << 20,
        }
    }

    /// The budget on this machine, bytes.
    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes_of(cgroup_memory_limit(Path::new("/")), machine_memory())
    }

    /// (index bytes, value cache bytes).
    pub fn split(&self, budget: u64) -> (u64, u64) {
        let index = budget / 100 * self.index_percent + budget % 100 * self.index_percent / 100;
        (index, budget - index)
    }
}

/// The memory limit of the process's cgroup (v2 `memory.max`, or v1
/// `memory.limit_in_bytes`), if it has one, read under `root` (`/`; a
/// test's fake tree).
fn cgroup_memory_limit(root: &Path) -> Option<u64> {
    let own = std::fs::read_to_string(root.join("proc/self/cgroup")).unwrap_or_default();
    cgroup_limit_files(&own).iter().find_map(|file| {
        let text = std::fs::read_to_string(root.join(file)).ok()?;
        // "max" (v2) or a huge number (v1) means no limit.
        text.trim().parse::<u64>().ok().filter(|&b| b < 1 << 60)
    })
}

/// Where the limit of the cgroup `/proc/self/cgroup` names may be, most
/// specific first, relative to `/`. In a container the cgroup namespace
/// usually shows the container's cgroup as the root (`0::/`), so the
/// mount's own files are the container's.
fn cgroup_limit_files(proc_self_cgroup: &str) -> Vec<String> {
    // v2: "0::/path"; v1: "N:a,memory,b:/path".
    let v2 = proc_self_cgroup.lines().find_map(|l| l.strip_prefix("0::"));
    let v1 = proc_self_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    });
    let mut files = Vec::new();
    if let Some(path) = v2 {
        let path = path.trim_matches('/');
        if !path.is_empty() {
            files.push(format!("sys/fs/cgroup/{path}/memory.max"));
        }
        files.push("sys/fs/cgroup/memory.max".to_string());
    }
    if let Some(path) = v1 {
        let path = path.trim_matches('/');
        if !path.is_empty() {
            files.push(format!("sys/fs/cgroup/memory/{path}/memory.limit_in_bytes"));
        }
        files.push("sys/fs/cgroup/memory/memory.limit_in_bytes".to_string());
    }
    files
}

/// The machine's memory, bytes (`MemTotal`; 4 GiB if unreadable).
fn machine_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(4 << 30, |kib| kib << 10)
}

/// A fixed cluster: peers, shards, namespaces.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticCluster {
    /// Number of shards splitting the hash space evenly.
    pub shards: u32,
    /// Node ids hosting every shard (founding voters).
    pub replicas: Vec<u64>,
    /// Every node's address.
    pub peers: Vec<Peer>,
    /// Namespaces.
    #[serde(default = "default_namespaces")]
    pub namespaces: Vec<NamespaceSpec>,
    /// Client tokens (with TLS, the only way a client gets in; clusters
    /// with a coordinator manage theirs with `tidectl token`).
    #[serde(default)]
    pub tokens: Vec<StaticToken>,
}

/// A client token of a fixed cluster, as its hash.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticToken {
    /// Its name.
    pub name: String,
    /// SHA-256 of the secret, 64 hex digits.
    pub sha256: String,
    /// Every method of the client plane in every namespace.
    #[serde(default)]
    pub admin: bool,
    /// `NAMESPACE=ROLE[,ROLE...]` (roles `read`, `write`, `append-only`,
    /// `delete`; namespace `*` for all).
    #[serde(default)]
    pub grants: Vec<String>,
}

impl StaticToken {
    /// The record the map holds, or what is wrong with the entry.
    pub fn record(&self) -> std::result::Result<tidepool_proto::v1::TokenRecord, String> {
        let hex = self.sha256.trim();
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "token {:?}: sha256 must be 64 hex digits",
                self.name
            ));
        }
        let sha256 = (0..32)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex checked"))
            .collect();
        let mut grants = Vec::new();
        for grant in &self.grants {
            let (namespace, roles) = grant.split_once('=').ok_or_else(|| {
                format!(
                    "token {:?}: grant {grant:?} is not NAMESPACE=ROLES",
                    self.name
                )
            })?;
            let roles = roles
                .split(',')
                .map(|r| {
                    tidepool_security::guard::role_of(r.trim())
                        .map(|r| r as i32)
                        .ok_or_else(|| format!("token {:?}: unknown role {r:?}", self.name))
                })
                .collect::<std::result::Result<Vec<_>, _>>()?;
            grants.push(tidepool_proto::v1::TokenGrant {
                namespace: namespace.to_string(),
                roles,
            });
        }
        Ok(tidepool_proto::v1::TokenRecord {
            name: self.name.clone(),
            sha256,
            admin: self.admin,
            grants,
            created_ms: 0,
        })
    }
}

/// A node and its address.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peer {
    /// Node id.
    pub id: u64,
    /// gRPC URL, `http://host:port`.
    pub address: String,
}

/// A namespace of a fixed cluster.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceSpec {
    /// Name.
    pub name: String,
    /// Id, unique, never 0.
    pub id: u32,
    /// Keys are SHA-256 digests of the content.
    #[serde(default)]
    pub content_addressed: bool,
    /// Blobs live this many epochs after their last write or touch; unset:
    /// durable (never dropped by epochs).
    #[serde(default)]
    pub retain_epochs: Option<u32>,
}

fn default_namespaces() -> Vec<NamespaceSpec> {
    vec![NamespaceSpec {
        name: "default".into(),
        id: 1,
        content_addressed: false,
        retain_epochs: None,
    }]
}

impl NodeConfig {
    /// A configuration with defaults for node `node_id`.
    pub fn new(node_id: u64) -> Self {
        toml::from_str(&format!("node_id = {node_id}")).expect("defaults parse")
    }

    /// Reads a TOML file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| NodeError::Config(format!("cannot read {}: {e}", path.display())))?;
        Self::from_toml(&text).map_err(|e| NodeError::Config(format!("{}: {e}", path.display())))
    }

    /// Parses TOML text.
    pub fn from_toml(text: &str) -> Result<Self> {
        let config: NodeConfig =
            toml::from_str(text).map_err(|e| NodeError::Config(e.to_string()))?;
        Ok(config)
    }

    /// Checks the settings; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(NodeError::Config(m));
        if self.node_id == 0 && self.coordinator.is_none() {
            return bad("node_id must not be 0 (only a coordinator assigns ids)".into());
        }
        if self.cluster.is_some() && self.coordinator.is_some() {
            return bad("give either a fixed [cluster] or a [coordinator], not both".into());
        }
        if let Some(link) = &self.coordinator
            && link.addresses.is_empty()
        {
            return bad("coordinator.addresses must name at least one coordinator".into());
        }
        self.durability()?;
        if self.raft.tick_ms == 0 || self.raft.heartbeat_ticks == 0 {
            return bad("raft.tick_ms and raft.heartbeat_ticks must be positive".into());
        }
        if self.raft.election_ticks <= self.raft.heartbeat_ticks {
            return bad("raft.election_ticks must exceed raft.heartbeat_ticks".into());
        }
        if self.raft.election_spread_ticks == 0 {
            return bad("raft.election_spread_ticks must be at least 1".into());
        }
        if self.raft.max_value_bytes == 0 || self.raft.max_value_bytes > 64 << 20 {
            return bad("raft.max_value_bytes must be between 1 and 64 MiB".into());
        }
        // One entry's ops are one engine record when appended (at most
        // 65,535 items): more could never be stored.
        if self.raft.max_batch_ops == 0 || self.raft.max_batch_ops > 65_000 {
            return bad("raft.max_batch_ops must be between 1 and 65000".into());
        }
        // Limits a request could never get through (it would be refused
        // as OVERLOADED or TIMEOUT, retryable, forever).
        if self.limits.put_idle_timeout_ms == 0 || self.limits.max_streams_per_connection == 0 {
            return bad(
                "limits.put_idle_timeout_ms and limits.max_streams_per_connection must be positive"
                    .into(),
            );
        }
        if self.limits.session_opens_per_second == 0 || self.limits.session_opens_burst == 0 {
            return bad(
                "limits.session_opens_per_second and limits.session_opens_burst must be positive"
                    .into(),
            );
        }
        if self.limits.opening_put_ms == 0 || self.limits.opening_put_ms > 120_000 {
            return bad("limits.opening_put_ms must be between 1 and 120000".into());
        }
        if self.limits.max_request_bytes < MIN_REQUEST_BYTES {
            return bad(format!(
                "limits.max_request_bytes ({}) must hold a put's 1 MiB piece and its framing: at least {MIN_REQUEST_BYTES}",
                self.limits.max_request_bytes
            ));
        }
        if self.limits.in_flight_mib.saturating_mul(1 << 20) < 2 * self.raft.max_value_bytes {
            return bad(format!(
                "limits.in_flight_mib ({} MiB) must hold two of the largest values (raft.max_value_bytes, {} bytes): a manifest being checked holds one of its chunks",
                self.limits.in_flight_mib, self.raft.max_value_bytes
            ));
        }
        for (key, set) in [
            ("index_memory_mib", self.engine.index_memory_mib),
            ("value_cache_mib", self.engine.value_cache_mib),
        ] {
            if set.is_some() {
                return bad(format!(
                    "engine.{key} is no longer read: the replicas' indexes and value caches share \
                     the node's budget, [memory] budget_mib (and index_percent)"
                ));
            }
        }
        if !(1..=100).contains(&self.memory.index_percent) {
            return bad("memory.index_percent must be between 1 and 100".into());
        }
        if self.engine.wal_segment_mib << 20 < 2 * self.max_record_bytes() {
            return bad(format!(
                "engine.wal_segment_mib ({}) must hold two of the largest entries ({} bytes)",
                self.engine.wal_segment_mib,
                self.max_record_bytes()
            ));
        }
        if let Some(cluster) = &self.cluster {
            if cluster.shards == 0 {
                return bad("cluster.shards must be positive".into());
            }
            if cluster.replicas.is_empty() {
                return bad("cluster.replicas must name at least one node".into());
            }
            for token in &cluster.tokens {
                token
                    .record()
                    .map_err(|m| NodeError::Config(format!("cluster.tokens: {m}")))?;
            }
            if !cluster.peers.iter().any(|p| p.id == self.node_id) {
                return bad(format!(
                    "cluster.peers has no entry for this node (node_id {})",
                    self.node_id
                ));
            }
            let mut ids: Vec<u64> = cluster.peers.iter().map(|p| p.id).collect();
            ids.sort_unstable();
            if let Some(pair) = ids.windows(2).find(|w| w[0] == w[1]) {
                return bad(format!("cluster.peers lists node {} twice", pair[0]));
            }
            let mut names: Vec<(&str, u32)> = cluster
                .namespaces
                .iter()
                .map(|ns| (ns.name.as_str(), ns.id))
                .collect();
            names.sort_unstable();
            if let Some(pair) = names.windows(2).find(|w| w[0].0 == w[1].0) {
                return bad(format!("namespace {:?} is listed twice", pair[0].0));
            }
            names.sort_unstable_by_key(|(_, id)| *id);
            if let Some(pair) = names.windows(2).find(|w| w[0].1 == w[1].1) {
                return bad(format!(
                    "namespaces {:?} and {:?} share id {}",
                    pair[0].0, pair[1].0, pair[0].1
                ));
            }
            for id in &cluster.replicas {
                if !cluster.peers.iter().any(|p| p.id == *id) {
                    return bad(format!(
                        "cluster.replicas names node {id}, which has no peer entry"
                    ));
                }
            }
            for ns in &cluster.namespaces {
                tidepool_proto::validate_namespace_name(&ns.name)
                    .map_err(|e| NodeError::Config(format!("namespace {:?}: {e}", ns.name)))?;
                // 0 is the untagged records' tag, the largest the name
                // index's.
                if ns.id == 0 || ns.id == u32::MAX {
                    return bad(format!(
                        "namespace {:?}: id must be 1 to {} (0 and {} are reserved)",
                        ns.name,
                        u32::MAX - 1,
                        u32::MAX
                    ));
                }
            }
        }
        self.engine_config(self.data_dir.clone())
            .validate()
            .map_err(|e| NodeError::Config(format!("engine: {e}")))
    }

    /// The durability writes need before an ack.
    pub fn durability(&self) -> Result<Durability> {
        match self.raft.durability.as_str() {
            "synced" => Ok(Durability::Synced),
            "buffered" => Ok(Durability::Buffered),
            other => Err(NodeError::Config(format!(
                "raft.durability must be \"synced\" or \"buffered\", not {other:?}"
            ))),
        }
    }

    /// The URL peers and clients use for this node.
    pub fn advertise(&self) -> String {
        self.advertise.clone().unwrap_or_else(|| {
            let scheme = if self.tls.is_some() { "https" } else { "http" };
            format!("{scheme}://{}", self.listen)
        })
    }

    /// Largest engine record: a batch of values plus headers.
    fn max_record_bytes(&self) -> u64 {
        (self
            .raft
            .max_value_bytes
            .max(self.raft.max_batch_bytes as u64))
            + (1 << 20)
    }

    /// The threads of the node's worker pool: (normal lane, low lane).
    pub fn worker_threads(&self) -> (usize, usize) {
        let threads = match self.engine.workers {
            0 => {
                let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
                (2 * cores).max(4)
            }
            n => n,
        };
        (threads, (threads / 4).max(1))
    }

    /// The memory budget every replica's engine shares.
    pub fn memory_budget(&self) -> tidepool_engine::MemoryBudget {
        let (index, cache) = self.memory.split(self.memory.budget_bytes());
        tidepool_engine::MemoryBudget::new(index, cache)
    }

    /// The engine configuration of a replica in `dir`.
    pub fn engine_config(&self, dir: PathBuf) -> EngineConfig {
        let e = &self.engine;
        EngineConfig {
            dir,
            wal_segment_bytes: e.wal_segment_mib << 20,
            index_segment_bytes: e.index_segment_mib << 20,
            max_value_bytes: self.raft.max_value_bytes + crate::blob::HEADER_BYTES as u64 + 4096,
            spare_segments: 1,
            relocation_enabled: e.relocation,
            relocation_interval_ms: e.relocation_interval_ms,
            // The Raft log is records appended before they are applied:
            // nothing may delete them before the log has read itself back.
            retain_log_until_set: true,
            // Committed entries are applied again after a restart from the
            // open's replay position: snapshots keep it until they are.
            hold_replay_until_released: true,
            append_pwrite_min_bytes: e.append_pwrite_min_kib.saturating_mul(1024),
            key_spaces: vec![
                KeySpaceConfig {
                    name: BLOB_KEY_SPACE.into(),
                    key_bytes: 32,
                    layout: CellLayout::Uniform { cells: e.cells },
                },
                crate::names::key_space_config(e.cells),
            ],
            ..EngineConfig::default()
        }
    }

    /// The Raft settings of a replica of `shard_id`.
    pub fn replica_config(&self, shard_id: u32) -> Result<ReplicaConfig> {
        let mut config = ReplicaConfig::new(shard_id, self.node_id);
        config.address = self.advertise();
        config.election_ticks = self.raft.election_ticks;
        config.election_spread_ticks = self.raft.election_spread_ticks;
        config.heartbeat_ticks = self.raft.heartbeat_ticks;
        config.durability = self.durability()?;
        config.max_command_bytes = self.max_record_bytes() as usize;
        config.compact_log_entries = self.raft.compact_log_entries;
        config.early_campaign = true;
        config.quiesce_ticks = self.raft.quiesce_ticks;
        if self.raft.lease_reads {
            config.lease = crate::replica::safe_lease(
                Duration::from_millis(self.raft.tick_ms),
                self.raft.election_ticks,
            );
        }
        Ok(config)
    }

    /// How shard owners run.
    pub fn driver_config(&self) -> DriverConfig {
        DriverConfig {
            tick: Duration::from_millis(self.raft.tick_ms),
            max_batch_ops: self.raft.max_batch_ops,
            max_batch_bytes: self.raft.max_batch_bytes,
            ..DriverConfig::default()
        }
    }

    /// The cluster map of a fixed cluster (version 1), if configured.
    pub fn static_map(&self) -> Option<ClusterMap> {
        let cluster = self.cluster.as_ref()?;
        let shard_infos = tidepool_proto::even_shard_ranges(cluster.shards)
            .into_iter()
            .zip(1..)
            .map(|((start, end), shard_id)| ShardInfo {
                shard_id,
                hash_start: start,
                hash_end: end,
                replicas: cluster
                    .replicas
                    .iter()
                    .map(|id| ReplicaInfo {
                        node_id: *id,
                        role: ReplicaRole::Voter as i32,
                    })
                    .collect(),
                leader_hint: 0,
                conf_version: 0,
                split: None,
            })
            .collect();
        Some(ClusterMap {
            version: 1,
            cluster_id: "static".into(),
            next_shard_id: cluster.shards + 1,
            // A fixed cluster creates no namespace: one above its largest.
            next_namespace_id: 0,
            epoch: 1,
            replication_factor: cluster.replicas.len() as u32,
            max_value_bytes: self.raft.max_value_bytes,
            nodes: cluster
                .peers
                .iter()
                .map(|p| NodeInfo {
                    node_id: p.id,
                    address: p.address.clone(),
                    zone: String::new(),
                    capacity_bytes: 0,
                    state: NodeState::Up as i32,
                    // A fixed cluster's node certificates are named by id.
                    identity: format!("node-{}", p.id),
                    scale_down: false,
                })
                .collect(),
            shards: shard_infos,
            namespaces: cluster
                .namespaces
                .iter()
                .map(|ns| Namespace {
                    name: ns.name.clone(),
                    id: ns.id,
                    content_addressed: ns.content_addressed,
                    retention: Some(Retention {
                        policy: Some(match ns.retain_epochs {
                            None => retention::Policy::Durable(retention::Durable {}),
                            Some(epochs) => {
                                retention::Policy::Retain(retention::RetainEpochs { epochs })
                            }
                        }),
                    }),
                    created_epoch: 1,
                })
                .collect(),
            tokens: cluster
                .tokens
                .iter()
                .filter_map(|t| t.record().ok())
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The annotated node configuration in the README parses and passes
    /// validation (docs are code).
    #[test]
    fn the_readme_example_configuration_is_valid() {
        let readme = include_str!("../../README.md");
        let block = readme
            .split("```toml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("a toml block in the README");
        let config: NodeConfig = toml::from_str(block).expect("the README's TOML parses");
        config
            .validate()
            .expect("the README's configuration is valid");
        assert_eq!(config.limits.put_idle_timeout_ms, 30_000);
        let map = config.static_map().expect("a fixed cluster");
        assert!(map.namespaces.iter().any(|n| n.name == "ci"
            && matches!(
                n.retention.as_ref().and_then(|r| r.policy.as_ref()),
                Some(retention::Policy::Retain(r)) if r.epochs == 2
            )));
        // Its token reaches the map as a hash with its roles.
        let token = &map.tokens[0];
        assert_eq!(token.name, "app");
        assert_eq!(token.sha256.len(), 32);
        assert_eq!(token.grants[1].namespace, "chunks");
        assert_eq!(
            token.grants[1].roles().collect::<Vec<_>>(),
            [
                tidepool_proto::v1::Role::Read,
                tidepool_proto::v1::Role::AppendOnly
            ]
        );
        assert!(config.tls.is_some());
    }

    #[test]
    fn the_memory_budget_is_the_nodes_configured_or_derived() {
        let mut memory = MemorySettings::default();
        // Derived: half a container's limit, else a quarter of the machine.
        assert_eq!(memory.budget_bytes_of(Some(8 << 30), 64 << 30), 4 << 30);
        assert_eq!(memory.budget_bytes_of(Some(128 << 30), 64 << 30), 32 << 30);
        assert_eq!(memory.budget_bytes_of(None, 64 << 30), 16 << 30);
        memory.budget_mib = 1024;
        assert_eq!(memory.budget_bytes_of(Some(8 << 30), 64 << 30), 1 << 30);
        assert_eq!(memory.split(1 << 30), (512 << 20, 512 << 20));
        memory.index_percent = 100;
        assert_eq!(memory.split(1 << 30), (1 << 30, 0));
        memory.index_percent = 33;
        let (index, cache) = memory.split(1_000_003);
        assert_eq!((index, index + cache), (330_000, 1_000_003));
        // On this machine it is positive and at most the machine's memory.
        let here = MemorySettings::default().budget_bytes();
        assert!(here > 0 && here <= machine_memory(), "{here}");
    }

    /// The container's limit is found in cgroup v2 and v1 trees as a
    /// container runtime lays them out (a fake tree under a temporary
    /// root), and "no limit" is told from a limit.
    #[test]
    fn the_container_memory_limit_is_read_from_its_cgroup() {
        fn write(root: &Path, path: &str, text: &str) {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // Nothing readable: no limit.
        assert_eq!(cgroup_memory_limit(root), None);
        // v2, cgroup namespace: the container's cgroup is the root.
        write(root, "proc/self/cgroup", "0::/\n");
        write(root, "sys/fs/cgroup/memory.max", "4294967296\n");
        assert_eq!(cgroup_memory_limit(root), Some(4 << 30));
        write(root, "sys/fs/cgroup/memory.max", "max\n");
        assert_eq!(cgroup_memory_limit(root), None, "v2 without a limit");
        // v2 without a namespace: the process's own cgroup path.
        write(
            root,
            "proc/self/cgroup",
            "0::/kubepods/burstable/pod1/abc\n",
        );
        write(
            root,
            "sys/fs/cgroup/kubepods/burstable/pod1/abc/memory.max",
            "536870912\n",
        );
        assert_eq!(cgroup_memory_limit(root), Some(512 << 20));
        // v1: the memory controller's line, among others.
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        write(
            root,
            "proc/self/cgroup",
            "12:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n1:name=systemd:/docker/c1\n",
        );
        let v1 = "sys/fs/cgroup/memory/docker/c1/memory.limit_in_bytes";
        write(root, v1, "1073741824\n");
        assert_eq!(cgroup_memory_limit(root), Some(1 << 30));
        write(root, v1, "9223372036854771712\n");
        assert_eq!(cgroup_memory_limit(root), None, "v1 without a limit");
        // The budget then is half the limit.
        assert_eq!(
            MemorySettings::default().budget_bytes_of(Some(1 << 30), 64 << 30),
            512 << 20
        );
    }

    #[test]
    fn per_replica_memory_settings_are_refused_with_where_they_went() {
        for (text, reason) in [
            ("[engine]\nindex_memory_mib = 128\n", "[memory] budget_mib"),
            ("[engine]\nvalue_cache_mib = 64\n", "[memory] budget_mib"),
            ("[memory]\nindex_percent = 0\n", "index_percent"),
            ("[memory]\nbudget = 5\n", "unknown field"),
        ] {
            let error = NodeConfig::from_toml(&format!("node_id = 1\n{text}"))
                .and_then(|c| c.validate())
                .unwrap_err()
                .to_string();
            assert!(error.contains(reason), "{text}: {error}");
        }
    }

    #[test]
    fn raft_timings_are_checked_and_the_election_spread_reaches_the_replicas() {
        for (text, reason) in [
            (
                "[raft]\nelection_spread_ticks = 0\n",
                "election_spread_ticks",
            ),
            (
                "[raft]\nelection_ticks = 2\n",
                "must exceed raft.heartbeat_ticks",
            ),
        ] {
            let error = NodeConfig::from_toml(&format!("node_id = 1\n{text}"))
                .and_then(|c| c.validate())
                .unwrap_err()
                .to_string();
            assert!(error.contains(reason), "{text}: {error}");
        }
        let config = NodeConfig::from_toml("node_id = 1\n[raft]\nelection_spread_ticks = 5\n")
            .expect("parses");
        config.validate().expect("valid");
        let replica = config.replica_config(1).expect("replica config");
        assert_eq!(
            (replica.election_ticks, replica.election_spread_ticks),
            (10, 5)
        );
        let default = NodeConfig::from_toml("node_id = 1\n").expect("parses");
        assert_eq!(default.replica_config(1).unwrap().election_spread_ticks, 3);
    }

    #[test]
    fn the_pwrite_threshold_reaches_the_replicas_engines() {
        let dir = PathBuf::from("d");
        let default = NodeConfig::from_toml("node_id = 1\n").expect("parses");
        assert_eq!(
            default.engine_config(dir.clone()).append_pwrite_min_bytes,
            tidepool_engine::DEFAULT_APPEND_PWRITE_MIN_BYTES
        );
        for (kib, bytes) in [(0, 0), (4, 4096), (i64::MAX as u64, u64::MAX)] {
            let text = format!("node_id = 1\n[engine]\nappend_pwrite_min_kib = {kib}\n");
            let config = NodeConfig::from_toml(&text).expect("parses");
            config.validate().expect("valid");
            assert_eq!(
                config.engine_config(dir.clone()).append_pwrite_min_bytes,
                bytes
            );
        }
    }

    /// Limits no request could get through are refused at start, naming
    /// the setting (before, every put was refused as `OVERLOADED` or
    /// `TIMEOUT`, which clients retry forever).
    #[test]
    fn limits_no_request_fits_are_refused() {
        for (limits, reason) in [
            ("in_flight_mib = 0", "in_flight_mib"),
            ("put_idle_timeout_ms = 0", "put_idle_timeout_ms"),
            (
                "max_streams_per_connection = 0",
                "max_streams_per_connection",
            ),
            ("max_request_bytes = 65536", "max_request_bytes"),
            ("session_opens_per_second = 0", "session_opens_per_second"),
            ("session_opens_burst = 0", "session_opens_burst"),
        ] {
            let text = format!(
                "node_id = 1\n[limits]\n{limits}\n[cluster]\nshards = 1\nreplicas = [1]\npeers = [{{ id = 1, address = \"http://a\" }}]\n"
            );
            let error = NodeConfig::from_toml(&text)
                .and_then(|c| c.validate())
                .unwrap_err()
                .to_string();
            assert!(error.contains(reason), "{limits}: {error}");
        }
        let text = "node_id = 1\n[limits]\nin_flight_mib = 2\n[raft]\nmax_value_bytes = 1048576\n[cluster]\nshards = 1\nreplicas = [1]\npeers = [{ id = 1, address = \"http://a\" }]\n";
        NodeConfig::from_toml(text)
            .and_then(|c| c.validate())
            .expect("a budget holding two of the largest values is valid");
    }

    #[test]
    fn bad_static_tokens_are_refused_with_their_reason() {
        for (token, reason) in [
            (r#"{ name = "t", sha256 = "abc" }"#, "64 hex digits"),
            (
                r#"{ name = "t", sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", grants = ["default"] }"#,
                "NAMESPACE=ROLES",
            ),
            (
                r#"{ name = "t", sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", grants = ["default=owner"] }"#,
                "unknown role",
            ),
        ] {
            let text = format!(
                "node_id = 1\n[cluster]\nshards = 1\nreplicas = [1]\npeers = [{{ id = 1, address = \"http://a\" }}]\ntokens = [{token}]\n"
            );
            let error = NodeConfig::from_toml(&text)
                .and_then(|c| c.validate())
                .unwrap_err()
                .to_string();
            assert!(error.contains(reason), "{error}");
        }
    }

    #[test]
    fn a_file_with_a_static_cluster_parses_and_maps_the_whole_hash_space() {
        let config = NodeConfig::from_toml(
            r#"
            node_id = 2
            listen = "127.0.0.1:7402"
            data_dir = "/tmp/x"
            [raft]
            tick_ms = 50
            [cluster]
            shards = 3
            replicas = [1, 2]
            peers = [{ id = 1, address = "http://a" }, { id = 2, address = "http://b" }]
            namespaces = [{ name = "cas", id = 5, content_addressed = true }]
            "#,
        )
        .unwrap();
        config.validate().unwrap();
        assert_eq!(config.advertise(), "http://127.0.0.1:7402");
        let map = config.static_map().unwrap();
        assert_eq!(map.shards.len(), 3);
        assert_eq!(map.shards[0].hash_start, 0);
        assert_eq!(map.shards[2].hash_end, u64::MAX);
        for pair in map.shards.windows(2) {
            assert_eq!(pair[0].hash_end + 1, pair[1].hash_start);
        }
        assert!(map.namespaces[0].content_addressed);
    }

    #[test]
    fn bad_settings_are_named() {
        let err = |text: &str| {
            NodeConfig::from_toml(text)
                .and_then(|c| c.validate())
                .unwrap_err()
                .to_string()
        };
        assert!(err("node_id = 0").contains("node_id"));
        assert!(err("node_id = 1\n[raft]\nmax_batch_ops = 70000").contains("max_batch_ops"));
        assert!(err("node_id = 1\n[raft]\ndurability = \"maybe\"").contains("durability"));
        assert!(err("node_id = 1\nbogus = 3").contains("bogus"));
        assert!(
            err("node_id = 1\n[cluster]\nshards = 2\nreplicas = [1, 9]\npeers = [{ id = 1, address = \"x\" }]")
                .contains("node 9")
        );
        assert!(err("node_id = 1\n[engine]\nwal_segment_mib = 4").contains("wal_segment_mib"));
        let cluster = |peers: &str, namespaces: &str| {
            format!(
                "node_id = 1\n[cluster]\nshards = 1\nreplicas = [1]\npeers = [{peers}]\nnamespaces = [{namespaces}]"
            )
        };
        assert!(
            err(&cluster("{ id = 2, address = \"x\" }", "")).contains("no entry for this node")
        );
        assert!(
            err(&cluster(
                "{ id = 1, address = \"x\" }, { id = 1, address = \"y\" }",
                ""
            ))
            .contains("node 1 twice")
        );
        let one = "{ id = 1, address = \"x\" }";
        assert!(
            err(&cluster(
                one,
                "{ name = \"a\", id = 1 }, { name = \"a\", id = 2 }"
            ))
            .contains("\"a\" is listed twice")
        );
        assert!(
            err(&cluster(
                one,
                "{ name = \"a\", id = 3 }, { name = \"b\", id = 3 }"
            ))
            .contains("share id 3")
        );
        for reserved in [0, u32::MAX] {
            assert!(
                err(&cluster(
                    one,
                    &format!("{{ name = \"a\", id = {reserved} }}")
                ))
                .contains("id must be 1 to 4294967294"),
                "{reserved}"
            );
        }
    }
}
