//! Replicas that cannot serve are replaced, and nothing holds the
//! cluster's moves for ever.
//!
//! - A learner that stops catching up: one shard of three replicas on
//!   nodes 1, 2 and 3; node 3 is drained, so the coordinator adds a learner
//!   on node 4. The learner receives a snapshot that never completes. While
//!   the bytes it reports received grow, it is left alone however long that
//!   takes; once they stop growing for `learner_stall_ms`, the coordinator
//!   removes the learner, closes its replica, and does not put the shard
//!   back on node 4 while the pair is barred (`learner_bar_ms`). Node 3
//!   keeps its copy meanwhile (a drain never takes a shard below its
//!   replication factor).
//! - A replica whose engine failed (its node live, the replica not
//!   reopening): counted down at once, and replaced once it has been down
//!   for the down grace period — a learner on node 4, promoted, then the
//!   failed replica removed and closed.
//!
//! The nodes are scripted `NodeAdmin` servers on real sockets sharing one
//! scripted Raft group: they register and heartbeat like nodes, apply the
//! membership changes they are asked for, and report the group as a
//! leader and its followers would.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidepool_coordinator::meta::{EmbeddedStore, MetaStore};
use tidepool_coordinator::{CoordinatorConfig, RunningCoordinator, start_with_store};
use tidepool_proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_proto::v1::node_admin_server::{NodeAdmin, NodeAdminServer};
use tidepool_proto::v1::{
    ChangeMembershipRequest, ChangeMembershipResponse, CloseReplicaRequest, CloseReplicaResponse,
    ClusterMap, DrainNodeRequest, HeldMapRequest, MembershipChange, NodeStatus, NodeStatusRequest,
    OpenReplicaRequest, OpenReplicaResponse, ProposeAdminRequest, ProposeAdminResponse,
    ReplicaInfo, ReplicaRole, ReplicaStatus, TransferLeaderRequest, TransferLeaderResponse,
};
use tonic::{Request, Response, Status};

mod support;

/// The scripted group of shard 1, and what the nodes were asked.
#[derive(Default)]
struct Group {
    voters: BTreeSet<u64>,
    learners: BTreeSet<u64>,
    conf_version: u64,
    /// Nodes holding a replica (opened and not closed).
    open: BTreeSet<u64>,
    /// Snapshot bytes the learner reports received.
    received: u64,
    /// Whether each status poll of the learner reports more bytes.
    receiving: bool,
    /// Learners catch up at once (else they never do).
    catch_up: bool,
    /// Nodes whose replica reports its engine failed.
    failed: BTreeSet<u64>,
    /// Nodes that keep heartbeating but answer no status poll.
    unreachable: BTreeSet<u64>,
    /// Calls, in order: "open 4", "add_learner 4", "remove 4", "close 4".
    calls: Vec<String>,
}

impl Group {
    fn members(&self) -> BTreeSet<u64> {
        self.voters.union(&self.learners).copied().collect()
    }
}

/// The group's leader: node 1.
const LEADER: u64 = 1;

struct Scripted {
    node_id: Mutex<u64>,
    address: String,
    group: Arc<Mutex<Group>>,
}

impl Scripted {
    fn id(&self) -> u64 {
        *self.node_id.lock().unwrap()
    }
}

#[tonic::async_trait]
impl NodeAdmin for Scripted {
    async fn open_replica(
        &self,
        request: Request<OpenReplicaRequest>,
    ) -> Result<Response<OpenReplicaResponse>, Status> {
        let request = request.into_inner();
        let id = self.id();
        let mut group = self.group.lock().unwrap();
        if request.bootstrap {
            group.voters.insert(id);
            group.conf_version = 1;
        }
        group.open.insert(id);
        group.calls.push(format!("open {id}"));
        Ok(Response::new(OpenReplicaResponse::default()))
    }

    async fn change_membership(
        &self,
        request: Request<ChangeMembershipRequest>,
    ) -> Result<Response<ChangeMembershipResponse>, Status> {
        let request = request.into_inner();
        if self.id() != LEADER {
            return Err(Status::failed_precondition("scripted: not the leader"));
        }
        let mut group = self.group.lock().unwrap();
        if request.expected_conf_version != group.conf_version {
            return Err(Status::failed_precondition("scripted: conf_version moved"));
        }
        let node = request.node_id;
        let change = MembershipChange::try_from(request.change).unwrap();
        match change {
            MembershipChange::AddLearner => {
                group.learners.insert(node);
            }
            MembershipChange::Promote => {
                group.learners.remove(&node);
                group.voters.insert(node);
            }
            MembershipChange::Remove => {
                group.learners.remove(&node);
                group.voters.remove(&node);
            }
            MembershipChange::Unspecified => return Err(Status::invalid_argument("scripted")),
        }
        group.conf_version += 1;
        let name = match change {
            MembershipChange::AddLearner => "add_learner",
            MembershipChange::Promote => "promote",
            _ => "remove",
        };
        group.calls.push(format!("{name} {node}"));
        Ok(Response::new(ChangeMembershipResponse::default()))
    }

    async fn transfer_leader(
        &self,
        _: Request<TransferLeaderRequest>,
    ) -> Result<Response<TransferLeaderResponse>, Status> {
        Err(Status::unimplemented("scripted"))
    }

    async fn close_replica(
        &self,
        request: Request<CloseReplicaRequest>,
    ) -> Result<Response<CloseReplicaResponse>, Status> {
        let id = self.id();
        let mut group = self.group.lock().unwrap();
        // As a node does: a close meant for another node id is refused.
        let meant = request.into_inner().node_id;
        if meant != id {
            group
                .calls
                .push(format!("close meant for {meant} refused by {id}"));
            return Err(Status::not_found("scripted: another node"));
        }
        group.open.remove(&id);
        group.calls.push(format!("close {id}"));
        Ok(Response::new(CloseReplicaResponse::default()))
    }

    async fn propose_admin(
        &self,
        _: Request<ProposeAdminRequest>,
    ) -> Result<Response<ProposeAdminResponse>, Status> {
        // Epoch orders: accepted and forgotten.
        Ok(Response::new(ProposeAdminResponse::default()))
    }

    async fn status(&self, _: Request<NodeStatusRequest>) -> Result<Response<NodeStatus>, Status> {
        let id = self.id();
        let mut group = self.group.lock().unwrap();
        if group.unreachable.contains(&id) {
            return Err(Status::unavailable(
                "scripted: not reachable from the coordinator",
            ));
        }
        let mut replicas = Vec::new();
        if group.open.contains(&id) && group.failed.contains(&id) {
            // Down: every field at its default but these.
            replicas.push(ReplicaStatus {
                shard_id: 1,
                failed: true,
                failed_reason: "scripted: the engine failed".into(),
                ..ReplicaStatus::default()
            });
        } else if group.open.contains(&id) {
            let learner = group.learners.contains(&id);
            if learner && group.receiving {
                group.received += 1 << 20;
            }
            let members = group
                .voters
                .iter()
                .map(|&node_id| (node_id, ReplicaRole::Voter))
                .chain(group.learners.iter().map(|&n| (n, ReplicaRole::Learner)))
                .map(|(node_id, role)| ReplicaInfo {
                    node_id,
                    role: role as i32,
                })
                .collect();
            let behind = (learner && !group.catch_up) || !group.members().contains(&id);
            let applied = if behind { 0 } else { 100 };
            replicas.push(ReplicaStatus {
                shard_id: 1,
                role: if learner {
                    ReplicaRole::Learner as i32
                } else {
                    ReplicaRole::Voter as i32
                },
                is_leader: id == LEADER,
                term: 2,
                commit_index: 100,
                applied_index: applied,
                last_index: applied,
                conf_version: group.conf_version,
                members,
                leader: LEADER,
                receiving_snapshot: learner && !group.catch_up,
                snapshot_bytes_received: if learner { group.received } else { 0 },
                ..ReplicaStatus::default()
            });
        }
        Ok(Response::new(NodeStatus {
            node_id: id,
            address: self.address.clone(),
            replicas,
            ..NodeStatus::default()
        }))
    }

    async fn held_map(&self, _: Request<HeldMapRequest>) -> Result<Response<ClusterMap>, Status> {
        Ok(Response::new(ClusterMap::default()))
    }
}

/// Starts a scripted node of `group`, registers it with the coordinator at
/// `url` and keeps its lease. Returns its node id.
async fn scripted_node(url: &str, group: &Arc<Mutex<Group>>) -> u64 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let node = Arc::new(Scripted {
        node_id: Mutex::new(0),
        address: address.clone(),
        group: group.clone(),
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(NodeAdminServer::from_arc(node.clone()))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let node_id = support::register_and_beat(url, &address).await;
    *node.node_id.lock().unwrap() = node_id;
    node_id
}

/// Waits up to `limit` for `done`, printing the group's calls on failure.
async fn wait_for(
    group: &Arc<Mutex<Group>>,
    limit: Duration,
    what: &str,
    done: impl Fn(&Group) -> bool,
) {
    let deadline = Instant::now() + limit;
    while !done(&group.lock().unwrap()) {
        assert!(
            Instant::now() < deadline,
            "{what}: calls {:?}",
            group.lock().unwrap().calls
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A coordinator with `config` (one shard of three replicas, rounds every
/// 100 ms) founding the group on scripted nodes 1, 2 and 3, then a fourth
/// node registered: the coordinator, its URL, the group, node 4's id.
async fn founded(
    config: CoordinatorConfig,
    group: Group,
) -> (RunningCoordinator, String, Arc<Mutex<Group>>, u64) {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let config = CoordinatorConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        reconcile_interval_ms: 100,
        cluster: tidepool_coordinator::config::ClusterSettings {
            shards: 1,
            replication_factor: 3,
            ..Default::default()
        },
        ..config
    };
    let coordinator = start_with_store(config, store).await.unwrap();
    let url = format!("http://{}", coordinator.address);
    let group = Arc::new(Mutex::new(group));
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(scripted_node(&url, &group).await);
    }
    assert_eq!(ids, [1, 2, 3], "the group's leader is node 1");
    wait_for(&group, Duration::from_secs(20), "founded", |g| {
        g.voters.len() == 3
    })
    .await;
    let fourth = scripted_node(&url, &group).await;
    (coordinator, url, group, fourth)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_that_stops_catching_up_is_removed_and_its_node_barred() {
    const STALL: Duration = Duration::from_millis(1_500);
    let config = CoordinatorConfig {
        learner_stall_ms: STALL.as_millis() as u64,
        learner_bar_ms: 60_000,
        ..CoordinatorConfig::default()
    };
    let group = Group {
        receiving: true,
        ..Group::default()
    };
    let (coordinator, url, group, fourth) = founded(config, group).await;

    // Drain node 3: the shard gets a learner on node 4.
    let mut client = CoordinatorServiceClient::connect(url.clone())
        .await
        .unwrap();
    client
        .drain_node(DrainNodeRequest { node_id: 3 })
        .await
        .unwrap();
    wait_for(&group, Duration::from_secs(20), "a learner added", |g| {
        g.learners.contains(&fourth)
    })
    .await;

    // Its snapshot goes on arriving: however long, it stays.
    tokio::time::sleep(STALL * 3).await;
    {
        let g = group.lock().unwrap();
        assert!(g.learners.contains(&fourth), "calls {:?}", g.calls);
        assert!(g.received > 0);
    }
    assert_eq!(coordinator.shared.progress.lock().moves_abandoned, 0);

    // It stops: removed and closed after the stall bound.
    let stopped = Instant::now();
    group.lock().unwrap().receiving = false;
    let remove = format!("remove {fourth}");
    let close = format!("close {fourth}");
    wait_for(&group, STALL * 10, "the learner removed", |g| {
        g.calls.contains(&remove) && g.calls.contains(&close)
    })
    .await;
    let took = stopped.elapsed();
    println!(
        "learner removed {took:?} after it stopped: {:?}",
        group.lock().unwrap().calls
    );
    // Its clock runs from the last round that saw more bytes, up to a
    // round (100 ms, and a poll) before it stopped.
    assert!(
        took + Duration::from_millis(500) >= STALL,
        "not before the stall bound: {took:?}"
    );
    assert_eq!(coordinator.shared.progress.lock().moves_abandoned, 1);

    // Barred: the shard is not put back on node 4, and node 3 keeps its
    // copy (the drain waits).
    let calls = group.lock().unwrap().calls.len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    {
        let g = group.lock().unwrap();
        assert_eq!(&g.calls[calls..], &[] as &[String], "nothing more asked");
        assert_eq!(g.voters, BTreeSet::from([1, 2, 3]));
        assert!(g.learners.is_empty());
    }
    coordinator.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_engine_failed_is_counted_down_then_replaced() {
    const GRACE: Duration = Duration::from_millis(2_000);
    let config = CoordinatorConfig {
        down_grace_ms: GRACE.as_millis() as u64,
        ..CoordinatorConfig::default()
    };
    let group = Group {
        catch_up: true,
        ..Group::default()
    };
    let (coordinator, _url, group, fourth) = founded(config, group).await;
    let under = || coordinator.shared.progress.lock().under_replicated;
    let deadline = Instant::now() + Duration::from_secs(10);
    while under() != 0 {
        assert!(Instant::now() < deadline, "settled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Node 3's replica fails (its node stays live): down at once, as the
    // shard's under-replication says; nothing moves within the grace.
    let failed_at = Instant::now();
    group.lock().unwrap().failed.insert(3);
    while under() != 1 {
        assert!(failed_at.elapsed() < Duration::from_secs(5), "counted down");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let calls = group.lock().unwrap().calls.len();

    // After it: a replica on node 4, then the failed one removed and closed.
    let replaced = [
        format!("add_learner {fourth}"),
        format!("promote {fourth}"),
        "remove 3".to_string(),
        "close 3".to_string(),
    ];
    wait_for(&group, Duration::from_secs(20), "replaced", |g| {
        g.calls.ends_with(&replaced) || g.calls.contains(&replaced[3])
    })
    .await;
    let took = failed_at.elapsed();
    let g = group.lock().unwrap().calls.clone();
    println!("replaced after {took:?}: {:?}", &g[calls..]);
    assert!(took >= GRACE, "not before the grace period: {took:?}");
    let order: Vec<usize> = replaced
        .iter()
        .map(|c| g[calls..].iter().position(|x| x == c).unwrap_or(usize::MAX))
        .collect();
    assert!(
        order.windows(2).all(|w| w[0] < w[1]) && order[3] != usize::MAX,
        "a replica added and promoted before the failed one is removed: {:?}",
        &g[calls..]
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while under() != 0 {
        assert!(Instant::now() < deadline, "whole again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(group.lock().unwrap().voters, BTreeSet::from([1, 2, fourth]));
    coordinator.stop().await.unwrap();
}

/// A node that keeps its lease (heartbeats) but answers no status poll —
/// an address the coordinator cannot reach, a process too stalled to
/// answer — is down once it has not answered for the grace period, and its
/// replica is rebuilt on another node. Before, a live lease counted it live
/// for good: its replicas were never rebuilt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_heartbeats_but_answers_no_poll_is_replaced() {
    const GRACE: Duration = Duration::from_millis(2_000);
    let config = CoordinatorConfig {
        down_grace_ms: GRACE.as_millis() as u64,
        ..CoordinatorConfig::default()
    };
    let group = Group {
        catch_up: true,
        ..Group::default()
    };
    let (coordinator, _url, group, fourth) = founded(config, group).await;
    let under = || coordinator.shared.progress.lock().under_replicated;
    let deadline = Instant::now() + Duration::from_secs(10);
    while under() != 0 {
        assert!(Instant::now() < deadline, "settled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let silent_at = Instant::now();
    group.lock().unwrap().unreachable.insert(3);
    wait_for(&group, Duration::from_secs(20), "replaced", |g| {
        g.voters.contains(&fourth) && !g.members().contains(&3)
    })
    .await;
    let took = silent_at.elapsed();
    println!("replaced after {took:?}: {:?}", group.lock().unwrap().calls);
    assert!(took >= GRACE, "not before the grace period: {took:?}");
    coordinator.stop().await.unwrap();
}

/// A new coordinator term in the middle of a replacement goes on with it.
/// Node 3 stops answering; after the grace its replica gets a learner on
/// node 4, which copies (slowly). The leader key is then deleted: the
/// coordinator wins again, a new term whose targets and down clocks start
/// empty. Before, its first round kept the lowest ids (1, 2, 3), removed
/// the learner and closed it — its copy deleted, the dead node kept for
/// another grace period, and at every new term again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_coordinator_term_goes_on_with_a_replacement_under_way() {
    const GRACE: Duration = Duration::from_millis(2_000);
    let config = CoordinatorConfig {
        down_grace_ms: GRACE.as_millis() as u64,
        ..CoordinatorConfig::default()
    };
    let group = Group {
        receiving: true,
        ..Group::default()
    };
    let (coordinator, _url, group, fourth) = founded(config, group).await;
    group.lock().unwrap().unreachable.insert(3);
    wait_for(&group, Duration::from_secs(20), "a learner added", |g| {
        g.learners.contains(&fourth)
    })
    .await;
    let before = coordinator.shared.leadership().expect("leads").generation;
    coordinator
        .shared
        .store
        .delete(&coordinator.shared.keys.leader())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while coordinator
        .shared
        .leadership()
        .is_none_or(|l| l.generation == before)
    {
        assert!(Instant::now() < deadline, "no new term");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Several rounds of the new term.
    tokio::time::sleep(Duration::from_secs(1)).await;
    {
        let g = group.lock().unwrap();
        let undone = [format!("remove {fourth}"), format!("close {fourth}")];
        assert!(
            !g.calls.iter().any(|c| undone.contains(c)),
            "the replacement was undone: {:?}",
            g.calls
        );
        assert!(g.learners.contains(&fourth), "calls {:?}", g.calls);
    }
    coordinator.stop().await.unwrap();
}
