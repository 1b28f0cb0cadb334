//! What the coordinator reads back from etcd — the cluster map and the
//! node status records — fed well-formed inputs and thousands of mutants
//! (seeded; `FUZZ_SEED` replays, `FUZZ_CASES` runs more): a typed error,
//! never a panic or an allocation out of proportion to the input.

use prost::Message as _;
use tidepool_coordinator::schema::{decode_map, encode_map, new_map};
use tidepool_proto::v1::{NodeStatus, ReplicaStatus};
use tidepool_testkit::fuzz::{CountingAllocator, Decode, run_all};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[test]
fn stored_cluster_records_survive_hostile_bytes() {
    let status = NodeStatus {
        node_id: 2,
        address: "http://10.0.0.2:7400".into(),
        disk_used_bytes: 1 << 30,
        replicas: vec![ReplicaStatus {
            shard_id: 3,
            ..ReplicaStatus::default()
        }],
        ..NodeStatus::default()
    };
    let targets: Vec<(&str, Vec<Vec<u8>>, Decode)> = vec![
        (
            "cluster map",
            vec![
                encode_map(&new_map(8, 3, 4 << 20)),
                encode_map(&new_map(1, 1, 1 << 20)),
            ],
            Box::new(|b| decode_map(b).is_ok()),
        ),
        (
            "node status",
            vec![status.encode_to_vec()],
            Box::new(|b| NodeStatus::decode(b).is_ok()),
        ),
    ];
    run_all(targets);
}
