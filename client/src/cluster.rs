//! The cached cluster map and connections: fetched from a coordinator,
//! kept current by a watch, refreshed on demand; one channel per address.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tidepool_proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_proto::v1::{
    ClusterMap, ErrorCode, GetClusterMapRequest, Namespace, ShardInfo, WatchClusterMapRequest,
};
use tidepool_proto::{hash_position, storage_key};
use tidepool_security::{Channel, Security};
use tokio::sync::watch;

use crate::error::{Error, Result};

/// Largest gRPC message the SDK accepts (a node sends up to 1 MiB of data
/// per message; manifests and maps are small).
pub(crate) const MAX_MESSAGE: usize = 64 << 20;

/// While calls are in flight on a connection, the SDK pings its server
/// this often (an HTTP/2 PING, answered by the server process itself, not
/// by its kernel)...
const PING_INTERVAL: Duration = Duration::from_millis(500);
/// ... and a server that answers none for this long is taken for frozen:
/// the connection is closed, its calls fail as unreachable and are retried
/// on another replica (writes keep their session, so they apply once). A
/// node stopped mid-call (SIGSTOP, a stalled VM, a wedged process) costs a
/// call about this plus an election, not its whole deadline. A busy node
/// still answers: pings are served by the connection's task, not queued
/// behind requests.
const PING_TIMEOUT: Duration = Duration::from_secs(1);

/// Shared state behind every clone of a `Client`.
pub(crate) struct Cluster {
    pub seeds: Vec<String>,
    pub connect_timeout: Duration,
    map: watch::Sender<Arc<ClusterMap>>,
    channels: Mutex<HashMap<String, Channel>>,
    security: Security,
    /// What answers taught about each shard's leader (node id), ahead of
    /// the map's hint, which trails a leadership change by a reconcile
    /// round and a map push.
    leaders: Mutex<HashMap<u32, u64>>,
    /// Nodes that recently did not answer at all (could not connect, the
    /// connection failed, no answer in time), with when: tried last for
    /// `UNREACHABLE_FOR`, since dialling a pod that is gone costs the
    /// whole connect timeout.
    unreachable: Mutex<HashMap<u64, std::time::Instant>>,
    /// Held while a refresh asked for by a newer map version runs, so
    /// that the calls which all hear of that version at once fetch the
    /// map once.
    catching_up: tokio::sync::Mutex<()>,
    /// Held while a map fetch runs: callers that ask meanwhile wait for it
    /// and take its map, instead of each fetching (a split or an election
    /// sends every call in flight to refresh at once).
    fetching: tokio::sync::Mutex<()>,
    /// Fetches begun so far.
    fetches: std::sync::atomic::AtomicU64,
    /// Whether the last fetch got no map (those waiting for it fetch
    /// again).
    last_fetch_failed: std::sync::atomic::AtomicBool,
    /// The seed that last gave a map: the next fetch asks it first (a
    /// dead first seed cost every fetch its connect timeout).
    answering: std::sync::atomic::AtomicUsize,
    /// The newest map version a node reported: a fetch passes over a
    /// coordinator whose map is older (one cut off from etcd serves the
    /// map it cached) for the next seed's.
    reported: std::sync::atomic::AtomicU64,
}

/// Whether a client holding `held` follows `offered`: a newer version of
/// the same cluster, or of another cluster only while the one held has no
/// nodes (nothing of it was ever served). A coordinator whose store lost
/// the cluster (etcd emptied, another key prefix) founds a new one; its
/// map, once its versions pass the held one's, would send every request to
/// shards the nodes do not hold — and writes into the new cluster, lost
/// when the map is restored from the nodes. The nodes keep to their
/// cluster too; they serve on, and the restored map (same cluster, a
/// version above the store's) is taken when it comes. A cluster created
/// anew on purpose is joined by restarting the client.
fn takes(held: &ClusterMap, offered: &ClusterMap) -> bool {
    offered.version > held.version && (!other_cluster(held, offered) || held.nodes.is_empty())
}

/// Whether two maps are of different clusters (a map without an id, as
/// the empty one a client starts from, is of none).
fn other_cluster(held: &ClusterMap, offered: &ClusterMap) -> bool {
    !held.cluster_id.is_empty()
        && !offered.cluster_id.is_empty()
        && held.cluster_id != offered.cluster_id
}

/// How long a node that did not answer is tried after the others.
const UNREACHABLE_FOR: Duration = Duration::from_secs(5);

/// Where a key goes.
pub(crate) struct Route {
    pub shard: ShardInfo,
}

impl Cluster {
    pub fn new(seeds: Vec<String>, connect_timeout: Duration, security: Security) -> Arc<Self> {
        Arc::new(Self {
            security,
            seeds,
            connect_timeout,
            map: watch::Sender::new(Arc::new(ClusterMap::default())),
            channels: Mutex::new(HashMap::new()),
            leaders: Mutex::new(HashMap::new()),
            unreachable: Mutex::new(HashMap::new()),
            catching_up: tokio::sync::Mutex::new(()),
            fetching: tokio::sync::Mutex::new(()),
            fetches: std::sync::atomic::AtomicU64::new(0),
            last_fetch_failed: std::sync::atomic::AtomicBool::new(false),
            answering: std::sync::atomic::AtomicUsize::new(0),
            reported: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The nodes to try for `shard`, in order: the leader answers taught,
    /// the map's hint, the other replicas — nodes that recently did not
    /// answer last.
    pub fn candidates(&self, shard: &ShardInfo) -> Vec<u64> {
        let mut order: Vec<u64> = Vec::with_capacity(shard.replicas.len() + 1);
        let members = || shard.replicas.iter().map(|r| r.node_id);
        if let Some(learned) = self.leaders.lock().get(&shard.shard_id).copied()
            && members().any(|id| id == learned)
        {
            order.push(learned);
        }
        if shard.leader_hint != 0 && !order.contains(&shard.leader_hint) {
            order.push(shard.leader_hint);
        }
        for id in members() {
            if !order.contains(&id) {
                order.push(id);
            }
        }
        let now = std::time::Instant::now();
        let mut unreachable = self.unreachable.lock();
        unreachable.retain(|_, at| now.duration_since(*at) < UNREACHABLE_FOR);
        // Stable: the order above holds within each group.
        order.sort_by_key(|id| unreachable.contains_key(id));
        order
    }

    /// `node` answered for `shard` as its leader.
    pub fn answered(&self, shard: u32, node: u64) {
        self.leaders.lock().insert(shard, node);
        self.unreachable.lock().remove(&node);
    }

    /// `node` does not lead `shard` (it said so, or named another).
    pub fn not_leader(&self, shard: u32, node: u64) {
        let mut leaders = self.leaders.lock();
        if leaders.get(&shard) == Some(&node) {
            leaders.remove(&shard);
        }
    }

    /// Whether `node` failed to answer within the last few seconds.
    pub fn is_unreachable(&self, node: u64) -> bool {
        self.unreachable
            .lock()
            .get(&node)
            .is_some_and(|at| at.elapsed() < UNREACHABLE_FOR)
    }

    /// `node` did not answer at all.
    pub fn unreachable(&self, node: u64) {
        self.unreachable
            .lock()
            .insert(node, std::time::Instant::now());
    }

    /// The id of the node at `address` in `map`.
    pub fn node_at(map: &ClusterMap, address: &str) -> Option<u64> {
        map.nodes
            .iter()
            .find(|n| n.address == address)
            .map(|n| n.node_id)
    }

    /// The cached map.
    pub fn map(&self) -> Arc<ClusterMap> {
        self.map.borrow().clone()
    }

    pub(crate) fn install(&self, map: ClusterMap) {
        self.map.send_if_modified(|current| {
            if !takes(current, &map) {
                if other_cluster(current, &map) && map.version > current.version {
                    tracing::warn!(
                        cluster = %current.cluster_id,
                        other = %map.cluster_id,
                        version = map.version,
                        "a coordinator serves another cluster's map; keeping this one's (restore the map, or restart the client to join the other)"
                    );
                }
                return false;
            }
            *current = Arc::new(map);
            true
        });
    }

    /// A channel to `address` (created lazily, reused).
    pub fn channel(&self, address: &str) -> Result<Channel> {
        let mut channels = self.channels.lock();
        if let Some(channel) = channels.get(address) {
            return Ok(channel.clone());
        }
        let endpoint = self
            .security
            .endpoint(address)
            .map_err(|e| {
                Error::new(
                    ErrorCode::InvalidArgument,
                    format!("bad address {address:?}: {e}"),
                )
            })?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(PING_INTERVAL)
            .keep_alive_timeout(PING_TIMEOUT);
        let channel = self.security.connect_lazy(&endpoint);
        channels.insert(address.to_string(), channel.clone());
        Ok(channel)
    }

    /// A coordinator client for seed `i`.
    pub fn coordinator(&self, i: usize) -> Result<CoordinatorServiceClient<Channel>> {
        let seed = &self.seeds[i % self.seeds.len()];
        Ok(CoordinatorServiceClient::new(self.channel(seed)?))
    }

    /// Fetches the map from the first seed that answers. Calls that ask
    /// while a fetch runs wait for the next one to begin after they asked
    /// (as fresh as their own would be), sharing it: one fetch serves
    /// every call that hears at once that the map moved.
    pub async fn refresh(&self) -> Result<Arc<ClusterMap>> {
        use std::sync::atomic::Ordering;
        let asked = self.fetches.load(Ordering::Acquire);
        let _one = self.fetching.lock().await;
        if self.fetches.load(Ordering::Acquire) > asked
            && !self.last_fetch_failed.load(Ordering::Acquire)
        {
            // A fetch began after this call asked, and has got the map.
            return Ok(self.map());
        }
        self.fetches.fetch_add(1, Ordering::AcqRel);
        let fetched = self.fetch().await;
        self.last_fetch_failed
            .store(fetched.is_err(), Ordering::Release);
        fetched
    }

    /// [`Cluster::refresh`], given up at `deadline` (a call's own): with
    /// every coordinator unreachable, a fetch tries each seed for the
    /// connect timeout, which may be longer than what is left of the call.
    pub async fn refresh_before(&self, deadline: std::time::Instant) -> Result<Arc<ClusterMap>> {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match tokio::time::timeout(left, self.refresh()).await {
            Ok(result) => result,
            Err(_) => Err(Error::new(
                ErrorCode::Timeout,
                "no coordinator gave the map before the call's deadline",
            )),
        }
    }

    /// A node answered with map `version`: fetches look for that one.
    pub fn note_version(&self, version: u64) {
        self.reported
            .fetch_max(version, std::sync::atomic::Ordering::AcqRel);
    }

    /// One fetch of the map, seed after seed from the one that answered
    /// last, until one gives a map at least as new as any a node reported
    /// (else the newest given).
    async fn fetch(&self) -> Result<Arc<ClusterMap>> {
        use std::sync::atomic::Ordering;
        let mut last = None;
        let mut answered = false;
        let first = self.answering.load(Ordering::Acquire);
        for i in (0..self.seeds.len()).map(|i| (first + i) % self.seeds.len()) {
            let mut coordinator = self.coordinator(i)?;
            let fetched = tokio::time::timeout(
                self.connect_timeout,
                coordinator.get_cluster_map(GetClusterMapRequest {}),
            )
            .await;
            match fetched {
                Ok(Ok(map)) => {
                    let version = map.get_ref().version;
                    self.install(map.into_inner());
                    if !answered {
                        self.answering.store(i, Ordering::Release);
                    }
                    answered = true;
                    if version >= self.reported.load(Ordering::Acquire) {
                        self.answering.store(i, Ordering::Release);
                        return Ok(self.map());
                    }
                    last = Some(format!(
                        "{} serves map version {version}, a node has a newer one",
                        self.seeds[i]
                    ));
                }
                Ok(Err(status)) => {
                    // A refused credential is the answer, not a reason to
                    // try other seeds until the deadline.
                    if let crate::error::Disposition::Fail(error) = crate::error::classify(&status)
                        && matches!(
                            error.code(),
                            ErrorCode::Unauthenticated | ErrorCode::PermissionDenied
                        )
                    {
                        return Err(error);
                    }
                    last = Some(status.message().to_string());
                }
                Err(_) => last = Some(format!("no answer within {:?}", self.connect_timeout)),
            }
        }
        if answered {
            // None has the version a node reported (or that node made it
            // up): the newest map there is.
            return Ok(self.map());
        }
        Err(Error::new(
            ErrorCode::Timeout,
            format!(
                "no coordinator answered ({}): {}",
                self.seeds.join(", "),
                last.unwrap_or_default()
            ),
        ))
    }

    /// Refreshes the map unless it is already at `version` or newer (a
    /// node answered with that map version). Concurrent callers wait for
    /// one fetch instead of each making their own. Given up at `deadline`
    /// (the call's own), waiting included: with no coordinator answering,
    /// each caller queued here fetched in turn, for the connect timeout of
    /// every seed.
    pub async fn catch_up(&self, version: u64, deadline: std::time::Instant) -> Result<()> {
        self.note_version(version);
        if self.map().version >= version {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let caught_up = async {
            let _one = self.catching_up.lock().await;
            if self.map().version >= version {
                return Ok(());
            }
            self.refresh().await.map(|_| ())
        };
        match tokio::time::timeout(left, caught_up).await {
            Ok(result) => result,
            Err(_) => Err(Error::new(
                ErrorCode::Timeout,
                "no coordinator gave the map before the call's deadline",
            )),
        }
    }

    /// Follows map versions until the last `Client` is dropped.
    pub fn spawn_watch(self: &Arc<Self>) {
        let weak: Weak<Cluster> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut seed = 0;
            let mut delay = Duration::from_millis(100);
            loop {
                let Some(cluster) = weak.upgrade() else {
                    return;
                };
                let after = cluster.map().version;
                let stream = match cluster.coordinator(seed) {
                    Ok(mut c) => c
                        .watch_cluster_map(WatchClusterMapRequest {
                            after_version: after,
                        })
                        .await
                        .ok(),
                    Err(_) => None,
                };
                drop(cluster);
                if let Some(stream) = stream {
                    let mut stream = stream.into_inner();
                    while let Ok(Some(map)) = stream.message().await {
                        let Some(cluster) = weak.upgrade() else {
                            return;
                        };
                        cluster.install(map);
                        delay = Duration::from_millis(100);
                    }
                }
                seed += 1;
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        });
    }

    /// The namespace named `name` in `map`.
    pub fn namespace(map: &ClusterMap, name: &str) -> Result<Namespace> {
        map.namespaces
            .iter()
            .find(|ns| ns.name == name)
            .cloned()
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::NamespaceNotFound,
                    format!("no namespace {name:?}"),
                )
            })
    }

    /// Where `(namespace, key)` lives in `map`.
    pub fn route(map: &ClusterMap, namespace: &str, key: &[u8]) -> Result<Route> {
        let namespace = Self::namespace(map, namespace)?;
        let storage = storage_key(namespace.id, key);
        let position = hash_position(&storage);
        let shard = map
            .shards
            .iter()
            .find(|s| s.hash_start <= position && position <= s.hash_end)
            .cloned()
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::ShardNotFound,
                    format!("the map has no shard for position {position:#018x}"),
                )
            })?;
        Ok(Route { shard })
    }

    /// Address of node `id` in `map`.
    pub fn address(map: &ClusterMap, id: u64) -> Option<String> {
        map.nodes
            .iter()
            .find(|n| n.node_id == id)
            .map(|n| n.address.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidepool_proto::v1::ReplicaInfo;

    fn shard(hint: u64, replicas: &[u64]) -> ShardInfo {
        ShardInfo {
            shard_id: 7,
            leader_hint: hint,
            replicas: replicas
                .iter()
                .map(|id| ReplicaInfo {
                    node_id: *id,
                    ..ReplicaInfo::default()
                })
                .collect(),
            ..ShardInfo::default()
        }
    }

    #[test]
    fn learned_leaders_first_unreachable_nodes_last() {
        let cluster = Cluster::new(Vec::new(), Duration::from_secs(1), Security::default());
        let s = shard(2, &[1, 2, 3]);
        assert_eq!(cluster.candidates(&s), [2, 1, 3], "the map's hint first");
        cluster.answered(7, 3);
        assert_eq!(
            cluster.candidates(&s),
            [3, 2, 1],
            "then what answers taught"
        );
        cluster.unreachable(3);
        assert_eq!(
            cluster.candidates(&s),
            [2, 1, 3],
            "a node that did not answer last"
        );
        cluster.answered(7, 3);
        assert_eq!(cluster.candidates(&s), [3, 2, 1], "answering clears it");
        cluster.not_leader(7, 3);
        assert_eq!(cluster.candidates(&s), [2, 1, 3]);
        // A learned leader that is no longer a replica is ignored.
        cluster.answered(7, 9);
        assert_eq!(cluster.candidates(&s), [2, 1, 3]);
        // Another shard's knowledge does not leak.
        cluster.answered(8, 1);
        assert_eq!(cluster.candidates(&s), [2, 1, 3]);
    }

    fn map(cluster: &str, version: u64, nodes: &[u64]) -> ClusterMap {
        ClusterMap {
            cluster_id: cluster.into(),
            version,
            nodes: nodes
                .iter()
                .map(|id| tidepool_proto::v1::NodeInfo {
                    node_id: *id,
                    ..Default::default()
                })
                .collect(),
            ..ClusterMap::default()
        }
    }

    #[test]
    fn a_client_keeps_to_the_cluster_it_joined() {
        let joined = map("a", 40, &[1, 2, 3]);
        assert!(takes(&ClusterMap::default(), &joined), "the first map");
        assert!(takes(&joined, &map("a", 41, &[1, 2, 3])), "a newer version");
        assert!(!takes(&joined, &map("a", 40, &[1, 2, 3])), "the same one");
        assert!(!takes(&joined, &map("a", 39, &[1, 2])), "an older one");
        // A coordinator that lost the store founds another cluster: its
        // map is not followed, however far its versions go.
        assert!(!takes(&joined, &map("b", 41, &[])));
        assert!(!takes(&joined, &map("b", 900, &[7])));
        // Joined while the new cluster was served (no nodes): the restored
        // map of the nodes' cluster, a version above, is followed.
        let founded = map("b", 5, &[]);
        assert!(takes(&founded, &map("a", 6, &[1, 2, 3])));
        assert!(!takes(&founded, &map("a", 5, &[1, 2, 3])));
    }
}
