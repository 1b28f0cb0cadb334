//! Real nodes over real sockets: a leader stopped and restarted under
//! writes, a replica that comes back after the log was compacted and is
//! caught up by a snapshot streamed over gRPC, and a replica moved from one
//! node to another through the admin calls the coordinator makes.

mod grpc_support;

use grpc_support::{
    TestCluster, code, get, get_on, put, replica_status, wait_caught_up, wait_leader,
};
use tidepool_proto::v1::{
    ChangeMembershipRequest, CloseReplicaRequest, ErrorCode, MembershipChange, OpenReplicaRequest,
    ReadConsistency, TransferLeaderRequest,
};

fn value(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j) as u8).collect()
}

/// Puts `count` keys `<prefix>/<i>` of `len` bytes (content seeded by
/// `i + seed`) through the leader; returns what was written.
async fn write_keys(
    cluster: &TestCluster,
    prefix: &str,
    count: usize,
    seed: usize,
    len: usize,
) -> Vec<(String, Vec<u8>)> {
    let mut written = Vec::new();
    for i in 0..count {
        let key = format!("{prefix}/{i}");
        let content = value(i + seed, len);
        put(cluster, "default", key.as_bytes(), &content)
            .await
            .unwrap();
        written.push((key, content));
    }
    written
}

/// Every key reads back on node `id` from its local state.
async fn assert_replica_holds(cluster: &TestCluster, id: u64, keys: &[(String, Vec<u8>)]) {
    assert_replica_holds_in(cluster, id, "default", keys).await
}

async fn assert_replica_holds_in(
    cluster: &TestCluster,
    id: u64,
    namespace: &str,
    keys: &[(String, Vec<u8>)],
) {
    for (key, content) in keys {
        let got = get_on(
            cluster,
            id,
            namespace,
            key.as_bytes(),
            ReadConsistency::AnyReplica,
        )
        .await
        .unwrap_or_else(|s| panic!("node {id} lacks {key}: {s:?}"));
        assert_eq!(&got, content, "node {id}, {key}");
    }
}

/// Advances shard 1 to `epoch` and drops namespace `namespace`'s blobs
/// below it, through the leader.
async fn drop_epochs(cluster: &TestCluster, leader: u64, epoch: u64, namespace: u32) {
    use tidepool_proto::v1::{
        AdvanceEpochOp, DropEpochsOp, ProposeAdminRequest, propose_admin_request::Op,
    };
    for op in [
        Op::AdvanceEpoch(AdvanceEpochOp { epoch }),
        Op::DropEpochs(DropEpochsOp {
            namespace_id: namespace,
            below: epoch,
        }),
    ] {
        cluster
            .admin(leader)
            .await
            .propose_admin(ProposeAdminRequest {
                shard_id: 1,
                op: Some(op),
            })
            .await
            .unwrap();
    }
}

/// Opens an empty replica of shard 1 on node `id` and has `leader` add it
/// as a learner (caught up by a snapshot once the log is compacted).
async fn add_learner(cluster: &TestCluster, leader: u64, id: u64) {
    let info = cluster.running[&leader].node.map().shards[0].clone();
    cluster
        .admin(id)
        .await
        .open_replica(OpenReplicaRequest {
            shard: Some(info),
            bootstrap: false,
        })
        .await
        .unwrap();
    let conf = replica_status(cluster, leader, 1)
        .await
        .unwrap()
        .conf_version;
    cluster
        .admin(leader)
        .await
        .change_membership(ChangeMembershipRequest {
            shard_id: 1,
            change: MembershipChange::AddLearner as i32,
            node_id: id,
            expected_conf_version: conf,
        })
        .await
        .unwrap();
}

fn drop_bounds(status: &tidepool_proto::v1::ReplicaStatus) -> Vec<(u32, u64)> {
    status
        .drops
        .iter()
        .map(|d| (d.namespace_id, d.dropped_below))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_stopped_and_restarted_under_writes() {
    let mut cluster = TestCluster::start(3, 1, |_| {}).await;
    let mut written = write_keys(&cluster, "before", 40, 0, 2_000).await;
    let old = wait_leader(&cluster, 1).await;
    cluster.stop(old).await;
    // The first request the new leader serves: a delete that must see the
    // put acknowledged by the old leader.
    let (key, _) = written.pop().unwrap();
    let deleted = tidepool_testkit::grpc::routed(&cluster.urls(), |url| {
        let key = key.clone();
        async move {
            tidepool_testkit::grpc::client(&url)
                .await
                .delete(tidepool_proto::v1::DeleteRequest {
                    blob: grpc_support::blob("default", key.as_bytes()),
                    ..Default::default()
                })
                .await
                .map(|r| r.into_inner())
        }
    })
    .await
    .unwrap();
    assert!(deleted.existed);
    let status = get(&cluster, "default", key.as_bytes()).await.unwrap_err();
    assert_eq!(code(&status), ErrorCode::NotFound);
    // The two left elect a leader; the client follows the hints to it.
    written.extend(write_keys(&cluster, "after", 40, 1000, 3_000).await);
    let new = wait_leader(&cluster, 1).await;
    assert_ne!(new, old);
    cluster.restart(old).await;
    wait_caught_up(&cluster, old, 1).await;
    for id in 1..=3 {
        assert_replica_holds(&cluster, id, &written).await;
    }
    for (key, content) in &written {
        assert_eq!(
            &get(&cluster, "default", key.as_bytes()).await.unwrap(),
            content
        );
    }
    cluster.shutdown().await;
}

/// A fixed cluster's node whose disk is replaced starts again under its
/// id on an empty directory: its replica founds the shard again and holds
/// its votes (`replica/votes.rs`) until a snapshot and the log have caught
/// it up, then votes again — with the leader stopped, it and the third node
/// elect one of them and every write reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_started_again_on_a_new_disk_catches_up_then_votes_again() {
    let mut cluster = TestCluster::start(3, 1, |c| c.raft.compact_log_entries = 16).await;
    let mut written = write_keys(&cluster, "before", 40, 0, 4_000).await;
    let leader = wait_leader(&cluster, 1).await;
    let lost = leader % 3 + 1;
    assert_eq!(
        replica_status(&cluster, lost, 1)
            .await
            .map(|r| r.votes_held),
        Some(false),
        "a replica that caught up long ago holds nothing"
    );
    cluster.stop(lost).await;
    std::fs::remove_dir_all(&cluster.configs[&lost].data_dir).unwrap();
    written.extend(write_keys(&cluster, "while-away", 60, 100, 4_000).await);

    cluster.restart(lost).await;
    let status = replica_status(&cluster, lost, 1).await.unwrap();
    assert!(
        status.votes_held || status.applied_index > 20,
        "founded again, it holds its votes until it catches up: {status:?}"
    );
    wait_caught_up(&cluster, lost, 1).await;
    assert!(
        cluster.running[&lost].node.metrics.snapshots_received.get() >= 1,
        "caught up without a snapshot"
    );
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while replica_status(&cluster, lost, 1)
        .await
        .is_none_or(|r| r.votes_held)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "node {lost} caught up but still holds its votes"
        );
        put(&cluster, "default", b"nudge", b"n").await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_replica_holds(&cluster, lost, &written).await;

    let leader = wait_leader(&cluster, 1).await;
    cluster.stop(leader).await;
    written.extend(write_keys(&cluster, "after", 20, 200, 4_000).await);
    let new = wait_leader(&cluster, 1).await;
    assert_ne!(new, leader);
    for (key, content) in &written {
        assert_eq!(
            &get(&cluster, "default", key.as_bytes()).await.unwrap(),
            content
        );
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_behind_a_compacted_log_is_caught_up_by_a_snapshot_over_grpc() {
    let mut cluster = TestCluster::start(3, 1, |c| c.raft.compact_log_entries = 16).await;
    put(&cluster, "default", b"first", b"1").await.unwrap();
    let leader = wait_leader(&cluster, 1).await;
    let away = leader % 3 + 1;
    cluster.stop(away).await;
    // An epoch drop it misses must come with the snapshot.
    drop_epochs(&cluster, leader, 2, 3).await;
    let written = write_keys(&cluster, "k", 150, 0, 8_000).await;
    // The log no longer reaches back to where the stopped replica was.
    let leader = wait_leader(&cluster, 1).await;
    // Compaction follows the Ready that applied the writes, and the status
    // is published after it: asked until it shows (10 s at most).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        let status = replica_status(&cluster, leader, 1).await.unwrap();
        if status.first_index > 20 || std::time::Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(
        status.first_index > 20,
        "the leader never compacted: {status:?}"
    );

    cluster.restart(away).await;
    wait_caught_up(&cluster, away, 1).await;
    let metrics = &cluster.running[&away].node.metrics;
    assert!(
        metrics.snapshots_received.get() >= 1,
        "caught up without a snapshot"
    );
    assert!(metrics.snapshot_bytes_received.get() > 150 * 8_000 / 2);
    assert_replica_holds(&cluster, away, &written).await;
    assert_replica_holds(&cluster, away, &[("first".into(), b"1".to_vec())]).await;
    let status = replica_status(&cluster, away, 1).await.unwrap();
    assert_eq!(
        (status.epoch, drop_bounds(&status)),
        (2, vec![(3, 2)]),
        "{status:?}"
    );
    // And it keeps following the log afterwards.
    put(&cluster, "default", b"last", b"2").await.unwrap();
    wait_caught_up(&cluster, away, 1).await;
    assert_replica_holds(&cluster, away, &[("last".into(), b"2".to_vec())]).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_moved_to_a_new_node_through_admin_calls() {
    // Four nodes; the shard starts on 1, 2 and 3.
    let cluster = TestCluster::start(4, 1, |c| {
        if let Some(static_cluster) = c.cluster.as_mut() {
            static_cluster.replicas = vec![1, 2, 3];
        }
    })
    .await;
    assert!(replica_status(&cluster, 4, 1).await.is_none());
    let mut written = write_keys(&cluster, "m", 30, 0, 5_000).await;
    let leader = wait_leader(&cluster, 1).await;
    let info = cluster.running[&leader].node.map().shards[0].clone();

    // Node 4 opens an empty replica that waits to be added.
    let opened = cluster
        .admin(4)
        .await
        .open_replica(OpenReplicaRequest {
            shard: Some(info.clone()),
            bootstrap: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!opened.already_open);

    let change = |change: MembershipChange, node_id: u64, expected: u64| ChangeMembershipRequest {
        shard_id: 1,
        change: change as i32,
        node_id,
        expected_conf_version: expected,
    };
    // A stale conf_version is refused.
    let conf = replica_status(&cluster, leader, 1)
        .await
        .unwrap()
        .conf_version;
    let status = cluster
        .admin(leader)
        .await
        .change_membership(change(MembershipChange::AddLearner, 4, conf + 7))
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::Conflict);
    // Promoting a node that is not a learner is refused.
    let status = cluster
        .admin(leader)
        .await
        .change_membership(change(MembershipChange::Promote, 4, conf))
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::Conflict);

    let added = cluster
        .admin(leader)
        .await
        .change_membership(change(MembershipChange::AddLearner, 4, conf))
        .await
        .unwrap()
        .into_inner()
        .shard
        .unwrap();
    assert!(added.conf_version > conf);
    wait_caught_up(&cluster, 4, 1).await;
    let promoted = cluster
        .admin(leader)
        .await
        .change_membership(change(MembershipChange::Promote, 4, added.conf_version))
        .await
        .unwrap()
        .into_inner()
        .shard
        .unwrap();
    assert_eq!(promoted.replicas.len(), 4);

    // Leadership to node 4, then node 1 leaves. Raft abandons a transfer
    // the target does not finish within an election timeout (on a loaded
    // machine it may not), so the test asks again every two seconds, the
    // way the coordinator does on each reconcile pass.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut asked_at: Option<tokio::time::Instant> = None;
    while !replica_status(&cluster, 4, 1).await.unwrap().is_leader {
        let now = tokio::time::Instant::now();
        assert!(now < deadline, "leadership never moved to node 4");
        if asked_at.is_none_or(|at| now - at > std::time::Duration::from_secs(2)) {
            let current = wait_leader(&cluster, 1).await;
            // The old leader may have just stepped down; ask again next turn.
            let _ = cluster
                .admin(current)
                .await
                .transfer_leader(TransferLeaderRequest {
                    shard_id: 1,
                    to_node: 4,
                })
                .await;
            asked_at = Some(now);
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let removed = cluster
        .admin(4)
        .await
        .change_membership(change(MembershipChange::Remove, 1, promoted.conf_version))
        .await
        .unwrap()
        .into_inner()
        .shard
        .unwrap();
    assert!(removed.replicas.iter().all(|r| r.node_id != 1));
    cluster
        .admin(1)
        .await
        .close_replica(CloseReplicaRequest {
            shard_id: 1,
            map_version: 0,
            node_id: 0,
            conf_version: 0,
        })
        .await
        .unwrap();
    assert!(replica_status(&cluster, 1, 1).await.is_none());
    assert!(!cluster.configs[&1].data_dir.join("shards/1").exists());

    // Writes go on with the new membership, and everything is on node 4.
    put(&cluster, "default", b"after-move", b"ok")
        .await
        .unwrap();
    written.push(("after-move".into(), b"ok".to_vec()));
    for id in 2..=4 {
        wait_caught_up(&cluster, id, 1).await;
        assert_replica_holds(&cluster, id, &written).await;
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_entries_act_on_every_replica() {
    use tidepool_proto::v1::{
        AdvanceEpochOp, DropEpochsOp, ProposeAdminRequest, TouchRequest, propose_admin_request,
    };
    // And a namespace keeping 3 epochs.
    let cluster = TestCluster::start(3, 1, |c| {
        if let Some(cluster) = c.cluster.as_mut() {
            cluster
                .namespaces
                .push(tidepool_node::config::NamespaceSpec {
                    name: "long".into(),
                    id: 4,
                    content_addressed: false,
                    retain_epochs: Some(3),
                });
        }
    })
    .await;
    put(&cluster, "ci", b"old", b"written in epoch 1")
        .await
        .unwrap();
    put(&cluster, "ci", b"kept", b"touched in epoch 2")
        .await
        .unwrap();
    put(&cluster, "ci", b"batch", b"touched by batch-exists")
        .await
        .unwrap();
    let leader = wait_leader(&cluster, 1).await;
    let follower = leader % 3 + 1;
    let admin = |op| ProposeAdminRequest {
        shard_id: 1,
        op: Some(op),
    };

    // Only the leader proposes; an empty request is refused.
    let status = cluster
        .admin(follower)
        .await
        .propose_admin(admin(propose_admin_request::Op::AdvanceEpoch(
            AdvanceEpochOp { epoch: 2 },
        )))
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::NotLeader);
    let status = cluster
        .admin(leader)
        .await
        .propose_admin(ProposeAdminRequest {
            shard_id: 1,
            op: None,
        })
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::InvalidArgument);
    // A durable namespace's blobs are never dropped; an unknown one is not
    // found.
    for (namespace_id, expected) in [
        (1, ErrorCode::InvalidArgument),
        (99, ErrorCode::NamespaceNotFound),
    ] {
        let status = cluster
            .admin(leader)
            .await
            .propose_admin(admin(propose_admin_request::Op::DropEpochs(DropEpochsOp {
                namespace_id,
                below: 1,
            })))
            .await
            .unwrap_err();
        assert_eq!(
            code(&status),
            expected,
            "namespace {namespace_id}: {status:?}"
        );
    }
    // Dropping the current epoch's data is refused.
    let status = cluster
        .admin(leader)
        .await
        .propose_admin(admin(propose_admin_request::Op::DropEpochs(DropEpochsOp {
            namespace_id: 3,
            below: 2,
        })))
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::InvalidArgument);

    let advanced = cluster
        .admin(leader)
        .await
        .propose_admin(admin(propose_admin_request::Op::AdvanceEpoch(
            AdvanceEpochOp { epoch: 2 },
        )))
        .await
        .unwrap()
        .into_inner();
    assert!(advanced.raft_index > 1);
    // A drop the node's own map does not allow (at epoch 2, a namespace
    // keeping 3 epochs drops nothing yet): a coordinator computing with an
    // older, shorter retention is refused.
    let status = cluster
        .admin(leader)
        .await
        .propose_admin(admin(propose_admin_request::Op::DropEpochs(DropEpochsOp {
            namespace_id: 4,
            below: 2,
        })))
        .await
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::Conflict, "{status:?}");
    let touched = cluster
        .client(leader)
        .await
        .touch(TouchRequest {
            blob: grpc_support::blob("ci", b"kept"),
            ..TouchRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(touched.epoch, 2);
    assert!(touched.recorded, "a blob of epoch 1 moves through the log");
    let again = cluster
        .client(leader)
        .await
        .touch(TouchRequest {
            blob: grpc_support::blob("ci", b"kept"),
            ..TouchRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.epoch, 2);
    assert!(
        !again.recorded,
        "a blob already in the current epoch is answered without a log entry"
    );
    let presence = cluster
        .client(leader)
        .await
        .batch_exists(tidepool_proto::v1::BatchExistsRequest {
            namespace: "ci".into(),
            keys: vec![b"batch".to_vec(), b"missing".to_vec()],
            touch: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .presence;
    use tidepool_proto::v1::Presence;
    assert_eq!(
        presence,
        vec![Presence::Present as i32, Presence::Absent as i32]
    );
    put(&cluster, "ci", b"new", b"written in epoch 2")
        .await
        .unwrap();
    cluster
        .admin(leader)
        .await
        .propose_admin(admin(propose_admin_request::Op::DropEpochs(DropEpochsOp {
            namespace_id: 3,
            below: 2,
        })))
        .await
        .unwrap();

    for id in 1..=3 {
        wait_caught_up(&cluster, id, 1).await;
        // The status a node publishes may lag its apply by a moment (the
        // leader's commit index waited for above too): asked until the
        // drop shows, 10 s at most.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let status = replica_status(&cluster, id, 1).await.unwrap();
            let seen = (status.epoch, drop_bounds(&status));
            if seen == (2, vec![(3, 2)]) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "node {id}: {seen:?} 10 s after the drop"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let status = get_on(&cluster, id, "ci", b"old", ReadConsistency::AnyReplica)
            .await
            .unwrap_err();
        assert_eq!(
            code(&status),
            ErrorCode::NotFound,
            "node {id} kept an expired blob"
        );
        assert_replica_holds_in(
            &cluster,
            id,
            "ci",
            &[
                ("kept".into(), b"touched in epoch 2".to_vec()),
                ("new".into(), b"written in epoch 2".to_vec()),
                ("batch".into(), b"touched by batch-exists".to_vec()),
            ],
        )
        .await;
    }
    cluster.shutdown().await;
}

/// The coordinator raises the map's epoch, then asks each shard to advance
/// in turn: a shard still behind stamps what it is asked to write or touch
/// meanwhile with the map's epoch, not its own. Stamped with its own, a
/// blob written in the cluster's epoch 2 counted as one of epoch 1, and the
/// drop that followed (a namespace keeping one epoch) took it at once.
/// And a drop compacts the log, however short: an idle shard's expired
/// blobs stayed on disk while the log still spanned their segments.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shard_behind_the_map_epoch_stamps_writes_with_the_map_epoch() {
    use tidepool_proto::v1::{BatchExistsRequest, HeadRequest, Presence, TouchRequest};
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    for key in ["expires", "touched", "found"] {
        put(&cluster, "ci", key.as_bytes(), b"written in epoch 1")
            .await
            .unwrap();
    }
    for id in 1..=3 {
        let node = &cluster.running[&id].node;
        let mut advanced = (*node.map()).clone();
        advanced.version += 1;
        advanced.epoch = 2;
        node.set_map(advanced);
    }
    let leader = wait_leader(&cluster, 1).await;
    assert_eq!(
        replica_status(&cluster, leader, 1).await.unwrap().epoch,
        1,
        "the shard has not advanced"
    );
    put(&cluster, "ci", b"written", b"written in epoch 2")
        .await
        .unwrap();
    let touched = cluster
        .client(leader)
        .await
        .touch(TouchRequest {
            blob: grpc_support::blob("ci", b"touched"),
            ..TouchRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((touched.epoch, touched.recorded), (2, true));
    let presence = cluster
        .client(leader)
        .await
        .batch_exists(BatchExistsRequest {
            namespace: "ci".into(),
            keys: vec![b"found".to_vec()],
            touch: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .presence;
    assert_eq!(presence, vec![Presence::Present as i32]);
    let head = cluster
        .client(leader)
        .await
        .head(HeadRequest {
            blob: grpc_support::blob("ci", b"written"),
            ..HeadRequest::default()
        })
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap();
    assert_eq!((head.epoch, head.current_epoch), (2, 2));

    let mut first = Vec::new();
    for id in 1..=3 {
        wait_caught_up(&cluster, id, 1).await;
        first.push(replica_status(&cluster, id, 1).await.unwrap().first_index);
    }
    drop_epochs(&cluster, leader, 2, 3).await;
    for id in 1..=3 {
        wait_caught_up(&cluster, id, 1).await;
        // A drop compacts the log whatever its limits (a few entries
        // here): the expired blobs' segments are then no longer the log's.
        // A leader's compaction waits for its slowest follower to have the
        // drop (then at its next Ready: a heartbeat at the latest).
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let status = replica_status(&cluster, id, 1).await.unwrap();
            if status.first_index > first[id as usize - 1] {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "node {id}: the log still starts at {} 10 s after the drop",
                status.first_index
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let status = get_on(&cluster, id, "ci", b"expires", ReadConsistency::AnyReplica)
            .await
            .unwrap_err();
        assert_eq!(code(&status), ErrorCode::NotFound, "node {id}");
        assert_replica_holds_in(
            &cluster,
            id,
            "ci",
            &[
                ("written".into(), b"written in epoch 2".to_vec()),
                ("touched".into(), b"written in epoch 1".to_vec()),
                ("found".into(), b"written in epoch 1".to_vec()),
            ],
        )
        .await;
    }
    cluster.shutdown().await;
}

/// A leader stopped on purpose hands its leadership over first: with an
/// election timeout of 5 s no election can be held in the test's bound, yet
/// another node leads as soon as the stop returns, and holds every write
/// the old leader acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_leader_hands_leadership_over() {
    let mut cluster = TestCluster::start(3, 1, |c| c.raft.election_ticks = 250).await;
    let mut written = write_keys(&cluster, "before", 20, 0, 1_000).await;
    let old = wait_leader(&cluster, 1).await;
    for id in 1..=3 {
        wait_caught_up(&cluster, id, 1).await;
    }
    cluster.stop(old).await;
    let stopped = tokio::time::Instant::now();
    let mut new = None;
    while stopped.elapsed() < std::time::Duration::from_millis(2_500) && new.is_none() {
        for id in (1..=3).filter(|id| *id != old) {
            if replica_status(&cluster, id, 1)
                .await
                .is_some_and(|r| r.is_leader)
            {
                new = Some(id);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let new = new.expect("no leader within 2.5 s of the stop: leadership was not handed over");
    written.extend(write_keys(&cluster, "after", 20, 100, 1_000).await);
    assert_replica_holds(&cluster, new, &written).await;
    cluster.shutdown().await;
}

/// A replica closed (and deleted) while a snapshot streams into it: the
/// transfer ends first, so the close succeeds and nothing of the replica is
/// left on disk, then or later. (The e2e soak once saw the deletion fail
/// with "Directory not empty": the transfer kept writing into the spare
/// slot while the directory was removed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_deleted_while_a_snapshot_streams_into_it_leaves_nothing() {
    let cluster = TestCluster::start(4, 1, |c| {
        c.raft.compact_log_entries = 16;
        if let Some(static_cluster) = c.cluster.as_mut() {
            static_cluster.replicas = vec![1, 2, 3];
        }
    })
    .await;
    // Enough that the transfer takes a while: 48 MiB.
    write_keys(&cluster, "big", 48, 0, 1 << 20).await;
    let leader = wait_leader(&cluster, 1).await;
    add_learner(&cluster, leader, 4).await;
    // The first chunk has arrived: the transfer is under way.
    let node = cluster.running[&4].node.clone();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while node.metrics.snapshot_bytes_received.get() == 0 {
        assert!(std::time::Instant::now() < deadline, "no snapshot came");
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let dir = cluster.configs[&4].data_dir.join("shards").join("1");
    assert!(dir.exists());
    let before = node.metrics.snapshot_bytes_received.get();
    let closed = tokio::task::block_in_place(|| node.close_replica(1, true));
    let received = node.metrics.snapshot_bytes_received.get();
    eprintln!(
        "snapshot bytes received: {before} when the close began, {received} when it returned"
    );
    assert!(matches!(closed, Ok(true)), "{closed:?}");
    assert!(!dir.exists(), "{} left", dir.display());
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(!dir.exists(), "{} made again", dir.display());
    assert_eq!(
        node.metrics.snapshot_bytes_received.get(),
        received,
        "the transfer went on after the close"
    );
    cluster.shutdown().await;
}

/// A replica that fails while a snapshot streams into its spare slot is
/// reopened only once the transfer ended: the opening empties the spare
/// slot, and a transfer going on under it used to write the rest of its
/// files and mark the slot complete without the ones deleted, so the
/// replica installed a snapshot missing segments (values then read
/// CORRUPT).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_failing_while_a_snapshot_streams_into_it_installs_it_whole() {
    let cluster = TestCluster::start(4, 1, |c| {
        c.raft.compact_log_entries = 16;
        if let Some(static_cluster) = c.cluster.as_mut() {
            static_cluster.replicas = vec![1, 2, 3];
        }
    })
    .await;
    // Enough that the transfer takes a while: 48 MiB over 1 MiB chunks.
    let written = write_keys(&cluster, "big", 48, 0, 1 << 20).await;
    let leader = wait_leader(&cluster, 1).await;
    add_learner(&cluster, leader, 4).await;
    let node = cluster.running[&4].node.clone();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while node.metrics.snapshot_bytes_received.get() == 0 {
        assert!(std::time::Instant::now() < deadline, "no snapshot came");
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    // The replica fails under the transfer: its engine stops (every call
    // then fails), and the owner reopens it from disk.
    node.shard(1).unwrap().engine().shutdown();
    wait_caught_up(&cluster, 4, 1).await;
    assert!(node.metrics.snapshots_received.get() >= 1);
    assert_replica_holds(&cluster, 4, &written).await;
    cluster.shutdown().await;
}

/// A snapshot stream whose connection goes silent mid-transfer (open, but
/// nothing more arrives: the source's host froze, or a middlebox lost the
/// flow) does not hold the learner's only transfer slot for ever: after
/// the idle bound the pull resumes on a new connection and the learner
/// catches up. Before the bound the transfer waited on the dead stream
/// until the replica closed, and every later snapshot was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_stream_gone_silent_is_resumed_on_a_new_connection() {
    use tidepool_testkit::proxy::Proxy;
    // Each node advertises (names as a snapshot's source) a proxy in front
    // of it; Raft traffic goes straight to the peers' ports.
    let ports: Vec<u16> = (0..4).map(|_| grpc_support::free_port()).collect();
    let mut proxies = Vec::new();
    for port in &ports {
        proxies.push(Proxy::start(format!("127.0.0.1:{port}").parse().unwrap()).await);
    }
    let advertised: Vec<String> = proxies
        .iter()
        .map(|p| format!("http://{}", p.address))
        .collect();
    let cluster = TestCluster::start(4, 1, |c| {
        let i = c.node_id as usize - 1;
        c.listen = format!("127.0.0.1:{}", ports[i]).parse().unwrap();
        c.advertise = Some(advertised[i].clone());
        c.raft.compact_log_entries = 16;
        if let Some(static_cluster) = c.cluster.as_mut() {
            static_cluster.replicas = vec![1, 2, 3];
            for peer in &mut static_cluster.peers {
                peer.address = format!("http://127.0.0.1:{}", ports[peer.id as usize - 1]);
            }
        }
    })
    .await;
    let written = write_keys(&cluster, "big", 24, 0, 1 << 20).await;
    let leader = wait_leader(&cluster, 1).await;
    // The first connection to carry 4 MiB from the leader goes silent.
    let source = &proxies[leader as usize - 1];
    source.black_hole_after(4 << 20);
    add_learner(&cluster, leader, 4).await;
    wait_caught_up(&cluster, 4, 1).await;
    assert_eq!(source.black_holed(), 1, "the transfer never went silent");
    let node = &cluster.running[&4].node;
    assert!(node.metrics.snapshots_received.get() >= 1);
    assert_replica_holds(&cluster, 4, &written).await;
    cluster.shutdown().await;
}

/// Engine files (segments, control) under a replica's spare slot.
fn engine_files(spare: &std::path::Path) -> usize {
    let mut found = 0;
    for sub in ["", "wal", "index"] {
        if let Ok(entries) = std::fs::read_dir(spare.join(sub)) {
            found += entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .filter(|e| e.file_name() != "SNAPSHOT")
                .count();
        }
    }
    found
}

/// A snapshot transfer that fails — its source cut off mid-stream — leaves
/// the learner's spare slot empty while no transfer runs. Its partial
/// files (up to a whole shard, sized in full when the transfer starts)
/// stayed until the next transfer, install or reopen: several shards'
/// failed transfers could fill a volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_snapshot_transfer_leaves_the_spare_slot_empty() {
    use tidepool_testkit::proxy::Proxy;
    let ports: Vec<u16> = (0..4).map(|_| grpc_support::free_port()).collect();
    let mut proxies = Vec::new();
    for port in &ports {
        proxies.push(Proxy::start(format!("127.0.0.1:{port}").parse().unwrap()).await);
    }
    let advertised: Vec<String> = proxies
        .iter()
        .map(|p| format!("http://{}", p.address))
        .collect();
    let cluster = TestCluster::start(4, 1, |c| {
        let i = c.node_id as usize - 1;
        c.listen = format!("127.0.0.1:{}", ports[i]).parse().unwrap();
        c.advertise = Some(advertised[i].clone());
        c.raft.compact_log_entries = 16;
        if let Some(static_cluster) = c.cluster.as_mut() {
            static_cluster.replicas = vec![1, 2, 3];
            for peer in &mut static_cluster.peers {
                peer.address = format!("http://127.0.0.1:{}", ports[peer.id as usize - 1]);
            }
        }
    })
    .await;
    let written = write_keys(&cluster, "big", 24, 0, 1 << 20).await;
    let leader = wait_leader(&cluster, 1).await;
    let source = &proxies[leader as usize - 1];
    // Slowly enough to be cut mid-stream.
    source.black_hole_after(4 << 20);
    add_learner(&cluster, leader, 4).await;
    let node = &cluster.running[&4].node;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while source.black_holed() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the transfer never began"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    source.block();
    let spare = node.shard(1).unwrap().store().spare_dir().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let receiving = |_: ()| async {
            replica_status(&cluster, 4, 1)
                .await
                .is_some_and(|r| r.receiving_snapshot)
        };
        if !receiving(()).await {
            let files = engine_files(&spare);
            if files == 0 && !receiving(()).await {
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the spare slot kept {} files with no transfer running",
            engine_files(&spare)
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Healed: the next transfer catches the learner up.
    source.unblock();
    wait_caught_up(&cluster, 4, 1).await;
    assert_replica_holds(&cluster, 4, &written).await;
    cluster.shutdown().await;
}

/// A linearizable get on a leader within its lease reads the engine on the
/// request's own thread (the lease gate, `replica/read.rs`, "Reads without
/// the owner"), and sees the write acknowledged just before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn linearizable_gets_on_the_lease_skip_the_owner_and_see_every_acknowledged_write() {
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    write_keys(&cluster, "warm", 1, 0, 100).await;
    let direct = |cluster: &TestCluster| -> u64 {
        cluster
            .running
            .values()
            .filter_map(|n| n.node.shard(1))
            .map(|shard| shard.stats().lease_reads_direct.get())
            .sum()
    };
    let before = direct(&cluster);
    for i in 0..200 {
        let key = format!("gate/{i}");
        let content = value(i, 300);
        put(&cluster, "default", key.as_bytes(), &content)
            .await
            .unwrap();
        let got = get(&cluster, "default", key.as_bytes()).await.unwrap();
        assert_eq!(got, content, "{key}");
    }
    let served = direct(&cluster) - before;
    assert!(
        served > 100,
        "{served} of 200 gets were served without the owner"
    );
    cluster.shutdown().await;
}

/// A node's Raft messages speak only in the groups it is a member of. A
/// heartbeat in shard 1 from node 99 — in no configuration of the group and
/// no replica of the shard in the map — with a higher term is dropped;
/// before, any node's certificate spoke in every group: it deposed the
/// leader, and forged appends could write into the shard. Nor does node
/// 99 pull the group's snapshots.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn raft_messages_from_a_node_outside_the_group_are_dropped() {
    use prost011::Message as _;
    use tidepool_proto::v1::raft_transport_client::RaftTransportClient;
    use tidepool_proto::v1::{RaftBatch, RaftEnvelope};
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    let leader = wait_leader(&cluster, 1).await;
    let before = replica_status(&cluster, leader, 1).await.unwrap();
    // A term no election of the members reaches in this test.
    let forged_term = before.term + 1_000;
    let mut forged = raft::eraftpb::Message {
        from: 99,
        to: leader,
        term: forged_term,
        ..Default::default()
    };
    forged.set_msg_type(raft::eraftpb::MessageType::MsgHeartbeat);
    let batch = RaftBatch {
        from_node: 99,
        to_node: leader,
        messages: vec![RaftEnvelope {
            shard_id: 1,
            message: forged.encode_to_vec(),
        }],
    };
    let summary = RaftTransportClient::connect(cluster.url(leader))
        .await
        .unwrap()
        .send(tokio_stream::iter(vec![batch]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((summary.delivered, summary.dropped), (0, 1));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // Not deposed by it (a term of its own, from an election of the
    // members on a loaded machine, is not what this checks).
    let after = replica_status(&cluster, leader, 1).await.unwrap();
    assert!(
        after.term < forged_term,
        "the forged term was taken: {after:?}"
    );
    // Nor does it pull the group's snapshots (before, any node's
    // certificate read any shard's, and kept its files pinned by pulling
    // again); a member's pull of a snapshot not offered is only told so.
    let mut raft = RaftTransportClient::connect(cluster.url(leader))
        .await
        .unwrap();
    let pull = |to_node: u64| tidepool_proto::v1::FetchSnapshotRequest {
        shard_id: 1,
        snapshot_id: 7,
        to_node,
        ..Default::default()
    };
    let status = raft.fetch_snapshot(pull(99)).await.map(|_| ()).unwrap_err();
    assert_eq!(code(&status), ErrorCode::PermissionDenied, "{status:?}");
    let member = if leader == 1 { 2 } else { 1 };
    let status = raft
        .fetch_snapshot(pull(member))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(code(&status), ErrorCode::SnapshotGone, "{status:?}");
    // The members still write.
    put(&cluster, "default", b"after the forged heartbeat", b"v")
        .await
        .unwrap();
    cluster.shutdown().await;
}

/// A CloseReplica decided on a map older than the node's, whose newer map
/// lists the replica, is refused (STALE_MAP) and deletes nothing: a
/// coordinator deposed or stalled since it decided must not delete a
/// replica the coordinator leading now added again. Meant for another node
/// id, it is refused too (NODE_NOT_FOUND); decided at an older
/// configuration than the replica's, which lists it, too (STALE_MAP: the
/// node's map lists a member added again only after the coordinator's next
/// round). Decided on the node's map (or a newer one) and configuration,
/// for this node, it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_decided_on_an_older_map_than_the_node_holds_deletes_nothing() {
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    put(&cluster, "default", b"kept", b"v").await.unwrap();
    let node = &cluster.running[&1].node;
    let decided = node.map().version;
    let mut newer = (*node.map()).clone();
    newer.version = decided + 1;
    node.set_map(newer);
    let refused = cluster
        .admin(1)
        .await
        .close_replica(CloseReplicaRequest {
            shard_id: 1,
            map_version: decided,
            node_id: 0,
            conf_version: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(
        tidepool_proto::error_detail(&refused).map(|d| d.code),
        Some(ErrorCode::StaleMap as i32),
        "{refused:?}"
    );
    assert!(replica_status(&cluster, 1, 1).await.is_some());
    assert!(cluster.configs[&1].data_dir.join("shards/1").exists());
    // Meant for another node (a dead one whose address this node took
    // over): refused, nothing deleted.
    let refused = cluster
        .admin(1)
        .await
        .close_replica(CloseReplicaRequest {
            shard_id: 1,
            map_version: decided + 1,
            node_id: 7,
            conf_version: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(
        tidepool_proto::error_detail(&refused).map(|d| d.code),
        Some(ErrorCode::NodeNotFound as i32),
        "{refused:?}"
    );
    assert!(replica_status(&cluster, 1, 1).await.is_some());
    // Decided at a configuration older than the replica's, which lists it
    // (added again since; the node's map may not show it yet): refused.
    // A change keeping node 1 a member moves the configuration on.
    let decided_conf = replica_status(&cluster, 1, 1).await.unwrap().conf_version;
    assert!(decided_conf > 0);
    let leader = wait_leader(&cluster, 1).await;
    let remove = if leader == 3 { 2 } else { 3 };
    cluster
        .admin(leader)
        .await
        .change_membership(ChangeMembershipRequest {
            shard_id: 1,
            change: MembershipChange::Remove as i32,
            node_id: remove,
            expected_conf_version: decided_conf,
        })
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let conf_version = loop {
        let now = replica_status(&cluster, 1, 1).await.unwrap().conf_version;
        if now > decided_conf {
            break now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the change applied on node 1"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let refused = cluster
        .admin(1)
        .await
        .close_replica(CloseReplicaRequest {
            shard_id: 1,
            map_version: decided + 1,
            node_id: 1,
            conf_version: decided_conf,
        })
        .await
        .unwrap_err();
    assert_eq!(
        tidepool_proto::error_detail(&refused).map(|d| d.code),
        Some(ErrorCode::StaleMap as i32),
        "{refused:?}"
    );
    assert!(replica_status(&cluster, 1, 1).await.is_some());
    cluster
        .admin(1)
        .await
        .close_replica(CloseReplicaRequest {
            shard_id: 1,
            map_version: decided + 1,
            node_id: 1,
            conf_version,
        })
        .await
        .unwrap();
    assert!(replica_status(&cluster, 1, 1).await.is_none());
    cluster.shutdown().await;
}

/// Membership changes that would leave a group without a voter — removing
/// its only voter, making it a learner — are refused (`CONFLICT`) when
/// asked, and the group goes on: raft-rs takes such a change as a
/// proposal and fails it only when it applies, and a replica failing in
/// the middle of a Ready lost entries. A voter is not made a learner
/// either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_leaving_a_group_no_voter_are_refused() {
    let cluster = TestCluster::start(1, 1, |_| {}).await;
    put(&cluster, "default", b"before", b"v").await.unwrap();
    let status = replica_status(&cluster, 1, 1).await.unwrap();
    for change in [MembershipChange::Remove, MembershipChange::AddLearner] {
        let refused = cluster
            .admin(1)
            .await
            .change_membership(ChangeMembershipRequest {
                shard_id: 1,
                change: change as i32,
                node_id: 1,
                expected_conf_version: status.conf_version,
            })
            .await
            .unwrap_err();
        assert_eq!(
            code(&refused),
            ErrorCode::Conflict,
            "{change:?}: {refused:?}"
        );
    }
    put(&cluster, "default", b"after", b"w").await.unwrap();
    assert_eq!(get(&cluster, "default", b"after").await.unwrap(), b"w");
    cluster.shutdown().await;
}

/// A put and a touch whose answers were lost, retried (same session and
/// sequence) after the cluster's epoch advanced, are answered in the new
/// epoch — and the blobs are stored there: the retry is a duplicate,
/// which applies nothing, so before they stayed in the epochs their first
/// copies applied in, and the drop that followed (a namespace keeping one
/// epoch) took both a retention early (a chunked upload's manifest, retried
/// so, went before its chunks).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_retried_after_an_epoch_advance_is_stored_in_the_epoch_it_is_answered_in() {
    use tidepool_proto::v1::{
        AdvanceEpochOp, BlobKind, HeadRequest, ProposeAdminRequest, PutHeader, PutRequest,
        TouchRequest, WriteSession, propose_admin_request::Op, put_request,
    };
    let cluster = TestCluster::start(3, 1, |_| {}).await;
    let advance = |epoch: u64| {
        let cluster = &cluster;
        async move {
            for id in 1..=3 {
                let node = &cluster.running[&id].node;
                let mut advanced = (*node.map()).clone();
                advanced.version += 1;
                advanced.epoch = epoch;
                node.set_map(advanced);
            }
            let leader = wait_leader(cluster, 1).await;
            cluster
                .admin(leader)
                .await
                .propose_admin(ProposeAdminRequest {
                    shard_id: 1,
                    op: Some(Op::AdvanceEpoch(AdvanceEpochOp { epoch })),
                })
                .await
                .unwrap();
        }
    };
    let session = |id: u8| WriteSession {
        id: vec![id; 16],
        sequence: 1,
        opens: true,
    };
    let session_put = |key: &'static [u8]| {
        let cluster = &cluster;
        async move {
            let leader = wait_leader(cluster, 1).await;
            let content = b"kept one epoch".to_vec();
            let messages = vec![
                PutRequest {
                    msg: Some(put_request::Msg::Header(PutHeader {
                        blob: grpc_support::blob("ci", key),
                        size: content.len() as u64,
                        kind: BlobKind::Data as i32,
                        session: Some(session(1)),
                        ..PutHeader::default()
                    })),
                },
                PutRequest {
                    msg: Some(put_request::Msg::Data(content.into())),
                },
            ];
            cluster
                .client(leader)
                .await
                .put(tokio_stream::iter(messages))
                .await
                .unwrap()
                .into_inner()
                .info
                .unwrap()
                .epoch
        }
    };
    let session_touch = |key: &'static [u8]| {
        let cluster = &cluster;
        async move {
            let leader = wait_leader(cluster, 1).await;
            let touched = cluster
                .client(leader)
                .await
                .touch(TouchRequest {
                    blob: grpc_support::blob("ci", key),
                    session: Some(session(2)),
                    ..TouchRequest::default()
                })
                .await
                .unwrap()
                .into_inner();
            (touched.epoch, touched.recorded)
        }
    };
    let stored_epoch = |key: &'static [u8]| {
        let cluster = &cluster;
        async move {
            let leader = wait_leader(cluster, 1).await;
            cluster
                .client(leader)
                .await
                .head(HeadRequest {
                    blob: grpc_support::blob("ci", key),
                    ..HeadRequest::default()
                })
                .await
                .unwrap()
                .into_inner()
                .info
                .unwrap()
                .epoch
        }
    };

    put(&cluster, "ci", b"touched", b"written in epoch 1")
        .await
        .unwrap();
    assert_eq!(session_put(b"put").await, 1);
    advance(2).await;
    assert_eq!(session_touch(b"touched").await, (2, true));
    advance(3).await;
    // The retries: duplicates, answered in epoch 3.
    assert_eq!(session_put(b"put").await, 3);
    assert_eq!(session_touch(b"touched").await, (3, true));
    assert_eq!(stored_epoch(b"put").await, 3);
    assert_eq!(stored_epoch(b"touched").await, 3);
    // The drop below 3 ("ci" keeps one epoch) keeps both, on every replica.
    let leader = wait_leader(&cluster, 1).await;
    drop_epochs(&cluster, leader, 3, 3).await;
    for id in 1..=3 {
        wait_caught_up(&cluster, id, 1).await;
        for key in [&b"put"[..], b"touched"] {
            get_on(&cluster, id, "ci", key, ReadConsistency::AnyReplica)
                .await
                .unwrap_or_else(|e| panic!("node {id}, {key:?}: {e:?}"));
        }
    }
}
