//! The coordinator when one node does not answer: its rounds and the
//! other nodes' work go on.
//!
//! - Founding a new cluster's shards: each node's founding replicas are
//!   opened apart from the other nodes', so the answering nodes get all of
//!   theirs at once (each shard then has a quorum and elects) instead of
//!   every shard waiting, one after another, for the silent node's call to
//!   time out.
//! - Status polls: a node that holds its lease but does not answer its poll
//!   (a frozen process) costs one round the poll's deadline, not every round
//!   until its lease ends; once it answers, every round polls it again.
//!
//! The nodes are scripted `NodeAdmin` servers on real sockets: they
//! register and heartbeat like nodes, report no replicas, and record what
//! they are asked; one is silent (to openings, or to status polls).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidepool_coordinator::meta::{EmbeddedStore, MetaStore};
use tidepool_coordinator::{CoordinatorConfig, start_with_store};
use tidepool_proto::v1::node_admin_server::{NodeAdmin, NodeAdminServer};
use tidepool_proto::v1::{
    ChangeMembershipRequest, ChangeMembershipResponse, CloseReplicaRequest, CloseReplicaResponse,
    ClusterMap, HeldMapRequest, NodeStatus, NodeStatusRequest, OpenReplicaRequest,
    OpenReplicaResponse, ProposeAdminRequest, ProposeAdminResponse, TransferLeaderRequest,
    TransferLeaderResponse,
};
use tonic::{Request, Response, Status};

mod support;

const SHARDS: u32 = 6;

/// A node that answers the coordinator from a script.
struct Scripted {
    node_id: Mutex<u64>,
    address: String,
    /// Shards it was asked to open.
    opened: Arc<Mutex<BTreeSet<u32>>>,
    /// Never answers an opening (a node that stopped mid-way).
    silent: bool,
    /// Openings asked of it, answered or not.
    asked: Arc<Mutex<Vec<u32>>>,
    /// Answers no status poll while set.
    status_silent: Arc<AtomicBool>,
    /// Status polls asked of it, answered or not.
    status_asks: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl NodeAdmin for Scripted {
    async fn open_replica(
        &self,
        request: Request<OpenReplicaRequest>,
    ) -> Result<Response<OpenReplicaResponse>, Status> {
        let shard = request.into_inner().shard.unwrap_or_default();
        self.asked.lock().unwrap().push(shard.shard_id);
        if self.silent {
            std::future::pending::<()>().await;
        }
        self.opened.lock().unwrap().insert(shard.shard_id);
        Ok(Response::new(OpenReplicaResponse::default()))
    }

    async fn change_membership(
        &self,
        _: Request<ChangeMembershipRequest>,
    ) -> Result<Response<ChangeMembershipResponse>, Status> {
        Err(Status::unimplemented("scripted"))
    }

    async fn transfer_leader(
        &self,
        _: Request<TransferLeaderRequest>,
    ) -> Result<Response<TransferLeaderResponse>, Status> {
        Err(Status::unimplemented("scripted"))
    }

    async fn close_replica(
        &self,
        _: Request<CloseReplicaRequest>,
    ) -> Result<Response<CloseReplicaResponse>, Status> {
        Err(Status::unimplemented("scripted"))
    }

    async fn propose_admin(
        &self,
        _: Request<ProposeAdminRequest>,
    ) -> Result<Response<ProposeAdminResponse>, Status> {
        Err(Status::unimplemented("scripted"))
    }

    async fn status(&self, _: Request<NodeStatusRequest>) -> Result<Response<NodeStatus>, Status> {
        self.status_asks.fetch_add(1, Ordering::SeqCst);
        if self.status_silent.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(Response::new(NodeStatus {
            node_id: *self.node_id.lock().unwrap(),
            address: self.address.clone(),
            ..NodeStatus::default()
        }))
    }

    async fn held_map(&self, _: Request<HeldMapRequest>) -> Result<Response<ClusterMap>, Status> {
        Ok(Response::new(ClusterMap::default()))
    }
}

/// A scripted node's record, and its switch.
struct Asked {
    /// Shards it opened.
    opened: Arc<Mutex<BTreeSet<u32>>>,
    /// Every opening asked of it.
    openings: Arc<Mutex<Vec<u32>>>,
    /// Set: it answers no status poll.
    status_silent: Arc<AtomicBool>,
    /// Status polls asked of it.
    status_asks: Arc<AtomicUsize>,
}

/// Starts a scripted node, registers it with the coordinator at `url` and
/// keeps its lease. `silent`: it never answers an opening.
async fn scripted_node(url: &str, silent: bool) -> Asked {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let asked = Asked {
        opened: Arc::new(Mutex::new(BTreeSet::new())),
        openings: Arc::new(Mutex::new(Vec::new())),
        status_silent: Arc::new(AtomicBool::new(false)),
        status_asks: Arc::new(AtomicUsize::new(0)),
    };
    let node = Arc::new(Scripted {
        node_id: Mutex::new(0),
        address: address.clone(),
        opened: asked.opened.clone(),
        silent,
        asked: asked.openings.clone(),
        status_silent: asked.status_silent.clone(),
        status_asks: asked.status_asks.clone(),
    });
    let service = NodeAdminServer::from_arc(node.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let node_id = support::register_and_beat(url, &address).await;
    *node.node_id.lock().unwrap() = node_id;
    asked
}

/// A coordinator on an in-memory store, rounds every 100 ms, for a
/// cluster of `SHARDS` shards of 3 replicas; and its URL.
async fn coordinator() -> (tidepool_coordinator::RunningCoordinator, String) {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let config = CoordinatorConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        leader_lease_ms: 1_000,
        reconcile_interval_ms: 100,
        cluster: tidepool_coordinator::config::ClusterSettings {
            shards: SHARDS,
            replication_factor: 3,
            ..Default::default()
        },
        ..CoordinatorConfig::default()
    };
    let coordinator = start_with_store(config, store).await.unwrap();
    let url = format!("http://{}", coordinator.address);
    (coordinator, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_node_holds_back_only_its_own_founding_replicas() {
    let (coordinator, url) = coordinator().await;
    let first = scripted_node(&url, false).await.opened;
    let second = scripted_node(&url, false).await.opened;
    let Asked {
        opened: silent,
        openings: asked,
        ..
    } = scripted_node(&url, true).await;

    // Every shard's replica is opened on both answering nodes, long before
    // the silent node's first opening would time out (30 s): one at a
    // time over all nodes, the second shard would wait for that.
    let all: BTreeSet<u32> = (1..=SHARDS).collect();
    let started = Instant::now();
    while *first.lock().unwrap() != all || *second.lock().unwrap() != all {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "answering nodes opened {:?} and {:?} of {all:?}",
            first.lock().unwrap(),
            second.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "answering nodes had every shard after {:?}",
        started.elapsed()
    );
    assert!(silent.lock().unwrap().is_empty());

    // Rounds go on meanwhile (they publish what the answering nodes
    // elect), and the silent node is not asked again while its first
    // opening is under way.
    let rounds = || coordinator.shared.progress.lock().rounds;
    let before = rounds();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        rounds() >= before + 3,
        "rounds every 100 ms: {before} -> {}",
        rounds()
    );
    assert_eq!(
        asked.lock().unwrap().len(),
        1,
        "one opening at a time on the silent node"
    );
    coordinator.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_does_not_answer_its_status_poll_does_not_slow_every_round() {
    let (coordinator, url) = coordinator().await;
    scripted_node(&url, false).await;
    scripted_node(&url, false).await;
    let frozen = scripted_node(&url, false).await;
    let rounds = || coordinator.shared.progress.lock().rounds;
    let asks = || frozen.status_asks.load(Ordering::SeqCst) as u64;
    let started = Instant::now();
    while asks() < 3 {
        assert!(started.elapsed() < Duration::from_secs(10), "polls begin");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // It stops answering (its lease goes on). The round that finds it
    // silent waits out the poll's 2 s deadline; the rounds after go on
    // every 100 ms. Waiting for it in every round, 5 s would hold three.
    frozen.status_silent.store(true, Ordering::SeqCst);
    let (before, asked_before) = (rounds(), asks());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (during, asked_during) = (rounds() - before, asks() - asked_before);
    println!("silent for 5 s: {during} rounds, {asked_during} polls of the silent node");
    assert!(during >= 10, "rounds went on: {during} in 5 s");
    assert!(
        asked_during <= 4,
        "one unanswered poll at a time, each for its deadline: {asked_during} in 5 s"
    );

    // It answers again: rounds poll it, and wait for it, every round.
    frozen.status_silent.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let (before, asked_before) = (rounds(), asks());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (after, asked_after) = (rounds() - before, asks() - asked_before);
    assert!(
        asked_after + 1 >= after && after >= 3,
        "polled in every round again: {asked_after} polls in {after} rounds"
    );
    coordinator.stop().await.unwrap();
}
