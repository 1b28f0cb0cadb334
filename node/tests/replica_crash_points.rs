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
use tidepool_node::replica::ReplicaConfig;
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

#[test]
fn every_crash_point_of_a_snapshot_install_keeps_committed_writes() {
    let seed = tidepool_testkit::seed_from_env("CRASH_POINT_SEED");
    let mut crashed = 0;
    let points: Vec<u64> = (1..=30).chain((32..=120).step_by(8)).collect();
    for &point in &points {
        let mut config = ReplicaConfig::new(0, 0);
        config.compact_log_entries = 32;
        let mut cluster = SimCluster::with_config(seed ^ point, 3, config);
        let mut writes = Writes::new();
        let leader = elect(&mut cluster);
        write_for(&mut cluster, &mut writes, 5);
        let victim = leader % 3 + 1;
        cluster.partition(&[victim]);
        write_for(&mut cluster, &mut writes, 40);
        // The victim comes back needing a snapshot and fails at its
        // `point`-th storage operation from here: while emptying its spare
        // slot, writing the files, marking them complete, opening them,
        // persisting its Raft state, flipping the slot or cleaning up.
        let storage = cluster.storage(victim);
        storage.crash_at_op(storage.ops() + point);
        cluster.heal();
        write_for(&mut cluster, &mut writes, 20);
        if !cluster.is_up(victim) {
            crashed += 1;
        }
        if point % 2 == 0 {
            cluster.power_off(victim);
        } else {
            cluster.kill(victim);
        }
        cluster
            .restart(victim)
            .unwrap_or_else(|e| panic!("seed {seed}, point {point}: restart: {e}"));
        write_for(&mut cluster, &mut writes, 10);
        assert_converged(
            &mut cluster,
            &writes,
            &format!("crash point {point} of a snapshot install"),
        );
    }
    println!(
        "seed {seed}: {} crash points, {crashed} of them reached before the planned stop",
        points.len()
    );
    assert!(
        crashed > points.len() / 2,
        "most crash points must be reached"
    );
}
