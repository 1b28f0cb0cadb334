//! The coordinator's gRPC API on real sockets, two coordinators sharing one
//! embedded store: reads from either, changes only on the leader (the
//! follower names it), namespaces and their validation, epochs advanced by
//! call (with compare-and-swap) and on a schedule, the map watch.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tidepool_coordinator::meta::{EmbeddedStore, MetaStore, Op};
use tidepool_coordinator::{CoordinatorConfig, RunningCoordinator, start_with_store};
use tidepool_proto::error_detail;
use tidepool_proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_proto::v1::retention::{Policy, RetainEpochs};
use tidepool_proto::v1::{
    AdvanceEpochRequest, CreateNamespaceRequest, CreateTokenRequest, DrainNodeRequest, ErrorCode,
    GetClusterMapRequest, GetClusterStatusRequest, GetEpochStatusRequest, HeartbeatRequest,
    ListNamespacesRequest, NodeStatus, RegisterNodeRequest, Retention, RevokeTokenRequest,
    SetRetentionRequest, WatchClusterMapRequest,
};
use tonic::transport::Channel;

fn config(epoch_interval_s: u64) -> CoordinatorConfig {
    CoordinatorConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        leader_lease_ms: 1_000,
        reconcile_interval_ms: 100,
        epoch_interval_s,
        cluster: tidepool_coordinator::config::ClusterSettings {
            shards: 4,
            ..Default::default()
        },
        ..CoordinatorConfig::default()
    }
}

async fn client(c: &RunningCoordinator) -> CoordinatorServiceClient<Channel> {
    CoordinatorServiceClient::connect(format!("http://{}", c.address))
        .await
        .unwrap()
}

fn code(status: &tonic::Status) -> ErrorCode {
    error_detail(status)
        .and_then(|d| ErrorCode::try_from(d.code).ok())
        .unwrap_or(ErrorCode::Unspecified)
}

fn retain(epochs: u32) -> Option<Retention> {
    Some(Retention {
        policy: Some(Policy::Retain(RetainEpochs { epochs })),
    })
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_go_to_the_leader_and_reads_to_anyone() {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let first = start_with_store(config(0), store.clone()).await.unwrap();
    until("the first to lead", || first.shared.leadership().is_some()).await;
    let second = start_with_store(config(0), store.clone()).await.unwrap();
    until("the second to see the map", || {
        second.shared.map().version > 0
    })
    .await;
    let (mut leader, mut follower) = (client(&first).await, client(&second).await);

    // Both serve the map; only one cluster was created.
    let a = leader
        .get_cluster_map(GetClusterMapRequest {})
        .await
        .unwrap()
        .into_inner();
    let b = follower
        .get_cluster_map(GetClusterMapRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.cluster_id, b.cluster_id);
    assert_eq!((a.shards.len(), a.epoch), (4, 1));
    assert_eq!(a.shards.last().unwrap().hash_end, u64::MAX);

    // A change on the follower names the leader.
    let refused = follower
        .create_namespace(CreateNamespaceRequest {
            name: "cache".into(),
            content_addressed: false,
            retention: retain(2),
        })
        .await
        .unwrap_err();
    assert_eq!(code(&refused), ErrorCode::NotCoordinatorLeader);
    let hint = error_detail(&refused).unwrap().leader_hint.unwrap();
    assert_eq!(hint.address, format!("http://{}", first.address));

    // Namespaces: created with the next id, validated, listed by name.
    let cache = leader
        .create_namespace(CreateNamespaceRequest {
            name: "cache".into(),
            content_addressed: false,
            retention: retain(2),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((cache.id, cache.created_epoch), (2, 1));
    for (name, retention, expected) in [
        ("cache", None, ErrorCode::NamespaceExists),
        ("Bad Name", None, ErrorCode::InvalidArgument),
        ("zero", retain(0), ErrorCode::InvalidArgument),
    ] {
        let e = leader
            .create_namespace(CreateNamespaceRequest {
                name: name.into(),
                content_addressed: false,
                retention,
            })
            .await
            .unwrap_err();
        assert_eq!(code(&e), expected, "{name}: {}", e.message());
    }
    let e = leader
        .set_retention(SetRetentionRequest {
            name: "nope".into(),
            retention: retain(1),
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::NamespaceNotFound);
    let changed = leader
        .set_retention(SetRetentionRequest {
            name: "cache".into(),
            retention: retain(1),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(changed.retention, retain(1));
    // Durable is a one-way door: an expiring namespace may become durable,
    // never the other way (no admin call makes a backup store expire).
    let e = leader
        .set_retention(SetRetentionRequest {
            name: "default".into(),
            retention: retain(1),
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::InvalidArgument, "{}", e.message());
    assert!(e.message().contains("durable"), "{}", e.message());
    until("the follower to see the namespace", || {
        second.shared.map().namespaces.len() == 2
    })
    .await;
    let names: Vec<String> = follower
        .list_namespaces(ListNamespacesRequest {})
        .await
        .unwrap()
        .into_inner()
        .namespaces
        .into_iter()
        .map(|n| n.name)
        .collect();
    assert_eq!(names, ["cache", "default"]);

    // Epochs: compare-and-swap, and the drop target in the status.
    let e = leader
        .advance_epoch(AdvanceEpochRequest {
            expected_current: 5,
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::Conflict);
    let advanced = leader
        .advance_epoch(AdvanceEpochRequest {
            expected_current: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(advanced.epoch, 2);
    let status = leader
        .get_epoch_status(GetEpochStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.current_epoch, 2);
    assert_eq!(
        status.namespaces.len(),
        1,
        "durable namespaces have no drops"
    );
    assert_eq!(status.namespaces[0].drop_below, 2);
    assert_eq!(status.namespaces[0].shards_done, 0, "no node runs a shard");

    // An expiring namespace may become durable, and then never expire.
    let durable = || {
        Some(Retention {
            policy: Some(Policy::Durable(tidepool_proto::v1::retention::Durable {})),
        })
    };
    let made_durable = leader
        .set_retention(SetRetentionRequest {
            name: "cache".into(),
            retention: durable(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(made_durable.retention, durable());
    let e = leader
        .set_retention(SetRetentionRequest {
            name: "cache".into(),
            retention: retain(3),
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::InvalidArgument);

    // Nodes: registration assigns ids, validates the address; drains and
    // heartbeats of unknown nodes are refused.
    let e = leader
        .register_node(RegisterNodeRequest {
            node_id: 0,
            address: "127.0.0.1:1".into(),
            zone: String::new(),
            capacity_bytes: 0,
            cluster_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::InvalidArgument);
    let registered = leader
        .register_node(RegisterNodeRequest {
            node_id: 0,
            address: "http://127.0.0.1:1".into(),
            zone: "z".into(),
            capacity_bytes: 1 << 30,
            cluster_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(registered.node_id, 1);
    let map = registered.map.unwrap();
    assert!(map.nodes.iter().any(|n| n.zone == "z"));
    let e = follower
        .heartbeat(HeartbeatRequest {
            status: Some(NodeStatus {
                node_id: 42,
                ..NodeStatus::default()
            }),
            cluster_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::NodeNotFound);
    // An id far above any handed out is refused (one at u64::MAX left no
    // id for any new node); a heartbeat of an unknown node claiming a map
    // far ahead is refused and marks nothing (it froze every map change).
    let e = leader
        .register_node(RegisterNodeRequest {
            node_id: u64::MAX,
            address: "http://127.0.0.1:9".into(),
            ..RegisterNodeRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::InvalidArgument);
    let e = leader
        .heartbeat(HeartbeatRequest {
            status: Some(NodeStatus {
                node_id: 43,
                map_version: u64::MAX,
                ..NodeStatus::default()
            }),
            cluster_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::NodeNotFound);
    leader
        .create_namespace(CreateNamespaceRequest {
            name: "after-a-false-heartbeat".into(),
            ..CreateNamespaceRequest::default()
        })
        .await
        .expect("the map still changes");

    // A node whose data belongs to another cluster is refused, and the
    // map is left as it was; one of this cluster registers again.
    let e = leader
        .register_node(RegisterNodeRequest {
            node_id: 7,
            address: "http://127.0.0.1:7".into(),
            cluster_id: "another".into(),
            ..RegisterNodeRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::WrongCluster);
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    let e = follower
        .heartbeat(HeartbeatRequest {
            status: Some(NodeStatus {
                node_id: 1,
                ..NodeStatus::default()
            }),
            cluster_id: "another".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::WrongCluster);
    let again = leader
        .register_node(RegisterNodeRequest {
            node_id: 1,
            address: "http://127.0.0.1:1".into(),
            zone: "z".into(),
            capacity_bytes: 1 << 30,
            cluster_id: map.cluster_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .map
        .unwrap();
    assert_eq!(
        again.nodes.iter().map(|n| n.node_id).collect::<Vec<_>>(),
        vec![1],
        "the refused node is not in the map"
    );
    follower
        .heartbeat(HeartbeatRequest {
            status: Some(NodeStatus {
                node_id: 1,
                ..NodeStatus::default()
            }),
            cluster_id: map.cluster_id.clone(),
        })
        .await
        .unwrap();
    let e = leader
        .drain_node(DrainNodeRequest { node_id: 42 })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::NodeNotFound);
    let status = follower
        .get_cluster_status(GetClusterStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!status.is_leader);
    assert_eq!(status.nodes.len(), 1, "the registered node counts as live");

    second.stop().await.unwrap();
    first.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_epoch_advances_on_schedule_and_watchers_see_each_map() {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let coordinator = start_with_store(config(1), store).await.unwrap();
    let mut api = client(&coordinator).await;
    let mut watch = api
        .watch_cluster_map(WatchClusterMapRequest { after_version: 0 })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    let started = Instant::now();
    let mut last = first.clone();
    while last.epoch < first.epoch + 2 {
        let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
            .await
            .expect("a newer map within 5 s")
            .unwrap()
            .unwrap();
        assert!(next.version > last.version, "versions only grow");
        last = next;
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(6),
        "two scheduled advances took {took:?}"
    );
    coordinator.stop().await.unwrap();
}

/// The current epoch's start recorded by a leader whose clock ran a day
/// ahead: the schedule counts from when this leader first saw it, on its
/// own clock, and advances one interval later — not a day and an interval
/// later, holding every drop meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_start_in_the_future_delays_the_schedule_one_interval() {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let coordinator = start_with_store(config(2), store.clone()).await.unwrap();
    until("the coordinator to lead", || {
        coordinator.shared.leadership().is_some() && coordinator.shared.map().version > 0
    })
    .await;
    let ahead = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 86_400_000;
    store
        .txn(
            Vec::new(),
            vec![Op::Put {
                key: coordinator.shared.keys.epoch_started(),
                value: ahead.to_string().into_bytes(),
                lease: None,
            }],
        )
        .await
        .unwrap();
    let epoch = coordinator.shared.map().epoch;
    let since = Instant::now();
    until("an advance", || coordinator.shared.map().epoch > epoch).await;
    let took = since.elapsed();
    assert!(took < Duration::from_secs(8), "the advance took {took:?}");
    let started = store
        .get(&coordinator.shared.keys.epoch_started())
        .await
        .unwrap()
        .unwrap();
    let started: u64 = String::from_utf8_lossy(&started.value).parse().unwrap();
    assert!(started < ahead, "the advance records this leader's clock");
    coordinator.stop().await.unwrap();
}

/// A current epoch's start missing or unreadable (a store put back without
/// it) counts from when the leader first saw that: read as 1970, the epoch
/// advanced at once, cutting the current one short (its blobs dropped an
/// epoch early).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_epoch_start_does_not_advance_the_epoch_at_once() {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let coordinator = start_with_store(config(2), store.clone()).await.unwrap();
    until("the coordinator to lead", || {
        coordinator.shared.leadership().is_some() && coordinator.shared.map().version > 0
    })
    .await;
    store
        .txn(
            Vec::new(),
            vec![Op::Put {
                key: coordinator.shared.keys.epoch_started(),
                value: b"not a time".to_vec(),
                lease: None,
            }],
        )
        .await
        .unwrap();
    let epoch = coordinator.shared.map().epoch;
    let since = Instant::now();
    // Reconcile rounds run every 100 ms: read as 1970, the start advanced
    // the epoch within one.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        coordinator.shared.map().epoch,
        epoch,
        "the epoch advanced at once"
    );
    until("an advance one interval on", || {
        coordinator.shared.map().epoch > epoch
    })
    .await;
    let took = since.elapsed();
    assert!(
        took >= Duration::from_millis(1_500),
        "the advance took {took:?}"
    );
    coordinator.stop().await.unwrap();
}

/// One connection holds at most 256 calls at once: a caller opening
/// watches without end (each holds a task and copies of the map) waits
/// for a place; before, every one was taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_holds_a_bounded_number_of_calls() {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let coordinator = start_with_store(config(3600), store).await.unwrap();
    let api = client(&coordinator).await;
    let mut watches = Vec::new();
    for _ in 0..256 {
        let mut watch = api
            .clone()
            .watch_cluster_map(WatchClusterMapRequest { after_version: 0 })
            .await
            .unwrap()
            .into_inner();
        watch.message().await.unwrap().unwrap();
        watches.push(watch);
    }
    let one_more = tokio::time::timeout(
        Duration::from_secs(1),
        api.clone().get_cluster_map(GetClusterMapRequest {}),
    )
    .await;
    assert!(
        one_more.is_err(),
        "a 257th call on the connection was served at once"
    );
    // A place freed: served.
    drop(watches.pop());
    tokio::time::timeout(
        Duration::from_secs(5),
        api.clone().get_cluster_map(GetClusterMapRequest {}),
    )
    .await
    .expect("served once a call ended")
    .unwrap();
    // Another connection is not held up.
    client(&coordinator)
        .await
        .get_cluster_map(GetClusterMapRequest {})
        .await
        .unwrap();
    drop(watches);
    coordinator.stop().await.unwrap();
}

/// `AdvanceEpoch` and `RevokeToken` answer once every node holding a
/// liveness lease holds the new map: a node stamps writes with its map's
/// epoch and checks tokens against its map, so one still behind after the
/// answer stamped writes an epoch early (they expired an epoch early) and
/// took the revoked token. A node whose lease ends is no longer waited
/// for; one heartbeating but never taking the map is named in the answer
/// (`behind_nodes`) after two leases. A `CONFLICT` refusal waits alike and
/// names such nodes in its message. The node here answers no status call
/// (nothing listens at its address): only its heartbeats say which map it
/// holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epoch_advances_and_revocations_answer_once_every_live_node_holds_the_map() {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
    let mut settings = config(0);
    settings.node_lease_ms = 3_000;
    let coordinator = start_with_store(settings, store).await.unwrap();
    let mut api = client(&coordinator).await;
    let registered = api
        .register_node(RegisterNodeRequest {
            node_id: 0,
            address: "http://127.0.0.1:1".into(),
            zone: "z".into(),
            capacity_bytes: 1 << 30,
            cluster_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let node_id = registered.node_id;
    let cluster_id = registered.map.unwrap().cluster_id;
    let beat = {
        let api = api.clone();
        move |map_version: u64| {
            let mut api = api.clone();
            let cluster_id = cluster_id.clone();
            async move {
                api.heartbeat(HeartbeatRequest {
                    status: Some(NodeStatus {
                        node_id,
                        map_version,
                        ..NodeStatus::default()
                    }),
                    cluster_id,
                })
                .await
                .unwrap();
            }
        }
    };
    let version = || coordinator.shared.map().version;
    beat(version()).await;

    // Held until the node reports the new map.
    let epoch = coordinator.shared.map().epoch;
    let before = version();
    let advance = tokio::spawn({
        let mut api = api.clone();
        async move { api.advance_epoch(AdvanceEpochRequest::default()).await }
    });
    until("the advance to be stored", || version() > before).await;
    assert_eq!(coordinator.shared.map().epoch, epoch + 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !advance.is_finished(),
        "answered while the node held the old map"
    );
    beat(version()).await;
    let answered = tokio::time::timeout(Duration::from_secs(5), advance)
        .await
        .expect("answered once the node reported the map")
        .unwrap()
        .unwrap()
        .into_inner();
    assert_eq!(answered.epoch, epoch + 1);
    assert!(answered.behind_nodes.is_empty());

    // A revocation likewise.
    api.create_token(CreateTokenRequest {
        name: "leaving".into(),
        admin: true,
        grants: Vec::new(),
    })
    .await
    .unwrap();
    beat(version()).await;
    let before = version();
    let revoke = tokio::spawn({
        let mut api = api.clone();
        async move {
            api.revoke_token(RevokeTokenRequest {
                name: "leaving".into(),
            })
            .await
        }
    });
    until("the revocation to be stored", || version() > before).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !revoke.is_finished(),
        "answered while the node still held the token"
    );
    beat(version()).await;
    let revoked = tokio::time::timeout(Duration::from_secs(5), revoke)
        .await
        .expect("answered once the node reported the map")
        .unwrap()
        .unwrap()
        .into_inner();
    assert!(revoked.existed);
    assert!(revoked.behind_nodes.is_empty());

    // A node that stops beating is waited for until its lease ends.
    beat(version()).await;
    let last_beat = Instant::now();
    let answered = api
        .advance_epoch(AdvanceEpochRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answered.epoch, epoch + 2);
    assert!(answered.behind_nodes.is_empty());
    let waited = last_beat.elapsed();
    assert!(
        waited >= Duration::from_millis(2_500) && waited < Duration::from_secs(10),
        "answered {waited:?} after the node's last heartbeat (lease 3 s)"
    );

    // One beating but never taking the map is named after two leases.
    beat(version() - 1).await;
    let stuck = tokio::spawn({
        let beat = beat.clone();
        let behind = version();
        async move {
            loop {
                beat(behind).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    });
    let started = Instant::now();
    let answered = api
        .advance_epoch(AdvanceEpochRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answered.epoch, epoch + 3, "advanced");
    assert_eq!(answered.behind_nodes, [node_id]);
    assert!(started.elapsed() >= Duration::from_millis(5_500));
    // A refusal waits as well (the repeat of a call whose answer was lost
    // reads it as its success), and names the node.
    let started = Instant::now();
    let e = api
        .advance_epoch(AdvanceEpochRequest {
            expected_current: epoch + 2,
        })
        .await
        .unwrap_err();
    assert_eq!(code(&e), ErrorCode::Conflict, "{}", e.message());
    assert!(
        e.message()
            .contains(&format!("live nodes [{node_id}] have not taken")),
        "{}",
        e.message()
    );
    assert!(started.elapsed() >= Duration::from_millis(5_500));
    stuck.abort();
    coordinator.stop().await.unwrap();
}
