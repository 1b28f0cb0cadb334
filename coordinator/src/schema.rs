//! The key schema in the metadata store, and the cluster map's encoding.
//!
//! Every key starts with the configured prefix (`/tidepool/` by default):
//!
//! | key | value | lease | written by |
//! |---|---|---|---|
//! | `map` | the `ClusterMap`, protobuf | none | the leader, compare-and-swap on its revision and the leader key |
//! | `leader` | `LeaderRecord`, JSON | the leader's | the election |
//! | `nodes/<id>` | the node's last `NodeStatus`, protobuf | the node's heartbeat lease | any coordinator, on a heartbeat |
//! | `epoch_started` | unix milliseconds when the current epoch began, decimal | none | the leader, in the same transaction as the map |
//!
//! The map is one key, so every change is one compare-and-swap and the
//! version in it rises by exactly one per write. Liveness is the presence
//! of `nodes/<id>`: its lease expires when heartbeats stop.

use prost::Message as _;
use serde::{Deserialize, Serialize};
use tidepool_proto::v1::{
    ClusterMap, Namespace, Retention, ShardInfo, retention::Durable, retention::Policy,
};

use crate::CoordinatorError;

/// Key names under one prefix.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `prefix` (which ends with '/').
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_string(),
        }
    }

    /// The cluster map.
    pub fn map(&self) -> String {
        format!("{}map", self.prefix)
    }

    /// The leader record.
    pub fn leader(&self) -> String {
        format!("{}leader", self.prefix)
    }

    /// Prefix of the node liveness keys.
    pub fn nodes(&self) -> String {
        format!("{}nodes/", self.prefix)
    }

    /// Liveness key of node `id`.
    pub fn node(&self, id: u64) -> String {
        format!("{}nodes/{id}", self.prefix)
    }

    /// When the current epoch began.
    pub fn epoch_started(&self) -> String {
        format!("{}epoch_started", self.prefix)
    }

    /// Prefix of the records of nodes refused as another cluster's.
    pub fn refused(&self) -> String {
        format!("{}refused/", self.prefix)
    }

    /// The record of node `node_id` of cluster `cluster_id`, refused.
    pub fn refused_node(&self, cluster_id: &str, node_id: u64) -> String {
        format!("{}refused/{cluster_id}/{node_id}", self.prefix)
    }
}

/// A node refused as another cluster's (`WRONG_CLUSTER`), as stored under
/// `refused/` for a minute (its lease), so that every coordinator of the
/// store lists it, not only the one it called.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusedRecord {
    /// Its id in its cluster.
    pub node_id: u64,
    /// Where it serves, as it said.
    pub address: String,
    /// The cluster its data belongs to.
    pub cluster_id: String,
    /// When it was refused (ms since the Unix epoch, the writer's clock).
    pub at_ms: u64,
}

/// Who leads, as stored under `leader`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderRecord {
    /// The coordinator's id.
    pub id: String,
    /// Where it serves.
    pub address: String,
}

/// Decodes a stored map.
pub fn decode_map(bytes: &[u8]) -> Result<ClusterMap, CoordinatorError> {
    ClusterMap::decode(bytes)
        .map_err(|e| CoordinatorError::Corrupt(format!("stored cluster map: {e}")))
}

/// Encodes a map for storage.
pub fn encode_map(map: &ClusterMap) -> Vec<u8> {
    map.encode_to_vec()
}

/// Durable retention.
pub fn durable() -> Retention {
    Retention {
        policy: Some(Policy::Durable(Durable {})),
    }
}

/// The epochs a namespace keeps, or `None` when durable.
pub fn retained_epochs(namespace: &Namespace) -> Option<u32> {
    match namespace.retention.as_ref().and_then(|r| r.policy.as_ref()) {
        Some(Policy::Retain(retain)) => Some(retain.epochs),
        _ => None,
    }
}

/// A new cluster's map (version 1): `shards` even ranges of the hash space
/// with no replicas yet, no nodes, epoch 1, and the `default` namespace.
pub fn new_map(shards: u32, replication_factor: u32, max_value_bytes: u64) -> ClusterMap {
    let shard_infos = tidepool_proto::even_shard_ranges(shards)
        .into_iter()
        .zip(1..)
        .map(|((start, end), shard_id)| ShardInfo {
            shard_id,
            hash_start: start,
            hash_end: end,
            replicas: Vec::new(),
            leader_hint: 0,
            conf_version: 0,
            split: None,
        })
        .collect();
    ClusterMap {
        version: 1,
        next_shard_id: shards + 1,
        next_namespace_id: 2,
        cluster_id: format!("{:016x}", rand::random::<u64>()),
        epoch: 1,
        replication_factor,
        max_value_bytes,
        nodes: Vec::new(),
        shards: shard_infos,
        namespaces: vec![Namespace {
            name: "default".into(),
            id: 1,
            content_addressed: false,
            retention: Some(durable()),
            created_epoch: 1,
        }],
        tokens: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_map_covers_the_hash_space_without_gaps() {
        for shards in [1, 2, 3, 7, 16, 1000] {
            let map = new_map(shards, 3, 1 << 20);
            assert_eq!(map.shards.len(), shards as usize);
            assert_eq!(map.shards[0].hash_start, 0);
            assert_eq!(map.shards.last().unwrap().hash_end, u64::MAX);
            for pair in map.shards.windows(2) {
                assert_eq!(pair[0].hash_end + 1, pair[1].hash_start, "{shards} shards");
            }
        }
    }

    #[test]
    fn maps_survive_encoding() {
        let map = new_map(4, 3, 1 << 20);
        assert_eq!(decode_map(&encode_map(&map)).unwrap(), map);
        assert!(decode_map(b"\xff\xff\xff").is_err());
    }
}
