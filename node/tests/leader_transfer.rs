//! Leadership transfers on the simulated network: a leader refuses to hand
//! leadership to a voter it cannot hear or that lags; proposals arriving
//! while a transfer is pending are held, not refused with a wrong hint —
//! proposed once the transfer aborts, answered `NotLeader` naming the new
//! leader once it completes.
//!
//! Prints its seed; replay with `CLUSTER_SEED=<seed>`.

mod support;

use support::{elect, key, value};
use tidepool_engine::Durability;
use tidepool_node::replica::Outcome;
use tidepool_node::sim::{Pending, SimCluster};

fn followers(cluster: &SimCluster, leader: u64) -> (u64, u64) {
    let others: Vec<u64> = cluster.ids().into_iter().filter(|i| *i != leader).collect();
    (others[0], others[1])
}

fn outcome(slot: &Pending) -> Option<Outcome> {
    slot.lock().unwrap().clone()
}

#[test]
fn a_transfer_to_a_voter_the_leader_cannot_hear_is_refused() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::new(seed, 3, Durability::Synced);
    let leader = elect(&mut cluster);
    let (cut_off, other) = followers(&cluster, leader);
    // Everything is healthy: a transfer to a caught-up voter is accepted.
    cluster.run(5).unwrap();
    cluster
        .replica(leader)
        .unwrap()
        .transfer_leader(other)
        .unwrap();
    assert!(
        cluster
            .run_until(100, |c| c.leader() == Some(other))
            .unwrap(),
        "seed {seed}: the accepted transfer completed"
    );
    let leader = other;
    // Cut one follower's answers only: the leader's messages still reach it.
    cluster.cut_one_way(cut_off, leader);
    cluster.run(10).unwrap();
    let refused = cluster.replica(leader).unwrap().transfer_leader(cut_off);
    let reason = refused.expect_err("the leader cannot hear it");
    assert!(reason.contains("has not answered"), "seed {seed}: {reason}");
    // Writes go on through the transfer that never started.
    let slot = cluster.put(key(1), value(1));
    cluster.run_until(50, |_| outcome(&slot).is_some()).unwrap();
    assert!(
        matches!(outcome(&slot), Some(Outcome::Applied { .. })),
        "seed {seed}: {:?}",
        outcome(&slot)
    );
    assert_eq!(cluster.leader(), Some(leader));
    // Not a voter, not the leader: refused too.
    assert!(cluster.replica(leader).unwrap().transfer_leader(9).is_err());
    assert!(
        cluster
            .replica(cut_off)
            .unwrap()
            .transfer_leader(leader)
            .is_err()
    );
}

#[test]
fn proposals_during_a_transfer_that_aborts_are_held_then_applied() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::new(seed, 3, Durability::Synced);
    let leader = elect(&mut cluster);
    let (target, _) = followers(&cluster, leader);
    cluster.run(5).unwrap();
    cluster
        .replica(leader)
        .unwrap()
        .transfer_leader(target)
        .unwrap();
    // The "time out now" message never arrives: the transfer hangs until
    // raft-rs aborts it after an election timeout.
    cluster.cut_one_way(leader, target);
    assert!(cluster.replica(leader).unwrap().transferring());
    let slots: Vec<Pending> = (0..5).map(|i| cluster.put(key(i), value(i))).collect();
    cluster.run(1).unwrap();
    for slot in &slots {
        assert!(
            outcome(slot).is_none(),
            "seed {seed}: held, not refused: {:?}",
            outcome(slot)
        );
    }
    let done = cluster
        .run_until(100, |_| slots.iter().all(|s| outcome(s).is_some()))
        .unwrap();
    assert!(done, "seed {seed}: the held proposals were never answered");
    assert_eq!(cluster.leader(), Some(leader), "seed {seed}: aborted");
    for slot in &slots {
        assert!(
            matches!(outcome(slot), Some(Outcome::Applied { .. })),
            "seed {seed}: {:?}",
            outcome(slot)
        );
    }
}

#[test]
fn proposals_held_during_a_transfer_that_completes_name_the_new_leader() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::new(seed, 3, Durability::Synced);
    let leader = elect(&mut cluster);
    let (target, _) = followers(&cluster, leader);
    cluster.run(5).unwrap();
    cluster
        .replica(leader)
        .unwrap()
        .transfer_leader(target)
        .unwrap();
    let slot = cluster.put(key(1), value(1));
    let done = cluster
        .run_until(100, |_| outcome(&slot).is_some())
        .unwrap();
    assert!(done, "seed {seed}: never answered");
    assert_eq!(cluster.leader(), Some(target));
    assert_eq!(
        outcome(&slot),
        Some(Outcome::NotLeader { leader: target }),
        "seed {seed}: nothing proposed; the client is sent to the new leader"
    );
}
