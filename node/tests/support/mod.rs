//! Helpers shared by the node's cluster tests: a client that records which
//! writes were acknowledged, and the convergence check.

#![allow(dead_code)]

use std::collections::BTreeMap;

use tidepool_node::replica::Outcome;
use tidepool_node::sim::{NetworkFaults, Pending, SimCluster};

pub fn key(i: u64) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    k[8..16].copy_from_slice(&i.to_le_bytes());
    k
}

pub fn value(i: u64) -> Vec<u8> {
    format!("value of {i}")
        .into_bytes()
        .repeat(1 + (i as usize % 40))
}

/// Writes proposed so far: key number -> outcome slot.
pub struct Writes {
    pub next: u64,
    pending: BTreeMap<u64, Pending>,
}

impl Writes {
    pub fn new() -> Self {
        Self {
            next: 0,
            pending: BTreeMap::new(),
        }
    }

    pub fn put(&mut self, cluster: &mut SimCluster) {
        let i = self.next;
        self.next += 1;
        let slot = cluster.put(key(i), value(i));
        self.pending.insert(i, slot);
    }

    pub fn acknowledged(&self) -> Vec<u64> {
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
pub fn assert_converged(cluster: &mut SimCluster, writes: &Writes, context: &str) {
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
    if !settled {
        let statuses: Vec<_> = cluster
            .ids()
            .into_iter()
            .map(|id| (id, cluster.replica(id).map(|r| r.status())))
            .collect();
        panic!("seed {seed}, {context}: replicas did not converge: {statuses:#?}");
    }
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

pub fn elect(cluster: &mut SimCluster) -> u64 {
    assert!(
        cluster.run_until(500, |c| c.leader().is_some()).unwrap(),
        "seed {}: no leader",
        cluster.seed()
    );
    cluster.leader().unwrap()
}

pub fn write_for(cluster: &mut SimCluster, writes: &mut Writes, ticks: u64) {
    for _ in 0..ticks {
        for _ in 0..3 {
            writes.put(cluster);
        }
        cluster.tick().unwrap();
    }
}

/// Ticks `ticks` times, calling `before_tick` first each time and asking
/// the cut-off leader `old` for a read after each tick; fails if `old`
/// serves a read (by its lease: no round can confirm one) at a tick where
/// another node leads. Returns the last tick it served one (0: none) and
/// the first tick another node led.
pub fn watch_lease_reads(
    cluster: &mut SimCluster,
    old: u64,
    ticks: u64,
    mut before_tick: impl FnMut(&mut SimCluster, u64),
) -> (u64, Option<u64>) {
    let seed = cluster.seed();
    let mut last_leased_tick = 0;
    let mut elected_at = None;
    for tick in 1..=ticks {
        before_tick(cluster, tick);
        cluster.tick().unwrap();
        let other = cluster
            .ids()
            .into_iter()
            .filter(|id| *id != old)
            .find(|id| cluster.replica(*id).is_some_and(|r| r.status().is_leader));
        if other.is_some() && elected_at.is_none() {
            elected_at = Some(tick);
        }
        // The gate of reads without the owner opens only inside the lease.
        assert!(
            other.is_none() || !cluster.gate_open(old),
            "seed {seed}: node {old}'s lease gate was open at tick {tick} while node {} led",
            other.unwrap()
        );
        let read = cluster.read(old);
        if *read.lock().unwrap() == Some(tidepool_node::replica::ReadOutcome::Ready) {
            last_leased_tick = tick;
            assert!(
                other.is_none(),
                "seed {seed}: node {old} served a read by its lease at tick {tick} while node {} led",
                other.unwrap()
            );
        }
    }
    (last_leased_tick, elected_at)
}
