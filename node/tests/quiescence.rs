//! Quiescence on the simulated network (`docs/design/quiescence.md`): an
//! idle group stops ticking and heartbeating and any write wakes it; the
//! followers of a lost leader elect once the node tells them
//! (`Replica::leader_lost`, what the node's watcher calls after an election
//! timeout of silence) and not before; a cut-off quiesced leader serves no
//! lease read once another leads; lossy networks still settle quiesced.
//!
//! Prints its seed; replay with `CLUSTER_SEED=<seed>`.

mod support;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use support::{Writes, assert_converged, elect, key, value, watch_lease_reads, write_for};
use tidepool_node::replica::{LeaseClock, Outcome, ReadOutcome, ReplicaConfig, safe_lease};
use tidepool_node::sim::{NetworkFaults, SIM_TICK, SimCluster};

fn quiescing(ticks: u32) -> ReplicaConfig {
    let mut template = ReplicaConfig::new(0, 0);
    template.quiesce_ticks = ticks;
    template
}

fn all_quiesced(cluster: &mut SimCluster) -> bool {
    cluster
        .ids()
        .into_iter()
        .all(|id| cluster.replica(id).is_none_or(|r| r.is_quiesced()))
}

fn terms(cluster: &mut SimCluster) -> Vec<(u64, u64)> {
    cluster
        .ids()
        .into_iter()
        .filter_map(|id| cluster.replica(id).map(|r| (id, r.status().term)))
        .collect()
}

#[test]
fn an_idle_group_quiesces_and_any_write_wakes_it() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::with_config(seed, 3, quiescing(5));
    let mut writes = Writes::new();
    let leader = elect(&mut cluster);
    write_for(&mut cluster, &mut writes, 10);
    assert!(
        cluster.run_until(50, all_quiesced).unwrap(),
        "seed {seed}: an idle group quiesces"
    );
    // Ten election timeouts: were heartbeats still sent, the followers
    // would wake; were they still counting ticks, they would campaign.
    let before = terms(&mut cluster);
    cluster.run(100).unwrap();
    assert!(all_quiesced(&mut cluster), "seed {seed}");
    assert_eq!(terms(&mut cluster), before, "seed {seed}: no election");
    assert_eq!(cluster.leader(), Some(leader));

    let put = cluster.put(key(1_000), value(1_000));
    assert!(
        !all_quiesced(&mut cluster),
        "seed {seed}: a proposal wakes the leader"
    );
    assert!(
        cluster
            .run_until(20, |_| put.lock().unwrap().is_some())
            .unwrap()
    );
    assert!(matches!(
        *put.lock().unwrap(),
        Some(Outcome::Applied { .. })
    ));
    // And the group goes quiet again, each replica once more.
    let counts: Vec<u64> = (1..=3)
        .map(|id| cluster.replica(id).unwrap().quiesce_count())
        .collect();
    assert!(counts.iter().all(|c| *c >= 1), "seed {seed}: {counts:?}");
    assert!(cluster.run_until(50, all_quiesced).unwrap(), "seed {seed}");
    for id in 1..=3 {
        assert!(
            cluster.replica(id).unwrap().quiesce_count() > counts[id as usize - 1],
            "seed {seed}: node {id} quiesced again"
        );
    }
    assert_converged(&mut cluster, &writes, "quiesced");
}

#[test]
fn a_read_wakes_a_quiesced_leader() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::with_config(seed, 3, quiescing(5));
    let leader = elect(&mut cluster);
    assert!(cluster.run_until(60, all_quiesced).unwrap(), "seed {seed}");
    let read = cluster.read(leader);
    assert!(
        cluster
            .run_until(20, |_| read.lock().unwrap().is_some())
            .unwrap()
    );
    assert_eq!(*read.lock().unwrap(), Some(ReadOutcome::Ready));
    assert!(cluster.run_until(60, all_quiesced).unwrap(), "seed {seed}");
}

#[test]
fn followers_of_a_lost_quiesced_leader_elect_once_told_and_not_before() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::with_config(seed, 3, quiescing(5));
    let mut writes = Writes::new();
    let old = elect(&mut cluster);
    write_for(&mut cluster, &mut writes, 10);
    assert!(cluster.run_until(50, all_quiesced).unwrap(), "seed {seed}");
    cluster.kill(old);
    // Quiesced followers count no ticks: nothing happens on its own (on a
    // node, its watcher tells them; here the test does).
    cluster.run(100).unwrap();
    assert_eq!(cluster.leader(), None, "seed {seed}");
    let followers: Vec<u64> = cluster.ids().into_iter().filter(|id| *id != old).collect();
    for id in &followers {
        let replica = cluster.replica(*id).unwrap();
        assert!(replica.is_quiesced(), "seed {seed}");
        replica.leader_lost(old + 10); // not its leader: ignored
        assert!(replica.is_quiesced(), "seed {seed}");
        replica.leader_lost(old);
        assert!(!replica.is_quiesced(), "seed {seed}");
    }
    // The election timeout counts as passed: an election within the spread
    // of the timeout plus a few ticks, or a whole timeout later after
    // each split vote (both followers campaigned in the same tick: one
    // chance in `election_spread_ticks`, raft-rs drawing the timeouts).
    let config = ReplicaConfig::new(0, 0);
    let attempt = (config.election_ticks + config.election_spread_ticks) as u64;
    assert!(
        cluster
            .run_until(10 * attempt, |c| c.leader().is_some())
            .unwrap(),
        "seed {seed}: a new leader soon after the followers learn of the loss"
    );
    write_for(&mut cluster, &mut writes, 10);
    cluster.restart(old).unwrap();
    write_for(&mut cluster, &mut writes, 10);
    assert_converged(&mut cluster, &writes, "lost quiesced leader");
}

#[test]
fn followers_told_of_a_lost_leader_in_one_tick_elect_without_a_split_vote() {
    // The node's watcher tells every follower of the lost leader in the
    // same tick. Drawing their timeouts at random, they campaigned in one
    // tick one time in `election_spread_ticks` and split the vote (each
    // voting for itself: a whole timeout more, the term up by two). Each
    // takes its own tick now: one election, the term up by one.
    let base = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let config = ReplicaConfig::new(0, 0);
    let attempt = (config.election_ticks + config.election_spread_ticks) as u64;
    for seed in base..base + 12 {
        let mut cluster = SimCluster::with_config(seed, 3, quiescing(5));
        let mut writes = Writes::new();
        let old = elect(&mut cluster);
        write_for(&mut cluster, &mut writes, 10);
        assert!(cluster.run_until(50, all_quiesced).unwrap(), "seed {seed}");
        let term = cluster.replica(old).unwrap().status().term;
        cluster.kill(old);
        let followers: Vec<u64> = cluster.ids().into_iter().filter(|id| *id != old).collect();
        for id in &followers {
            cluster.replica(*id).unwrap().leader_lost(old);
        }
        assert!(
            cluster
                .run_until(attempt, |c| c.leader().is_some())
                .unwrap(),
            "seed {seed}: a leader within one election's ticks"
        );
        let leader = cluster.leader().unwrap();
        assert_eq!(
            cluster.replica(leader).unwrap().status().term,
            term + 1,
            "seed {seed}: one election, no split vote"
        );
    }
}

#[test]
fn a_cut_off_quiesced_leader_serves_lease_reads_only_while_no_other_can_lead() {
    // The lease argument with quiescence: the watcher wakes the followers
    // an election timeout after it last heard the leader's node (here:
    // the partition, since the transport's keepalives flow until then),
    // which is after the lease of any round they answered ran out.
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let clock = Arc::new(AtomicU64::new(0));
    let mut template = quiescing(2);
    template.lease = safe_lease(SIM_TICK, template.election_ticks);
    template.lease_clock = LeaseClock::Manual(clock);
    let election_ticks = template.election_ticks as u64;
    let mut cluster = SimCluster::with_config(seed, 3, template);
    let mut writes = Writes::new();
    let old = elect(&mut cluster);
    write_for(&mut cluster, &mut writes, 10);
    let confirmed = cluster.read(old);
    assert!(
        cluster
            .run_until(20, |_| confirmed.lock().unwrap().is_some())
            .unwrap()
    );
    // Quiesced with the lease still running (it lasts 7.2 ticks).
    assert!(cluster.run_until(6, all_quiesced).unwrap(), "seed {seed}");
    cluster.partition(&[old]);
    let leased = cluster.read(old);
    assert_eq!(
        *leased.lock().unwrap(),
        Some(ReadOutcome::Ready),
        "seed {seed}: within its lease the woken leader answers without a round"
    );
    let followers: Vec<u64> = cluster.ids().into_iter().filter(|id| *id != old).collect();
    let (last_leased_tick, elected_at) = watch_lease_reads(&mut cluster, old, 100, |c, tick| {
        if tick == election_ticks {
            for id in &followers {
                c.replica(*id).unwrap().leader_lost(old);
            }
        }
    });
    let elected_at = elected_at.expect("the majority elects a leader");
    assert!(
        last_leased_tick >= 1 && last_leased_tick < elected_at,
        "seed {seed}: lease reads until tick {last_leased_tick}, a new leader at {elected_at}"
    );
    assert_converged(&mut cluster, &writes, "quiesced lease");
}

#[test]
fn a_lossy_network_still_settles_quiesced() {
    // Lost quiesce heartbeats, lost answers, delays and duplicates: the
    // group may wake and elect, but it always settles quiet again, and
    // every acknowledged write survives.
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::with_config(seed, 3, quiescing(3));
    let mut writes = Writes::new();
    elect(&mut cluster);
    for round in 0..5 {
        cluster.faults = NetworkFaults {
            drop: 0.2,
            duplicate: 0.05,
            max_delay_ticks: 3,
            ..NetworkFaults::default()
        };
        write_for(&mut cluster, &mut writes, 5);
        cluster.run(40).unwrap();
        cluster.faults = NetworkFaults::default();
        assert!(
            cluster
                .run_until(300, |c| c.leader().is_some() && all_quiesced(c))
                .unwrap(),
            "seed {seed}: round {round} settles quiesced"
        );
    }
    assert_converged(&mut cluster, &writes, "lossy quiescence");
}
