//! Real nodes on real sockets in one test process: start, stop and restart
//! them, and a small client that finds shard leaders by following
//! `NOT_LEADER` hints.

#![allow(dead_code, unused_imports)]

use std::collections::BTreeMap;
use std::time::Duration;

use tidepool_node::config::{NamespaceSpec, NodeConfig, Peer, StaticCluster};
use tidepool_node::server::{RunningNode, start};
use tidepool_proto::v1::blob_service_client::BlobServiceClient;
use tidepool_proto::v1::node_admin_client::NodeAdminClient;
use tidepool_proto::v1::{PutResponse, ReadConsistency};
use tidepool_testkit::grpc;
use tonic::transport::Channel;

pub use tidepool_testkit::free_port;

/// A cluster of nodes serving on loopback ports.
pub struct TestCluster {
    pub root: tempfile::TempDir,
    pub configs: BTreeMap<u64, NodeConfig>,
    pub running: BTreeMap<u64, RunningNode>,
}

impl TestCluster {
    /// `nodes` nodes founding `shards` shards (every node a replica of
    /// each), with namespaces `default` (id 1) and `cas` (id 2,
    /// content-addressed); `adjust` may change each configuration.
    pub async fn start(nodes: u64, shards: u32, adjust: impl Fn(&mut NodeConfig)) -> TestCluster {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_test_writer()
            .try_init();
        let root = tempfile::tempdir().unwrap();
        let ports: Vec<u16> = (0..nodes).map(|_| free_port()).collect();
        let peers: Vec<Peer> = (1..=nodes)
            .map(|id| Peer {
                id,
                address: format!("http://127.0.0.1:{}", ports[id as usize - 1]),
            })
            .collect();
        let mut configs = BTreeMap::new();
        for id in 1..=nodes {
            let mut config = NodeConfig::new(id);
            config.listen = format!("127.0.0.1:{}", ports[id as usize - 1])
                .parse()
                .unwrap();
            config.data_dir = root.path().join(format!("node-{id}"));
            config.raft.tick_ms = 20;
            config.engine.wal_segment_mib = 16;
            config.engine.index_segment_mib = 4;
            config.memory.budget_mib = 24;
            config.engine.cells = 64;
            config.cluster = Some(StaticCluster {
                shards,
                replicas: (1..=nodes).collect(),
                peers: peers.clone(),
                namespaces: vec![
                    NamespaceSpec {
                        name: "default".into(),
                        id: 1,
                        content_addressed: false,
                        retain_epochs: None,
                    },
                    NamespaceSpec {
                        name: "cas".into(),
                        id: 2,
                        content_addressed: true,
                        retain_epochs: None,
                    },
                    NamespaceSpec {
                        name: "ci".into(),
                        id: 3,
                        content_addressed: false,
                        retain_epochs: Some(1),
                    },
                ],
                tokens: Vec::new(),
            });
            adjust(&mut config);
            configs.insert(id, config);
        }
        let mut cluster = TestCluster {
            root,
            configs,
            running: BTreeMap::new(),
        };
        for id in 1..=nodes {
            cluster.restart(id).await;
        }
        cluster
    }

    /// Starts (or restarts) node `id` from its configuration and data.
    pub async fn restart(&mut self, id: u64) {
        let running = start(self.configs[&id].clone()).await.unwrap();
        self.running.insert(id, running);
    }

    /// Stops node `id` cleanly.
    pub async fn stop(&mut self, id: u64) {
        if let Some(running) = self.running.remove(&id) {
            running.stop().await.unwrap();
        }
    }

    pub fn url(&self, id: u64) -> String {
        format!("http://{}", self.configs[&id].listen)
    }

    pub async fn client(&self, id: u64) -> BlobServiceClient<Channel> {
        grpc::client(&self.url(id)).await
    }

    pub async fn admin(&self, id: u64) -> NodeAdminClient<Channel> {
        NodeAdminClient::connect(self.url(id)).await.unwrap()
    }

    pub async fn shutdown(mut self) {
        let ids: Vec<u64> = self.running.keys().copied().collect();
        for id in ids {
            self.stop(id).await;
        }
    }
}

pub use tidepool_testkit::grpc::{blob, code};

impl TestCluster {
    /// URLs of the running nodes.
    pub fn urls(&self) -> BTreeMap<u64, String> {
        self.running.keys().map(|id| (*id, self.url(*id))).collect()
    }
}

/// One put on node `id`.
pub async fn put_on(
    cluster: &TestCluster,
    id: u64,
    namespace: &str,
    key: &[u8],
    content: &[u8],
) -> Result<PutResponse, tonic::Status> {
    grpc::put_at(&cluster.url(id), namespace, key, content).await
}

/// A put routed to the shard leader.
pub async fn put(
    cluster: &TestCluster,
    namespace: &str,
    key: &[u8],
    content: &[u8],
) -> Result<PutResponse, tonic::Status> {
    grpc::put(&cluster.urls(), namespace, key, content).await
}

/// A whole-blob get on node `id`.
pub async fn get_on(
    cluster: &TestCluster,
    id: u64,
    namespace: &str,
    key: &[u8],
    consistency: ReadConsistency,
) -> Result<Vec<u8>, tonic::Status> {
    grpc::get_at(&cluster.url(id), namespace, key, consistency).await
}

/// A linearizable get routed to the leader.
pub async fn get(
    cluster: &TestCluster,
    namespace: &str,
    key: &[u8],
) -> Result<Vec<u8>, tonic::Status> {
    grpc::get(&cluster.urls(), namespace, key).await
}

/// Node `id`'s view of its replica of `shard`, if it hosts one.
pub async fn replica_status(
    cluster: &TestCluster,
    id: u64,
    shard: u32,
) -> Option<tidepool_proto::v1::ReplicaStatus> {
    let status = cluster
        .admin(id)
        .await
        .status(tidepool_proto::v1::NodeStatusRequest {})
        .await
        .ok()?
        .into_inner();
    status.replicas.into_iter().find(|r| r.shard_id == shard)
}

/// Waits (up to 20 s) for a running node to lead `shard`.
pub async fn wait_leader(cluster: &TestCluster, shard: u32) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        for id in cluster.running.keys() {
            if replica_status(cluster, *id, shard)
                .await
                .is_some_and(|r| r.is_leader)
            {
                return *id;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "shard {shard} has no leader"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (up to 30 s each time) until node `id` has applied everything the
/// leader of `shard` has committed — twice, 50 ms apart: a node publishes
/// its status after the Ready that applied an operation, so a commit index
/// read right after an acknowledged operation can predate it (a drop an
/// admin call had applied was then not yet on the node "caught up").
pub async fn wait_caught_up(cluster: &TestCluster, id: u64, shard: u32) {
    wait_applied_to_commit(cluster, id, shard).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    wait_applied_to_commit(cluster, id, shard).await;
}

/// Waits (up to 30 s) until node `id` has applied everything the leader
/// of `shard` has committed, as their published statuses say.
async fn wait_applied_to_commit(cluster: &TestCluster, id: u64, shard: u32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let leader = wait_leader(cluster, shard).await;
        let target = replica_status(cluster, leader, shard)
            .await
            .map(|r| r.commit_index);
        let applied = replica_status(cluster, id, shard)
            .await
            .map(|r| r.applied_index);
        if let (Some(target), Some(applied)) = (target, applied)
            && applied >= target
        {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            let lagging = replica_status(cluster, id, shard).await;
            let leading = replica_status(cluster, leader, shard).await;
            for (n, running) in &cluster.running {
                eprintln!(
                    "node {n}: raft messages dropped {}",
                    running.node.metrics.raft_messages_dropped.get()
                );
            }
            panic!(
                "node {id} did not catch up on shard {shard}: {lagging:?}; leader {leader}: {leading:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
