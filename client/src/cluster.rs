//! The cached cluster map and connections: fetched from a coordinator,
//! kept current by a watch, refreshed on demand; one channel per address.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tidepool_proto::v1::coordinator_service_client::CoordinatorServiceClient;
use tidepool_proto::v1::{
    ClusterMap, ErrorCode, GetClusterMapRequest, Namespace, ShardInfo, WatchClusterMapRequest,
};
use tidepool_proto::{hash_position, storage_key};
use tidepool_security::{Channel, Security};
use tokio::sync::watch;

use crate::error::{Error, Result};

/// Largest gRPC message the SDK accepts (a node sends up to 1 MiB of data
/// per message; manifests and maps are small).
pub(crate) const MAX_MESSAGE: usize = 64 << 20;

/// Shared state behind every clone of a `Client`.
pub(crate) struct Cluster {
    pub seeds: Vec<String>,
    pub connect_timeout: Duration,
    map: watch::Sender<Arc<ClusterMap>>,
    channels: Mutex<HashMap<String, Channel>>,
    security: Security,
}

/// Where a key goes.
pub(crate) struct Route {
    pub shard: ShardInfo,
}

impl Cluster {
    pub fn new(seeds: Vec<String>, connect_timeout: Duration, security: Security) -> Arc<Self> {
        Arc::new(Self {
            security,
            seeds,
            connect_timeout,
            map: watch::Sender::new(Arc::new(ClusterMap::default())),
            channels: Mutex::new(HashMap::new()),
        })
    }

    /// The cached map.
    pub fn map(&self) -> Arc<ClusterMap> {
        self.map.borrow().clone()
    }

    fn install(&self, map: ClusterMap) {
        self.map.send_if_modified(|current| {
            if map.version > current.version {
                *current = Arc::new(map);
                true
            } else {
                false
            }
        });
    }

    /// A channel to `address` (created lazily, reused).
    pub fn channel(&self, address: &str) -> Result<Channel> {
        let mut channels = self.channels.lock();
        if let Some(channel) = channels.get(address) {
            return Ok(channel.clone());
        }
        let endpoint = self
            .security
            .endpoint(address)
            .map_err(|e| {
                Error::new(
                    ErrorCode::InvalidArgument,
                    format!("bad address {address:?}: {e}"),
                )
            })?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true);
        let channel = self.security.connect_lazy(&endpoint);
        channels.insert(address.to_string(), channel.clone());
        Ok(channel)
    }

    /// A coordinator client for seed `i`.
    pub fn coordinator(&self, i: usize) -> Result<CoordinatorServiceClient<Channel>> {
        let seed = &self.seeds[i % self.seeds.len()];
        Ok(CoordinatorServiceClient::new(self.channel(seed)?))
    }

    /// Fetches the map from the first seed that answers.
    pub async fn refresh(&self) -> Result<Arc<ClusterMap>> {
        let mut last = None;
        for i in 0..self.seeds.len() {
            let mut coordinator = self.coordinator(i)?;
            let fetched = tokio::time::timeout(
                self.connect_timeout,
                coordinator.get_cluster_map(GetClusterMapRequest {}),
            )
            .await;
            match fetched {
                Ok(Ok(map)) => {
                    self.install(map.into_inner());
                    return Ok(self.map());
                }
                Ok(Err(status)) => {
                    // A refused credential is the answer, not a reason to
                    // try other seeds until the deadline.
                    if let crate::error::Disposition::Fail(error) = crate::error::classify(&status)
                        && matches!(
                            error.code(),
                            ErrorCode::Unauthenticated | ErrorCode::PermissionDenied
                        )
                    {
                        return Err(error);
                    }
                    last = Some(status.message().to_string());
                }
                Err(_) => last = Some(format!("no answer within {:?}", self.connect_timeout)),
            }
        }
        Err(Error::new(
            ErrorCode::Timeout,
            format!(
                "no coordinator answered ({}): {}",
                self.seeds.join(", "),
                last.unwrap_or_default()
            ),
        ))
    }

    /// Follows map versions until the last `Client` is dropped.
    pub fn spawn_watch(self: &Arc<Self>) {
        let weak: Weak<Cluster> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut seed = 0;
            let mut delay = Duration::from_millis(100);
            loop {
                let Some(cluster) = weak.upgrade() else {
                    return;
                };
                let after = cluster.map().version;
                let stream = match cluster.coordinator(seed) {
                    Ok(mut c) => c
                        .watch_cluster_map(WatchClusterMapRequest {
                            after_version: after,
                        })
                        .await
                        .ok(),
                    Err(_) => None,
                };
                drop(cluster);
                if let Some(stream) = stream {
                    let mut stream = stream.into_inner();
                    while let Ok(Some(map)) = stream.message().await {
                        let Some(cluster) = weak.upgrade() else {
                            return;
                        };
                        cluster.install(map);
                        delay = Duration::from_millis(100);
                    }
                }
                seed += 1;
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        });
    }

    /// The namespace named `name` in `map`.
    pub fn namespace(map: &ClusterMap, name: &str) -> Result<Namespace> {
        map.namespaces
            .iter()
            .find(|ns| ns.name == name)
            .cloned()
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::NamespaceNotFound,
                    format!("no namespace {name:?}"),
                )
            })
    }

    /// Where `(namespace, key)` lives in `map`.
    pub fn route(map: &ClusterMap, namespace: &str, key: &[u8]) -> Result<Route> {
        let namespace = Self::namespace(map, namespace)?;
        let storage = storage_key(namespace.id, key);
        let position = hash_position(&storage);
        let shard = map
            .shards
            .iter()
            .find(|s| s.hash_start <= position && position <= s.hash_end)
            .cloned()
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::ShardNotFound,
                    format!("the map has no shard for position {position:#018x}"),
                )
            })?;
        Ok(Route { shard })
    }

    /// Address of node `id` in `map`.
    pub fn address(map: &ClusterMap, id: u64) -> Option<String> {
        map.nodes
            .iter()
            .find(|n| n.node_id == id)
            .map(|n| n.address.clone())
    }
}
