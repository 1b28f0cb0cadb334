//! The name index on a simulated 3-replica shard against a `BTreeMap`
//! model: random named puts and deletes in two namespaces, touches, epoch
//! advances and drops of the expiring one, replicas killed and restarted,
//! every live entry relocated, and a replica replaced by one rebuilt from a
//! snapshot. After each round
//! every replica's listing (in pages of random sizes) must equal the model.
//!
//! Prints its seed; replay with `CLUSTER_SEED=<seed>`.

mod support;

use std::collections::BTreeMap;

use raft::eraftpb::ConfChangeType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::elect;
use tidepool_node::blob;
use tidepool_node::command::{Command, WriteOp};
use tidepool_node::names::{self, NAMES_KEY_SPACE, PageLimits};
use tidepool_node::replica::{Outcome, ReplicaConfig};
use tidepool_node::sim::SimCluster;
use tidepool_proto::storage_key;
use tidepool_proto::v1::BlobKind;

/// Namespace 1 keeps everything; namespace 2's old epochs are dropped.
const KEEP: u32 = 1;
const EXPIRE: u32 = 2;

fn random_name(rng: &mut StdRng) -> Vec<u8> {
    let stem: &[u8] = match rng.random_range(0..4) {
        0 => b"",
        1 => b"data/",
        2 => b"snapshots/2026-11-27/host-number-one/",
        _ => b"index/",
    };
    let mut name = stem.to_vec();
    for _ in 0..rng.random_range(1..4) {
        name.push(b"0af/"[rng.random_range(0..4)]);
    }
    name
}

fn content(rng: &mut StdRng) -> Vec<u8> {
    vec![rng.random::<u8>(); rng.random_range(0..300)]
}

fn put(namespace: u32, epoch: u32, name: &[u8], content: &[u8]) -> WriteOp {
    WriteOp {
        value: Some(blob::encode(
            BlobKind::Data,
            &blob::sha256(content),
            content,
        )),
        namespace,
        epoch,
        key: storage_key(namespace, name),
        name: name.to_vec(),
        session: None,
        if_absent: false,
    }
}

fn delete(namespace: u32, epoch: u32, name: &[u8]) -> WriteOp {
    WriteOp {
        value: None,
        namespace,
        epoch,
        key: storage_key(namespace, name),
        name: name.to_vec(),
        session: None,
        if_absent: false,
    }
}

/// Proposes on the leader until applied (a leader change loses proposals).
fn commit(cluster: &mut SimCluster, command: &Command) {
    let seed = cluster.seed();
    for _ in 0..20 {
        let leader = elect(cluster);
        let slot = cluster.propose(leader, command);
        cluster
            .run_until(300, |_| slot.lock().unwrap().is_some())
            .unwrap();
        if matches!(*slot.lock().unwrap(), Some(Outcome::Applied { .. })) {
            return;
        }
    }
    panic!("seed {seed}: {command:?} never applied");
}

/// Lets every replica apply everything.
fn settle(cluster: &mut SimCluster) {
    let seed = cluster.seed();
    let settled = cluster
        .run_until(2_000, |c| {
            let Some(leader) = c.leader() else {
                return false;
            };
            let commit = c.replica(leader).unwrap().status().commit;
            c.ids()
                .into_iter()
                .all(|id| c.replica(id).is_some_and(|r| r.status().applied >= commit))
        })
        .unwrap();
    assert!(settled, "seed {seed}: replicas did not catch up");
}

/// name -> (size, epoch) per namespace.
type Model = BTreeMap<u32, BTreeMap<Vec<u8>, (u64, u32)>>;

fn check(cluster: &mut SimCluster, model: &Model, rng: &mut StdRng, when: &str) {
    settle(cluster);
    let seed = cluster.seed();
    for id in cluster.ids() {
        let engine = cluster.replica(id).unwrap().engine().clone();
        let (names_space, blobs) = (
            engine.key_space(NAMES_KEY_SPACE).unwrap(),
            engine.key_space("blobs").unwrap(),
        );
        assert!(names::is_complete(&engine, names_space).unwrap());
        for namespace in [KEEP, EXPIRE] {
            let limits = PageLimits {
                entries: rng.random_range(1..7),
                name_bytes: 1 << 20,
                examined: rng.random_range(1..20),
                entered: rng.random_range(1..60),
                owned: None,
            };
            let mut listed = Vec::new();
            let mut after: Option<Vec<u8>> = None;
            loop {
                let page = names::list_page(
                    &engine,
                    names_space,
                    blobs,
                    namespace,
                    b"",
                    after.as_deref(),
                    limits,
                )
                .unwrap();
                listed.extend(
                    page.entries
                        .into_iter()
                        .map(|e| (e.name, (e.meta.size, e.epoch))),
                );
                if page.done {
                    break;
                }
                after = Some(page.resume_after);
            }
            let expected: Vec<(Vec<u8>, (u64, u32))> = model
                .get(&namespace)
                .map(|m| m.iter().map(|(k, v)| (k.clone(), *v)).collect())
                .unwrap_or_default();
            assert_eq!(
                listed, expected,
                "seed {seed}: {when}: node {id}, namespace {namespace}, pages of {limits:?}"
            );
        }
    }
    // Drops' names are swept out in the background (ticks): soon no
    // replica's index holds a dead leaf.
    let live = |namespace: u32| -> Vec<Vec<u8>> {
        model
            .get(&namespace)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    };
    let swept = cluster
        .run_until(500, |c| {
            c.ids().into_iter().all(|id| {
                c.replica(id).is_some_and(|r| {
                    [KEEP, EXPIRE]
                        .into_iter()
                        .all(|namespace| indexed(r.engine(), namespace) == live(namespace))
                })
            })
        })
        .unwrap();
    if !swept {
        for id in cluster.ids() {
            let engine = cluster.replica(id).unwrap().engine().clone();
            for namespace in [KEEP, EXPIRE] {
                assert_eq!(
                    indexed(&engine, namespace),
                    live(namespace),
                    "seed {seed}: {when}: node {id}: dead leaves not swept"
                );
            }
        }
    }
}

/// The names namespace `namespace`'s index holds.
fn indexed(engine: &tidepool_engine::Engine, namespace: u32) -> Vec<Vec<u8>> {
    let names_space = engine.key_space(NAMES_KEY_SPACE).unwrap();
    let mut indexed = Vec::new();
    names::walk(engine, names_space, namespace, b"", None, |name, _| {
        indexed.push(name.to_vec());
        Ok(names::Step::Continue)
    })
    .unwrap();
    indexed
}

#[test]
fn listings_match_a_model_through_drops_restarts_and_a_snapshot() {
    let seed = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut config = ReplicaConfig::new(0, 0);
    config.compact_log_entries = 16;
    let mut cluster = SimCluster::with_config(seed, 3, config);
    let mut model: Model = BTreeMap::new();
    let mut epoch = 1u32;
    let mut next_node = 4u64;
    let mut expired = 0;
    let mut relocated = 0;
    elect(&mut cluster);
    for round in 0..12 {
        for _ in 0..25 {
            let mut ops = Vec::new();
            let mut touched = Vec::new();
            for _ in 0..rng.random_range(1..4) {
                let namespace = if rng.random_bool(0.5) { KEEP } else { EXPIRE };
                let name = random_name(&mut rng);
                // One op per name per entry keeps the model simple.
                if ops
                    .iter()
                    .any(|o: &WriteOp| o.name == name && o.namespace == namespace)
                {
                    continue;
                }
                let names = model.entry(namespace).or_default();
                if rng.random_bool(0.7) {
                    let bytes = content(&mut rng);
                    names.insert(name.clone(), (bytes.len() as u64, epoch));
                    ops.push(put(namespace, epoch, &name, &bytes));
                } else {
                    names.remove(&name);
                    ops.push(delete(namespace, epoch, &name));
                }
            }
            commit(&mut cluster, &Command::Write(ops));
            // A touch moves a blob into the current epoch (no name needed).
            if rng.random_bool(0.2)
                && let Some((name, _)) = model.get(&EXPIRE).and_then(|m| m.iter().next())
            {
                touched.push(name.clone());
            }
            for name in touched {
                commit(
                    &mut cluster,
                    &Command::Touch {
                        namespace: EXPIRE,
                        epoch,
                        key: storage_key(EXPIRE, &name),
                        session: None,
                    },
                );
                model.get_mut(&EXPIRE).unwrap().get_mut(&name).unwrap().1 = epoch;
            }
        }
        check(&mut cluster, &model, &mut rng, &format!("round {round}"));
        match round % 5 {
            // A new epoch, and the expiring namespace drops the one before.
            0 | 2 => {
                epoch += 1;
                commit(&mut cluster, &Command::AdvanceEpoch(epoch));
                settle(&mut cluster);
                let below = epoch - 1;
                commit(
                    &mut cluster,
                    &Command::DropEpochs {
                        namespace: EXPIRE,
                        below,
                    },
                );
                if let Some(names) = model.get_mut(&EXPIRE) {
                    let before = names.len();
                    names.retain(|_, (_, e)| *e >= below);
                    expired += before - names.len();
                }
            }
            // A replica killed and restarted.
            1 => {
                let ids = cluster.ids();
                let victim = ids[rng.random_range(0..ids.len())];
                cluster.kill(victim);
                cluster.run(20).unwrap();
                cluster.restart(victim).unwrap();
            }
            // Every replica relocates every entry below its processed
            // position (the index walk): each live name and blob moves to
            // a new place in the WAL, and the segments left behind go.
            4 => {
                for id in cluster.ids() {
                    let engine = cluster.replica(id).unwrap().engine().clone();
                    let below = engine.processed_position();
                    let report = engine
                        .relocate(tidepool_engine::Strategy::Index { below })
                        .unwrap();
                    assert!(
                        report.entries_relocated > 0,
                        "seed {seed}: node {id} relocated nothing: {report:?}"
                    );
                    relocated += report.entries_relocated;
                }
            }
            // A replica replaced by a new one, rebuilt from a snapshot.
            _ => {
                let ids = cluster.ids();
                let leader = elect(&mut cluster);
                let victim = *ids.iter().find(|id| **id != leader).unwrap();
                let new = next_node;
                next_node += 1;
                let received = cluster.snapshots.received;
                cluster.add_node(new, &[]);
                for change in [ConfChangeType::AddLearnerNode, ConfChangeType::AddNode] {
                    let slot = cluster.change_membership(change, new);
                    cluster
                        .run_until(500, |_| slot.lock().unwrap().is_some())
                        .unwrap();
                }
                let slot = cluster.change_membership(ConfChangeType::RemoveNode, victim);
                cluster
                    .run_until(500, |_| slot.lock().unwrap().is_some())
                    .unwrap();
                cluster.remove_node(victim);
                settle(&mut cluster);
                assert!(
                    cluster.snapshots.received > received,
                    "seed {seed}: node {new} joined without a snapshot"
                );
            }
        }
        check(
            &mut cluster,
            &model,
            &mut rng,
            &format!("after round {round}'s event"),
        );
    }
    assert!(expired > 0, "seed {seed}: no drop expired a name");
    assert!(relocated > 0, "seed {seed}: nothing was relocated");
}
