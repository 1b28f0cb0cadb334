//! In-process clusters on the simulated network.

use tidepool_engine::Durability;

use crate::replica::Outcome;
use crate::sim::SimCluster;

fn key(i: u64) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    k[8..16].copy_from_slice(&i.to_le_bytes());
    k
}

#[test]
fn three_replicas_elect_a_leader_and_replicate_writes() {
    let mut cluster = SimCluster::new(1, 3, Durability::Synced);
    assert!(
        cluster.run_until(200, |c| c.leader().is_some()).unwrap(),
        "no leader elected"
    );
    let mut pending = Vec::new();
    for i in 0..50 {
        pending.push(cluster.put(key(i), vec![i as u8; 1000]));
    }
    assert!(
        cluster
            .run_until(200, |_| pending.iter().all(|p| p.lock().unwrap().is_some()))
            .unwrap()
    );
    for p in &pending {
        assert!(
            matches!(*p.lock().unwrap(), Some(Outcome::Applied { .. })),
            "{:?}",
            p.lock().unwrap()
        );
    }
    cluster.run(20).unwrap();
    for id in cluster.ids() {
        let replica = cluster.replica(id).unwrap();
        let engine = replica.engine().clone();
        let space = engine.key_space("blobs").unwrap();
        for i in 0..50 {
            assert_eq!(
                engine.get(space, &key(i)).unwrap().as_deref(),
                Some(&vec![i as u8; 1000][..]),
                "node {id} key {i}"
            );
        }
    }
}
