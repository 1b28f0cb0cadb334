//! Crash tests: a replica (leader or follower) fails at the N-th storage
//! operation of its engine — in the middle of appending entries, persisting
//! hard state, committing or applying — for every N in a range; it then
//! comes back after a process kill or a power loss (torn unsynced sectors)
//! while the others keep writing. Checked after each: no acknowledged
//! (committed) write is lost and all replicas applied the same state.
//!
//! Prints its seed; replay with `CRASH_POINT_SEED=<seed>`.

mod support;

use support::{Writes, assert_converged, elect, write_for};
use tidepool_engine::Durability;
use tidepool_node::sim::SimCluster;

#[test]
fn every_crash_point_of_a_replica_keeps_committed_writes() {
    let seed = tidepool_testkit::seed_from_env("CRASH_POINT_SEED");
    let mut crashed = 0;
    for point in 1..=48u64 {
        let mut cluster = SimCluster::new(seed ^ point, 3, Durability::Synced);
        let mut writes = Writes::new();
        let leader = elect(&mut cluster);
        write_for(&mut cluster, &mut writes, 5);
        let victim = if point % 2 == 0 {
            leader
        } else {
            leader % 3 + 1
        };
        let storage = cluster.storage(victim);
        storage.crash_at_op(storage.ops() + point / 2 + 1);
        write_for(&mut cluster, &mut writes, 30);
        if !cluster.is_up(victim) {
            crashed += 1;
        }
        if point % 4 < 2 {
            cluster.power_off(victim);
        } else {
            cluster.kill(victim);
        }
        write_for(&mut cluster, &mut writes, 20);
        cluster
            .restart(victim)
            .unwrap_or_else(|e| panic!("seed {seed}, point {point}: restart: {e}"));
        write_for(&mut cluster, &mut writes, 10);
        let role = if victim == leader {
            "leader"
        } else {
            "follower"
        };
        assert_converged(
            &mut cluster,
            &writes,
            &format!("crash point {point} on the {role}"),
        );
    }
    println!("seed {seed}: 48 crash points, {crashed} of them reached before the planned stop");
    assert!(crashed > 30, "most crash points must be reached");
}
