//! In-process clusters of 3 and 5 replicas on the simulated network (drops,
//! delays, duplicates, partitions, seeded): leader loss, partitioned
//! minority, isolated leader, healed partition, crashes and restarts. After
//! every scenario all replicas hold identical data and every acknowledged
//! put is readable on each of them.
//!
//! Prints its seed; replay with `CLUSTER_SEED=<seed>`.

use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tidepool_engine::Durability;
use tidepool_node::replica::Outcome;
use tidepool_node::sim::{NetworkFaults, Pending, SimCluster};

fn key(i: u64) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    k[8..16].copy_from_slice(&i.to_le_bytes());
    k
}

fn value(i: u64) -> Vec<u8> {
    format!("value of {i}")
        .into_bytes()
        .repeat(1 + (i as usize % 40))
}

/// Writes proposed so far: key number -> outcome slot.
struct Writes {
    next: u64,
    pending: BTreeMap<u64, Pending>,
}

impl Writes {
    fn new() -> Self {
        Self {
            next: 0,
            pending: BTreeMap::new(),
        }
    }

    fn put(&mut self, cluster: &mut SimCluster) {
        let i = self.next;
        self.next += 1;
        let slot = cluster.put(key(i), value(i));
        self.pending.insert(i, slot);
    }

    fn acknowledged(&self) -> Vec<u64> {
        self.pending
            .iter()
            .filter(|(_, p)| matches!(*p.lock().unwrap(), Some(Outcome::Applied { .. })))
            .map(|(i, _)| *i)
            .collect()
    }
}

/// Heals everything, lets the cluster settle, and checks that every running
/// replica applied the same entries, holds the same values, and has every
/// acknowledged write.
fn assert_converged(cluster: &mut SimCluster, writes: &Writes, context: &str) {
    let seed = cluster.seed();
    cluster.heal();
    cluster.faults = NetworkFaults::default();
    let settled = cluster
        .run_until(2_000, |c| {
            let statuses: Vec<_> = c
                .ids()
                .into_iter()
                .filter_map(|id| c.replica(id).map(|r| r.status()))
                .collect();
            c.leader().is_some()
                && statuses
                    .windows(2)
                    .all(|w| w[0].applied == w[1].applied && w[0].commit == w[1].commit)
                && statuses.iter().all(|s| s.applied == s.commit)
        })
        .unwrap();
    assert!(settled, "seed {seed}, {context}: replicas did not converge");
    let acknowledged = writes.acknowledged();
    let mut reference: Option<(u64, Vec<Option<Vec<u8>>>)> = None;
    for id in cluster.ids() {
        let Some(replica) = cluster.replica(id) else {
            continue;
        };
        let engine = replica.engine().clone();
        let space = engine.key_space("blobs").unwrap();
        let state: Vec<Option<Vec<u8>>> = (0..writes.next)
            .map(|i| engine.get(space, &key(i)).unwrap().map(|v| v.to_vec()))
            .collect();
        for i in &acknowledged {
            assert_eq!(
                state[*i as usize].as_deref(),
                Some(&value(*i)[..]),
                "seed {seed}, {context}: node {id} lost acknowledged write {i}"
            );
        }
        for (i, v) in state.iter().enumerate() {
            if let Some(v) = v {
                assert_eq!(
                    v,
                    &value(i as u64),
                    "seed {seed}, {context}: node {id} key {i} has a value never written"
                );
            }
        }
        match &reference {
            None => reference = Some((id, state)),
            Some((first, expected)) => {
                let differing: Vec<usize> = (0..state.len())
                    .filter(|i| state[*i] != expected[*i])
                    .collect();
                assert!(
                    differing.is_empty(),
                    "seed {seed}, {context}: node {id} and node {first} differ on keys {differing:?}"
                );
            }
        }
    }
    assert!(
        !acknowledged.is_empty(),
        "seed {seed}, {context}: nothing was acknowledged"
    );
}

fn elect(cluster: &mut SimCluster) -> u64 {
    assert!(
        cluster.run_until(500, |c| c.leader().is_some()).unwrap(),
        "seed {}: no leader",
        cluster.seed()
    );
    cluster.leader().unwrap()
}

fn write_for(cluster: &mut SimCluster, writes: &mut Writes, ticks: u64) {
    for _ in 0..ticks {
        for _ in 0..3 {
            writes.put(cluster);
        }
        cluster.tick().unwrap();
    }
}

#[test]
fn leader_loss_and_restart() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    for durability in [Durability::Synced, Durability::Buffered] {
        let mut cluster = SimCluster::new(seed, 3, durability);
        let mut writes = Writes::new();
        let leader = elect(&mut cluster);
        write_for(&mut cluster, &mut writes, 20);
        cluster.kill(leader);
        write_for(&mut cluster, &mut writes, 60);
        let new_leader = elect(&mut cluster);
        assert_ne!(new_leader, leader, "seed {seed}");
        write_for(&mut cluster, &mut writes, 20);
        cluster.restart(leader).unwrap();
        write_for(&mut cluster, &mut writes, 20);
        assert_converged(
            &mut cluster,
            &writes,
            &format!("leader loss ({durability:?})"),
        );
    }
}

#[test]
fn partitioned_minority_catches_up_after_healing() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::new(seed, 5, Durability::Synced);
    let mut writes = Writes::new();
    let leader = elect(&mut cluster);
    let minority: Vec<u64> = cluster
        .ids()
        .into_iter()
        .filter(|id| *id != leader)
        .take(2)
        .collect();
    cluster.partition(&minority);
    write_for(&mut cluster, &mut writes, 60);
    assert!(
        writes.acknowledged().len() > 100,
        "seed {seed}: the majority keeps committing"
    );
    assert_converged(&mut cluster, &writes, "partitioned minority");
}

#[test]
fn an_isolated_leader_acknowledges_nothing_and_steps_down() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::new(seed, 3, Durability::Synced);
    let mut writes = Writes::new();
    let old = elect(&mut cluster);
    write_for(&mut cluster, &mut writes, 10);
    let before = writes.acknowledged().len();
    cluster.partition(&[old]);
    // Proposals to the isolated leader cannot commit.
    let stranded: Vec<Pending> = (0..10)
        .map(|i| cluster.put_on(old, key(10_000 + i), value(10_000 + i)))
        .collect();
    cluster.run(200).unwrap();
    let new = cluster.leader().expect("the majority elects a leader");
    assert_ne!(new, old, "seed {seed}");
    for slot in &stranded {
        assert!(
            !matches!(*slot.lock().unwrap(), Some(Outcome::Applied { .. })),
            "seed {seed}: an isolated leader acknowledged a write"
        );
    }
    write_for(&mut cluster, &mut writes, 20);
    assert!(writes.acknowledged().len() > before);
    assert_converged(&mut cluster, &writes, "isolated leader");
    let status = cluster.replica(old).unwrap().status();
    assert!(
        !status.is_leader,
        "seed {seed}: the old leader stepped down"
    );
}

#[test]
fn a_faulty_network_with_crashes_converges() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut cluster = SimCluster::new(seed, 5, Durability::Synced);
    cluster.faults = NetworkFaults {
        drop: 0.05,
        duplicate: 0.05,
        max_delay_ticks: 3,
    };
    let mut writes = Writes::new();
    elect(&mut cluster);
    let mut down: Option<u64> = None;
    for round in 0..15 {
        write_for(&mut cluster, &mut writes, 15);
        match (round % 5, down) {
            (1, None) => {
                let victim = rng.random_range(1..=5);
                if rng.random_bool(0.5) {
                    cluster.kill(victim)
                } else {
                    cluster.power_off(victim)
                }
                down = Some(victim);
            }
            (3, Some(victim)) => {
                cluster.restart(victim).unwrap();
                down = None;
            }
            (4, _) => {
                let side = [rng.random_range(1..=5)];
                cluster.partition(&side);
            }
            (0, _) => cluster.heal(),
            _ => {}
        }
    }
    if let Some(victim) = down {
        cluster.restart(victim).unwrap();
    }
    assert_converged(&mut cluster, &writes, "faulty network with crashes");
}
