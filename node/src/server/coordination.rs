//! The node's side of the coordinator: registration at start-up, periodic
//! heartbeats carrying the node's status, and a watch of the cluster map.
//!
//! Any coordinator replica serves heartbeats and the map watch; only the
//! leader registers nodes (the others answer `NOT_COORDINATOR_LEADER` with
//! a hint, which the node follows). A node that cannot reach any
//! coordinator keeps serving with the map it has: the data path never waits
//! for the control plane. That holds at start-up too: a node that has run
//! before (its data directory records its id and the last map it had)
//! reopens its replicas and serves at once, and registers in the
//! background — after a whole-cluster restart the shards elect leaders
//! while the coordinators are still electing theirs.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use tidepool_engine::storage::{FileStorage, read_whole_file, write_file_atomically};
use tidepool_proto::error_detail;
use tidepool_proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_proto::v1::{
    ClusterMap, ErrorCode, GetClusterMapRequest, HeartbeatRequest, PrepareNodeStopRequest,
    RegisterNodeRequest, WatchClusterMapRequest,
};
use tidepool_security::{Channel, Security};

use super::Node;
use crate::config::NodeConfig;
use crate::error::{NodeError, Result};

/// File in the data directory holding the id the cluster assigned.
const NODE_ID_FILE: &str = "NODE_ID";
/// File in the data directory holding the last cluster map received.
const MAP_FILE: &str = "CLUSTER_MAP";
/// Longest pause between attempts to reach a coordinator.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Connect timeout for a coordinator.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest a registration or pre-stop call waits for its answer: a
/// coordinator that accepted the connection and then hung (or whose host
/// went away without a reset) held the pre-stop hook past its `undecided`
/// bound, up to the pod's grace period.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// How soon a failed heartbeat is sent again (to the next coordinator).
const HEARTBEAT_RETRY: Duration = Duration::from_millis(200);

/// `call`, or an error once `within` passed without its answer.
async fn answered_within<T>(
    within: Duration,
    call: impl std::future::Future<Output = std::result::Result<T, (NodeError, Option<tonic::Status>)>>,
) -> std::result::Result<T, (NodeError, Option<tonic::Status>)> {
    tokio::time::timeout(within, call)
        .await
        .unwrap_or_else(|_| {
            Err((
                NodeError::Network(format!("no answer from the coordinator within {within:?}")),
                None,
            ))
        })
}
/// Pause between attempts to register with coordinators of another
/// cluster (until an operator fixes their store or the node's addresses).
const WRONG_CLUSTER_BACKOFF: Duration = Duration::from_secs(10);
/// What a node says when coordinators serve another cluster than the one
/// its data belongs to.
const WRONG_CLUSTER_HELP: &str = "the coordinator serves another cluster than the one this node's data belongs to: not joining it (this node keeps serving its replicas with the map it has). Was the coordinator's store (etcd, its key prefix) emptied or replaced, or is --coordinator wrong? Restore the store, or put the cluster's map back from the nodes (`tidectl cluster restore-map --from-node ADDRESS`), or give this node an empty data directory to join the new cluster";

/// Coordinator clients, tried in turn; remembers which one answered last.
struct Coordinators {
    addresses: Vec<String>,
    next: usize,
    security: Security,
}

impl Coordinators {
    fn new(addresses: Vec<String>, security: Security) -> Self {
        Self {
            addresses,
            next: 0,
            security,
        }
    }

    /// A client for the current address.
    async fn client(&self) -> Result<CoordinatorServiceClient<Channel>> {
        let address = &self.addresses[self.next % self.addresses.len()];
        let endpoint = self
            .security
            .endpoint(address)
            .map_err(|e| NodeError::Config(format!("coordinator address {address:?}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        let channel = self
            .security
            .connect(&endpoint)
            .await
            .map_err(|e| NodeError::Network(format!("coordinator {address}: {e}")))?;
        Ok(CoordinatorServiceClient::new(channel))
    }

    /// Moves on after a failure: to the hinted leader if the error names
    /// one, else to the next address.
    fn after_failure(&mut self, status: Option<&tonic::Status>) {
        let hint = status
            .and_then(error_detail)
            .filter(|d| d.code == ErrorCode::NotCoordinatorLeader as i32)
            .and_then(|d| d.leader_hint)
            .map(|h| h.address);
        if let Some(address) = hint {
            if let Some(i) = self.addresses.iter().position(|a| *a == address) {
                self.next = i;
                return;
            }
            self.addresses.push(address);
            self.next = self.addresses.len() - 1;
            return;
        }
        self.next = (self.next + 1) % self.addresses.len();
    }
}

/// Before a node process stops (a Kubernetes pre-stop hook): asks the
/// coordinators whether the node leaves for good and, if it does, waits
/// until the map places no replica on it — the caller's process keeps
/// serving meanwhile, so no shard loses a member before its replacement
/// has caught up. Returns what happened, in words.
///
/// `undecided` bounds how long coordinators may fail to answer before the
/// node stops anyway (a restart must not hang on a lost control plane);
/// once a drain has begun it is waited for without bound — the pod's
/// termination grace period is the bound. A restart that would take a
/// shard below a majority (another of its voters is down: a rolling update
/// reached this pod anyway) waits up to `hold` for that member to come
/// back.
pub async fn prepare_stop(
    data_dir: &Path,
    addresses: Vec<String>,
    security: Security,
    undecided: Duration,
    hold: Duration,
) -> Result<String> {
    let Some(node_id) = recorded_id(data_dir)? else {
        return Ok("no node id recorded: nothing to drain".into());
    };
    if addresses.is_empty() {
        return Err(NodeError::Config("no coordinator given".into()));
    }
    let mut coordinators = Coordinators::new(addresses, security);
    let started = tokio::time::Instant::now();
    let mut draining = false;
    let mut last_report = None::<(tokio::time::Instant, u32)>;
    loop {
        let attempt = async {
            let mut client = coordinators.client().await.map_err(|e| (e, None))?;
            client
                .prepare_node_stop(PrepareNodeStopRequest { node_id })
                .await
                .map(|r| r.into_inner())
                .map_err(|status| {
                    (
                        NodeError::Network(format!("prepare stop: {}", status.message())),
                        Some(status),
                    )
                })
        };
        match answered_within(CALL_TIMEOUT, attempt).await {
            Ok(answer)
                if !answer.leaving && answer.quorum_at_risk > 0 && started.elapsed() < hold =>
            {
                let now = tokio::time::Instant::now();
                if last_report.is_none_or(|(at, _)| now - at >= Duration::from_secs(10)) {
                    tracing::warn!(
                        node_id,
                        shards = answer.quorum_at_risk,
                        left = ?hold.saturating_sub(started.elapsed()),
                        "stopping now would leave shards without a majority (another of their members is down): waiting for it"
                    );
                    last_report = Some((now, answer.quorum_at_risk));
                }
            }
            Ok(answer) if !answer.leaving => {
                let risk = if answer.quorum_at_risk > 0 {
                    format!(
                        " ({} shards are left without a majority until it is back)",
                        answer.quorum_at_risk
                    )
                } else {
                    String::new()
                };
                return Ok(format!("node {node_id} stops: {}{risk}", answer.reason));
            }
            Ok(answer) if answer.replicas == 0 => {
                return Ok(format!(
                    "node {node_id} drained: it hosts no replica; stopping"
                ));
            }
            Ok(answer) => {
                draining = true;
                let now = tokio::time::Instant::now();
                let due = last_report.is_none_or(|(at, replicas)| {
                    replicas != answer.replicas || now - at >= Duration::from_secs(10)
                });
                if due {
                    tracing::info!(
                        node_id,
                        replicas = answer.replicas,
                        "leaving the cluster: waiting for the drain"
                    );
                    last_report = Some((now, answer.replicas));
                }
            }
            Err((error, status)) => {
                if !draining && started.elapsed() >= undecided {
                    return Ok(format!(
                        "node {node_id} stops without an answer from a coordinator for {undecided:?} ({error})"
                    ));
                }
                tracing::warn!(%error, "cannot ask a coordinator yet; retrying");
                coordinators.after_failure(status.as_ref());
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The id recorded in `data_dir`, if any.
fn recorded_id(data_dir: &Path) -> Result<Option<u64>> {
    let path = data_dir.join(NODE_ID_FILE);
    let bytes = read_whole_file(&FileStorage::new(), &path)
        .map_err(|e| NodeError::Config(format!("{}: {e}", path.display())))?;
    let Some(bytes) = bytes else { return Ok(None) };
    let text = String::from_utf8_lossy(&bytes);
    text.trim()
        .parse()
        .map(Some)
        .map_err(|_| NodeError::Malformed(format!("{}: not a node id", path.display())))
}

/// The id this data directory belongs to, if it records one (checked
/// against a configured id); sets `config.node_id` to it.
pub(crate) fn adopt_recorded_id(config: &mut NodeConfig) -> Result<bool> {
    std::fs::create_dir_all(&config.data_dir).map_err(|e| {
        NodeError::Config(format!("cannot create {}: {e}", config.data_dir.display()))
    })?;
    match (recorded_id(&config.data_dir)?, config.node_id) {
        (Some(on_disk), configured) if configured != 0 && configured != on_disk => {
            Err(NodeError::Config(format!(
                "node_id is {configured} but {} belongs to node {on_disk}",
                config.data_dir.display()
            )))
        }
        (Some(on_disk), _) => {
            config.node_id = on_disk;
            Ok(true)
        }
        (None, _) => Ok(false),
    }
}

/// A node of a fixed cluster (no coordinator) records its id in its data
/// directory at first start and refuses to start under another: its
/// replicas' Raft state (term, vote, log) is the recorded node's, and
/// served as another voter of the same groups it could vote twice and
/// lose committed writes (`--node-id 2` given for node 1's directory).
pub(crate) fn bind_static_id(config: &NodeConfig) -> Result<()> {
    std::fs::create_dir_all(&config.data_dir).map_err(|e| {
        NodeError::Config(format!("cannot create {}: {e}", config.data_dir.display()))
    })?;
    match recorded_id(&config.data_dir)? {
        Some(on_disk) if on_disk != config.node_id => Err(NodeError::Config(format!(
            "node_id is {} but {} belongs to node {on_disk}",
            config.node_id,
            config.data_dir.display()
        ))),
        Some(_) => Ok(()),
        None => {
            let path = config.data_dir.join(NODE_ID_FILE);
            write_file_atomically(
                &FileStorage::new(),
                &path,
                format!("{}\n", config.node_id).as_bytes(),
            )
            .map_err(|e| NodeError::Config(format!("cannot write {}: {e}", path.display())))
        }
    }
}

/// The last cluster map this node saved, if any.
pub(crate) fn saved_map(data_dir: &Path) -> Result<Option<ClusterMap>> {
    let path = data_dir.join(MAP_FILE);
    let bytes = read_whole_file(&FileStorage::new(), &path)
        .map_err(|e| NodeError::Config(format!("{}: {e}", path.display())))?;
    bytes
        .map(|b| ClusterMap::decode(&b[..]))
        .transpose()
        .map_err(|e| NodeError::Malformed(format!("{}: {e}", path.display())))
}

/// Saves `map` as the last one received (read again at the next start).
pub(crate) fn save_map(data_dir: &Path, map: &ClusterMap) {
    let path = data_dir.join(MAP_FILE);
    if let Err(error) = write_file_atomically(&FileStorage::new(), &path, &map.encode_to_vec()) {
        // Only start-up before registering reads it; the map is not lost.
        tracing::warn!(%error, path = %path.display(), "cannot save the cluster map");
    }
}

/// Registers with the coordinators (retrying until a leader answers) and
/// records the assigned id in the data directory. Sets `config.node_id`;
/// returns the map the coordinator sent.
pub(crate) async fn register(
    config: &mut NodeConfig,
    security: &Security,
) -> Result<(ClusterMap, Duration)> {
    let link = config
        .coordinator
        .clone()
        .ok_or_else(|| NodeError::Config("no coordinator configured".into()))?;
    adopt_recorded_id(config)?;
    let node_id = config.node_id;
    let capacity_bytes = if link.capacity_bytes != 0 {
        link.capacity_bytes
    } else {
        super::admin::disk_usage(&config.data_dir).1
    };
    // The cluster this directory's data belongs to, if it joined one.
    let cluster_id = saved_map(&config.data_dir)?
        .map(|map| map.cluster_id)
        .unwrap_or_default();
    let request = RegisterNodeRequest {
        node_id,
        address: config.advertise(),
        zone: link.zone.clone(),
        capacity_bytes,
        cluster_id: cluster_id.clone(),
    };
    let mut coordinators = Coordinators::new(link.addresses.clone(), security.clone());
    let mut backoff = Duration::from_millis(100);
    let response = loop {
        let attempt = async {
            let mut client = coordinators.client().await.map_err(|e| (e, None))?;
            client
                .register_node(request.clone())
                .await
                .map(|r| r.into_inner())
                .map_err(|status| {
                    (
                        NodeError::Network(format!("register: {}", status.message())),
                        Some(status),
                    )
                })
        };
        let pause = match answered_within(CALL_TIMEOUT, attempt).await {
            // A coordinator that does not check the cluster (an older
            // version) registered it anyway: the map says which it serves.
            Ok(response) => match response.map.as_ref().map(|m| m.cluster_id.as_str()) {
                Some(theirs) if other_cluster(&cluster_id, theirs) => {
                    tracing::error!(
                        cluster = %cluster_id,
                        coordinator_cluster = %theirs,
                        "{WRONG_CLUSTER_HELP}"
                    );
                    coordinators.after_failure(None);
                    WRONG_CLUSTER_BACKOFF
                }
                _ => break response,
            },
            Err((error, status)) if status.as_ref().is_some_and(is_wrong_cluster) => {
                tracing::error!(%error, cluster = %cluster_id, "{WRONG_CLUSTER_HELP}");
                coordinators.after_failure(status.as_ref());
                WRONG_CLUSTER_BACKOFF
            }
            Err((error, status)) => {
                tracing::warn!(%error, "cannot register with a coordinator yet; retrying");
                coordinators.after_failure(status.as_ref());
                let pause = backoff;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                pause
            }
        };
        tokio::time::sleep(pause).await;
    };
    if response.node_id == 0 || (node_id != 0 && response.node_id != node_id) {
        return Err(NodeError::Malformed(format!(
            "the coordinator assigned node id {} (asked for {node_id})",
            response.node_id
        )));
    }
    let path = config.data_dir.join(NODE_ID_FILE);
    write_file_atomically(
        &FileStorage::new(),
        &path,
        format!("{}\n", response.node_id).as_bytes(),
    )
    .map_err(|e| NodeError::Config(format!("cannot write {}: {e}", path.display())))?;
    config.node_id = response.node_id;
    tracing::info!(
        node_id = response.node_id,
        "registered with the coordinator"
    );
    let lease_ttl = Duration::from_millis(u64::from(response.lease_ttl_ms.max(300)));
    Ok((response.map.unwrap_or_default(), lease_ttl))
}

/// Whether a map of cluster `theirs` belongs to another cluster than
/// `ours` (either empty: nothing is known, so no).
pub(crate) fn other_cluster(ours: &str, theirs: &str) -> bool {
    !ours.is_empty() && !theirs.is_empty() && ours != theirs
}

/// Whether a coordinator refused the node as one of another cluster.
fn is_wrong_cluster(status: &tonic::Status) -> bool {
    error_detail(status).is_some_and(|d| d.code == ErrorCode::WrongCluster as i32)
}

/// Registers in the background (a restarted node already serving), then
/// starts the heartbeats and the map watch.
pub(crate) fn spawn_registration(node: Arc<Node>) {
    tokio::spawn(async move {
        let mut config = node.config.clone();
        let registered = tokio::select! {
            _ = node.stopped() => return,
            registered = register(&mut config, &node.security) => registered,
        };
        match registered {
            Ok((map, lease_ttl)) => {
                node.set_map(map);
                spawn(node, lease_ttl);
            }
            // Only a coordinator that names another id ends here: the node
            // goes on serving its replicas with the map it has.
            Err(error) => tracing::error!(%error, "registration refused"),
        }
    });
}

/// Heartbeats and the map watch, until the node stops.
pub(crate) fn spawn(node: Arc<Node>, lease_ttl: Duration) {
    let Some(link) = node.config.coordinator.clone() else {
        return;
    };
    let behind = Arc::new(tokio::sync::Notify::new());
    tokio::spawn(heartbeats(
        node.clone(),
        link.addresses.clone(),
        lease_ttl,
        behind.clone(),
    ));
    tokio::spawn(watch_map(node, link.addresses, behind));
}

/// Heartbeats that answer a newer map version than the node holds, in a
/// row, before the node fetches the map itself: the watch delivers a new
/// map within moments, but a watch held by a coordinator cut off from its
/// store stays open and silent, and the node went on for as long with an
/// old map — revoked tokens accepted, new namespaces unknown, writes
/// stamped with an old epoch, a deposed coordinator's commands judged by
/// it.
const BEATS_BEHIND: u32 = 2;

async fn heartbeats(
    node: Arc<Node>,
    addresses: Vec<String>,
    mut lease_ttl: Duration,
    behind: Arc<tokio::sync::Notify>,
) {
    let mut coordinators = Coordinators::new(addresses, node.security.clone());
    let mut beats_behind = 0u32;
    let stopped = node.stopped();
    tokio::pin!(stopped);
    let mut wait = Duration::ZERO;
    loop {
        let interval = (lease_ttl / 3).max(Duration::from_millis(100));
        if !wait.is_zero() {
            tokio::select! {
                _ = &mut stopped => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
        // After a failure, the next coordinator is asked soon: two beats
        // missed in a row (a coordinator pod gone but still behind the
        // Service) outlasted the lease and marked the node down.
        wait = interval;
        let status = node.status();
        let beat = async {
            let mut client = coordinators.client().await.map_err(|e| (e, None))?;
            let request = HeartbeatRequest {
                status: Some(status),
                cluster_id: node.map().cluster_id.clone(),
            };
            client
                .heartbeat(request)
                .await
                .map(|r| r.into_inner())
                .map_err(|s| (NodeError::Network(s.message().to_string()), Some(s)))
        };
        // At most a beat's interval: a hung coordinator must not hold the
        // next beat back until the lease ran out.
        match answered_within(interval, beat).await {
            Ok(response) => {
                if response.lease_ttl_ms > 0 {
                    lease_ttl = Duration::from_millis(u64::from(response.lease_ttl_ms));
                }
                if response.map_version <= node.map().version {
                    beats_behind = 0;
                    continue;
                }
                beats_behind += 1;
                if beats_behind < BEATS_BEHIND {
                    continue;
                }
                // From the coordinator that answered (it holds the newer
                // map), and the watch moves on to another.
                tracing::warn!(
                    held = node.map().version,
                    current = response.map_version,
                    "the cluster map watch is behind the coordinators; fetching the map"
                );
                behind.notify_one();
                let fetch = async {
                    let mut client = coordinators.client().await.map_err(|e| (e, None))?;
                    client
                        .get_cluster_map(GetClusterMapRequest {})
                        .await
                        .map(|r| r.into_inner())
                        .map_err(|s| (NodeError::Network(s.message().to_string()), Some(s)))
                };
                match answered_within(interval, fetch).await {
                    Ok(map) => {
                        node.set_map(map);
                        beats_behind = 0;
                    }
                    Err((error, _)) => {
                        tracing::warn!(%error, "fetching the cluster map failed");
                    }
                }
            }
            Err((error, status)) if status.as_ref().is_some_and(is_wrong_cluster) => {
                tracing::error!(%error, "{WRONG_CLUSTER_HELP}");
                coordinators.after_failure(status.as_ref());
            }
            Err((error, status)) => {
                tracing::warn!(%error, "heartbeat failed");
                coordinators.after_failure(status.as_ref());
                wait = HEARTBEAT_RETRY.min(interval);
            }
        }
    }
}

async fn watch_map(node: Arc<Node>, addresses: Vec<String>, behind: Arc<tokio::sync::Notify>) {
    let mut coordinators = Coordinators::new(addresses, node.security.clone());
    let stopped = node.stopped();
    tokio::pin!(stopped);
    let mut delay = Duration::from_millis(100);
    loop {
        let mut received = false;
        let follow = async {
            let mut client = coordinators.client().await?;
            let request = WatchClusterMapRequest {
                after_version: node.map().version,
            };
            let mut stream = client
                .watch_cluster_map(request)
                .await
                .map_err(|s| NodeError::Network(s.message().to_string()))?
                .into_inner();
            while let Some(map) = stream
                .message()
                .await
                .map_err(|s| NodeError::Network(s.message().to_string()))?
            {
                received = true;
                node.set_map(map);
            }
            Ok::<(), NodeError>(())
        };
        tokio::select! {
            _ = &mut stopped => return,
            result = follow => {
                if let Err(error) = result {
                    tracing::warn!(%error, "cluster map watch ended; reconnecting");
                }
                coordinators.after_failure(None);
            }
            // The heartbeats saw the coordinators ahead of this watch: it
            // is held by one that no longer follows the store.
            () = behind.notified() => {
                tracing::warn!("cluster map watch behind the heartbeats' map version; watching another coordinator");
                coordinators.after_failure(None);
            }
        }
        delay = if received {
            Duration::from_millis(100)
        } else {
            (delay * 2).min(MAX_BACKOFF)
        };
        tokio::select! {
            _ = &mut stopped => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}
