//! An in-process cluster on real loopback sockets: a coordinator on the
//! embedded metadata store and nodes that register with it, each node in
//! its own directory. For tests of the SDK and the CLI.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tidepool_coordinator::meta::{EmbeddedStore, MetaStore};
use tidepool_coordinator::{CoordinatorConfig, RunningCoordinator, start_with_store};
use tidepool_node::config::{CoordinatorLink, NodeConfig};
use tidepool_node::server::RunningNode;
use tidepool_proto::v1::{ClusterMap, ReplicaRole};

/// A running cluster.
pub struct LocalCluster {
    /// The coordinator.
    pub coordinator: RunningCoordinator,
    /// The nodes, in start order (`None` once stopped).
    pub nodes: Vec<Option<RunningNode>>,
    /// The coordinator's URL (what clients connect to).
    pub url: String,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for LocalCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCluster")
            .field("url", &self.url)
            .finish()
    }
}

impl LocalCluster {
    /// A coordinator (`shards` shards, `replication` replicas each, fast
    /// reconcile) and `nodes` nodes; returns once every shard has its
    /// replicas and a leader.
    pub async fn start(nodes: usize, shards: u32, replication: u32) -> LocalCluster {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::in_memory());
        let mut config = CoordinatorConfig {
            listen: "127.0.0.1:0".parse().expect("address"),
            node_lease_ms: 1_500,
            leader_lease_ms: 1_500,
            reconcile_interval_ms: 100,
            ..CoordinatorConfig::default()
        };
        config.cluster.shards = shards;
        config.cluster.replication_factor = replication;
        config.cluster.max_value_bytes = 1 << 20;
        let coordinator = start_with_store(config, store)
            .await
            .expect("the coordinator starts");
        let url = format!("http://{}", coordinator.address);
        let mut cluster = LocalCluster {
            coordinator,
            nodes: Vec::new(),
            url,
            dir,
        };
        for _ in 0..nodes {
            cluster.add_node().await;
        }
        cluster.wait_settled(nodes).await;
        cluster
    }

    /// Starts one more node. Returns its index.
    pub async fn add_node(&mut self) -> usize {
        self.add_node_with(|_| {}).await
    }

    /// [`LocalCluster::add_node`] with `adjust` applied to the node's
    /// configuration.
    pub async fn add_node_with(&mut self, adjust: impl FnOnce(&mut NodeConfig)) -> usize {
        let i = self.nodes.len();
        let mut config = NodeConfig::new(0);
        config.listen = "127.0.0.1:0".parse().expect("address");
        config.data_dir = self.dir.path().join(format!("node-{i}"));
        config.raft.max_value_bytes = 1 << 20;
        config.raft.max_batch_bytes = 1 << 20;
        config.engine.wal_segment_mib = 8;
        config.memory.budget_mib = 20;
        config.coordinator = Some(CoordinatorLink {
            addresses: vec![self.url.clone()],
            zone: String::new(),
            capacity_bytes: 0,
        });
        adjust(&mut config);
        let node = tidepool_node::server::start(config)
            .await
            .expect("the node starts");
        self.nodes.push(Some(node));
        i
    }

    /// Stops node `i` cleanly.
    pub async fn stop_node(&mut self, i: usize) {
        if let Some(node) = self.nodes[i].take() {
            node.stop().await.expect("the node stops");
        }
    }

    /// The coordinator's current map.
    pub fn map(&self) -> Arc<ClusterMap> {
        self.coordinator.shared.map()
    }

    /// Node `i`'s data directory.
    pub fn node_dir(&self, i: usize) -> std::path::PathBuf {
        self.dir.path().join(format!("node-{i}"))
    }

    /// Waits (up to 60 s) until `nodes` nodes are registered and every
    /// shard has the replication factor in voters, a leader, and no move
    /// pending.
    pub async fn wait_settled(&self, nodes: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let map = self.map();
            let rf = map.replication_factor as usize;
            let placed = map.nodes.len() == nodes
                && map.shards.iter().all(|s| {
                    s.leader_hint != 0
                        && s.replicas.len() == rf
                        && s.replicas
                            .iter()
                            .all(|r| r.role == ReplicaRole::Voter as i32)
                });
            let idle = self.coordinator.shared.progress.lock().moves.is_empty();
            if placed && idle {
                return;
            }
            if Instant::now() >= deadline {
                let reports: Vec<String> = self
                    .nodes
                    .iter()
                    .flatten()
                    .map(|n| {
                        let status = n.node.status();
                        let replicas: Vec<String> = status
                            .replicas
                            .iter()
                            .map(|r| {
                                format!(
                                    "shard {} leader={} applied={} commit={} last={} first={} snapshot={}",
                                    r.shard_id,
                                    r.is_leader,
                                    r.applied_index,
                                    r.commit_index,
                                    r.last_index,
                                    r.first_index,
                                    r.receiving_snapshot
                                )
                            })
                            .collect();
                        format!("node {}: {}", status.node_id, replicas.join("; "))
                    })
                    .collect();
                panic!(
                    "the cluster did not settle: {map:?}\nmoves: {:?}\n{}",
                    self.coordinator.shared.progress.lock().moves,
                    reports.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops every node, then the coordinator.
    pub async fn stop(mut self) {
        for i in 0..self.nodes.len() {
            self.stop_node(i).await;
        }
        let _ = self.coordinator.stop().await;
    }
}
