//! A coordinator that starts on a store older than the nodes' maps (etcd
//! restored from an older backup) knows it before it leads: it asks the
//! nodes of the store's map for the map they hold (`NodeAdmin.HeldMap`)
//! before taking leadership, so its first answer as leader already refuses
//! changes — no heartbeat needed — and keeps refusing them until a
//! restore stores a map above every version it saw. The node here is a
//! scripted `NodeAdmin` server on a real socket that answers only
//! `HeldMap` and never heartbeats the second coordinator.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidepool_coordinator::meta::{EmbeddedStore, MetaStore, Op};
use tidepool_coordinator::{CoordinatorConfig, RunningCoordinator, start_with_store};
use tidepool_coordinator::{RESTORE_ID_SKIP, RESTORE_VERSION_SKIP};
use tidepool_proto::error_detail;
use tidepool_proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_proto::v1::node_admin_server::{NodeAdmin, NodeAdminServer};
use tidepool_proto::v1::{
    ChangeMembershipRequest, ChangeMembershipResponse, CloseReplicaRequest, CloseReplicaResponse,
    ClusterMap, CreateNamespaceRequest, ErrorCode, GetClusterStatusRequest, HeldMapRequest,
    Namespace, NodeStatus, NodeStatusRequest, OpenReplicaRequest, OpenReplicaResponse,
    ProposeAdminRequest, ProposeAdminResponse, RegisterNodeRequest, RestoreMapRequest,
    TransferLeaderRequest, TransferLeaderResponse,
};
use tonic::{Request, Response, Status};

/// A node that answers `HeldMap` with the map it is given, and nothing else
/// (nothing at all while `away`).
#[derive(Default)]
struct Holding {
    map: Mutex<ClusterMap>,
    away: AtomicBool,
}

#[tonic::async_trait]
impl NodeAdmin for Holding {
    async fn open_replica(
        &self,
        _: Request<OpenReplicaRequest>,
    ) -> Result<Response<OpenReplicaResponse>, Status> {
        Err(Status::unimplemented("scripted"))
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
        Err(Status::unavailable("scripted"))
    }

    async fn held_map(&self, _: Request<HeldMapRequest>) -> Result<Response<ClusterMap>, Status> {
        if self.away.load(Ordering::SeqCst) {
            return Err(Status::unavailable("scripted: away"));
        }
        Ok(Response::new(self.map.lock().unwrap().clone()))
    }
}

/// A `Holding` node serving on a real socket, and its address.
async fn holding_node() -> (Arc<Holding>, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let node = Arc::new(Holding::default());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(NodeAdminServer::from_arc(node.clone()))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    (node, address)
}

/// A coordinator on `store`, once it leads, with a client of it.
async fn leading(
    store: &Arc<dyn MetaStore>,
) -> (
    RunningCoordinator,
    CoordinatorServiceClient<tonic::transport::Channel>,
) {
    let coordinator = start_with_store(config(), store.clone()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while coordinator.shared.leadership().is_none() {
        assert!(Instant::now() < deadline, "the coordinator leads");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let client = CoordinatorServiceClient::connect(format!("http://{}", coordinator.address))
        .await
        .unwrap();
    (coordinator, client)
}

fn config() -> CoordinatorConfig {
    CoordinatorConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        leader_lease_ms: 1_000,
        reconcile_interval_ms: 100,
        cluster: tidepool_coordinator::config::ClusterSettings {
            shards: 2,
            ..Default::default()
        },
        ..CoordinatorConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_on_a_store_behind_the_nodes_refuses_changes_from_its_first_moment_as_leader()
{
    let (node, address) = holding_node().await;

    // A cluster with this node in its map.
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let (first, mut client) = leading(&store).await;
    let registered = client
        .register_node(RegisterNodeRequest {
            address: address.clone(),
            capacity_bytes: 1 << 30,
            ..RegisterNodeRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    let stored = (*first.shared.map()).clone();
    first.stop().await.unwrap();

    // The node holds a newer map of the cluster than the store (it went on
    // while the store was later put back from an older backup), with a
    // namespace created since.
    let highest = stored.namespaces.iter().map(|ns| ns.id).max().unwrap();
    let mut newer = ClusterMap {
        version: stored.version + 3,
        ..stored.clone()
    };
    newer.namespaces.push(Namespace {
        name: "created-since".into(),
        id: highest + 1,
        ..Namespace::default()
    });
    *node.map.lock().unwrap() = newer.clone();

    let (second, mut client) = leading(&store).await;
    let behind = second
        .shared
        .store_behind()
        .expect("the store known behind the node's map from the first moment of leading");
    assert_eq!(
        (behind.node_id, behind.node_version, behind.store_version),
        (registered.node_id, newer.version, stored.version)
    );
    let refused = client
        .create_namespace(CreateNamespaceRequest {
            name: "on-the-older-map".into(),
            ..CreateNamespaceRequest::default()
        })
        .await
        .unwrap_err();
    let code = error_detail(&refused).and_then(|d| ErrorCode::try_from(d.code).ok());
    assert_eq!(code, Some(ErrorCode::Conflict), "{refused:?}");
    assert!(refused.message().contains("restore-map"), "{refused:?}");
    // Rounds do not clear it though the node never reports: the store is
    // still behind a map that exists.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(second.shared.store_behind(), Some(behind));

    // The node now answers with an older map than the one it was seen
    // holding (as if another node had held that one), without the
    // namespace: a restore of it is refused unless told to go on, and then
    // stored above the version seen, with the ids the newer map may have
    // handed out skipped.
    *node.map.lock().unwrap() = ClusterMap {
        version: stored.version + 2,
        ..stored.clone()
    };
    let refused = client
        .restore_map(RestoreMapRequest {
            node_address: address.clone(),
            allow_unanswered: false,
        })
        .await
        .unwrap_err();
    let code = error_detail(&refused).and_then(|d| ErrorCode::try_from(d.code).ok());
    assert_eq!(code, Some(ErrorCode::Conflict), "{refused:?}");
    assert!(
        refused.message().contains(&format!(
            "node {} was seen holding map v{}",
            registered.node_id, newer.version
        )),
        "{refused:?}"
    );
    let restored = client
        .restore_map(RestoreMapRequest {
            node_address: address.clone(),
            allow_unanswered: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(restored.from_node_address, address);
    assert_eq!(restored.previous_version, stored.version);
    // One version missed (v+2 restored, v+3 seen), plus the margin for
    // maps nobody reported.
    assert_eq!(restored.skipped_ids, RESTORE_ID_SKIP + 1);
    let map = restored.map.unwrap();
    // Past any map a node that did not answer may hold.
    assert_eq!(map.version, newer.version + RESTORE_VERSION_SKIP + 1);
    assert_eq!(map.next_namespace_id, highest + 1 + RESTORE_ID_SKIP + 1);
    let shards_above = map.shards.iter().map(|s| s.shard_id).max().unwrap() + 1;
    assert_eq!(map.next_shard_id, shards_above + RESTORE_ID_SKIP + 1);
    assert_eq!(second.shared.store_behind(), None);
    let created = client
        .create_namespace(CreateNamespaceRequest {
            name: "after-the-restore".into(),
            ..CreateNamespaceRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    // Not the id of the namespace the lost map created: the id is part of
    // every storage key, so this namespace would read that one's blobs.
    assert_eq!(created.id, highest + 1 + RESTORE_ID_SKIP + 1);
    assert_eq!(
        second.shared.map().next_namespace_id,
        created.id + 1,
        "ids go on from there"
    );
    second.stop().await.unwrap();
}

/// The store loses every key under a running coordinator (etcd's data
/// gone): it keeps serving its map, refuses changes (`CONFLICT`: the store
/// holds no map, behind the one it served), and a restore creates the map
/// key again, with the epoch's start, so the epoch does not advance at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_lost_every_key_takes_the_map_back_with_the_epoch_clock() {
    let (node, address) = holding_node().await;
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let (coordinator, mut client) = leading(&store).await;
    client
        .register_node(RegisterNodeRequest {
            address: address.clone(),
            capacity_bytes: 1 << 30,
            ..RegisterNodeRequest::default()
        })
        .await
        .unwrap();
    let served = (*coordinator.shared.map()).clone();
    *node.map.lock().unwrap() = served.clone();
    let keys = &coordinator.shared.keys;
    store
        .txn(
            Vec::new(),
            vec![
                Op::Delete { key: keys.map() },
                Op::Delete {
                    key: keys.epoch_started(),
                },
            ],
        )
        .await
        .unwrap();

    let refused = client
        .create_namespace(CreateNamespaceRequest {
            name: "on-no-map".into(),
            ..CreateNamespaceRequest::default()
        })
        .await
        .unwrap_err();
    let code = error_detail(&refused).and_then(|d| ErrorCode::try_from(d.code).ok());
    assert_eq!(code, Some(ErrorCode::Conflict), "{refused:?}");
    assert_eq!(
        coordinator.shared.map().version,
        served.version,
        "the map it served stays"
    );

    let restored = client
        .restore_map(RestoreMapRequest {
            node_address: address.clone(),
            allow_unanswered: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(restored.previous_version, 0);
    assert_eq!(restored.map.unwrap().version, served.version + 1);
    assert_eq!(
        restored.skipped_ids, 0,
        "every node answered, none newer seen"
    );
    let stored = store
        .get(&keys.map())
        .await
        .unwrap()
        .expect("the map key again");
    assert!(!stored.value.is_empty());
    let clock = store
        .get(&keys.epoch_started())
        .await
        .unwrap()
        .expect("the epoch's start written with the map");
    let started: u64 = String::from_utf8_lossy(&clock.value).parse().unwrap();
    assert!(started > 0);
    let created = client
        .create_namespace(CreateNamespaceRequest {
            name: "after-the-restore".into(),
            ..CreateNamespaceRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    let highest = served.namespaces.iter().map(|ns| ns.id).max().unwrap();
    assert_eq!(created.id, highest + 1);
    coordinator.stop().await.unwrap();
}

/// A restore that went on without a node stores a version past any map
/// that node can hold. Back with a newer map of the line before the restore
/// (it alone received changes the answering nodes did not), it takes the
/// restored map: the store is not reported behind it, and a second restore
/// cannot store its map over what changed since the first — here a
/// namespace created after it, whose blobs would be out of every map and
/// whose id the next creations would hand out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_after_a_restore_without_it_does_not_bring_its_older_line_back() {
    let (answering, answering_address) = holding_node().await;
    let (away, away_address) = holding_node().await;
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let (coordinator, mut client) = leading(&store).await;
    let mut away_id = 0;
    for address in [&answering_address, &away_address] {
        let registered = client
            .register_node(RegisterNodeRequest {
                address: address.clone(),
                capacity_bytes: 1 << 30,
                ..RegisterNodeRequest::default()
            })
            .await
            .unwrap()
            .into_inner();
        if address == &away_address {
            away_id = registered.node_id;
        }
    }
    let served = (*coordinator.shared.map()).clone();
    *answering.map.lock().unwrap() = served.clone();
    // The away node received ten changes the other did not, one of them a
    // namespace, and does not answer.
    let highest = served.namespaces.iter().map(|ns| ns.id).max().unwrap();
    let mut ahead = ClusterMap {
        version: served.version + 10,
        ..served.clone()
    };
    ahead.namespaces.push(Namespace {
        name: "only-on-the-away-node".into(),
        id: highest + 1,
        ..Namespace::default()
    });
    *away.map.lock().unwrap() = ahead.clone();
    away.away.store(true, Ordering::SeqCst);

    // The store loses its map, and its epoch clock is an old backup's (an
    // epoch begun long ago); the map is restored without the away node.
    let keys = &coordinator.shared.keys;
    store
        .txn(
            Vec::new(),
            vec![
                Op::Delete { key: keys.map() },
                Op::Put {
                    key: keys.epoch_started(),
                    value: b"1".to_vec(),
                    lease: None,
                },
            ],
        )
        .await
        .unwrap();
    let before_restore = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let restored = client
        .restore_map(RestoreMapRequest {
            node_address: answering_address.clone(),
            allow_unanswered: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(restored.unanswered_nodes, vec![away_address.clone()]);
    // The epoch restored starts its interval now: kept, the old clock made
    // it advance at once, cutting the restored epoch short (blobs expired
    // before their retention).
    let clock = store.get(&keys.epoch_started()).await.unwrap().unwrap();
    let started: u64 = String::from_utf8_lossy(&clock.value).parse().unwrap();
    assert!(started >= before_restore, "the epoch clock is {started}");
    let restored_version = restored.map.unwrap().version;
    assert_eq!(
        restored_version,
        served.version + RESTORE_VERSION_SKIP + 1,
        "past any version the away node can hold"
    );
    let created = client
        .create_namespace(CreateNamespaceRequest {
            name: "after-the-restore".into(),
            ..CreateNamespaceRequest::default()
        })
        .await
        .unwrap()
        .into_inner();

    // The away node is back with the older line's map, ten versions ahead
    // of the one restored: the store is not behind it.
    away.away.store(false, Ordering::SeqCst);
    let behind = coordinator
        .shared
        .note_node_maps([(away_id, ahead.version)], true)
        .await
        .unwrap();
    assert_eq!(behind, None, "the store is reported behind the away node");
    assert_eq!(coordinator.shared.store_behind(), None);
    // With every node answering, a restore finds nothing newer than the
    // store's: the namespace created since stays, with its id.
    let again = client
        .restore_map(RestoreMapRequest {
            node_address: away_address.clone(),
            allow_unanswered: false,
        })
        .await
        .unwrap_err();
    let code = error_detail(&again).and_then(|d| ErrorCode::try_from(d.code).ok());
    assert_eq!(code, Some(ErrorCode::Conflict), "{again:?}");
    assert!(again.message().contains("nothing to restore"), "{again:?}");
    let map = coordinator.shared.map();
    assert!(map.version > restored_version);
    assert!(
        map.namespaces
            .iter()
            .any(|ns| ns.name == created.name && ns.id == created.id),
        "{map:?}"
    );
    assert!(
        !map.namespaces
            .iter()
            .any(|ns| ns.name == "only-on-the-away-node"),
        "what only the away node's map held is left out"
    );
    coordinator.stop().await.unwrap();
}

/// A node refused as another cluster's is listed by every coordinator of
/// the store, not only by the one it called: a node registers with the
/// leader, and an operator's `tidectl cluster status` through a Service
/// may reach a standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_coordinator_of_the_store_lists_a_node_one_of_them_refused() {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let (leader, mut to_leader) = leading(&store).await;
    let standby = start_with_store(config(), store.clone()).await.unwrap();
    let mut to_standby = CoordinatorServiceClient::connect(format!("http://{}", standby.address))
        .await
        .unwrap();
    let (address, theirs) = ("http://10.0.0.9:7401", "0123456789abcdef");
    let refused = to_leader
        .register_node(RegisterNodeRequest {
            node_id: 7,
            address: address.into(),
            capacity_bytes: 1 << 30,
            cluster_id: theirs.into(),
            ..RegisterNodeRequest::default()
        })
        .await
        .unwrap_err();
    let code = error_detail(&refused).and_then(|d| ErrorCode::try_from(d.code).ok());
    assert_eq!(code, Some(ErrorCode::WrongCluster), "{refused:?}");

    for (name, client) in [
        ("the standby", &mut to_standby),
        ("the leader", &mut to_leader),
    ] {
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            let status = client
                .get_cluster_status(GetClusterStatusRequest::default())
                .await
                .unwrap()
                .into_inner();
            if !status.refused_nodes.is_empty() {
                break status;
            }
            assert!(Instant::now() < deadline, "{name} lists the refused node");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let listed: Vec<_> = status
            .refused_nodes
            .iter()
            .map(|n| (n.node_id, n.address.as_str(), n.cluster_id.as_str()))
            .collect();
        assert_eq!(listed, vec![(7, address, theirs)], "{name}");
        assert!(status.refused_nodes[0].seconds_ago < 60, "{name}");
        assert_eq!(status.is_leader, name == "the leader");
    }
    standby.stop().await.unwrap();
    leader.stop().await.unwrap();
}
