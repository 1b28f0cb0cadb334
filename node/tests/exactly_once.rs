//! Exactly-once writes on the simulated network: a sessioned write whose
//! first attempt commits late (through a new leader) and is retried applies
//! once; the decisions survive a restart of every replica (entries applied
//! again apply exactly what they applied) and travel with a snapshot to a
//! replica that then leads.
//!
//! Prints its seed; replay with `CLUSTER_SEED=<seed>`.

mod support;

use raft::eraftpb::ConfChangeType;
use support::{elect, key};
use tidepool_engine::Durability;
use tidepool_node::command::{Command, WriteOp};
use tidepool_node::replica::{Outcome, ReplicaConfig};
use tidepool_node::session::{OpResult, Refusal, SessionTag};
use tidepool_node::sim::{Pending, SimCluster};

const SESSION: u128 = 0x5e55_1011;

fn put(k: [u8; 32], value: &[u8]) -> Command {
    Command::Write(vec![WriteOp {
        value: Some(value.to_vec()),
        namespace: 1,
        epoch: 1,
        key: k,
        name: Vec::new(),
        session: None,
        if_absent: false,
    }])
}

fn delete(k: [u8; 32], seq: u64, opens: bool, time_ms: u64) -> Command {
    Command::Write(vec![WriteOp {
        value: None,
        namespace: 1,
        epoch: 1,
        key: k,
        name: Vec::new(),
        session: Some(SessionTag {
            id: SESSION,
            seq,
            opens,
            time_ms,
        }),
        if_absent: false,
    }])
}

/// Waits for a proposal; returns its op's result.
fn wait(cluster: &mut SimCluster, slot: &Pending, what: &str) -> OpResult {
    let seed = cluster.seed();
    let done = cluster
        .run_until(500, |_| slot.lock().unwrap().is_some())
        .unwrap();
    assert!(done, "seed {seed}: {what} never completed");
    let outcome = slot.lock().unwrap().clone().unwrap();
    match outcome.op_result() {
        Some(result) => result,
        None => panic!("seed {seed}: {what}: {outcome:?}"),
    }
}

fn propose_on_leader(cluster: &mut SimCluster, command: &Command, what: &str) -> OpResult {
    let leader = elect(cluster);
    let slot = cluster.propose(leader, command);
    wait(cluster, &slot, what)
}

/// What replica `id` stores under `k`.
fn stored(cluster: &mut SimCluster, id: u64, k: &[u8; 32]) -> Option<Vec<u8>> {
    let engine = cluster.replica(id).expect("running").engine().clone();
    let space = engine.key_space("blobs").unwrap();
    engine.get(space, k).unwrap().map(|v| v.to_vec())
}

/// Heals, lets every replica apply everything, and checks each holds
/// `expected` under `k`.
fn assert_everywhere(cluster: &mut SimCluster, k: &[u8; 32], expected: Option<&[u8]>, when: &str) {
    let seed = cluster.seed();
    cluster.heal();
    let settled = cluster
        .run_until(1_000, |c| {
            let Some(leader) = c.leader() else {
                return false;
            };
            let commit = c.replica(leader).unwrap().status().commit;
            c.ids()
                .into_iter()
                .all(|id| c.replica(id).is_some_and(|r| r.status().applied >= commit))
        })
        .unwrap();
    assert!(settled, "seed {seed}: {when}: replicas did not catch up");
    for id in cluster.ids() {
        assert_eq!(
            stored(cluster, id, k).as_deref(),
            expected,
            "seed {seed}: {when}: node {id}"
        );
    }
}

/// The history of the linearizability bug, replayed: the first attempt of
/// a delete reaches one follower only and its leader never hears back (the
/// client times out); the follower becomes leader and commits it; another
/// client's put is acknowledged; then the retry of the delete arrives. It
/// must not erase that put.
#[test]
fn a_retried_delete_committed_late_by_a_new_leader_applies_once() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::new(seed, 3, Durability::Synced);
    let k = key(1);
    let old = elect(&mut cluster);
    let result = propose_on_leader(&mut cluster, &put(k, b"v0"), "put v0");
    assert_eq!(result, OpResult::DONE);
    let others: Vec<u64> = cluster.ids().into_iter().filter(|i| *i != old).collect();
    let (f1, f2) = (others[0], others[1]);

    // The first attempt reaches f1 only; old never learns that it did.
    cluster.cut_one_way(old, f2);
    cluster.cut_one_way(f1, old);
    let first = cluster.propose(old, &delete(k, 1, true, 1_000));
    cluster.run(3).unwrap();
    assert!(
        first.lock().unwrap().is_none(),
        "seed {seed}: the first attempt must not commit while old is cut off"
    );

    // old is lost; f1, the only one holding the entry, wins and commits it.
    cluster.partition(&[old]);
    let took_over = cluster
        .run_until(500, |c| c.leader().is_some_and(|l| l != old))
        .unwrap();
    assert!(took_over, "seed {seed}: no new leader");
    let new = cluster.leader().unwrap();
    assert_eq!(new, f1, "seed {seed}: only f1 has the longer log");
    let slot = cluster.propose(new, &put(k, b"v1"));
    assert_eq!(wait(&mut cluster, &slot, "put v1"), OpResult::DONE);
    assert_eq!(stored(&mut cluster, new, &k).as_deref(), Some(&b"v1"[..]));

    // The retry: same session, same sequence. A duplicate: not applied,
    // answered with the first copy's outcome (the key existed then).
    let slot = cluster.propose(new, &delete(k, 1, true, 2_000));
    assert_eq!(
        wait(&mut cluster, &slot, "the retried delete"),
        OpResult::Done { existed: true }
    );
    assert_everywhere(&mut cluster, &k, Some(b"v1"), "after the retry");

    // Every replica restarts: entries applied again apply what they did
    // (the retry is skipped again, and the put that is the key's last write
    // — sessioned itself — is applied again, not taken for a duplicate).
    let other = SessionTag {
        id: SESSION + 1,
        seq: 1,
        opens: true,
        time_ms: 2_500,
    };
    let k2 = key(2);
    let mut sessioned_put = put(k2, b"w1");
    if let Command::Write(ops) = &mut sessioned_put {
        ops[0].session = Some(other);
    }
    propose_on_leader(&mut cluster, &sessioned_put, "a sessioned put");
    // A control snapshot after it on every replica (its cells stay dirty),
    // so the restart applies those entries again with their decisions made.
    snapshot_everywhere(&mut cluster);
    for id in cluster.ids() {
        cluster.kill(id);
    }
    for id in cluster.ids() {
        cluster.restart(id).unwrap();
    }
    assert_everywhere(&mut cluster, &k, Some(b"v1"), "after restarting all");
    assert_everywhere(&mut cluster, &k2, Some(b"w1"), "after restarting all");

    // The session goes on where it was.
    let third = propose_on_leader(&mut cluster, &delete(k, 1, false, 3_000), "a third copy");
    assert_eq!(third, OpResult::Done { existed: true });
    let next = propose_on_leader(&mut cluster, &delete(k, 2, false, 4_000), "write 2");
    assert_eq!(next, OpResult::Done { existed: true });
    assert_everywhere(&mut cluster, &k, None, "after write 2");
    let stale = propose_on_leader(&mut cluster, &delete(k, 1, true, 5_000), "write 1 again");
    assert_eq!(stale, OpResult::Refused(Refusal::Stale));
    let mut unknown = delete(k, 1, false, 5_000);
    if let Command::Write(ops) = &mut unknown {
        ops[0].session.as_mut().unwrap().id = 42;
    }
    let expired = propose_on_leader(&mut cluster, &unknown, "an unknown session");
    assert_eq!(expired, OpResult::Refused(Refusal::Expired));
}

/// The sessions travel in a snapshot: a replica that joined from one and
/// then leads recognises a retry of a write applied before it joined.
#[test]
fn sessions_travel_with_snapshots() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut config = ReplicaConfig::new(0, 0);
    config.compact_log_entries = 8;
    let mut cluster = SimCluster::with_config(seed, 3, config);
    let k = key(7);
    elect(&mut cluster);
    propose_on_leader(&mut cluster, &put(k, b"v0"), "put v0");
    let first = propose_on_leader(&mut cluster, &delete(k, 1, true, 1_000), "delete");
    assert_eq!(first, OpResult::Done { existed: true });
    propose_on_leader(&mut cluster, &put(k, b"v1"), "put v1");
    // Enough entries for the leader to compact past all of the above.
    for i in 0..40u8 {
        propose_on_leader(&mut cluster, &put(key(100 + u64::from(i)), &[i]), "filler");
    }
    cluster.add_node(4, &[]);
    let slot = cluster.change_membership(ConfChangeType::AddLearnerNode, 4);
    assert!(matches!(
        wait_outcome(&mut cluster, &slot),
        Outcome::Applied { .. }
    ));
    let slot = cluster.change_membership(ConfChangeType::AddNode, 4);
    assert!(matches!(
        wait_outcome(&mut cluster, &slot),
        Outcome::Applied { .. }
    ));
    assert!(
        cluster.snapshots.received >= 1,
        "seed {seed}: node 4 joined without a snapshot: {:?}",
        cluster.snapshots
    );
    // Asked until the leader sees node 4 caught up and answering.
    let moved = cluster
        .run_until(500, |c| {
            if let Some(leader) = c.leader()
                && leader != 4
            {
                let _ = c.replica(leader).unwrap().transfer_leader(4);
            }
            c.leader() == Some(4)
        })
        .unwrap();
    assert!(moved, "seed {seed}: leadership did not move to node 4");
    let slot = cluster.propose(4, &delete(k, 1, false, 2_000));
    assert_eq!(
        wait(&mut cluster, &slot, "the retry on node 4"),
        OpResult::Done { existed: true }
    );
    assert_everywhere(&mut cluster, &k, Some(b"v1"), "after the retry on node 4");
}

/// Waits until every replica's engine took two more control snapshots
/// (they do every 50 ms of real time in the test configuration): the
/// second began after this call, so the control file holds what it saw
/// (written, or kept because it already did).
fn snapshot_everywhere(cluster: &mut SimCluster) {
    let count = |cluster: &mut SimCluster, id: u64| {
        let engine = cluster.replica(id).unwrap().engine().clone();
        let counters = engine.metrics().counters;
        counters.snapshots + counters.snapshots_unchanged
    };
    let ids = cluster.ids();
    let before: Vec<u64> = ids.iter().map(|id| count(cluster, *id)).collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while ids
        .iter()
        .zip(&before)
        .any(|(id, b)| count(cluster, *id) <= *b + 1)
    {
        assert!(std::time::Instant::now() < deadline, "no engine snapshot");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn wait_outcome(cluster: &mut SimCluster, slot: &Pending) -> Outcome {
    let seed = cluster.seed();
    let done = cluster
        .run_until(500, |_| slot.lock().unwrap().is_some())
        .unwrap();
    assert!(done, "seed {seed}: never completed");
    slot.lock().unwrap().clone().unwrap()
}

/// A touch answers whether the blob was still there when it applied: a
/// content-addressed put that found its key present refreshes it with a
/// touch, and stores its bytes after all when a delete or a dropped epoch
/// applied in between; `Touch` and `BatchExists` answer `NOT_FOUND` and
/// absent then. A retried sessioned touch gets the first attempt's answer.
#[test]
fn a_touch_reports_whether_the_blob_was_still_there_when_it_applied() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut cluster = SimCluster::new(seed, 3, Durability::Synced);
    let k = key(7);
    let touch = |session: Option<SessionTag>| Command::Touch {
        namespace: 1,
        epoch: 2,
        key: k,
        session,
    };
    elect(&mut cluster);
    assert_eq!(
        propose_on_leader(&mut cluster, &put(k, b"chunk"), "put"),
        OpResult::DONE
    );
    assert_eq!(
        propose_on_leader(&mut cluster, &touch(None), "touch of a stored blob"),
        OpResult::Done { existed: true },
        "seed {seed}"
    );
    let gone = Command::Write(vec![WriteOp {
        value: None,
        namespace: 1,
        epoch: 1,
        key: k,
        name: Vec::new(),
        session: None,
        if_absent: false,
    }]);
    propose_on_leader(&mut cluster, &gone, "delete");
    assert_eq!(
        propose_on_leader(&mut cluster, &touch(None), "touch of a deleted blob"),
        OpResult::Done { existed: false },
        "seed {seed}"
    );
    let tag = SessionTag {
        id: SESSION,
        seq: 1,
        opens: true,
        time_ms: 1_000,
    };
    for attempt in ["first", "retried"] {
        assert_eq!(
            propose_on_leader(&mut cluster, &touch(Some(tag)), attempt),
            OpResult::Done { existed: false },
            "seed {seed}: {attempt} sessioned touch"
        );
    }
    assert_everywhere(&mut cluster, &k, None, "touches of a deleted blob");
}
