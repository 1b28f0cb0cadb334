//! `NodeAdmin`: the calls the coordinator (or an operator) makes on a node
//! to open and close replicas, change shard membership, move leadership,
//! order admin entries and read the node's state.

use std::sync::Arc;
use std::time::Duration;

use raft::eraftpb::{ConfChangeSingle, ConfChangeType, ConfChangeV2};
use tidepool_proto::ErrorInfo;
use tidepool_proto::v1::node_admin_server::NodeAdmin;
use tidepool_proto::v1::{
    ChangeMembershipRequest, ChangeMembershipResponse, CloseReplicaRequest, CloseReplicaResponse,
    ClusterMap, Durability, EpochDropApplied, ErrorCode, HashRange, HeldMapRequest,
    MembershipChange, NodeStatus, NodeStatusRequest, OpenReplicaRequest, OpenReplicaResponse,
    ProposeAdminRequest, ProposeAdminResponse, ReplicaInfo, ReplicaRole,
    ReplicaStatus as WireReplicaStatus, RetentionApplied, ShardInfo, SplitOp,
    TransferLeaderRequest, TransferLeaderResponse, propose_admin_request, retention,
};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use super::Node;
use crate::command::Command;
use crate::entry_context::EntrySync;
use crate::replica::{Outcome, ReplicaStatus};
use crate::shard::ShardState;
use crate::shard::{Event, ShardHandle};

const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

type ApiResult<T> = std::result::Result<T, ErrorInfo>;

/// The `NodeAdmin` service.
pub(crate) struct AdminApi {
    node: Arc<Node>,
}

impl AdminApi {
    pub fn new(node: Arc<Node>) -> Self {
        Self { node }
    }

    fn shard(&self, shard_id: u32) -> ApiResult<Arc<ShardHandle>> {
        self.node.shard(shard_id).ok_or_else(|| {
            self.node.error(
                ErrorCode::ShardNotFound,
                format!(
                    "node {} hosts no replica of shard {shard_id}",
                    self.node.config.node_id
                ),
            )
        })
    }

    fn leader_status(&self, shard_id: u32, shard: &ShardHandle) -> ApiResult<ReplicaStatus> {
        match shard.state().status {
            Some(status) if status.is_leader => Ok(status),
            Some(status) => Err(self.node.not_leader(shard_id, status.leader)),
            None => Err(self
                .node
                .outcome_error(shard_id, Outcome::Failed("replica down".into()))),
        }
    }

    /// Epoch drops may only reach namespaces that expire: a durable
    /// namespace's blobs are never dropped, whoever asks; nor blobs the
    /// retention in this node's map still keeps at the later of its map's
    /// and the shard's epochs — a drop computed with an older, shorter
    /// retention (a coordinator deposed, or computing while the retention
    /// was lengthened) is refused `CONFLICT` where the longer one arrived.
    fn check_droppable(&self, namespace_id: u32, below: u64, shard_epoch: u64) -> ApiResult<()> {
        let map = self.node.map();
        let Some(namespace) = map.namespaces.iter().find(|n| n.id == namespace_id) else {
            return Err(self.node.error(
                ErrorCode::NamespaceNotFound,
                format!("no namespace with id {namespace_id} in this node's map"),
            ));
        };
        let keep = match namespace.retention.as_ref().and_then(|r| r.policy.as_ref()) {
            Some(retention::Policy::Retain(keep)) => Some(u64::from(keep.epochs)),
            _ => None,
        };
        if let Some(keep) = keep {
            let epoch = map.epoch.max(shard_epoch);
            let allowed = (epoch + 1).saturating_sub(keep);
            // (A drop past the shard's epoch is refused below, as such.)
            if below > allowed && below <= shard_epoch {
                return Err(self.node.error(
                    ErrorCode::Conflict,
                    format!(
                        "namespace {:?} keeps {keep} epochs: at epoch {epoch} blobs below {allowed} may be dropped, not below {below}",
                        namespace.name
                    ),
                ));
            }
        }
        if keep.is_none() {
            return Err(self.node.error(
                ErrorCode::InvalidArgument,
                format!(
                    "namespace {:?} is durable: its blobs are never dropped by epochs",
                    namespace.name
                ),
            ));
        }
        Ok(())
    }

    /// Asks the shard's leader to hand leadership over; refused (`CONFLICT`,
    /// with the reason) unless the leader sees the target reachable and
    /// caught up.
    async fn transfer_leader_inner(
        &self,
        request: TransferLeaderRequest,
    ) -> ApiResult<TransferLeaderResponse> {
        let shard_id = request.shard_id;
        let shard = self.shard(shard_id)?;
        let status = self.leader_status(shard_id, &shard)?;
        if !status.voters.contains(&request.to_node) {
            return Err(self.node.error(
                ErrorCode::InvalidArgument,
                format!(
                    "node {} is not a voter of shard {shard_id}",
                    request.to_node
                ),
            ));
        }
        let (tx, rx) = oneshot::channel();
        let reply = Box::new(move |result| {
            let _ = tx.send(result);
        });
        shard
            .send(Event::TransferLeader(request.to_node, reply))
            .map_err(|_| {
                self.node
                    .error(ErrorCode::Overloaded, "the shard's queue is full")
            })?;
        match tokio::time::timeout(ADMIN_TIMEOUT, rx).await {
            Ok(Ok(Ok(()))) => Ok(TransferLeaderResponse {}),
            Ok(Ok(Err(reason))) => {
                let mut info = self.node.error(
                    ErrorCode::Conflict,
                    format!("shard {shard_id}: no leadership transfer: {reason}"),
                );
                info.detail.shard_id = Some(shard_id);
                Err(info)
            }
            Ok(Err(_)) => Err(self
                .node
                .outcome_error(shard_id, Outcome::Failed("the replica stopped".into()))),
            Err(_) => Err(self.node.error(
                ErrorCode::Timeout,
                format!("shard {shard_id} did not answer within {ADMIN_TIMEOUT:?}"),
            )),
        }
    }

    async fn await_outcome(&self, shard_id: u32, rx: oneshot::Receiver<Outcome>) -> ApiResult<u64> {
        match tokio::time::timeout(ADMIN_TIMEOUT, rx).await {
            Ok(Ok(Outcome::Applied { index, .. })) => Ok(index),
            Ok(Ok(other)) => Err(self.node.outcome_error(shard_id, other)),
            Ok(Err(_)) => Err(self
                .node
                .outcome_error(shard_id, Outcome::Failed("the replica stopped".into()))),
            Err(_) => Err(self.node.error(
                ErrorCode::Timeout,
                format!("shard {shard_id} did not apply the change within {ADMIN_TIMEOUT:?}"),
            )),
        }
    }

    /// Refuses a split the shard cannot carry out as asked (the apply
    /// checks again, on replicated state).
    fn check_split(&self, shard_id: u32, shard: &ShardHandle, op: &SplitOp) -> ApiResult<()> {
        let invalid = |message: String| self.node.error(ErrorCode::InvalidArgument, message);
        if op.child_shard_id == 0 || op.child_shard_id == shard_id {
            return Err(invalid(format!(
                "child_shard_id {} cannot name a new shard",
                op.child_shard_id
            )));
        }
        let Some((start, end)) = shard.range() else {
            return Err(self.node.error(
                ErrorCode::Unsupported,
                format!(
                    "shard {shard_id} was founded before ranges were replicated and cannot split"
                ),
            ));
        };
        let children = shard.state().status.map(|s| s.children).unwrap_or_default();
        if children.iter().any(|c| c.shard_id == op.child_shard_id) {
            return Ok(()); // proposed again: a no-op, answered as done
        }
        if !(start < op.at && op.at <= end) {
            return Err(invalid(format!(
                "{:#018x} does not cut shard {shard_id}'s range {start:#018x}..={end:#018x}",
                op.at
            )));
        }
        if self.node.shard(op.child_shard_id).is_some() {
            return Err(invalid(format!(
                "shard {} exists already",
                op.child_shard_id
            )));
        }
        Ok(())
    }

    /// The shard as this replica's configuration describes it.
    fn shard_info(&self, shard_id: u32, status: &ReplicaStatus) -> ShardInfo {
        let mut info = self
            .node
            .hosted()
            .into_iter()
            .find(|(info, _)| info.shard_id == shard_id)
            .map(|(info, _)| info)
            .unwrap_or_default();
        info.shard_id = shard_id;
        info.replicas = members(&status.voters, &status.learners);
        info.leader_hint = status.leader;
        info.conf_version = status.conf_index;
        info
    }

    async fn change_membership_inner(
        &self,
        request: ChangeMembershipRequest,
    ) -> ApiResult<ChangeMembershipResponse> {
        let shard_id = request.shard_id;
        let shard = self.shard(shard_id)?;
        let status = self.leader_status(shard_id, &shard)?;
        if status.conf_index != request.expected_conf_version {
            return Err(self.node.error(
                ErrorCode::Conflict,
                format!(
                    "shard {shard_id} is at conf_version {}, not {}",
                    status.conf_index, request.expected_conf_version
                ),
            ));
        }
        let node = request.node_id;
        let change =
            MembershipChange::try_from(request.change).unwrap_or(MembershipChange::Unspecified);
        let (change_type, done_when): (ConfChangeType, fn(&ReplicaStatus, u64) -> bool) =
            match change {
                MembershipChange::AddLearner => (ConfChangeType::AddLearnerNode, |s, n| {
                    s.learners.contains(&n)
                }),
                MembershipChange::Promote => {
                    if !status.learners.contains(&node) {
                        return Err(self.node.error(
                            ErrorCode::Conflict,
                            format!("node {node} is not a learner of shard {shard_id}"),
                        ));
                    }
                    (ConfChangeType::AddNode, |s, n| s.voters.contains(&n))
                }
                MembershipChange::Remove => (ConfChangeType::RemoveNode, |s, n| {
                    !s.voters.contains(&n) && !s.learners.contains(&n)
                }),
                MembershipChange::Unspecified => {
                    return Err(self
                        .node
                        .error(ErrorCode::InvalidArgument, "change is required"));
                }
            };
        if node == 0 {
            return Err(self
                .node
                .error(ErrorCode::InvalidArgument, "node_id is required"));
        }
        // Changes that would leave the group without a voter: raft-rs takes
        // them as proposals and fails only when they apply, where the
        // replica must then fail.
        let only_voter = status.voters.len() == 1 && status.voters.contains(&node);
        if only_voter
            && matches!(
                change,
                MembershipChange::Remove | MembershipChange::AddLearner
            )
        {
            return Err(self.node.error(
                ErrorCode::Conflict,
                format!(
                    "node {node} is shard {shard_id}'s only voter: the change would leave it none"
                ),
            ));
        }
        if change == MembershipChange::AddLearner && status.voters.contains(&node) {
            return Err(self.node.error(
                ErrorCode::Conflict,
                format!("node {node} is a voter of shard {shard_id}, not to be made a learner"),
            ));
        }
        let mut single = ConfChangeSingle::default();
        single.set_change_type(change_type);
        single.node_id = node;
        let mut conf_change = ConfChangeV2::default();
        conf_change.set_changes(vec![single]);
        let (tx, rx) = oneshot::channel();
        shard.change_membership(
            conf_change,
            Box::new(move |outcome| {
                let _ = tx.send(outcome);
            }),
        );
        let index = self.await_outcome(shard_id, rx).await?;
        // The completion runs at apply time; the owner publishes the new
        // configuration right after.
        let status = published_at(&shard, index).await.unwrap_or(status);
        if !done_when(&status, node) {
            // raft-rs turns a change proposed while another is pending into
            // an empty entry.
            return Err(self.node.error(
                ErrorCode::Conflict,
                format!("shard {shard_id} had another membership change in progress; retry"),
            ));
        }
        Ok(ChangeMembershipResponse {
            shard: Some(self.shard_info(shard_id, &status)),
        })
    }

    async fn propose_admin_inner(
        &self,
        request: ProposeAdminRequest,
    ) -> ApiResult<ProposeAdminResponse> {
        let shard_id = request.shard_id;
        let shard = self.shard(shard_id)?;
        let status = self.leader_status(shard_id, &shard)?;
        let epoch = |value: u64, field: &str| {
            u32::try_from(value).map_err(|_| {
                self.node.error(
                    ErrorCode::InvalidArgument,
                    format!("{field} {value} is out of range"),
                )
            })
        };
        let command = match request.op {
            Some(propose_admin_request::Op::AdvanceEpoch(op)) => {
                Command::AdvanceEpoch(epoch(op.epoch, "epoch")?)
            }
            Some(propose_admin_request::Op::DropEpochs(op)) => {
                self.check_droppable(op.namespace_id, op.below, shard.engine().epoch().0.into())?;
                let below = epoch(op.below, "below")?;
                let current = shard.engine().epoch().0;
                if below > current {
                    return Err(self.node.error(
                        ErrorCode::InvalidArgument,
                        format!(
                            "shard {shard_id} is at epoch {current}: epochs below {below} include the current one"
                        ),
                    ));
                }
                // The retention the group holds, as the apply will judge
                // it (the node's map may be older than the last retain).
                if let Some((_, held)) = status
                    .retained
                    .iter()
                    .find(|(namespace, _)| *namespace == op.namespace_id)
                    && !held.allows_drop(below, current)
                {
                    return Err(self.node.error(
                        ErrorCode::Conflict,
                        format!(
                            "shard {shard_id} holds a retention of {} epochs for namespace id {} (map v{}): at epoch {current} it does not allow dropping the epochs below {below}",
                            held.epochs, op.namespace_id, held.map_version
                        ),
                    ));
                }
                Command::DropEpochs {
                    namespace: op.namespace_id,
                    below,
                }
            }
            Some(propose_admin_request::Op::Retain(op)) => {
                if op.map_version == 0 {
                    return Err(self.node.error(
                        ErrorCode::InvalidArgument,
                        "map_version is required (the cluster map version the retention was read from)",
                    ));
                }
                Command::Retain {
                    namespace: op.namespace_id,
                    epochs: op.epochs,
                    map_version: op.map_version,
                }
            }
            Some(propose_admin_request::Op::Split(op)) => {
                self.check_split(shard_id, &shard, &op)?;
                Command::Split {
                    child: op.child_shard_id,
                    at: op.at,
                }
            }
            None => {
                return Err(self
                    .node
                    .error(ErrorCode::InvalidArgument, "op is required"));
            }
        };
        let split = match &command {
            Command::Split { child, .. } => Some(*child),
            _ => None,
        };
        let (tx, rx) = oneshot::channel();
        shard.propose(
            command,
            EntrySync::AsConfigured,
            Box::new(move |outcome| {
                let _ = tx.send(outcome);
            }),
        );
        let raft_index = self.await_outcome(shard_id, rx).await?;
        if let Some(child) = split {
            // Applied; whether it was carried out is in the state published
            // right after.
            let status = published_at(&shard, raft_index).await;
            if !status.is_some_and(|s| s.children.iter().any(|c| c.shard_id == child)) {
                let mut info = self.node.error(
                    ErrorCode::Conflict,
                    format!(
                        "shard {shard_id} did not split: its membership is changing, or its range changed; retry"
                    ),
                );
                info.detail.shard_id = Some(shard_id);
                return Err(info);
            }
        }
        Ok(ProposeAdminResponse { raft_index })
    }
}

/// Whether replicas in these states, on node `me`, let their node be
/// ready ([`Node::readiness`]): each knows its leader, and none that votes
/// is catching up (a learner's catching up costs its shard nothing: a
/// node receiving new replicas as learners, for hours maybe, stays ready).
fn replicas_ready(me: u64, states: &[(u32, ShardState)]) -> std::result::Result<(), String> {
    let (mut leaderless, mut catching_up) = (Vec::new(), Vec::new());
    for (shard_id, state) in states {
        match &state.status {
            Some(status) if status.leader != 0 => {
                let learner = status.learners.contains(&me);
                if !learner && (state.receiving_snapshot || status.votes_held) {
                    catching_up.push(*shard_id);
                }
            }
            _ => leaderless.push(*shard_id),
        }
    }
    match (leaderless.is_empty(), catching_up.is_empty()) {
        (true, true) => Ok(()),
        (false, _) => Err(format!("shards without a known leader: {leaderless:?}")),
        (true, false) => Err(format!("shards catching up: {catching_up:?}")),
    }
}

impl Node {
    /// Whether the node serves (`GET /readyz`, a Kubernetes readiness
    /// probe): it is not stopping, has a cluster map, and every replica it
    /// hosts knows its shard's leader and is not catching up — receiving a
    /// snapshot, or holding its votes until it has caught up
    /// (`replica/votes.rs`). A node whose shards lost quorum is not ready,
    /// so a rolling restart waits for it instead of taking the next member
    /// of those shards down; nor is a node whose replicas could not yet
    /// help a majority commit (a restarted follower pulling a snapshot:
    /// ready, the next restart left its shards a leader and a follower
    /// that acknowledges nothing until the snapshot is in).
    pub fn readiness(&self) -> std::result::Result<(), String> {
        if self.is_stopping() {
            return Err("stopping".into());
        }
        if self.map().version == 0 {
            return Err("no cluster map yet".into());
        }
        let states: Vec<(u32, ShardState)> = self
            .hosted()
            .into_iter()
            .map(|(info, shard)| (info.shard_id, shard.state()))
            .collect();
        replicas_ready(self.config.node_id, &states)
    }

    /// What the node reports about itself (`NodeAdmin.Status`, heartbeats).
    pub fn status(&self) -> NodeStatus {
        let me = self.config.node_id;
        let (used, capacity) = disk_usage(&self.config.data_dir);
        let replicas = self
            .hosted()
            .into_iter()
            .map(|(info, shard)| {
                let state = shard.state();
                let status = state.status.unwrap_or_default();
                let role = if status.learners.contains(&me) {
                    ReplicaRole::Learner
                } else {
                    ReplicaRole::Voter
                };
                WireReplicaStatus {
                    shard_id: info.shard_id,
                    role: role as i32,
                    is_leader: status.is_leader,
                    term: status.term,
                    commit_index: status.commit,
                    applied_index: status.applied,
                    last_index: status.last_index,
                    epoch: u64::from(state.epoch),
                    disk_used_bytes: state.disk_bytes,
                    data_bytes: state.data_bytes,
                    requests_per_second: state.load.requests_per_second,
                    load_split_at: state.load.split_at,
                    receiving_snapshot: state.receiving_snapshot,
                    snapshot_bytes_received: state.snapshot_bytes_received,
                    quiesced: status.quiesced,
                    drops: status
                        .drops
                        .iter()
                        .map(|(namespace_id, below)| EpochDropApplied {
                            namespace_id: *namespace_id,
                            dropped_below: u64::from(*below),
                        })
                        .collect(),
                    retained: status
                        .retained
                        .iter()
                        .map(|(namespace_id, held)| RetentionApplied {
                            namespace_id: *namespace_id,
                            epochs: held.epochs,
                            map_version: held.map_version,
                        })
                        .collect(),
                    conf_version: status.conf_index,
                    first_index: status.first_index,
                    members: members(&status.voters, &status.learners),
                    leader: status.leader,
                    range: status.range.map(|(start, end)| HashRange { start, end }),
                    split_off: status.children.iter().map(|c| c.shard_id).collect(),
                    files_missing: state.files_missing,
                    failed: state.failed.is_some() && !state.files_missing,
                    failed_reason: if state.files_missing {
                        String::new()
                    } else {
                        state.failed.clone().unwrap_or_default()
                    },
                    votes_held: status.votes_held,
                }
            })
            .collect();
        NodeStatus {
            node_id: me,
            address: self.config.advertise(),
            disk_used_bytes: used,
            disk_capacity_bytes: capacity,
            replicas,
            map_version: self.map().version,
            capabilities: tidepool_proto::capabilities::ALL
                .iter()
                .map(|c| c.to_string())
                .collect(),
            durability: match self.config.durability() {
                Ok(tidepool_engine::Durability::Buffered) => Durability::Buffered,
                // Validated at start: anything else is synced.
                _ => Durability::Synced,
            } as i32,
        }
    }
}

/// A configuration as the wire lists it: voters, then learners.
fn members(voters: &[u64], learners: &[u64]) -> Vec<ReplicaInfo> {
    let with_role = |ids: &[u64], role: ReplicaRole| {
        ids.iter()
            .map(move |&node_id| ReplicaInfo {
                node_id,
                role: role as i32,
            })
            .collect::<Vec<_>>()
    };
    let mut all = with_role(voters, ReplicaRole::Voter);
    all.extend(with_role(learners, ReplicaRole::Learner));
    all
}

/// The replica's status once it is published with `index` applied (up to
/// a second; `None` if the replica went down meanwhile).
async fn published_at(shard: &ShardHandle, index: u64) -> Option<ReplicaStatus> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    loop {
        let status = shard.state().status?;
        if status.applied >= index || tokio::time::Instant::now() >= deadline {
            return Some(status);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Used and total bytes of the volume holding `dir`.
pub(crate) fn disk_usage(dir: &std::path::Path) -> (u64, u64) {
    use tidepool_engine::storage::{FileStorage, Storage};
    let free = FileStorage::new().available_bytes(dir).unwrap_or(0);
    let total = total_bytes(dir).unwrap_or(free);
    (total.saturating_sub(free), total)
}

fn total_bytes(dir: &std::path::Path) -> Option<u64> {
    // `df`-style total from statvfs, through the engine's storage seam is
    // not offered; read it from the kernel.
    let stat = rustix::fs::statvfs(dir).ok()?;
    Some(stat.f_blocks * stat.f_frsize)
}

fn respond<T>(result: ApiResult<T>) -> Result<Response<T>, Status> {
    result.map(Response::new).map_err(Status::from)
}

#[tonic::async_trait]
impl NodeAdmin for AdminApi {
    async fn open_replica(
        &self,
        request: Request<OpenReplicaRequest>,
    ) -> Result<Response<OpenReplicaResponse>, Status> {
        let request = request.into_inner();
        let result = (|| {
            let info = request.shard.ok_or_else(|| {
                self.node
                    .error(ErrorCode::InvalidArgument, "shard is required")
            })?;
            if info.hash_start > info.hash_end {
                return Err(self
                    .node
                    .error(ErrorCode::InvalidArgument, "hash_start is after hash_end"));
            }
            let voters: Vec<u64> = if request.bootstrap {
                info.replicas
                    .iter()
                    .filter(|r| r.role == ReplicaRole::Voter as i32)
                    .map(|r| r.node_id)
                    .collect()
            } else {
                Vec::new()
            };
            if request.bootstrap && !voters.contains(&self.node.config.node_id) {
                return Err(self.node.error(
                    ErrorCode::InvalidArgument,
                    "a bootstrapped shard must list this node among its voters",
                ));
            }
            let shard_id = info.shard_id;
            tokio::task::block_in_place(|| self.node.open_replica(info, &voters))
                .map_err(|e| self.node.admin_error(shard_id, e))
        })();
        respond(result.map(|already_open| OpenReplicaResponse { already_open }))
    }

    async fn change_membership(
        &self,
        request: Request<ChangeMembershipRequest>,
    ) -> Result<Response<ChangeMembershipResponse>, Status> {
        respond(self.change_membership_inner(request.into_inner()).await)
    }

    async fn transfer_leader(
        &self,
        request: Request<TransferLeaderRequest>,
    ) -> Result<Response<TransferLeaderResponse>, Status> {
        respond(self.transfer_leader_inner(request.into_inner()).await)
    }

    async fn close_replica(
        &self,
        request: Request<CloseReplicaRequest>,
    ) -> Result<Response<CloseReplicaResponse>, Status> {
        let request = request.into_inner();
        let shard_id = request.shard_id;
        let map = self.node.map();
        let me = self.node.config.node_id;
        if request.node_id != 0 && request.node_id != me {
            return Err(self
                .node
                .error(
                    ErrorCode::NodeNotFound,
                    format!(
                        "this is node {me}, not node {}: its replica of shard {shard_id} is not closed",
                        request.node_id
                    ),
                )
                .into());
        }
        let listed = map
            .shards
            .iter()
            .any(|s| s.shard_id == shard_id && s.replicas.iter().any(|r| r.node_id == me));
        if request.map_version != 0 && request.map_version < map.version && listed {
            // Decided on an older map than this node holds, and the newer
            // one lists this replica: it may have been added again since
            // (by the coordinator leading now).
            return Err(self
                .node
                .error(
                    ErrorCode::StaleMap,
                    format!(
                        "closing shard {shard_id}'s replica was decided on map {}; this node holds map {}, which lists the replica",
                        request.map_version, map.version
                    ),
                )
                .into());
        }
        if request.conf_version != 0
            && let Some(status) = self.node.shard(shard_id).and_then(|s| s.state().status)
            && status.conf_index > request.conf_version
            && (status.voters.contains(&me) || status.learners.contains(&me))
        {
            // A configuration newer than the caller's decision lists this
            // replica: added again since, a member now.
            return Err(self
                .node
                .error(
                    ErrorCode::StaleMap,
                    format!(
                        "closing shard {shard_id}'s replica was decided at conf_version {}; the replica is a member at conf_version {}",
                        request.conf_version, status.conf_index
                    ),
                )
                .into());
        }
        let result = tokio::task::block_in_place(|| self.node.close_replica(shard_id, true))
            .map_err(|e| self.node.admin_error(shard_id, e))
            .and_then(|was_open| {
                if was_open {
                    Ok(CloseReplicaResponse {})
                } else {
                    Err(self.node.error(
                        ErrorCode::ShardNotFound,
                        format!("no replica of shard {shard_id} here"),
                    ))
                }
            });
        respond(result)
    }

    async fn propose_admin(
        &self,
        request: Request<ProposeAdminRequest>,
    ) -> Result<Response<ProposeAdminResponse>, Status> {
        respond(self.propose_admin_inner(request.into_inner()).await)
    }

    async fn status(
        &self,
        _request: Request<NodeStatusRequest>,
    ) -> Result<Response<NodeStatus>, Status> {
        Ok(Response::new(self.node.status()))
    }

    async fn held_map(
        &self,
        _request: Request<HeldMapRequest>,
    ) -> Result<Response<ClusterMap>, Status> {
        Ok(Response::new((*self.node.map()).clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::ReplicaStatus;

    /// A node is ready when each replica knows its leader and no voter is
    /// catching up: one pulling a snapshot, or holding its votes until it
    /// has caught up, cannot help its shard commit yet; a learner doing so
    /// costs nothing.
    #[test]
    fn replicas_catching_up_keep_their_node_unready() {
        let following = ShardState {
            status: Some(ReplicaStatus {
                leader: 2,
                ..ReplicaStatus::default()
            }),
            ..ShardState::default()
        };
        assert_eq!(replicas_ready(1, &[(1, following.clone())]), Ok(()));
        let mut snapshot = following.clone();
        snapshot.receiving_snapshot = true;
        let mut held = following.clone();
        held.status.as_mut().unwrap().votes_held = true;
        let leaderless = ShardState::default();
        let error = replicas_ready(
            1,
            &[(1, following.clone()), (2, snapshot.clone()), (3, held)],
        );
        assert_eq!(error, Err("shards catching up: [2, 3]".to_string()));
        // A learner pulling a snapshot keeps its node ready.
        let mut learning = snapshot;
        learning.status.as_mut().unwrap().learners = vec![1];
        assert_eq!(
            replicas_ready(1, &[(1, following.clone()), (5, learning)]),
            Ok(())
        );
        let error = replicas_ready(1, &[(1, following), (4, leaderless)]);
        assert_eq!(error, Err("shards without a known leader: [4]".to_string()));
    }
}
