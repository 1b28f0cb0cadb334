//! The running node: its shard replicas, the cluster map it routes by, the
//! gRPC services (`BlobService`, `RaftTransport`, `NodeAdmin`) and the
//! metrics endpoint.
//!
//! Layout of the data directory:
//!
//! ```text
//! <data_dir>/shards/<shard id>/   one replica (see `store.rs`), with
//!                                 SHARD: its ShardInfo (protobuf), so a
//!                                 restarted node knows the range it serves
//! ```

mod admin;
mod blobs;
mod coordination;
mod errors;
mod liveness;
mod manifests;
mod metrics;
mod opens;
mod raft_service;
mod transport;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::{Mutex, RwLock};
use prost::Message as _;
use tidepool_engine::storage::{FileStorage, read_whole_file, write_file_atomically};
use tidepool_proto::v1::blob_service_server::BlobServiceServer;
use tidepool_proto::v1::node_admin_server::NodeAdminServer;
use tidepool_proto::v1::raft_transport_server::RaftTransportServer;
use tidepool_proto::v1::{ClusterMap, ErrorCode, Namespace, NodeAddress, ShardInfo};
use tidepool_proto::{ErrorInfo, StorageKey, hash_position};
use tidepool_security::guard::{Grant, TokenTable};
use tidepool_security::{Authority, GuardLayer, Security, Tls};
use tokio::sync::oneshot;

use crate::config::NodeConfig;
use crate::error::{NodeError, Result};
use crate::shard::ShardHandle;
use crate::snapshot::Outbox;
use crate::store::ReplicaStore;
pub use coordination::prepare_stop;
pub use metrics::{NodeMetrics, OPERATIONS, code_label};
use transport::Transport;

/// Largest gRPC message the node sends or accepts (Raft batches carry
/// whole entries).
pub(crate) const MAX_GRPC_MESSAGE: usize = 256 << 20;

use crate::store::SHARD_FILE;

/// How long a stopping node waits for requests in flight.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A shard replica hosted here, with the range it serves.
struct Hosted {
    handle: Arc<ShardHandle>,
    info: ShardInfo,
}

impl Hosted {
    /// The range it serves: the group's replicated range, or the map's for
    /// a group that has none recorded. A map never widens a range a split
    /// narrowed (`docs/design/splits.md`).
    fn range(&self) -> (u64, u64) {
        self.handle
            .range()
            .unwrap_or((self.info.hash_start, self.info.hash_end))
    }

    /// Its shard as the map says, with the range it serves.
    fn info(&self) -> ShardInfo {
        let (hash_start, hash_end) = self.range();
        ShardInfo {
            hash_start,
            hash_end,
            ..self.info.clone()
        }
    }
}

/// A storage node.
pub struct Node {
    /// Its configuration.
    pub config: NodeConfig,
    map: ArcSwap<ClusterMap>,
    /// The open replicas. Held only to look up, insert or remove: every
    /// request takes it to find its replica.
    shards: RwLock<BTreeMap<u32, Hosted>>,
    /// Held while a replica opens or closes, so two never open the same
    /// shard and a close waits for an opening under way; the files are
    /// made and synced under this lock, not under `shards`'s.
    opening: parking_lot::Mutex<()>,
    outbox: Arc<Outbox>,
    transport: Arc<Transport>,
    /// Request counters and latencies.
    pub metrics: NodeMetrics,
    /// The in-flight budget (`limits.in_flight_mib`), in KiB permits.
    in_flight: Arc<tokio::sync::Semaphore>,
    /// KiB of it each token holds now (by token name): one token takes at
    /// most half.
    in_flight_by_token: TokenTally,
    /// Write sessions each token may still open on each shard this node
    /// leads (`opens.rs`).
    pub(crate) session_opens: opens::SessionOpens,
    /// Manifest checks running at once (`manifests::verify`): each reads
    /// every chunk a manifest lists from the cluster.
    pub(crate) manifest_checks: Arc<tokio::sync::Semaphore>,
    /// Becomes true when the node begins to stop; long-lived streams
    /// (peers' Raft traffic) end on it.
    stopping: tokio::sync::watch::Sender<bool>,
    /// How it dials peers and coordinators (TLS material, no token).
    pub(crate) security: Security,
    /// The client tokens of the current map.
    tokens: Arc<Tokens>,
    /// Channels to peers for reads (manifest verification), by address.
    peer_channels:
        parking_lot::Mutex<std::collections::HashMap<String, tidepool_security::Channel>>,
    /// What every replica's engine shares: the worker pool running their
    /// background work, and the node's memory budget.
    engines: tidepool_engine::Host,
    /// Set once the replicas on disk are open: groups split off hosted
    /// ones are opened from then on.
    opened: std::sync::atomic::AtomicBool,
    /// One pass opening split-off groups at a time.
    adopting: parking_lot::Mutex<()>,
    /// The hold on the data directory ([`lock_data_dir`]), let go once
    /// every replica is closed.
    data_dir_lock: parking_lot::Mutex<Option<tidepool_engine::storage::DirLock>>,
    /// Run the replicas' Raft owners: pools of one thread, a replica's
    /// owner always in the same one (chosen by shard id). One shared pool,
    /// where an owner ran on whichever thread was free, measured about 20%
    /// fewer puts on a 4-shard dev cluster.
    owners: Vec<tidepool_engine::WorkerPool>,
    /// The ids of the current map's namespaces, shown to the replicas
    /// (`ReplicaConfig::namespaces`).
    namespace_ids: crate::replica::NamespaceIds,
    /// When each peer node was last heard from (quiesced followers rely
    /// on it instead of election timeouts).
    pub(crate) liveness: liveness::PeerLiveness,
}

/// The tokens a node accepts: those of its current map.
#[derive(Default)]
struct Tokens(ArcSwap<TokenTable>);

impl Authority for Tokens {
    fn token(&self, hash: &[u8; 32]) -> Option<Arc<Grant>> {
        self.0.load().get(hash)
    }
}

/// Loads the TLS material a configuration names (none: insecure).
pub fn security_of(config: &NodeConfig) -> Result<Security> {
    let tls = match &config.tls {
        Some(files) => {
            Some(Tls::load(files.clone()).map_err(|e| NodeError::Config(format!("tls: {e}")))?)
        }
        None => None,
    };
    Ok(Security { tls, token: None })
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("node_id", &self.config.node_id)
            .finish()
    }
}

impl Node {
    /// Opens the node: validates the configuration, reopens the replicas
    /// in the data directory and, for a fixed cluster, founds or reopens
    /// every shard it is a replica of. Must run inside a tokio runtime.
    pub fn open(config: NodeConfig) -> Result<Arc<Node>> {
        let security = security_of(&config)?;
        Self::open_with(config, security)
    }

    /// [`Node::open`] with TLS material already loaded.
    pub fn open_with(config: NodeConfig, security: Security) -> Result<Arc<Node>> {
        config.validate()?;
        let lock = lock_data_dir(&config.data_dir)?;
        Self::open_locked(config, security, lock)
    }

    /// [`Node::open_with`] holding the data directory already.
    fn open_locked(
        config: NodeConfig,
        security: Security,
        data_dir_lock: tidepool_engine::storage::DirLock,
    ) -> Result<Arc<Node>> {
        config.validate()?;
        let shards_dir = config.data_dir.join("shards");
        create_dir_durably(&shards_dir)?;
        let map = config.static_map().unwrap_or_default();
        let in_flight_kib = config.limits.in_flight_mib.saturating_mul(1024);
        let session_opens = opens::SessionOpens::new(
            config.limits.session_opens_per_second,
            config.limits.session_opens_burst,
        );
        let (threads, low_threads) = config.worker_threads();
        let workers = tidepool_engine::WorkerPool::with_sync_lane(
            "tidepool-worker",
            threads,
            low_threads,
            threads,
        )?;
        let owners = (0..threads)
            .map(|i| tidepool_engine::WorkerPool::new(&format!("tidepool-raft-{i}"), 1, 0))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let engines = tidepool_engine::Host {
            pool: workers,
            memory: config.memory_budget(),
        };
        let node = Arc::new(Node {
            engines,
            owners,
            opened: Default::default(),
            adopting: Default::default(),
            data_dir_lock: parking_lot::Mutex::new(Some(data_dir_lock)),
            transport: Transport::new(
                config.node_id,
                security.clone(),
                Duration::from_millis(config.raft.tick_ms),
            ),
            liveness: Default::default(),
            security,
            tokens: Arc::default(),
            peer_channels: Default::default(),
            config,
            map: ArcSwap::from_pointee(ClusterMap::default()),
            shards: RwLock::new(BTreeMap::new()),
            opening: parking_lot::Mutex::new(()),
            outbox: Arc::new(Outbox::default()),
            metrics: NodeMetrics::default(),
            in_flight_by_token: Arc::default(),
            session_opens,
            manifest_checks: Arc::new(tokio::sync::Semaphore::new(manifests::CHECKS_AT_ONCE)),
            in_flight: Arc::new(tokio::sync::Semaphore::new(
                in_flight_kib.min(u64::from(u32::MAX)) as usize,
            )),
            stopping: tokio::sync::watch::Sender::new(false),
            namespace_ids: Arc::default(),
        });
        node.transport.set_node(Arc::downgrade(&node));
        if node.config.raft.quiesce_ticks > 0 {
            // Quiesced followers count no ticks: wake those whose leader's
            // node stays silent for an election timeout.
            let tick = Duration::from_millis(node.config.raft.tick_ms);
            let silence = tick * node.config.raft.election_ticks as u32;
            tokio::spawn(liveness::watch(Arc::downgrade(&node), tick, silence));
        }
        node.set_map(map.clone());
        if node.config.coordinator.is_some()
            && let Some(saved) = coordination::saved_map(&node.config.data_dir)?
        {
            // Peers' addresses and ranges until a coordinator sends newer.
            node.set_map(saved);
        }
        node.remove_unfinished_splits()?;
        node.open_replicas_on_disk()?;
        let me = node.config.node_id;
        for info in &map.shards {
            if info.replicas.iter().any(|r| r.node_id == me) {
                let voters: Vec<u64> = info.replicas.iter().map(|r| r.node_id).collect();
                node.open_replica(info.clone(), &voters)?;
            }
        }
        node.opened
            .store(true, std::sync::atomic::Ordering::Release);
        node.open_split_children();
        Ok(node)
    }

    /// Removes the directories of split-off groups a crash left half made
    /// (their split entry is applied again, and makes them again).
    fn remove_unfinished_splits(&self) -> Result<()> {
        let dir = self.config.data_dir.join("shards");
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| NodeError::Config(format!("cannot list {}: {e}", dir.display())))?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            if name
                .to_str()
                .is_some_and(|n| n.starts_with(crate::replica::SPLIT_TEMP_PREFIX))
            {
                let path = entry.path();
                std::fs::remove_dir_all(&path).map_err(|e| {
                    NodeError::Config(format!("cannot remove {}: {e}", path.display()))
                })?;
                tracing::info!(path = %path.display(), "removed a split-off group's unfinished directory");
            }
        }
        Ok(())
    }

    /// Opens the replicas of groups split off hosted ones that this node
    /// does not host (`docs/design/splits.md`): from their directories if a
    /// split made them here, else empty, to receive a snapshot from the new
    /// group's leader (this node's replica of the parent installed a
    /// snapshot taken after the split, so never applied it). An empty one
    /// is opened only while the map does not know the new group or lists
    /// this node among its replicas: a group moved away is not reopened.
    pub(crate) fn open_split_children(&self) {
        use std::sync::atomic::Ordering;
        if !self.opened.load(Ordering::Acquire) || self.is_stopping() {
            return;
        }
        let _one_pass = self.adopting.lock();
        let children: Vec<_> = self
            .hosted()
            .into_iter()
            .filter_map(|(_, handle)| handle.state().status)
            .flat_map(|status| status.children)
            .collect();
        let map = self.map();
        let me = self.config.node_id;
        for child in children {
            if self.shard(child.shard_id).is_some() {
                continue;
            }
            let path = self.shard_dir(child.shard_id).join(SHARD_FILE);
            let on_disk = match read_whole_file(&FileStorage::new(), &path) {
                Ok(Some(bytes)) => ShardInfo::decode(&bytes[..]).ok(),
                _ => None,
            };
            let info = match on_disk {
                Some(info) => info,
                None => {
                    let mapped = map.shards.iter().find(|s| s.shard_id == child.shard_id);
                    if mapped.is_some_and(|s| !s.replicas.iter().any(|r| r.node_id == me)) {
                        continue;
                    }
                    ShardInfo {
                        shard_id: child.shard_id,
                        hash_start: child.start,
                        hash_end: child.end,
                        ..ShardInfo::default()
                    }
                }
            };
            match self.open_replica(info, &[]) {
                Ok(_) => tracing::info!(
                    shard_id = child.shard_id,
                    "opened a split-off group's replica"
                ),
                Err(error) => tracing::warn!(
                    shard_id = child.shard_id,
                    %error,
                    "cannot open a split-off group's replica"
                ),
            }
        }
    }

    /// Reopens every replica in the data directory, several at a time
    /// (each replays its log; a node restarts as fast as its slowest
    /// replica, not their sum).
    fn open_replicas_on_disk(&self) -> Result<()> {
        const AT_ONCE: usize = 4;
        let on_disk = self.shards_on_disk()?;
        for group in on_disk.chunks(AT_ONCE) {
            let opened: Vec<(u32, Result<Hosted>)> = std::thread::scope(|scope| {
                let running: Vec<_> = group
                    .iter()
                    .map(|(id, info)| (*id, scope.spawn(|| self.start_replica(info.clone(), &[]))))
                    .collect();
                running
                    .into_iter()
                    .map(|(id, thread)| {
                        let result = thread.join().unwrap_or_else(|_| {
                            Err(NodeError::Failed("opening the replica panicked".into()))
                        });
                        (id, result)
                    })
                    .collect()
            });
            for (shard_id, hosted) in opened {
                let hosted =
                    hosted.map_err(|e| NodeError::Config(format!("shard {shard_id}: {e}")))?;
                self.shards.write().insert(shard_id, hosted);
            }
        }
        Ok(())
    }

    fn shard_dir(&self, shard_id: u32) -> PathBuf {
        self.config
            .data_dir
            .join("shards")
            .join(shard_id.to_string())
    }

    fn shards_on_disk(&self) -> Result<Vec<(u32, ShardInfo)>> {
        let dir = self.config.data_dir.join("shards");
        let mut found = Vec::new();
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| NodeError::Config(format!("cannot list {}: {e}", dir.display())))?;
        for entry in entries.flatten() {
            let Some(shard_id) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            let path = entry.path().join(SHARD_FILE);
            let bytes = read_whole_file(&FileStorage::new(), &path)
                .map_err(|e| NodeError::Config(format!("{}: {e}", path.display())))?;
            let info = match bytes {
                Some(bytes) => ShardInfo::decode(&bytes[..])
                    .map_err(|e| NodeError::Malformed(format!("{}: {e}", path.display())))?,
                None => continue, // never finished opening: nothing in it
            };
            found.push((shard_id, info));
        }
        Ok(found)
    }

    /// Takes `bytes` of the in-flight budget for as long as the returned
    /// hold lives; `OVERLOADED` (with a retry-after) if the node holds too
    /// much already, or if the caller's token would hold more than half of
    /// it (so one tenant — 256 puts trickling their bytes, 256 gets never
    /// read — cannot take the whole budget from the others; a single value
    /// always fits). Callers without a token (no tokens checked, or a
    /// node's certificate) share the budget as one.
    pub(crate) fn reserve(
        &self,
        bytes: u64,
        caller: &tidepool_security::Caller,
    ) -> std::result::Result<InFlight, ErrorInfo> {
        self.reserve_beside(bytes, 0, caller)
    }

    /// [`Node::reserve`] for a request that holds `beside` bytes already:
    /// the token's share is at least the two together (a manifest being
    /// checked holds one of its chunks; at the smallest budget allowed, two
    /// of the largest values, the half is one value and the two never
    /// fitted: every chunked content-addressed put made with a token was
    /// `OVERLOADED`).
    pub(crate) fn reserve_beside(
        &self,
        bytes: u64,
        beside: u64,
        caller: &tidepool_security::Caller,
    ) -> std::result::Result<InFlight, ErrorInfo> {
        let kib = u32::try_from(bytes.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
        let beside_kib = u32::try_from(beside.div_ceil(1024)).unwrap_or(u32::MAX);
        let overloaded = |message: String| {
            let mut info = self.error(ErrorCode::Overloaded, message);
            info.detail.retry_after_ms = 100;
            info
        };
        let whole = || {
            overloaded(format!(
                "node {} holds its whole in-flight budget ({} MiB); retry",
                self.config.node_id, self.config.limits.in_flight_mib
            ))
        };
        let Some(name) = caller.grant.as_ref().map(|g| g.name.clone()) else {
            let permit = self
                .in_flight
                .clone()
                .try_acquire_many_owned(kib)
                .map_err(|_| whole())?;
            return Ok(InFlight {
                _permit: permit,
                token: None,
            });
        };
        let budget_kib = self.config.limits.in_flight_mib.saturating_mul(1024);
        let share = u32::try_from(budget_kib / 2)
            .unwrap_or(u32::MAX)
            .max(kib.saturating_add(beside_kib));
        let mut held = self.in_flight_by_token.lock();
        let now = held.get(&name).copied().unwrap_or(0);
        if now.saturating_add(kib) > share {
            return Err(overloaded(format!(
                "token {name:?} holds half of node {}'s in-flight budget ({} MiB); retry",
                self.config.node_id, self.config.limits.in_flight_mib
            )));
        }
        let permit = self
            .in_flight
            .clone()
            .try_acquire_many_owned(kib)
            .map_err(|_| whole())?;
        *held.entry(name.clone()).or_default() += kib;
        Ok(InFlight {
            _permit: permit,
            token: Some((self.in_flight_by_token.clone(), name, kib)),
        })
    }

    /// A lazily connected channel to the node at `address` (cached).
    pub(crate) fn peer_channel(
        &self,
        address: &str,
    ) -> std::result::Result<tidepool_security::Channel, tonic::Status> {
        let mut channels = self.peer_channels.lock();
        if let Some(channel) = channels.get(address) {
            return Ok(channel.clone());
        }
        let endpoint = self
            .security
            .endpoint(address)
            .map_err(|e| tonic::Status::unavailable(format!("{address}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true);
        let channel = self.security.connect_lazy(&endpoint);
        channels.insert(address.to_string(), channel.clone());
        Ok(channel)
    }

    /// The cluster map the node routes by.
    pub fn map(&self) -> Arc<ClusterMap> {
        self.map.load_full()
    }

    /// Installs a newer cluster map (older or equal versions, and maps of
    /// another cluster than the one held, are ignored): peer addresses and
    /// the ranges of hosted shards follow it.
    pub fn set_map(&self, map: ClusterMap) {
        let current = self.map.load();
        if map.version <= current.version && map.version != 0 {
            return;
        }
        // This node's replicas belong to the cluster whose map it holds: a
        // map of another (a coordinator whose store was emptied or
        // replaced) would place other shards over them.
        if coordination::other_cluster(&current.cluster_id, &map.cluster_id) {
            tracing::error!(
                cluster = %current.cluster_id,
                other = %map.cluster_id,
                version = map.version,
                "ignored the map of another cluster; keeping this one's"
            );
            return;
        }
        drop(current);
        for node in &map.nodes {
            let address = self
                .config
                .peer_addresses
                .iter()
                .find(|p| p.id == node.node_id)
                .map_or_else(|| node.address.clone(), |p| p.address.clone());
            self.transport.set_address(node.node_id, address);
        }
        let mut shards = self.shards.write();
        for info in &map.shards {
            if let Some(hosted) = shards.get_mut(&info.shard_id) {
                hosted.info = info.clone();
            }
        }
        drop(shards);
        self.tokens.0.store(Arc::new(TokenTable::of(&map.tokens)));
        self.namespace_ids
            .store(Arc::new(map.namespaces.iter().map(|n| n.id).collect()));
        if self.config.coordinator.is_some() && map.version != 0 {
            coordination::save_map(&self.config.data_dir, &map);
        }
        self.map.store(Arc::new(map));
    }

    /// Opens (or finds open) the replica of `info.shard_id`; a new one
    /// founds the shard with `voters`, or waits to be added if `voters` is
    /// empty. Returns whether it was already open.
    pub fn open_replica(&self, info: ShardInfo, voters: &[u64]) -> Result<bool> {
        let shard_id = info.shard_id;
        let _opening = self.opening.lock();
        if self.shards.read().contains_key(&shard_id) {
            return Ok(true);
        }
        // Outside the table's lock: an opening creates and syncs files
        // (and waits while a split moves a directory into place), which
        // would hold every request of the node that long.
        let hosted = self.start_replica(info, voters)?;
        self.shards.write().insert(shard_id, hosted);
        Ok(false)
    }

    /// Opens the replica of `info.shard_id` and records it in its
    /// directory (see [`Node::open_replica`]).
    fn start_replica(&self, info: ShardInfo, voters: &[u64]) -> Result<Hosted> {
        let shard_id = info.shard_id;
        let dir = self.shard_dir(shard_id);
        {
            // Not while a split moves a directory of that name into place.
            let _making = crate::store::making_dirs();
            create_dir_durably(&dir)?;
        }
        let store = ReplicaStore::on_files(&dir, self.config.engine_config(dir.clone()))
            .with_host(self.engines.clone());
        if dir.join(SHARD_FILE).exists() {
            // A replica this node hosted: opened only with its files.
            store.expect_existing()?;
        }
        let mut driver = self.config.driver_config();
        driver.pool = Some(self.owners[shard_id as usize % self.owners.len()].clone());
        let mut replica_config = self.config.replica_config(shard_id)?;
        replica_config.range = Some((info.hash_start, info.hash_end));
        replica_config.namespaces = Some(self.namespace_ids.clone());
        let handle = ShardHandle::start(
            replica_config,
            driver,
            store,
            self.outbox.clone(),
            voters,
            self.transport.clone(),
        )?;
        // Recorded once the replica exists, so a restart reopens it.
        let path = dir.join(SHARD_FILE);
        write_file_atomically(&FileStorage::new(), &path, &info.encode_to_vec())
            .map_err(|e| NodeError::Engine(tidepool_engine::Error::io(&path, e)))?;
        Ok(Hosted { handle, info })
    }

    /// Stops and forgets the replica of `shard_id`; with `delete`, removes
    /// its data. Returns whether it was open.
    pub fn close_replica(&self, shard_id: u32, delete: bool) -> Result<bool> {
        let _opening = self.opening.lock();
        let Some(hosted) = self.shards.write().remove(&shard_id) else {
            return Ok(false);
        };
        hosted.handle.stop();
        self.outbox.remove_shard(shard_id);
        if delete {
            let dir = self.shard_dir(shard_id);
            match std::fs::remove_dir_all(&dir) {
                // Already gone: a replica whose files went missing.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                result => result.map_err(|e| {
                    NodeError::Config(format!("cannot delete {}: {e}", dir.display()))
                })?,
            }
        }
        Ok(true)
    }

    /// Every hosted replica.
    pub(crate) fn hosted_shards(&self) -> Vec<Arc<ShardHandle>> {
        self.shards
            .read()
            .values()
            .map(|h| h.handle.clone())
            .collect()
    }

    /// The hosted replica of `shard_id`.
    pub fn shard(&self, shard_id: u32) -> Option<Arc<ShardHandle>> {
        self.shards.read().get(&shard_id).map(|h| h.handle.clone())
    }

    /// Every hosted replica with its range.
    pub fn hosted(&self) -> Vec<(ShardInfo, Arc<ShardHandle>)> {
        self.shards
            .read()
            .values()
            .map(|h| (h.info(), h.handle.clone()))
            .collect()
    }

    /// The hosted shard that owns `key`, or `WRONG_SHARD`.
    pub(crate) fn route(
        &self,
        key: &StorageKey,
    ) -> std::result::Result<(ShardInfo, Arc<ShardHandle>), ErrorInfo> {
        let position = hash_position(key);
        let shards = self.shards.read();
        let found = shards.values().find(|h| {
            let (start, end) = h.range();
            start <= position && position <= end
        });
        match found {
            Some(hosted) => {
                hosted.handle.load().record(position);
                Ok((hosted.info(), hosted.handle.clone()))
            }
            None => Err(self.error(
                ErrorCode::WrongShard,
                format!(
                    "node {} hosts no shard for hash position {position:#018x}",
                    self.config.node_id
                ),
            )),
        }
    }

    /// The namespace named `name`.
    pub(crate) fn namespace(&self, name: &str) -> std::result::Result<Namespace, ErrorInfo> {
        self.map
            .load()
            .namespaces
            .iter()
            .find(|ns| ns.name == name)
            .cloned()
            .ok_or_else(|| {
                self.error(
                    ErrorCode::NamespaceNotFound,
                    format!("no namespace {}", tidepool_proto::quoted_namespace(name)),
                )
            })
    }

    /// An error carrying this node's map version.
    pub(crate) fn error(&self, code: ErrorCode, message: impl Into<String>) -> ErrorInfo {
        let mut info = ErrorInfo::new(code, message);
        info.detail.map_version = self.map.load().version;
        info
    }

    /// Where node `id` is reached, if known.
    pub(crate) fn address_of(&self, id: u64) -> Option<NodeAddress> {
        if id == self.config.node_id {
            return Some(NodeAddress {
                node_id: id,
                address: self.config.advertise(),
            });
        }
        // The map's address (what clients can reach), not a peer override.
        let from_map = self
            .map
            .load()
            .nodes
            .iter()
            .find(|n| n.node_id == id)
            .map(|n| n.address.clone());
        from_map
            .or_else(|| self.transport.address(id))
            .map(|address| NodeAddress {
                node_id: id,
                address,
            })
    }

    /// Whether the node is shutting down.
    pub fn is_stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    /// Resolves once the node begins to stop.
    pub(crate) fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut watch = self.stopping.subscribe();
        async move {
            let _ = watch.wait_for(|stopping| *stopping).await;
        }
    }

    /// Refuses new requests and ends peers' streams.
    pub(crate) fn begin_stop(&self) {
        self.stopping.send_replace(true);
    }

    /// Before stopping: hands the leadership of every shard this node
    /// leads to another voter (the leader agrees only to one it hears and
    /// that is caught up), and waits until it leads none or `within` has
    /// passed. The shards then never wait out an election timeout for a
    /// node that stops on purpose (a rolling restart's write gap). Returns
    /// how many shards it still leads.
    pub async fn hand_off_leadership(&self, within: Duration) -> usize {
        let me = self.config.node_id;
        let deadline = tokio::time::Instant::now() + within;
        let mut round = 0usize;
        loop {
            let leading: Vec<(Arc<ShardHandle>, Vec<u64>)> = self
                .hosted()
                .into_iter()
                .filter_map(|(_, shard)| {
                    let status = shard.state().status?;
                    status.is_leader.then_some((shard, status.voters))
                })
                .collect();
            if leading.is_empty() || tokio::time::Instant::now() >= deadline {
                return leading.len();
            }
            let count = leading.len();
            let mut accepted = 0;
            for (shard, voters) in leading {
                let others: Vec<u64> = voters.into_iter().filter(|v| *v != me).collect();
                if others.is_empty() {
                    continue;
                }
                // Another target each round, in case one is behind.
                let to = others[round % others.len()];
                let (tx, rx) = oneshot::channel();
                let reply: crate::shard::TransferReply = Box::new(move |result| {
                    let _ = tx.send(result);
                });
                if shard
                    .send(crate::shard::Event::TransferLeader(to, reply))
                    .is_ok()
                    && let Ok(Ok(Ok(()))) =
                        tokio::time::timeout(Duration::from_millis(500), rx).await
                {
                    accepted += 1;
                }
            }
            // Every leader refused (no voter heard or caught up, say the
            // whole cluster is stopping): waiting would not help.
            if accepted == 0 && round > 0 {
                return count;
            }
            round += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops every replica (their engines close cleanly).
    pub fn shutdown(&self) {
        self.begin_stop();
        let shards: Vec<u32> = self.shards.read().keys().copied().collect();
        for shard in shards {
            let _ = self.close_replica(shard, false);
        }
        // Every engine is closed: another process (or this one, opening
        // the node again) may have the directory.
        self.data_dir_lock.lock().take();
    }
}

/// Makes `dir` and its missing parents, each durable in its parent
/// ([`FileStorage`]'s `create_dir_all`): a replica's files synced in a
/// directory whose own entry was not could vanish with it at a power loss.
fn create_dir_durably(dir: &std::path::Path) -> Result<()> {
    use tidepool_engine::storage::Storage as _;
    FileStorage::new()
        .create_dir_all(dir)
        .map_err(|e| NodeError::Config(format!("cannot create {}: {e}", dir.display())))
}

/// Takes the node's hold on its data directory (an `flock` on its `LOCK`
/// file), creating the directory if needed. Everything a node does to the
/// directory before its engines lock their own — recording or checking its
/// id, removing unfinished splits, emptying spare slots — would otherwise
/// undo the work of another process started on the same directory.
fn lock_data_dir(dir: &std::path::Path) -> Result<tidepool_engine::storage::DirLock> {
    use tidepool_engine::storage::Storage as _;
    create_dir_durably(dir)?;
    FileStorage::new().lock(dir).map_err(|e| {
        if e.kind() == std::io::ErrorKind::WouldBlock {
            NodeError::Config(format!(
                "data directory {} is in use by another node",
                dir.display()
            ))
        } else {
            NodeError::Config(format!("cannot lock {}: {e}", dir.display()))
        }
    })
}

/// Longest a stopping node spends handing its leaderships over.
const HAND_OFF: Duration = Duration::from_secs(3);

/// A node serving on its sockets.
pub struct RunningNode {
    /// The node.
    pub node: Arc<Node>,
    /// The bound gRPC address.
    pub address: SocketAddr,
    /// The bound metrics address, if any.
    pub metrics_address: Option<SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<Result<()>>,
}

impl RunningNode {
    /// Stops serving and closes every replica.
    /// Requests in flight get `STOP_GRACE` to finish; then the server is
    /// dropped with whatever is still open.
    pub async fn stop(mut self) -> Result<()> {
        let still_leading = self.node.hand_off_leadership(HAND_OFF).await;
        if still_leading > 0 {
            tracing::warn!(
                node_id = self.node.config.node_id,
                shards = still_leading,
                "stopping while still leading (no caught-up voter took over in time)"
            );
        }
        self.node.begin_stop();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let result = match tokio::time::timeout(STOP_GRACE, &mut self.server).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(NodeError::Network(format!("server task: {e}"))),
            Err(_) => {
                tracing::warn!(
                    node_id = self.node.config.node_id,
                    "requests still open after {STOP_GRACE:?}; closing them"
                );
                self.server.abort();
                Ok(())
            }
        };
        let node = self.node.clone();
        tokio::task::spawn_blocking(move || node.shutdown())
            .await
            .map_err(|e| NodeError::Network(format!("shutdown: {e}")))?;
        result
    }

    /// Waits until the server ends (it ends on `stop`, or on an error).
    pub async fn wait(&mut self) -> Result<()> {
        match (&mut self.server).await {
            Ok(result) => result,
            Err(e) => Err(NodeError::Network(format!("server task: {e}"))),
        }
    }
}

/// KiB of the in-flight budget each token holds, by token name.
type TokenTally = Arc<Mutex<HashMap<String, u32>>>;

/// Part of a node's in-flight budget a request holds ([`Node::reserve`]),
/// given back when dropped.
pub(crate) struct InFlight {
    _permit: tokio::sync::OwnedSemaphorePermit,
    /// The token's tally, its name and the KiB counted there.
    token: Option<(TokenTally, String, u32)>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some((held, name, kib)) = self.token.take() {
            let mut held = held.lock();
            if let Some(now) = held.get_mut(&name) {
                *now = now.saturating_sub(kib);
                if *now == 0 {
                    held.remove(&name);
                }
            }
        }
    }
}

/// The largest Raft batch a peer sends: up to `transport::BATCH_BYTES` of
/// messages, plus the message that crosses it — at most a message's
/// entry budget (`max_message_bytes`) plus one entry of the largest
/// record — and framing.
fn raft_batch_limit(config: &NodeConfig) -> usize {
    let message_budget = crate::replica::ReplicaConfig::new(0, 0).max_message_bytes as usize;
    let largest_entry = (config.raft.max_value_bytes as usize).max(config.raft.max_batch_bytes);
    transport::BATCH_BYTES + message_budget + largest_entry + (2 << 20)
}

/// Opens the node and serves it until `stop` is called. Binds before
/// returning (so `address` is usable at once).
pub async fn start(mut config: NodeConfig) -> Result<RunningNode> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| NodeError::Network(format!("cannot bind {}: {e}", config.listen)))?;
    let address = listener
        .local_addr()
        .map_err(|e| NodeError::Network(e.to_string()))?;
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| NodeError::Network(format!("cannot bind {addr}: {e}")))?,
        ),
        None => None,
    };
    let metrics_address = metrics_listener.as_ref().and_then(|l| l.local_addr().ok());
    if config.advertise.is_none() {
        let scheme = if config.tls.is_some() {
            "https"
        } else {
            "http"
        };
        config.advertise = Some(format!("{scheme}://{address}"));
    }
    config.validate()?;
    let security = security_of(&config)?;
    // Before the id is read or recorded: two processes on one directory
    // would otherwise both register, or share one id.
    let lock = lock_data_dir(&config.data_dir)?;
    // A node that ran before serves at once and registers meanwhile; a new
    // one needs its id first.
    let restarting = config.coordinator.is_some() && coordination::adopt_recorded_id(&mut config)?;
    if config.coordinator.is_none() {
        coordination::bind_static_id(&config)?;
    }
    let registered = match config.coordinator {
        Some(_) if !restarting => Some(coordination::register(&mut config, &security).await?),
        _ => None,
    };
    let node = tokio::task::block_in_place(|| Node::open_locked(config, security, lock))?;
    if let Some((map, lease_ttl)) = registered {
        node.set_map(map);
        coordination::spawn(node.clone(), lease_ttl);
    } else if restarting {
        coordination::spawn_registration(node.clone());
    }
    if let Some(listener) = metrics_listener {
        // Until the runtime stops: `/healthz` answers 503 while stopping.
        let exposition = Arc::new(metrics::NodeExposition::new(&node));
        tokio::spawn(tidepool_telemetry::metrics::serve(
            listener,
            exposition,
            std::future::pending(),
        ));
    }
    // A prepared snapshot pins its checkpoint's WAL segments: once nobody
    // pulls from it, let it go so deleted data's space comes back.
    let expiring = node.clone();
    tokio::spawn(async move {
        let stopped = expiring.stopped();
        tokio::pin!(stopped);
        loop {
            tokio::select! {
                _ = &mut stopped => return,
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
            expiring.outbox.expire_idle(crate::snapshot::SNAPSHOT_IDLE);
        }
    });
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let limits = node.config.limits.clone();
    // Client messages: at most the largest legal one (a put chunk, a
    // batch-exists), so a hostile one is refused before it is buffered.
    let blob = BlobServiceServer::new(blobs::BlobApi::new(node.clone()))
        .max_decoding_message_size(limits.max_request_bytes)
        .max_encoding_message_size(MAX_GRPC_MESSAGE);
    // Peer batches: at most the largest a peer sends (see
    // `raft_batch_limit`), not 256 MiB.
    let raft = RaftTransportServer::new(raft_service::RaftApi::new(node.clone()))
        .max_decoding_message_size(raft_batch_limit(&node.config))
        .max_encoding_message_size(MAX_GRPC_MESSAGE);
    let admin = NodeAdminServer::new(admin::AdminApi::new(node.clone()));
    let tls = node.security.tls.clone();
    let guard = match &tls {
        Some(_) => GuardLayer::secured(node.tokens.clone()),
        None => {
            tracing::warn!(
                node_id = node.config.node_id,
                "INSECURE: no TLS; every caller may call every method, including admin and peer ones"
            );
            GuardLayer::open()
        }
    };
    // Every method is counted, refused ones too (outside the guard).
    let counted = node.metrics.rpc.layer(
        "grpc",
        tidepool_telemetry::MethodNames::grpc(
            tidepool_security::planes::METHODS
                .iter()
                .map(|(path, _)| *path),
        ),
    );
    let server = tokio::spawn(async move {
        let keepalive = Duration::from_millis(limits.keepalive_ms);
        let router = tonic::transport::Server::builder()
            .max_concurrent_streams(Some(limits.max_streams_per_connection))
            .max_frame_size(Some(tidepool_security::MAX_FRAME_BYTES))
            .http2_keepalive_interval(Some(keepalive))
            .http2_keepalive_timeout(Some(keepalive))
            .layer(counted)
            .layer(guard)
            .add_service(blob)
            .add_service(raft)
            .add_service(admin);
        let stopped = async {
            let _ = stop_rx.await;
        };
        tidepool_security::tls::serve(router, listener, tls, stopped)
            .await
            .map_err(|e| NodeError::Network(format!("gRPC server: {e}")))
    });
    tracing::info!(node_id = node.config.node_id, %address, "node serving");
    Ok(RunningNode {
        node,
        address,
        metrics_address,
        stop: Some(stop_tx),
        server,
    })
}

#[cfg(test)]
mod tests;
