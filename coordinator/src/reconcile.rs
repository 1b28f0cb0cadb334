//! The reconciler: while this coordinator leads, every round it reads what
//! the nodes report, brings the map in line with the shards' actual Raft
//! configurations, founds shards that have no replicas yet, moves replicas
//! toward the placement (one step per shard per round, a bounded number of
//! shards at once), closes replicas nodes no longer need, balances
//! leadership and drives epoch advances and drops on every shard.
//!
//! Nothing it decides lives only in its memory: the map and the nodes'
//! Raft configurations hold every step's result, so a new leader resumes
//! where the old one stopped. (What is in memory: when each node was first
//! seen down. A new leader restarts that clock, which only delays
//! re-replication by up to one grace period.)

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tidepool_proto::v1::node_admin_client::NodeAdminClient;
use tidepool_proto::v1::{
    AdvanceEpochOp, ChangeMembershipRequest, CloseReplicaRequest, ClusterMap, DropEpochsOp,
    ErrorCode, MembershipChange, NodeState, NodeStatus, NodeStatusRequest, OpenReplicaRequest,
    ProposeAdminRequest, ReplicaInfo, ReplicaMove, ReplicaRole, ShardInfo, SplitOp,
    TransferLeaderRequest, propose_admin_request::Op as AdminOp,
};
use tidepool_security::Channel;
use tokio::sync::watch;

use crate::CoordinatorError;
use crate::core::Shared;
use crate::epochs::drop_target;
use crate::nodes::NodeClients;
use crate::placement::{NodeView, Placement, place_barring};
use crate::plan::{LearnerWatch, ShardView, Step, Wait, next_step, shard_views};
use crate::splits::Hot;
use crate::transfers::Transfers;

/// Deadline of a status poll.
const POLL_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline of a call that changes a shard (it waits for a Raft commit;
/// an epoch drop walks the index).
const CHANGE_TIMEOUT: Duration = Duration::from_secs(30);

/// What the reconciler last saw and did, for status and metrics.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// Shards changing membership, with their step.
    pub moves: Vec<ReplicaMove>,
    /// Replica moves completed by this coordinator (an old replica
    /// removed, or a missing one promoted).
    pub moves_done: u64,
    /// Learners removed for making no progress catching up.
    pub moves_abandoned: u64,
    /// Shards with fewer live voters than the replication factor.
    pub under_replicated: u32,
    /// Rounds run while leading.
    pub rounds: u64,
    /// Rounds or steps that failed.
    pub errors: u64,
    /// Shards in the map (as of the last round).
    pub shards: u32,
    /// Shards no replica reported leading.
    pub leaderless: u32,
    /// Epoch drops: each namespace with retention, its target and the
    /// shards that reached it.
    pub epochs: tidepool_proto::v1::EpochStatus,
}

/// The nodes whose liveness key exists, with the status they last sent.
pub(crate) async fn alive(shared: &Shared) -> Result<BTreeMap<u64, NodeStatus>, CoordinatorError> {
    use prost::Message as _;
    let mut alive = BTreeMap::new();
    for kv in shared.store.list(&shared.keys.nodes()).await? {
        let Some(id) = kv.key.rsplit('/').next().and_then(|id| id.parse().ok()) else {
            continue;
        };
        let status = NodeStatus::decode(&kv.value[..]).unwrap_or_default();
        alive.insert(id, status);
    }
    Ok(alive)
}

/// Node views for placement.
pub(crate) fn node_views(
    map: &ClusterMap,
    reports: &BTreeMap<u64, NodeStatus>,
    live: impl Fn(u64) -> bool,
) -> Vec<NodeView> {
    map.nodes
        .iter()
        .map(|n| {
            let report = reports.get(&n.node_id);
            NodeView {
                id: n.node_id,
                zone: n.zone.clone(),
                capacity_bytes: report
                    .map(|r| r.disk_capacity_bytes)
                    .filter(|c| *c > 0)
                    .unwrap_or(n.capacity_bytes),
                used_bytes: report.map_or(0, |r| r.disk_used_bytes),
                live: live(n.node_id),
                draining: n.state == NodeState::Draining as i32
                    || n.state == NodeState::Drained as i32,
            }
        })
        .collect()
}

/// The placement now: each founded shard's members (its map replicas while
/// no leader reports).
pub(crate) fn current_placement(views: &[ShardView]) -> Placement {
    views.iter().map(|v| (v.shard_id, v.members())).collect()
}

/// Where this round's placement starts from: each shard's members, except
/// that a shard in the middle of a move (a learner, or one voter more than
/// it keeps) starts from the target the move is heading for (`targets`,
/// last round's desired placement), when the move is that target's (the
/// target is among the members). Placing from such a shard's members would
/// pick which to keep by id, possibly undoing the move just made. A move
/// not started yet is not taken as made: its shard starts from what it
/// holds, so when the world changes before it starts (a node back within
/// moments of being replaced), placement sees the replicas where they are
/// and plans no move to put them back.
///
/// A moving shard with no target of this term (a coordinator that just
/// took over, whose targets and down clocks start empty) starts from its
/// members less those not answering (`live`) or down, while as many as it
/// keeps remain: else placement kept the lowest ids, and a replacement
/// under way — a learner copying for a dead voter — was removed and its
/// copy deleted, the dead voter kept for another grace period (and at
/// every new term: coordinators changing faster than a copy never
/// replaced a dead node).
pub(crate) fn placement_start(
    views: &[ShardView],
    targets: &Placement,
    replication: usize,
    live: &BTreeSet<u64>,
) -> Placement {
    views
        .iter()
        .map(|view| {
            // A replica whose files are gone is not one to keep.
            let members: BTreeSet<u64> = view
                .members()
                .difference(&view.files_missing())
                .copied()
                .collect();
            let moving = !view.learners.is_empty() || view.voters.len() > replication;
            let start = match targets.get(&view.shard_id) {
                Some(target) if view.leader.is_some() && moving && target.is_subset(&members) => {
                    target.clone()
                }
                None if view.leader.is_some() && moving => {
                    let down = view.down();
                    let working: BTreeSet<u64> = members
                        .iter()
                        .copied()
                        .filter(|n| live.contains(n) && !down.contains(n))
                        .collect();
                    if working.len() >= replication {
                        working
                    } else {
                        members
                    }
                }
                _ => members,
            };
            (view.shard_id, start)
        })
        .collect()
}

/// Whether the leader balancer may give `node` the leadership of `shard`:
/// it is `UP` (not draining) and the placement keeps the shard there — the
/// move path takes the leadership off any other node again.
pub(crate) fn may_lead(
    map: &ClusterMap,
    desired: &crate::placement::Placement,
    shard: u32,
    node: u64,
) -> bool {
    let up = map
        .nodes
        .iter()
        .any(|n| n.node_id == node && n.state == NodeState::Up as i32);
    up && desired.get(&shard).is_none_or(|d| d.contains(&node))
}

/// Where each shard's replicas should be, starting from `current`; never
/// on a node where the shard's replica reports its files missing (`views`),
/// nor on a pair in `barred`.
pub(crate) fn desired_placement(
    map: &ClusterMap,
    current: &Placement,
    nodes: &[NodeView],
    views: &[ShardView],
    barred: &BTreeSet<(u32, u64)>,
) -> Placement {
    let shards: Vec<u32> = map.shards.iter().map(|s| s.shard_id).collect();
    let mut barred = barred.clone();
    barred.extend(crate::plan::files_missing(views));
    place_barring(
        nodes,
        current,
        &shards,
        map.replication_factor as usize,
        &barred,
    )
}

/// The moves in progress as the status API shows them.
pub(crate) fn moves_of(
    views: &[ShardView],
    desired: &Placement,
    live: &BTreeSet<u64>,
    slack: u64,
) -> Vec<(ReplicaMove, Step)> {
    views
        .iter()
        .filter(|v| v.leader.is_some())
        .filter_map(|v| {
            // A shard the placement has no entry for (the map changed
            // under the round: a restore, a split) gets no step; planned
            // against an empty set, its voters were removed one by one.
            let want = desired.get(&v.shard_id)?;
            let step = next_step(v, want, live, slack)?;
            let from = v.voters.iter().find(|n| !want.contains(n)).copied();
            let to = v
                .learners
                .iter()
                .chain(want.iter().filter(|n| !v.voters.contains(n)))
                .next()
                .copied();
            let shown = ReplicaMove {
                shard_id: v.shard_id,
                from_node: from.unwrap_or(0),
                to_node: to.unwrap_or(0),
                step: step.move_step() as i32,
            };
            Some((shown, step))
        })
        .collect()
}

/// Whether a refused split decision says the shard cannot split (its
/// range, a split already under way): not tried again this term. A store
/// that did not answer, or a leadership lost meanwhile, is not the
/// shard's doing: it is tried again next round (before, one etcd hiccup
/// kept a shard from ever splitting until the next leader).
fn refuses_for_good(error: &CoordinatorError) -> bool {
    matches!(
        error,
        CoordinatorError::Conflict(_) | CoordinatorError::InvalidArgument(_)
    )
}

/// The moves that take this round's `max` slots, in order. A move that
/// cannot go on (a step now would risk the shard's majority; its target
/// node is not live) takes none: two such shards held every other move
/// behind them, re-replication after a node's loss included, and kept the
/// round busy so leaders were never balanced. A learner catching up does
/// take one (it is copying).
pub(crate) fn runnable_moves(
    pending: Vec<(ReplicaMove, Step)>,
    max: usize,
) -> Vec<(ReplicaMove, Step)> {
    pending
        .into_iter()
        .filter(|(_, step)| {
            !matches!(
                step,
                Step::Wait(Wait::Unsafe | Wait::TargetDown(_) | Wait::NoLeader)
            )
        })
        .take(max)
        .collect()
}

/// Runs rounds while this coordinator leads, until `stop` fires.
pub(crate) async fn run(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut reconciler = Reconciler {
        shared: shared.clone(),
        nodes: NodeClients::new(shared.security.clone()),
        down_since: HashMap::new(),
        targets: Placement::new(),
        transfers: shared.config.transfers(),
        unsplittable: Default::default(),
        hot: Default::default(),
        awaiting_upgrade: Default::default(),
        founding: Founding::default(),
        unanswered: HashMap::new(),
        learners: LearnerWatch::default(),
        failing: HashMap::new(),
        future_epoch_start: None,
    };
    let mut leadership = shared.subscribe_leadership();
    let mut led = None;
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = leadership.wait_for(|l| l.is_some()) => {}
        }
        let generation = shared.leadership().map(|l| l.generation);
        if generation != led {
            // A new term: the down clock starts again.
            reconciler.down_since.clear();
            reconciler.targets.clear();
            reconciler.transfers.clear();
            reconciler.unsplittable.clear();
            reconciler.hot.clear();
            reconciler.learners.clear();
            reconciler.failing.clear();
            led = generation;
        }
        if let Err(error) = reconciler.round().await {
            tracing::warn!(%error, "reconcile round failed");
            shared.progress.lock().errors += 1;
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(shared.config.reconcile_interval()) => {}
        }
    }
}

struct Reconciler {
    shared: Arc<Shared>,
    nodes: NodeClients,
    down_since: HashMap<u64, Instant>,
    /// Last round's desired placement: where a shard in the middle of a
    /// move starts from ([`placement_start`]).
    targets: Placement,
    /// Leadership transfers asked, and what the balancer leaves alone.
    transfers: Transfers,
    /// Shards that cannot split (this term): not split automatically.
    unsplittable: std::collections::BTreeSet<u32>,
    /// Shards over the load limit, and since when (splits by load).
    hot: crate::splits::HotShards,
    /// Shards last seen with a replica on a node that cannot split.
    awaiting_upgrade: BTreeSet<u32>,
    /// Founding replicas being opened.
    founding: Founding,
    /// Status polls of nodes whose last poll went unanswered past its
    /// deadline, still waiting for an answer: rounds do not wait for them.
    unanswered: HashMap<u64, tokio::task::JoinHandle<Polled>>,
    /// Learners' catch-up progress, and the pairs given up on.
    learners: LearnerWatch,
    /// Replicas reporting their engine failed, since when (this term).
    failing: HashMap<(u32, u64), Instant>,
    /// An epoch start found in the future (written by a leader whose clock
    /// ran ahead), missing or unreadable (`u64::MAX`), and when this one
    /// first saw it.
    future_epoch_start: Option<(u64, Instant)>,
}

/// How a status poll ended.
enum Polled {
    Answered(NodeStatus),
    Failed(CoordinatorError),
    /// No answer within the deadline.
    Silent,
}

impl Polled {
    async fn ask(mut client: NodeAdminClient<Channel>, deadline: Duration) -> Polled {
        match tokio::time::timeout(deadline, client.status(NodeStatusRequest {})).await {
            Ok(Ok(status)) => Polled::Answered(status.into_inner()),
            Ok(Err(status)) => Polled::Failed(CoordinatorError::Node(format!(
                "status: {}",
                status.message()
            ))),
            Err(_) => Polled::Silent,
        }
    }
}

/// Calls opening founding replicas, which rounds do not wait for: a node
/// that does not answer holds back neither the other nodes' openings nor
/// the rounds after (which publish the leaders the answering nodes elect).
/// Dropped with the reconciler, which aborts the calls.
#[derive(Default)]
struct Founding {
    calls: tokio::task::JoinSet<()>,
    /// (node, shard) of every opening under way: not asked again meanwhile.
    in_flight: Arc<parking_lot::Mutex<BTreeSet<(u64, u32)>>>,
}

/// Most automatic splits decided per round.
const SPLITS_PER_ROUND: usize = 4;

/// Nodes hosting a replica: members of a shard in the map or in its
/// leader's configuration, and nodes running a replica of a split's new
/// group not yet published (with the parent's members of the moment: the
/// parent may have moved off the node since). A draining node is drained
/// once it hosts none. (Not any replica of a group the map does not list:
/// nothing closes one the map will never list — a lost group that cannot
/// be adopted — and it held the drain for ever.)
fn hosting(
    map: &ClusterMap,
    views: &[ShardView],
    alive: &BTreeMap<u64, NodeStatus>,
) -> BTreeSet<u64> {
    let pending: BTreeSet<u32> = map
        .shards
        .iter()
        .filter_map(|s| s.split.map(|intent| intent.child_shard_id))
        .collect();
    let unlisted = alive.iter().filter_map(|(node, status)| {
        status
            .replicas
            .iter()
            .any(|r| pending.contains(&r.shard_id))
            .then_some(*node)
    });
    views
        .iter()
        .flat_map(|v| v.members())
        .chain(
            map.shards
                .iter()
                .flat_map(|s| s.replicas.iter().map(|r| r.node_id)),
        )
        .chain(unlisted)
        .collect()
}

impl Reconciler {
    /// The (shard, node) pairs whose replica has reported its engine failed
    /// — or whose live node has reported no replica of the shard at all —
    /// for at least `grace` (as a node down that long is replaced): barred
    /// from placement, so the shard gets a replica elsewhere and the failed
    /// one is removed and closed — it counted as a live voter before,
    /// never rebuilt, and let another voter's removal pass its majority
    /// check. One that reopens (or opens) is forgotten.
    fn failed_for_long(
        &mut self,
        now: Instant,
        views: &[ShardView],
        grace: Duration,
    ) -> BTreeSet<(u32, u64)> {
        let failed: BTreeSet<(u32, u64)> = views
            .iter()
            .flat_map(|v| {
                v.replicas
                    .iter()
                    .filter(|(_, r)| r.failed)
                    .map(|(node, _)| *node)
                    .chain(v.absent.iter().copied())
                    .map(|node| (v.shard_id, node))
            })
            .collect();
        self.failing.retain(|pair, _| failed.contains(pair));
        let mut long = BTreeSet::new();
        for pair in failed {
            let since = *self.failing.entry(pair).or_insert(now);
            if now.duration_since(since) >= grace {
                long.insert(pair);
            }
        }
        long
    }

    async fn round(&mut self) -> Result<(), CoordinatorError> {
        let shared = self.shared.clone();
        let map = shared.map();
        if map.version == 0 {
            return Ok(());
        }
        let alive = alive(&shared).await?;
        let now = Instant::now();
        let reports = self.poll(&map, &alive).await;
        // Down since it last answered a status poll: a node whose lease
        // is kept (its heartbeats arrive) but which does not answer the
        // coordinator (an address it cannot reach, a process too stalled
        // to answer) counted as live for good — its replicas never
        // rebuilt, new ones planned onto it.
        for node in &map.nodes {
            if reports.contains_key(&node.node_id) {
                self.down_since.remove(&node.node_id);
            } else {
                self.down_since.entry(node.node_id).or_insert(now);
            }
        }
        let held = reports.iter().map(|(id, r)| (*id, r.map_version));
        if shared.note_node_maps(held, true).await?.is_some() {
            // Planning from an older map than the nodes hold would undo
            // what happened since (splits, moves, namespaces, tokens):
            // nothing changes until the map is restored.
            return Ok(());
        }
        let live: BTreeSet<u64> = reports.keys().copied().collect();
        let views = shard_views(&map, &reports);
        let leaders = views.iter().map(|v| (v.shard_id, v.leader));
        for (shard_id, to) in self.transfers.observe(now, &live, leaders) {
            tracing::info!(
                shard_id,
                to,
                backoff_ms = shared.config.transfer_backoff_ms,
                "leadership transfer did not complete; not asking again for a while"
            );
        }
        let map = self.sync_map(&views, &alive).await?;
        let grace = shared.config.down_grace();
        let node_views = node_views(&map, &reports, |id| {
            live.contains(&id) || self.down_since.get(&id).is_none_or(|t| t.elapsed() < grace)
        });
        let config = &shared.config;
        let stalled = self.learners.observe(
            now,
            &views,
            config.catch_up_slack,
            Duration::from_millis(config.learner_stall_ms),
            Duration::from_millis(config.learner_bar_ms),
        );
        for (shard_id, node_id) in &stalled {
            tracing::warn!(
                shard_id,
                node_id,
                stall_ms = config.learner_stall_ms,
                bar_ms = config.learner_bar_ms,
                "a learner made no progress catching up: removing it and placing the replica elsewhere"
            );
        }
        shared.progress.lock().moves_abandoned += stalled.len() as u64;
        let mut barred = self.learners.barred();
        barred.extend(self.failed_for_long(now, &views, grace));
        let current = placement_start(
            &views,
            &self.targets,
            map.replication_factor as usize,
            &live,
        );
        let desired = desired_placement(&map, &current, &node_views, &views, &barred);
        self.targets = desired.clone();
        self.found(&map, &views, &desired, &live).await?;
        let (busy, adds) = self.move_replicas(&map, &views, &desired, &live).await;
        let bar = Duration::from_millis(config.learner_bar_ms);
        for (pair, ok) in adds {
            if self.learners.added(pair, ok, Instant::now(), bar) {
                tracing::warn!(
                    shard_id = pair.0,
                    node_id = pair.1,
                    failures = crate::plan::FAILED_ADDS,
                    bar_ms = config.learner_bar_ms,
                    "a replica could not be added to this node rounds in a row: placing it elsewhere"
                );
            }
        }
        self.close_strays(&map, &views, &desired).await;
        if !busy {
            self.balance_leaders(&map, &views, &live, &desired).await;
        }
        self.drive_epochs(&map, &views, &reports).await;
        self.drive_splits(&map, &views, &reports).await;
        if shared.config.epoch_interval_s > 0 {
            self.advance_on_schedule(&map).await?;
        }
        let rf = map.replication_factor as usize;
        let mut progress = shared.progress.lock();
        progress.rounds += 1;
        progress.shards = views.len() as u32;
        progress.leaderless = views.iter().filter(|v| v.leader.is_none()).count() as u32;
        progress.epochs = crate::epochs::epoch_status(map.epoch, &map.namespaces, &views);
        progress.under_replicated = views
            .iter()
            .filter(|v| {
                let down = v.down();
                v.voters
                    .intersection(&live)
                    .filter(|n| !down.contains(n))
                    .count()
                    < rf
            })
            .count() as u32;
        progress.moves = moves_of(&views, &desired, &live, shared.config.catch_up_slack)
            .into_iter()
            .map(|(m, _)| m)
            .collect();
        Ok(())
    }

    fn address(map: &ClusterMap, node: u64) -> Option<String> {
        map.nodes
            .iter()
            .find(|n| n.node_id == node)
            .map(|n| n.address.clone())
    }

    /// Fresh status from every live node that answers in time.
    ///
    /// A node that did not answer its last poll within `POLL_TIMEOUT` (a
    /// frozen process keeps its lease until the lease runs out) is asked
    /// again beside the rounds: the round does not wait for it, so one such
    /// node costs one round `POLL_TIMEOUT`, not every round until its lease
    /// ends. Once that poll answers, the next round polls the node afresh
    /// and waits for it again (an answer that arrived between rounds is
    /// not used as a report: it may be as old as the timeout).
    async fn poll(
        &mut self,
        map: &ClusterMap,
        alive: &BTreeMap<u64, NodeStatus>,
    ) -> BTreeMap<u64, NodeStatus> {
        self.unanswered.retain(|id, poll| {
            let keep = alive.contains_key(id);
            if !keep {
                poll.abort();
            }
            keep
        });
        let mut calls = tokio::task::JoinSet::new();
        for &id in alive.keys() {
            let Some(client) = Self::address(map, id).and_then(|a| self.nodes.admin(&a).ok())
            else {
                continue;
            };
            if let Some(poll) = self.unanswered.get(&id) {
                if !poll.is_finished() {
                    continue;
                }
                let finished = self.unanswered.remove(&id).expect("present");
                let answered = matches!(finished.await, Ok(Polled::Answered(_)));
                if !answered {
                    self.unanswered
                        .insert(id, tokio::spawn(Polled::ask(client, POLL_TIMEOUT)));
                    continue;
                }
                tracing::info!(node_id = id, "node answers status polls again");
            }
            calls.spawn(async move { (id, Polled::ask(client, POLL_TIMEOUT).await) });
        }
        let mut reports = BTreeMap::new();
        while let Some(joined) = calls.join_next().await {
            let Ok((id, polled)) = joined else { continue };
            match polled {
                Polled::Answered(status) if status.node_id == id => {
                    reports.insert(id, status);
                }
                Polled::Answered(status) => tracing::warn!(
                    node_id = id,
                    answered = status.node_id,
                    "a different node answers at this node's address"
                ),
                Polled::Failed(error) => {
                    tracing::debug!(node_id = id, %error, "status poll failed")
                }
                Polled::Silent => {
                    tracing::warn!(
                        node_id = id,
                        timeout_ms = POLL_TIMEOUT.as_millis() as u64,
                        "node did not answer its status poll; rounds go on without waiting for it"
                    );
                    if let Some(client) =
                        Self::address(map, id).and_then(|a| self.nodes.admin(&a).ok())
                    {
                        self.unanswered
                            .insert(id, tokio::spawn(Polled::ask(client, POLL_TIMEOUT)));
                    }
                }
            }
        }
        reports
    }

    /// Brings node states and each led shard's replicas, leader and
    /// configuration version in the map in line with the reports.
    async fn sync_map(
        &self,
        views: &[ShardView],
        alive: &BTreeMap<u64, NodeStatus>,
    ) -> Result<Arc<ClusterMap>, CoordinatorError> {
        self.shared
            .update_map(|map| {
                let mut changed = false;
                let hosting = hosting(map, views, alive);
                for node in &mut map.nodes {
                    let state = match NodeState::try_from(node.state).unwrap_or(NodeState::Up) {
                        NodeState::Draining if !hosting.contains(&node.node_id) => {
                            NodeState::Drained
                        }
                        s @ (NodeState::Draining | NodeState::Drained) => s,
                        _ if alive.contains_key(&node.node_id) => NodeState::Up,
                        _ => NodeState::Down,
                    };
                    if node.state != state as i32 {
                        tracing::info!(
                            node_id = node.node_id,
                            state = state.as_str_name(),
                            "node state changed"
                        );
                        node.state = state as i32;
                        changed = true;
                    }
                }
                for shard in &mut map.shards {
                    let Some(view) = views.iter().find(|v| v.shard_id == shard.shard_id) else {
                        continue;
                    };
                    let Some(leader) = view.leader else { continue };
                    let replicas = replica_infos(view);
                    if shard.replicas != replicas
                        || shard.leader_hint != leader
                        || shard.conf_version != view.conf_version
                    {
                        shard.replicas = replicas;
                        shard.leader_hint = leader;
                        shard.conf_version = view.conf_version;
                        changed = true;
                    }
                }
                Ok(changed.then(Vec::new))
            })
            .await
    }

    /// Records replicas for shards that have none (once R nodes can take
    /// them) and opens the founding replicas of shards not yet running.
    /// The map is written first, so a coordinator that fails halfway is
    /// followed by one that founds the same shard on the same nodes.
    async fn found(
        &mut self,
        map: &ClusterMap,
        views: &[ShardView],
        desired: &Placement,
        live: &BTreeSet<u64>,
    ) -> Result<(), CoordinatorError> {
        let rf = map.replication_factor as usize;
        let unplaced: Vec<u32> = map
            .shards
            .iter()
            .filter(|s| s.replicas.is_empty())
            .map(|s| s.shard_id)
            .filter(|id| {
                desired
                    .get(id)
                    .is_some_and(|d| d.len() == rf && d.is_subset(live))
            })
            .collect();
        let map = if unplaced.is_empty() {
            Arc::new(map.clone())
        } else {
            tracing::info!(shards = unplaced.len(), "placing new shards");
            self.shared
                .update_map(|m| {
                    let mut changed = false;
                    for shard in &mut m.shards {
                        if shard.replicas.is_empty() && unplaced.contains(&shard.shard_id) {
                            shard.replicas = desired[&shard.shard_id]
                                .iter()
                                .map(|&node_id| ReplicaInfo {
                                    node_id,
                                    role: ReplicaRole::Voter as i32,
                                })
                                .collect();
                            changed = true;
                        }
                    }
                    Ok(changed.then(Vec::new))
                })
                .await?
        };
        // Each node's founding replicas in shard order, the nodes at once:
        // a node opens one replica at a time (each creates and syncs its
        // files), so a cluster of many new shards is ready in about the
        // time its busiest node takes, not the sum over its nodes, and a
        // slow node holds back only its own replicas (`Founding`).
        while self.founding.calls.try_join_next().is_some() {}
        let in_flight = self.founding.in_flight.lock().clone();
        let mut per_node: BTreeMap<u64, Vec<ShardInfo>> = BTreeMap::new();
        for shard in map.shards.iter().filter(|s| founding(s)) {
            let view = views.iter().find(|v| v.shard_id == shard.shard_id);
            if view.is_some_and(|v| v.leader.is_some()) {
                continue;
            }
            for replica in &shard.replicas {
                let reported = view.is_some_and(|v| v.replicas.contains_key(&replica.node_id));
                if reported
                    || !live.contains(&replica.node_id)
                    || in_flight.contains(&(replica.node_id, shard.shard_id))
                {
                    continue;
                }
                per_node
                    .entry(replica.node_id)
                    .or_default()
                    .push(shard.clone());
            }
        }
        for (node_id, shards) in per_node {
            let client = Self::address(&map, node_id)
                .ok_or(CoordinatorError::UnknownNode(node_id))
                .and_then(|address| self.nodes.admin(&address));
            let client = match client {
                Ok(client) => client,
                Err(error) => {
                    tracing::warn!(node_id, %error, "cannot open founding replicas");
                    continue;
                }
            };
            let in_flight = self.founding.in_flight.clone();
            in_flight
                .lock()
                .extend(shards.iter().map(|s| (node_id, s.shard_id)));
            self.founding.calls.spawn(async move {
                for shard in shards {
                    let request = OpenReplicaRequest {
                        shard: Some(shard.clone()),
                        bootstrap: true,
                    };
                    let mut client = client.clone();
                    let call = client.open_replica(request);
                    if let Err(error) = NodeClients::call("open replica", CHANGE_TIMEOUT, call).await
                    {
                        tracing::warn!(shard_id = shard.shard_id, node_id, %error, "cannot open a founding replica");
                    }
                    in_flight.lock().remove(&(node_id, shard.shard_id));
                }
            });
        }
        Ok(())
    }

    async fn open(
        &self,
        map: &ClusterMap,
        node: u64,
        shard: &ShardInfo,
        bootstrap: bool,
    ) -> Result<(), CoordinatorError> {
        let address = Self::address(map, node).ok_or(CoordinatorError::UnknownNode(node))?;
        let mut client = self.nodes.admin(&address)?;
        let request = OpenReplicaRequest {
            shard: Some(shard.clone()),
            bootstrap,
        };
        NodeClients::call("open replica", CHANGE_TIMEOUT, client.open_replica(request)).await?;
        Ok(())
    }

    /// Closes `node`'s replica of `view`'s shard, decided at the shard's
    /// configuration as this round sees it.
    async fn close(&self, map: &ClusterMap, node: u64, view: &ShardView) {
        let shard_id = view.shard_id;
        let Some(address) = Self::address(map, node) else {
            return;
        };
        let Ok(mut client) = self.nodes.admin(&address) else {
            return;
        };
        // Not leading any more (deposed, or stalled past the lease): the
        // decision is someone else's now.
        if self.shared.leadership().is_none() {
            return;
        }
        // The map the round decided on: a node holding a newer one that
        // lists the replica refuses (a coordinator deposed or stalled since
        // it decided must not delete a replica added again). Not the map
        // cached now: that follows the new leader's writes, the re-add
        // included, and the check passed. The node id: a dead node's
        // address may serve a new node since, which refuses.
        let result = NodeClients::call(
            "close replica",
            CHANGE_TIMEOUT,
            client.close_replica(CloseReplicaRequest {
                shard_id,
                map_version: map.version,
                node_id: node,
                // And the configuration it decided at: a node whose
                // replica holds a newer one listing it refuses (added
                // again since; its map may not list it yet).
                conf_version: view.conf_version,
            }),
        )
        .await;
        match result {
            Ok(_) => tracing::info!(shard_id, node_id = node, "closed a replica"),
            Err(error) => {
                tracing::warn!(shard_id, node_id = node, %error, "cannot close a replica")
            }
        }
    }

    /// One step on each of up to `max_concurrent_moves` shards, shards
    /// already in the middle of a move first. Returns whether any shard is
    /// not where it should be.
    async fn move_replicas(
        &self,
        map: &ClusterMap,
        views: &[ShardView],
        desired: &Placement,
        live: &BTreeSet<u64>,
    ) -> (bool, Vec<((u32, u64), bool)>) {
        let slack = self.shared.config.catch_up_slack;
        let mut pending = moves_of(views, desired, live, slack);
        let mut adds = Vec::new();
        if pending.is_empty() {
            return (false, adds);
        }
        pending.sort_by_key(|(m, _)| {
            let v = views.iter().find(|v| v.shard_id == m.shard_id);
            let started = v.is_some_and(|v| {
                !v.learners.is_empty()
                    || desired
                        .get(&v.shard_id)
                        .is_some_and(|want| v.voters.len() > want.len())
            });
            (!started, m.shard_id)
        });
        let running = runnable_moves(pending, self.shared.config.max_concurrent_moves);
        if running.is_empty() {
            return (false, adds);
        }
        let generation = self.shared.leadership().map(|l| l.generation);
        for (shown, step) in running {
            // Each step only while leading the term the round began in:
            // steps run one after another, a minute or more in all, and a
            // deposed coordinator went on changing memberships from its
            // old views beside the new leader's.
            if generation.is_none() || self.shared.leadership().map(|l| l.generation) != generation
            {
                break;
            }
            let view = views
                .iter()
                .find(|v| v.shard_id == shown.shard_id)
                .expect("moves come from views");
            let result = self.execute(map, view, step).await;
            if let Step::AddLearner(node) = step {
                adds.push(((view.shard_id, node), result.is_ok()));
            }
            if let Err(error) = result {
                tracing::warn!(shard_id = view.shard_id, ?step, %error, "move step failed");
                self.shared.progress.lock().errors += 1;
            }
        }
        (true, adds)
    }

    /// The shard leader's id and an admin client for it.
    fn leader_admin(
        &self,
        map: &ClusterMap,
        view: &ShardView,
    ) -> Result<(u64, NodeAdminClient<Channel>), CoordinatorError> {
        let leader = view
            .leader
            .ok_or(CoordinatorError::NoLeader(view.shard_id))?;
        let address = Self::address(map, leader).ok_or(CoordinatorError::UnknownNode(leader))?;
        Ok((leader, self.nodes.admin(&address)?))
    }

    async fn change(
        &self,
        map: &ClusterMap,
        view: &ShardView,
        change: MembershipChange,
        node: u64,
    ) -> Result<(), CoordinatorError> {
        let (_, mut client) = self.leader_admin(map, view)?;
        let request = ChangeMembershipRequest {
            shard_id: view.shard_id,
            change: change as i32,
            node_id: node,
            expected_conf_version: view.conf_version,
        };
        NodeClients::call(
            "change membership",
            CHANGE_TIMEOUT,
            client.change_membership(request),
        )
        .await?;
        tracing::info!(
            shard_id = view.shard_id,
            node_id = node,
            change = change.as_str_name(),
            "membership changed"
        );
        Ok(())
    }

    async fn execute(
        &self,
        map: &ClusterMap,
        view: &ShardView,
        step: Step,
    ) -> Result<(), CoordinatorError> {
        let shard = map
            .shards
            .iter()
            .find(|s| s.shard_id == view.shard_id)
            .ok_or(CoordinatorError::NoLeader(view.shard_id))?;
        match step {
            Step::Wait(Wait::Unsafe) => {
                tracing::debug!(
                    shard_id = view.shard_id,
                    "waiting: a step now would risk the shard's majority"
                );
            }
            Step::Wait(_) => {}
            Step::AddLearner(node) => {
                self.open(map, node, shard, false).await?;
                self.change(map, view, MembershipChange::AddLearner, node)
                    .await?;
            }
            Step::ClearStale(node) => self.close(map, node, view).await,
            Step::Promote(node) => {
                self.change(map, view, MembershipChange::Promote, node)
                    .await?;
            }
            Step::Remove(node) => {
                let was_voter = view.voters.contains(&node);
                self.change(map, view, MembershipChange::Remove, node)
                    .await?;
                if was_voter {
                    self.shared.progress.lock().moves_done += 1;
                }
                self.close(map, node, view).await;
            }
            Step::TransferLeader(to) => self.transfer(map, view, to).await?,
        }
        Ok(())
    }

    async fn transfer(
        &self,
        map: &ClusterMap,
        view: &ShardView,
        to: u64,
    ) -> Result<(), CoordinatorError> {
        let (leader, mut client) = self.leader_admin(map, view)?;
        let request = TransferLeaderRequest {
            shard_id: view.shard_id,
            to_node: to,
        };
        NodeClients::call(
            "transfer leader",
            CHANGE_TIMEOUT,
            client.transfer_leader(request),
        )
        .await?;
        tracing::info!(
            shard_id = view.shard_id,
            from = leader,
            to,
            "leadership transfer asked"
        );
        Ok(())
    }

    /// Closes replicas on nodes that are neither in the shard's
    /// configuration nor wanted there (removed replicas whose node was away
    /// when they were removed).
    async fn close_strays(&self, map: &ClusterMap, views: &[ShardView], desired: &Placement) {
        for view in views.iter().filter(|v| v.leader.is_some()) {
            let members = view.members();
            for &node in view.replicas.keys() {
                let wanted = desired
                    .get(&view.shard_id)
                    .is_some_and(|d| d.contains(&node));
                if !members.contains(&node) && !wanted {
                    self.close(map, node, view).await;
                }
            }
        }
    }

    /// Moves one leadership from the node leading the most shards to a
    /// live voter on the node leading the fewest, when they differ by two
    /// or more — never to a node settling after its return, nor again to
    /// a target whose last transfer failed or was refused (`transfers.rs`),
    /// nor to a node that is not `UP` (draining) or a voter the placement
    /// is moving away: the move path takes the leadership off those again
    /// (before, the two handed it back and forth while moves waited).
    async fn balance_leaders(
        &mut self,
        map: &ClusterMap,
        views: &[ShardView],
        live: &BTreeSet<u64>,
        desired: &crate::placement::Placement,
    ) {
        let now = Instant::now();
        let mut led: BTreeMap<u64, usize> = live.iter().map(|n| (*n, 0)).collect();
        for view in views {
            if let Some(leader) = view.leader {
                *led.entry(leader).or_default() += 1;
            }
        }
        let Some((&busiest, &most)) = led
            .iter()
            .max_by_key(|(n, c)| (**c, std::cmp::Reverse(**n)))
        else {
            return;
        };
        let candidates = views.iter().filter(|v| v.leader == Some(busiest));
        for view in candidates {
            let missing = view.down();
            let best = view
                .voters
                .iter()
                .filter(|v| live.contains(v) && !missing.contains(v))
                .filter(|v| may_lead(map, desired, view.shard_id, **v))
                .filter(|v| self.transfers.may_ask(now, view.shard_id, **v))
                .min_by_key(|v| (led.get(v).copied().unwrap_or(usize::MAX), **v))
                .copied();
            if let Some(to) = best
                && led.get(&to).is_some_and(|c| c + 2 <= most)
            {
                match self.transfer(map, view, to).await {
                    Ok(()) => self.transfers.asked(now, view.shard_id, to),
                    Err(error) => {
                        // The leader does not see `to` reachable and caught
                        // up (or could not be asked): not this pair for now.
                        tracing::info!(shard_id = view.shard_id, to, %error, "leader balance refused");
                        self.transfers.refused(now, view.shard_id, to);
                    }
                }
                return;
            }
        }
    }

    /// Orders each shard's leader to advance to the cluster epoch, to
    /// record again a retention it holds with other epochs than the map
    /// (`epochs::retain_needed`), then to drop the expired epochs of every
    /// namespace with retention.
    async fn drive_epochs(
        &self,
        map: &ClusterMap,
        views: &[ShardView],
        reports: &BTreeMap<u64, NodeStatus>,
    ) {
        let generation = self.shared.leadership().map(|l| l.generation);
        // Leaders whose node did not answer a proposal this round: one
        // stalled node (its disk hung, its status still answered from
        // memory) cost every shard it leads a whole timeout, one after
        // another, and held the round — moves, splits, balancing — for as
        // long.
        let mut silent: BTreeSet<u64> = BTreeSet::new();
        for view in views {
            let Some(status) = view.leader_status() else {
                continue;
            };
            if view.leader.is_some_and(|leader| silent.contains(&leader)) {
                continue;
            }
            // Computed and proposed under the drop gate (a retention change
            // waits for it), and only while still leading the term the
            // round began in: a deposed coordinator went on ordering drops
            // shard after shard, with the retention it last saw.
            let _drops = self.shared.epoch_drops.lock().await;
            if generation.is_none() || self.shared.leadership().map(|l| l.generation) != generation
            {
                return;
            }
            // Retention as it is now, not as the round began: a round's
            // moves can take minutes before it gets here, and a retention
            // lengthened meanwhile (its call answered) must hold for every
            // shard dropped after that. The older of the two epochs.
            let fresh = self.shared.map();
            let epoch = map.epoch.min(fresh.epoch);
            let retain = || {
                let lacking = crate::splits::lacking(
                    &fresh,
                    view.shard_id,
                    reports,
                    tidepool_proto::capabilities::RETAIN,
                );
                lacking
                    .is_empty()
                    .then(|| crate::epochs::retain_needed(&fresh, status))
                    .flatten()
            };
            let op = if status.epoch < map.epoch {
                Some(AdminOp::AdvanceEpoch(AdvanceEpochOp { epoch: map.epoch }))
            } else if let Some(op) = retain() {
                Some(AdminOp::Retain(op))
            } else {
                fresh.namespaces.iter().find_map(|ns| {
                    let target = drop_target(ns, epoch)?;
                    let done = status
                        .drops
                        .iter()
                        .find(|d| d.namespace_id == ns.id)
                        .map_or(0, |d| d.dropped_below);
                    (done < target && status.epoch >= target).then_some(AdminOp::DropEpochs(
                        DropEpochsOp {
                            namespace_id: ns.id,
                            below: target,
                        },
                    ))
                })
            };
            let Some(op) = op else { continue };
            let Ok((_, mut client)) = self.leader_admin(map, view) else {
                continue;
            };
            let request = ProposeAdminRequest {
                shard_id: view.shard_id,
                op: Some(op),
            };
            let result = NodeClients::call(
                "propose admin",
                CHANGE_TIMEOUT,
                client.propose_admin(request),
            )
            .await;
            match result {
                Ok(_) => tracing::info!(shard_id = view.shard_id, ?op, "epoch entry applied"),
                Err(CoordinatorError::NodeCall { code, .. })
                    if code == ErrorCode::NotLeader as i32 => {}
                Err(error) => {
                    tracing::warn!(shard_id = view.shard_id, ?op, %error, "epoch entry failed");
                    self.shared.progress.lock().errors += 1;
                    if let (CoordinatorError::Node(_), Some(leader)) = (&error, view.leader) {
                        silent.insert(leader);
                    }
                }
            }
        }
    }

    /// Puts back into the map the groups split off listed shards that the
    /// map lost (`splits::adopt_lost`: a map restored from one older than
    /// the split), from the leaders' reported ranges.
    async fn adopt_lost_splits(
        &self,
        map: &ClusterMap,
        views: &[ShardView],
        reports: &BTreeMap<u64, NodeStatus>,
    ) {
        let unlisted = crate::splits::unlisted_leaders(map, reports);
        if unlisted.is_empty() {
            return;
        }
        for shard in map.shards.iter().filter(|s| s.split.is_none()) {
            let Some(range) = views
                .iter()
                .find(|v| v.shard_id == shard.shard_id)
                .and_then(ShardView::leader_status)
                .and_then(|s| s.range.as_ref())
            else {
                continue;
            };
            if range.end >= shard.hash_end {
                continue;
            }
            let (parent, parent_range) = (shard.shard_id, (range.start, range.end));
            let mut adopted = Vec::new();
            let result = self
                .shared
                .update_map(|m| {
                    adopted = crate::splits::adopt_lost(m, parent, parent_range, &unlisted);
                    Ok((!adopted.is_empty()).then(Vec::new))
                })
                .await;
            match result {
                Ok(_) if !adopted.is_empty() => tracing::warn!(
                    shard_id = parent,
                    adopted = ?adopted,
                    "the map had lost splits of this shard (restored from an older map); put back from the groups' ranges"
                ),
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(shard_id = parent, %error, "cannot put back a lost split")
                }
            }
        }
    }

    /// Decides splits of shards over `split_mib` or hot over `split_rps`
    /// for `split_load_secs` (a few per round), then
    /// carries decided splits on (`splits.rs`): publishes those whose new
    /// group has a leader, and has the leader of the others propose the
    /// split entry (again, if no replica reports it applied: a repeated
    /// entry is a no-op) unless the shard's membership is changing.
    async fn drive_splits(
        &mut self,
        map: &ClusterMap,
        views: &[ShardView],
        reports: &BTreeMap<u64, NodeStatus>,
    ) {
        // Shards with a replica on a node that reports it cannot apply a
        // split (an older version): neither decided nor proposed until it
        // can; said once per shard.
        let waiting: BTreeSet<u32> = map
            .shards
            .iter()
            .filter_map(|shard| {
                let unable = crate::splits::unable_to_split(map, shard.shard_id, reports);
                if unable.is_empty() {
                    return None;
                }
                if !self.awaiting_upgrade.contains(&shard.shard_id) {
                    tracing::info!(
                        shard_id = shard.shard_id,
                        nodes = ?unable,
                        "shard not split while these nodes run a version that cannot apply a split"
                    );
                }
                Some(shard.shard_id)
            })
            .collect();
        self.awaiting_upgrade = waiting.clone();
        // Lost splits are put back before any is decided, and no shard
        // whose group owns another range than the map says is split: a
        // split decided there (every round, on size or load) kept the
        // shard from the repair, which needs it without a split under way.
        self.adopt_lost_splits(map, views, reports).await;
        let excluded: BTreeSet<u32> = waiting
            .union(&self.unsplittable)
            .copied()
            .chain(crate::splits::misranged(map, views))
            .collect();
        let limit = self.shared.config.split_mib.saturating_mul(1 << 20);
        if limit > 0 {
            let over = crate::splits::over_limit(map, views, limit, &excluded);
            for (shard_id, bytes) in over.into_iter().take(SPLITS_PER_ROUND) {
                match self.shared.split_shard(shard_id, 0).await {
                    Ok((child, at)) => tracing::info!(
                        shard_id,
                        data_bytes = bytes,
                        child_shard_id = child,
                        at,
                        "shard over the split size; split decided"
                    ),
                    Err(error) => {
                        tracing::warn!(shard_id, %error, "cannot decide a split");
                        if refuses_for_good(&error) {
                            self.unsplittable.insert(shard_id);
                        }
                    }
                }
            }
        }
        let rps = self.shared.config.split_rps;
        if rps > 0 {
            let sustain = Duration::from_secs(self.shared.config.split_load_secs);
            let hot = self
                .hot
                .round(map, views, rps as f64, sustain, Instant::now(), &excluded);
            for hot in hot.into_iter().take(SPLITS_PER_ROUND) {
                match hot {
                    Hot::Split {
                        shard_id,
                        at,
                        requests_per_second,
                    } => match self.shared.split_shard(shard_id, at).await {
                        Ok((child, at)) => tracing::info!(
                            shard_id,
                            requests_per_second,
                            child_shard_id = child,
                            at,
                            "shard over the load limit; split decided"
                        ),
                        Err(error) => {
                            tracing::warn!(shard_id, %error, "cannot decide a split");
                            if refuses_for_good(&error) {
                                self.unsplittable.insert(shard_id);
                            }
                        }
                    },
                    Hot::NoCut {
                        shard_id,
                        requests_per_second,
                    } => tracing::warn!(
                        shard_id,
                        requests_per_second,
                        "shard over the load limit, but its load sits on a few keys \
                         that no split would spread; not split"
                    ),
                }
            }
        }
        for shard in &map.shards {
            let Some(intent) = shard.split else {
                continue;
            };
            let child = intent.child_shard_id;
            let child_leader = reports
                .iter()
                .filter_map(|(node, report)| {
                    let replica = report.replicas.iter().find(|r| r.shard_id == child)?;
                    replica.is_leader.then_some((*node, replica))
                })
                .max_by_key(|(_, replica)| replica.term);
            if let Some((leader, status)) = child_leader {
                let parent = shard.shard_id;
                let mut changed = false;
                let published = self
                    .shared
                    .update_map(|m| {
                        changed = crate::splits::publish(m, parent, leader, status);
                        Ok(changed.then(Vec::new))
                    })
                    .await;
                match published {
                    Ok(_) if !changed => tracing::debug!(
                        shard_id = parent,
                        child_shard_id = child,
                        "the new group's range does not start at the cut or reaches past the map's; not published"
                    ),
                    Ok(_) => tracing::info!(
                        shard_id = parent,
                        child_shard_id = child,
                        at = intent.at,
                        "shard split published"
                    ),
                    Err(error) => {
                        tracing::warn!(shard_id = parent, %error, "cannot publish a split")
                    }
                }
                continue;
            }
            let Some(view) = views.iter().find(|v| v.shard_id == shard.shard_id) else {
                continue;
            };
            let Some(status) = view.leader_status() else {
                continue;
            };
            if waiting.contains(&shard.shard_id) {
                continue; // a node would refuse the entry
            }
            if status.split_off.contains(&child) || !view.learners.is_empty() {
                continue; // the new group is electing, or a move is under way
            }
            if crate::splits::cut_outside_group(status, child, intent.at) {
                // The map's range is wider than the group's: withdrawn, so
                // the lost split the group knows of can be put back.
                tracing::warn!(
                    shard_id = view.shard_id,
                    at = intent.at,
                    "a split's cut lies outside the group's range; split withdrawn"
                );
                let parent = view.shard_id;
                let withdrawn = self
                    .shared
                    .update_map(|m| Ok(crate::splits::withdraw(m, parent, child).then(Vec::new)))
                    .await;
                if let Err(error) = withdrawn {
                    tracing::warn!(shard_id = parent, %error, "cannot withdraw a split");
                }
                continue;
            }
            let Ok((_, mut client)) = self.leader_admin(map, view) else {
                continue;
            };
            let request = ProposeAdminRequest {
                shard_id: view.shard_id,
                op: Some(AdminOp::Split(SplitOp {
                    child_shard_id: child,
                    at: intent.at,
                })),
            };
            let result =
                NodeClients::call("split", CHANGE_TIMEOUT, client.propose_admin(request)).await;
            match result {
                Ok(_) => tracing::info!(
                    shard_id = view.shard_id,
                    child_shard_id = child,
                    "split applied"
                ),
                Err(CoordinatorError::NodeCall { code, .. })
                    if code == ErrorCode::NotLeader as i32
                        || code == ErrorCode::Conflict as i32 => {}
                Err(CoordinatorError::NodeCall { code, message, .. })
                    if code == ErrorCode::Unsupported as i32 =>
                {
                    // A group founded before ranges were replicated: the
                    // intent is withdrawn, and not made again this term.
                    tracing::warn!(shard_id = view.shard_id, %message, "shard cannot split; split withdrawn");
                    self.unsplittable.insert(view.shard_id);
                    let parent = view.shard_id;
                    let withdrawn = self
                        .shared
                        .update_map(
                            |m| Ok(crate::splits::withdraw(m, parent, child).then(Vec::new)),
                        )
                        .await;
                    if let Err(error) = withdrawn {
                        tracing::warn!(shard_id = parent, %error, "cannot withdraw a split");
                    }
                }
                Err(error) => {
                    tracing::warn!(shard_id = view.shard_id, child_shard_id = child, %error, "split failed");
                    self.shared.progress.lock().errors += 1;
                }
            }
        }
    }

    async fn advance_on_schedule(&mut self, map: &ClusterMap) -> Result<(), CoordinatorError> {
        let started = self
            .shared
            .store
            .get(&self.shared.keys.epoch_started())
            .await?
            .and_then(|kv| String::from_utf8_lossy(&kv.value).parse::<u64>().ok());
        let interval_ms = self.shared.config.epoch_interval_s * 1000;
        let now = crate::core::unix_ms();
        let due = match started {
            Some(started) if started <= now => now >= started.saturating_add(interval_ms),
            // In the future (written by a leader whose clock ran ahead of
            // this one's), or missing or unreadable (a store put back
            // without it): the epoch counts from when this leader first
            // saw that, on its own monotonic clock. Taken as is, a clock a
            // day fast held every advance, and so every drop, for a day;
            // a missing start, read as 1970, advanced at once — the
            // current epoch cut short, its blobs dropped early.
            recorded => {
                let value = recorded.unwrap_or(u64::MAX);
                let seen = match self.future_epoch_start {
                    Some((seen_value, at)) if seen_value == value => at,
                    _ => {
                        tracing::warn!(
                            recorded,
                            now,
                            "the current epoch's recorded start is in the future (a coordinator's clock ran ahead), missing or unreadable: counting from now"
                        );
                        let at = Instant::now();
                        self.future_epoch_start = Some((value, at));
                        at
                    }
                };
                seen.elapsed() >= Duration::from_millis(interval_ms)
            }
        };
        if due {
            match self.shared.advance_epoch(map.epoch).await {
                Ok(epoch) => tracing::info!(epoch, "advanced the epoch on schedule"),
                Err(CoordinatorError::Conflict(_)) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }
}

/// Whether a shard's replicas are recorded but it has never been seen led.
fn founding(shard: &ShardInfo) -> bool {
    !shard.replicas.is_empty() && shard.leader_hint == 0 && shard.conf_version == 0
}

/// A view's configuration as the map lists it: voters, then learners.
fn replica_infos(view: &ShardView) -> Vec<ReplicaInfo> {
    let with_role = |ids: &BTreeSet<u64>, role: ReplicaRole| {
        ids.iter()
            .map(move |&node_id| ReplicaInfo {
                node_id,
                role: role as i32,
            })
            .collect::<Vec<_>>()
    };
    let mut all = with_role(&view.voters, ReplicaRole::Voter);
    all.extend(with_role(&view.learners, ReplicaRole::Learner));
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{moves, place};

    /// The leader balancer gives no leadership to a draining node, nor to
    /// a voter the placement moves away: the move path would take it off
    /// again, and the two handed it back and forth while moves waited.
    #[test]
    fn leaderships_go_only_where_the_placement_keeps_them() {
        use tidepool_proto::v1::NodeInfo;
        let map = ClusterMap {
            nodes: [
                (1, NodeState::Up),
                (2, NodeState::Draining),
                (3, NodeState::Up),
            ]
            .into_iter()
            .map(|(id, state)| NodeInfo {
                node_id: id,
                state: state as i32,
                ..NodeInfo::default()
            })
            .collect(),
            ..ClusterMap::default()
        };
        let desired: crate::placement::Placement = BTreeMap::from([(7, BTreeSet::from([1, 2]))]);
        assert!(may_lead(&map, &desired, 7, 1));
        assert!(!may_lead(&map, &desired, 7, 2), "draining");
        assert!(!may_lead(&map, &desired, 7, 3), "moved away");
        assert!(may_lead(&map, &desired, 8, 3), "no placement yet");
        assert!(!may_lead(&map, &desired, 8, 4), "unknown node");
    }

    /// Only a refusal about the shard itself keeps it from splitting for
    /// the term; a store error or a lost leadership is tried again.
    #[test]
    fn only_the_shards_own_refusal_makes_it_unsplittable() {
        use crate::meta::MetaError;
        assert!(refuses_for_good(&CoordinatorError::Conflict(
            "a split under way".into()
        )));
        assert!(refuses_for_good(&CoordinatorError::InvalidArgument(
            "range".into()
        )));
        assert!(!refuses_for_good(&CoordinatorError::Meta(
            MetaError::Unavailable("etcd: deadline".into())
        )));
        assert!(!refuses_for_good(&CoordinatorError::NotLeader));
    }

    /// Moves that cannot go on take no slot; a catching-up learner does.
    #[test]
    fn moves_that_cannot_go_on_take_no_slot() {
        let shown = |shard_id| ReplicaMove {
            shard_id,
            ..ReplicaMove::default()
        };
        let pending = vec![
            (shown(1), Step::Wait(Wait::TargetDown(5))),
            (shown(2), Step::Wait(Wait::Unsafe)),
            (shown(3), Step::Wait(Wait::CatchUp(4))),
            (shown(4), Step::AddLearner(4)),
            (shown(5), Step::Promote(4)),
        ];
        let running: Vec<u32> = runnable_moves(pending, 2)
            .iter()
            .map(|(m, _)| m.shard_id)
            .collect();
        assert_eq!(running, [3, 4], "shards 1 and 2 held every move before");
        let stuck = vec![(shown(1), Step::Wait(Wait::TargetDown(5)))];
        assert!(
            runnable_moves(stuck, 2).is_empty(),
            "not busy: leaders get balanced"
        );
    }

    fn set(ids: &[u64]) -> BTreeSet<u64> {
        ids.iter().copied().collect()
    }

    fn nodes(down: &[u64]) -> Vec<NodeView> {
        (1..=4)
            .map(|id| NodeView {
                id,
                zone: String::new(),
                capacity_bytes: 0,
                used_bytes: 0,
                live: !down.contains(&id),
                draining: false,
            })
            .collect()
    }

    fn view(shard_id: u32, voters: &BTreeSet<u64>, learners: &[u64]) -> ShardView {
        ShardView {
            shard_id,
            leader: voters.first().copied(),
            voters: voters.clone(),
            learners: set(learners),
            ..ShardView::default()
        }
    }

    /// A draining node running a replica of a split's new group, not yet
    /// published, still hosts: marked drained, its pod stopped under the
    /// group (which then ran a replica short until replaced). A replica
    /// of a group the map will never list does not hold the drain.
    #[test]
    fn a_replica_of_a_split_not_yet_published_counts_as_hosted() {
        use tidepool_proto::v1::{ReplicaStatus, ShardInfo, SplitIntent};
        let map = ClusterMap {
            shards: vec![ShardInfo {
                shard_id: 1,
                replicas: vec![ReplicaInfo {
                    node_id: 1,
                    role: ReplicaRole::Voter as i32,
                }],
                split: Some(SplitIntent {
                    child_shard_id: 7,
                    at: 1 << 63,
                }),
                ..ShardInfo::default()
            }],
            ..ClusterMap::default()
        };
        let views = [view(1, &set(&[1, 2]), &[])];
        let status = |shards: &[u32]| NodeStatus {
            replicas: shards
                .iter()
                .map(|s| ReplicaStatus {
                    shard_id: *s,
                    ..ReplicaStatus::default()
                })
                .collect(),
            ..NodeStatus::default()
        };
        let alive = BTreeMap::from([(1, status(&[1])), (2, status(&[1])), (3, status(&[7]))]);
        assert_eq!(hosting(&map, &views, &alive), set(&[1, 2, 3]));
        let alive = BTreeMap::from([(3, status(&[]))]);
        assert_eq!(hosting(&map, &views, &alive), set(&[1, 2]));
        let alive = BTreeMap::from([(3, status(&[9]))]);
        assert_eq!(hosting(&map, &views, &alive), set(&[1, 2]), "a lost group");
    }

    /// A shard the placement has no entry for (the map changed under the
    /// round) gets no move: planned against an empty set, its voters were
    /// removed one by one.
    #[test]
    fn a_shard_without_a_placement_is_not_moved() {
        let v = view(7, &set(&[1, 2, 3]), &[]);
        let live = set(&[1, 2, 3]);
        assert!(moves_of(std::slice::from_ref(&v), &Placement::new(), &live, 64).is_empty());
        let mut desired = Placement::new();
        desired.insert(7, set(&[1, 2, 4]));
        assert_eq!(moves_of(&[v], &desired, &live, 64).len(), 1);
    }

    #[test]
    fn a_node_back_before_its_replacements_started_keeps_its_replicas() {
        let shards: Vec<u32> = (1..=8).collect();
        let held = place(&nodes(&[]), &Placement::new(), &shards, 3);
        let views: Vec<ShardView> = held.iter().map(|(s, r)| view(*s, r, &[])).collect();
        // Node 3 down past its grace: every replica it holds is to be
        // replaced. No move starts before it is back.
        let start = placement_start(&views, &Placement::new(), 3, &everyone());
        assert_eq!(start, held);
        let replaced = place(&nodes(&[3]), &start, &shards, 3);
        assert!(replaced.values().all(|r| !r.contains(&3)));
        assert!(moves(&held, &replaced) > 0);
        // Back: placement starts from where the replicas are, not from the
        // replacements planned, and plans no move.
        let start = placement_start(&views, &replaced, 3, &everyone());
        assert_eq!(start, held);
        let desired = place(&nodes(&[]), &start, &shards, 3);
        assert_eq!(moves(&held, &desired), 0, "{held:?} -> {desired:?}");
    }

    /// Every node of these tests answering.
    fn everyone() -> BTreeSet<u64> {
        (1..=16).collect()
    }

    /// A coordinator that takes over (no targets, down clocks afresh) in
    /// the middle of a replacement — voter 3 dead, learner 4 copying for
    /// it — goes on with it: from the lowest ids it kept 1, 2, 3, removed
    /// the learner and deleted its copy.
    #[test]
    fn a_new_term_goes_on_with_a_replacement_under_way() {
        let none = Placement::new();
        let replacing = view(1, &set(&[1, 2, 3]), &[4]);
        let start = placement_start(std::slice::from_ref(&replacing), &none, 3, &set(&[1, 2, 4]));
        assert_eq!(start[&1], set(&[1, 2, 4]));
        let desired = place(&nodes(&[]), &start, &[1], 3);
        assert_eq!(desired[&1], set(&[1, 2, 4]));
        // Promoted already: the same.
        let promoted = view(1, &set(&[1, 2, 3, 4]), &[]);
        let start = placement_start(std::slice::from_ref(&promoted), &none, 3, &set(&[1, 2, 4]));
        assert_eq!(start[&1], set(&[1, 2, 4]));
        // Everyone answering (a move for balance or a drain): what the
        // shard holds, as before.
        let start = placement_start(std::slice::from_ref(&replacing), &none, 3, &everyone());
        assert_eq!(start[&1], set(&[1, 2, 3, 4]));
        // Too few answering to keep three: what the shard holds.
        let start = placement_start(std::slice::from_ref(&replacing), &none, 3, &set(&[1, 4]));
        assert_eq!(start[&1], set(&[1, 2, 3, 4]));
    }

    #[test]
    fn a_shard_in_the_middle_of_a_move_starts_from_its_target() {
        let target: Placement = [(1, set(&[1, 2, 4]))].into_iter().collect();
        let start = |v: ShardView| placement_start(&[v], &target, 3, &everyone())[&1].clone();
        // A learner added for the target, then promoted: the target.
        assert_eq!(start(view(1, &set(&[1, 2, 3]), &[4])), set(&[1, 2, 4]));
        assert_eq!(start(view(1, &set(&[1, 2, 3, 4]), &[])), set(&[1, 2, 4]));
        // A move the target did not ask for: what the shard holds.
        assert_eq!(start(view(1, &set(&[1, 2, 3]), &[5])), set(&[1, 2, 3, 5]));
        // No move under way, or no leader: what the shard holds.
        assert_eq!(start(view(1, &set(&[1, 2, 3]), &[])), set(&[1, 2, 3]));
        let mut leaderless = view(1, &set(&[1, 2, 3]), &[4]);
        leaderless.leader = None;
        assert_eq!(start(leaderless), set(&[1, 2, 3, 4]));
    }

    /// A replica whose files went missing (node 3's of shard 1, on a live
    /// node) is rebuilt: placement neither keeps it nor puts the shard back
    /// on that node while it reports so, and the shard's steps remove it;
    /// once it is closed (no longer reported) the shard comes back to the
    /// node like any other, afresh. With a fourth node it moves there.
    #[test]
    fn a_replica_whose_files_are_missing_is_replaced() {
        let members = set(&[1, 2, 3]);
        let mut lost = view(1, &members, &[]);
        for n in [1, 2, 3] {
            let status = tidepool_proto::v1::ReplicaStatus {
                shard_id: 1,
                is_leader: n == 1,
                files_missing: n == 3,
                ..tidepool_proto::v1::ReplicaStatus::default()
            };
            lost.replicas.insert(n, status);
        }
        let views = vec![lost.clone()];
        let start = placement_start(&views, &Placement::new(), 3, &everyone());
        assert_eq!(start[&1], set(&[1, 2]), "not kept");
        let map = ClusterMap {
            replication_factor: 3,
            shards: vec![tidepool_proto::v1::ShardInfo {
                shard_id: 1,
                ..Default::default()
            }],
            ..Default::default()
        };
        let three = &nodes(&[4]);
        let desired = desired_placement(&map, &start, three, &views, &BTreeSet::new());
        assert_eq!(desired[&1], set(&[1, 2]), "not put back on node 3");
        let live = set(&[1, 2, 3]);
        assert_eq!(
            next_step(&lost, &desired[&1], &live, 10),
            Some(Step::Remove(3))
        );
        // With a fourth node, the shard moves there.
        let desired = desired_placement(&map, &start, &nodes(&[]), &views, &BTreeSet::new());
        assert_eq!(desired[&1], set(&[1, 2, 4]));
        // Removed and closed: node 3 reports nothing, and gets the shard
        // back (a new replica, added as a learner).
        let rebuilt = view(1, &set(&[1, 2]), &[]);
        let start = placement_start(
            std::slice::from_ref(&rebuilt),
            &Placement::new(),
            3,
            &everyone(),
        );
        let desired = desired_placement(
            &map,
            &start,
            three,
            std::slice::from_ref(&rebuilt),
            &BTreeSet::new(),
        );
        assert_eq!(desired[&1], set(&[1, 2, 3]));
        assert_eq!(
            next_step(&rebuilt, &desired[&1], &live, 10),
            Some(Step::AddLearner(3))
        );
    }
}
