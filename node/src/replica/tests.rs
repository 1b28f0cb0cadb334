//! In-process clusters on the simulated network.

use std::sync::Arc;

use tidepool_engine::Durability;

use crate::command::Command;
use crate::replica::{Outcome, ReplicaConfig};
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

/// A storage key at hash position `position` (its first 8 bytes).
fn key_at(position: u64, i: u64) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&position.to_be_bytes());
    k[8..16].copy_from_slice(&i.to_le_bytes());
    k
}

/// A group founded with a hash range refuses, when they apply, writes of
/// keys outside it (`WRONG_SHARD`, nothing written), on every replica
/// alike; the range is part of the replicated state: it survives a restart
/// and reaches a replica added later (through the founding snapshot).
/// Without it a write proposed before a split and applied after it would
/// land in a group that no longer owns the key (`docs/design/splits.md`).
#[test]
fn writes_outside_the_groups_range_are_refused_when_they_apply() {
    use crate::replica::ReplicaConfig;
    use crate::session::{OpResult, Refusal};
    use raft::eraftpb::ConfChangeType;

    let range = (1 << 40, u64::MAX / 2);
    let mut template = ReplicaConfig::new(0, 0);
    template.range = Some(range);
    let mut cluster = SimCluster::with_config(11, 3, template);
    assert!(cluster.run_until(200, |c| c.leader().is_some()).unwrap());
    let keys = [
        (key_at(range.0, 1), true),
        (key_at(range.1, 2), true),
        (key_at(range.0 - 1, 3), false),
        (key_at(range.1 + 1, 4), false),
        (key_at(u64::MAX, 5), false),
    ];
    let check = |cluster: &mut SimCluster, round: u8| {
        let pending: Vec<_> = keys
            .iter()
            .map(|(key, _)| cluster.put(*key, vec![round; 100]))
            .collect();
        assert!(
            cluster
                .run_until(300, |_| pending.iter().all(|p| p.lock().unwrap().is_some()))
                .unwrap()
        );
        for ((key, inside), p) in keys.iter().zip(&pending) {
            let result = p.lock().unwrap().as_ref().and_then(|o| o.op_result());
            let expected = if *inside {
                OpResult::Done { existed: false }
            } else {
                OpResult::Refused(Refusal::WrongShard)
            };
            assert_eq!(
                result,
                Some(expected),
                "key at {:#x}",
                u64::from_be_bytes(key[..8].try_into().unwrap())
            );
        }
        cluster.run(20).unwrap();
        for id in cluster.ids() {
            let replica = cluster.replica(id).unwrap();
            assert_eq!(replica.log().range(), Some(range), "node {id}");
            let engine = replica.engine().clone();
            let space = engine.key_space("blobs").unwrap();
            for (key, inside) in &keys {
                assert_eq!(
                    engine.get(space, key).unwrap().is_some(),
                    *inside,
                    "node {id}, round {round}"
                );
            }
        }
    };
    check(&mut cluster, 1);
    // After a power loss the range comes from the saved state.
    let follower = cluster
        .ids()
        .into_iter()
        .find(|id| Some(*id) != cluster.leader())
        .unwrap();
    cluster.power_off(follower);
    cluster.restart(follower).unwrap();
    check(&mut cluster, 2);
    // A replica added later learns it from the leader's snapshot.
    cluster.add_node(4, &[]);
    let slot = cluster.change_membership(ConfChangeType::AddLearnerNode, 4);
    assert!(
        cluster
            .run_until(300, |_| slot.lock().unwrap().is_some())
            .unwrap()
    );
    assert!(
        cluster
            .run_until(500, |c| c
                .replica(4)
                .is_some_and(|r| r.log().range() == Some(range)))
            .unwrap(),
        "the new replica never learned the range"
    );
}

/// Whether the leader's engine holds `value` under `key`.
fn leader_holds(cluster: &mut SimCluster, key: &[u8; 32], value: &[u8]) -> bool {
    let Some(leader) = cluster.leader() else {
        return false;
    };
    let engine = cluster.replica(leader).unwrap().engine().clone();
    let space = engine.key_space("blobs").unwrap();
    engine.get(space, key).unwrap().as_deref() == Some(value)
}

#[test]
fn an_entry_marked_synced_survives_every_replica_losing_power_in_a_buffered_group() {
    use crate::command::Command;
    use crate::entry_context::EntrySync;
    use crate::sim::{SimOptions, put_op};

    let first = tidepool_testkit::seed_from_env("SIM_SEED");
    let mut unmarked_lost = 0;
    const RUNS: u64 = 4;
    for seed in (0..RUNS).map(|i| first.wrapping_add(i)) {
        let options = SimOptions::buffered_without_background_syncs();
        let mut cluster = SimCluster::with_options(seed, 3, options);
        assert!(cluster.run_until(300, |c| c.leader().is_some()).unwrap());
        let leader = cluster.leader().unwrap();
        let put = |i: u64, value: &[u8]| Command::Write(vec![put_op(key(i), value.to_vec())]);
        // 16 KiB each: a value torn by the power loss (each unsynced
        // sector kept with probability one half) cannot pass its CRC.
        let marked = vec![0xAB; 16 << 10];
        let unmarked = vec![0xCD; 16 << 10];
        let slot = cluster.propose_with(leader, &put(1, &marked), EntrySync::Always);
        assert!(
            cluster
                .run_until(300, |_| slot.lock().unwrap().is_some())
                .unwrap()
        );
        let outcome = slot.lock().unwrap().clone();
        assert!(
            matches!(outcome, Some(Outcome::Applied { .. })),
            "{outcome:?}"
        );
        let slot = cluster.propose(leader, &put(2, &unmarked));
        assert!(
            cluster
                .run_until(300, |_| slot.lock().unwrap().is_some())
                .unwrap()
        );
        assert!(matches!(
            *slot.lock().unwrap(),
            Some(Outcome::Applied { .. })
        ));
        for id in cluster.ids() {
            cluster.power_off(id);
        }
        for id in cluster.ids() {
            cluster.restart(id).unwrap();
        }
        assert!(
            cluster
                .run_until(1_000, |c| leader_holds(c, &key(1), &marked))
                .unwrap(),
            "seed {seed}: the entry marked synced was lost with every replica's power"
        );
        cluster.run(100).unwrap();
        if !leader_holds(&mut cluster, &key(2), &unmarked) {
            unmarked_lost += 1;
        }
    }
    // The power loss is real: acknowledged writes that were not marked
    // (buffered) do not all survive it.
    assert!(
        unmarked_lost > 0,
        "seeds {first} and the {} after it: every buffered write survived the power loss",
        RUNS - 1
    );
}

/// Ticks from cutting off a leader until a follower first campaigns (the
/// start of its pre-vote), for the cluster of `seed`.
fn ticks_to_first_campaign(seed: u64, spread: usize) -> u64 {
    let mut template = crate::replica::ReplicaConfig::new(0, 0);
    template.election_spread_ticks = spread;
    let mut cluster = SimCluster::with_config(seed, 3, template);
    assert!(
        cluster.run_until(200, |c| c.leader().is_some()).unwrap(),
        "seed {seed}: no leader elected"
    );
    // Heartbeats settle every follower's timer first.
    cluster.run(20).unwrap();
    let old = cluster.leader().expect("a leader");
    cluster.partition(&[old]);
    for tick in 1..=200 {
        cluster.tick().unwrap();
        for id in cluster.ids() {
            if id != old
                && cluster
                    .replica(id)
                    .is_some_and(|r| r.raw.raft.state != raft::StateRole::Follower)
            {
                return tick;
            }
        }
    }
    panic!("seed {seed}: nobody campaigned within 200 ticks of the leader's loss");
}

#[test]
fn a_follower_campaigns_within_the_election_spread_after_its_leader_goes_silent() {
    // The last heartbeat reached the followers at most `heartbeat_ticks`
    // before the cut; each then waits `election_ticks` plus a draw below
    // `election_spread_ticks`. With raft-rs's default spread (as many
    // ticks again) the first campaign comes as late as tick 19: a frozen
    // leader's shard would wait up to twice the election timeout.
    let config = crate::replica::ReplicaConfig::new(0, 0);
    let bound = (config.election_ticks + config.election_spread_ticks - 1) as u64;
    let base = tidepool_testkit::seed_from_env("CLUSTER_SEED");
    let mut seen = Vec::new();
    for seed in base..base.wrapping_add(12) {
        let ticks = ticks_to_first_campaign(seed, config.election_spread_ticks);
        assert!(
            ticks <= bound,
            "seed {seed}: first campaign {ticks} ticks after the leader's loss, bound {bound}"
        );
        seen.push(ticks);
    }
    let wide: Vec<u64> = (base..base.wrapping_add(12))
        .map(|seed| ticks_to_first_campaign(seed, config.election_ticks))
        .collect();
    eprintln!(
        "first campaign after the cut, in ticks: spread {} {seen:?}; spread {} {wide:?}",
        config.election_spread_ticks, config.election_ticks
    );
    assert!(
        wide.iter().any(|t| *t > bound),
        "the control with raft-rs's default spread campaigns late in some cluster"
    );
}

/// A proposal held while a leadership transfer is pending keeps its entry
/// context when it is proposed at last: a write asked to be synced (on a
/// buffered group) is synced, and its trace context follows it. Before,
/// held proposals were proposed with an empty context: acknowledged
/// unsynced.
#[test]
fn a_proposal_held_through_a_transfer_keeps_its_sync_marker() {
    use crate::command::Command;
    use crate::entry_context::EntrySync;
    use crate::sim::{SimOptions, put_op};

    let seed = tidepool_testkit::seed_from_env("SIM_SEED");
    let options = SimOptions::buffered_without_background_syncs();
    let mut cluster = SimCluster::with_options(seed, 3, options);
    assert!(cluster.run_until(300, |c| c.leader().is_some()).unwrap());
    let leader = cluster.leader().unwrap();
    cluster.run(5).unwrap();
    let target = cluster.ids().into_iter().find(|i| *i != leader).unwrap();
    cluster
        .replica(leader)
        .unwrap()
        .transfer_leader(target)
        .unwrap();
    // The transfer hangs (its message never arrives) until raft-rs aborts it.
    cluster.cut_one_way(leader, target);
    assert!(cluster.replica(leader).unwrap().transferring());
    let put = Command::Write(vec![put_op(key(1), vec![0xAB; 64])]);
    let slot = cluster.propose_with(leader, &put, EntrySync::Always);
    cluster.run(1).unwrap();
    assert!(slot.lock().unwrap().is_none(), "seed {seed}: held");
    assert!(
        cluster
            .run_until(300, |_| slot.lock().unwrap().is_some())
            .unwrap(),
        "seed {seed}: the held proposal was answered"
    );
    let outcome = slot.lock().unwrap().clone();
    let Some(Outcome::Applied { index, .. }) = outcome else {
        panic!("seed {seed}: {outcome:?}");
    };
    let entry = cluster.replica(leader).unwrap().log().entry(index).unwrap();
    assert!(
        crate::entry_context::must_sync(&entry.context),
        "seed {seed}: the entry proposed after the transfer lost its sync marker"
    );
}

/// Runs `cluster` until `slot` is answered; panics unless it applied.
fn applied(cluster: &mut SimCluster, slot: &crate::sim::Pending, what: &str) {
    assert!(
        cluster
            .run_until(500, |_| slot.lock().unwrap().is_some())
            .unwrap(),
        "{what}: no answer"
    );
    let outcome = slot.lock().unwrap().clone();
    assert!(
        matches!(outcome, Some(Outcome::Applied { .. })),
        "{what}: {outcome:?}"
    );
}

/// A three-voter group owning the whole hash space, in real files under
/// `dir` (a split makes and renames directories); node 4 is started empty,
/// to be added. Engines snapshot only when asked: a restart applies every
/// entry again, the saved application state being the founding one.
fn splittable_group(seed: u64, dir: &std::path::Path) -> SimCluster {
    let mut template = crate::replica::ReplicaConfig::new(0, 0);
    template.range = Some((0, u64::MAX));
    let mut options = crate::sim::SimOptions::new(template);
    options.engine.snapshot_interval_ms = 3_600_000;
    options.disk_root = Some(dir.to_path_buf());
    let mut cluster = SimCluster::with_options(seed, 3, options);
    assert!(cluster.run_until(300, |c| c.leader().is_some()).unwrap());
    cluster.add_node(4, &[]);
    cluster
}

/// Where the splits below cut, and the child they name.
const SPLIT_AT: u64 = 1 << 63;
const CHILD: u32 = 2;

/// Proposes the split on the leader and waits for it to apply.
fn split(cluster: &mut SimCluster) {
    let leader = cluster.leader().unwrap();
    let command = crate::command::Command::Split {
        child: CHILD,
        at: SPLIT_AT,
    };
    let slot = cluster.propose(leader, &command);
    applied(cluster, &slot, "the split");
    cluster.run(20).unwrap();
}

/// Kills a voter other than the leader and restarts it; returns its id.
/// First, a write nodes 1 to 4 apply: a follower learns that the last
/// entries committed only with the next message that says so.
fn restart_a_follower(cluster: &mut SimCluster) -> u64 {
    let slot = cluster.put(key(77), b"the last write".to_vec());
    applied(cluster, &slot, "the last write");
    let leader = cluster.leader().unwrap();
    let last = cluster.replica(leader).unwrap().log().applied();
    assert!(
        cluster
            .run_until(500, |c| (1..=4)
                .all(|id| c.replica(id).is_some_and(|r| r.log().applied() >= last)))
            .unwrap(),
        "the replicas never applied the last write"
    );
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    cluster.kill(follower);
    cluster.restart(follower).unwrap();
    cluster.run(50).unwrap();
    follower
}

/// A directory of the child's name that holds another group — its shard
/// id given again after the coordinator's store lost a split in flight —
/// is not taken for the child: every replica fails at the split, its
/// range whole, instead of giving the upper half away with no group to
/// hold it (and shedding it from its segments).
#[test]
fn a_split_does_not_take_another_groups_directory_for_its_child() {
    use prost::Message as _;
    let seed = tidepool_testkit::seed_from_env("SIM_SEED");
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = splittable_group(seed, dir.path());
    let slot = cluster.put(key(1), b"before the split".to_vec());
    applied(&mut cluster, &slot, "a write");
    let other = dir.path().join(CHILD.to_string());
    std::fs::create_dir(&other).unwrap();
    let info = tidepool_proto::v1::ShardInfo {
        shard_id: CHILD,
        hash_start: 5,
        hash_end: 6,
        ..Default::default()
    };
    std::fs::write(other.join(crate::store::SHARD_FILE), info.encode_to_vec()).unwrap();
    let leader = cluster.leader().unwrap();
    let slot = cluster.propose(
        leader,
        &crate::command::Command::Split {
            child: CHILD,
            at: SPLIT_AT,
        },
    );
    cluster.run(50).unwrap();
    assert!(
        !matches!(*slot.lock().unwrap(), Some(Outcome::Applied { .. })),
        "seed {seed}: the split was carried out"
    );
    for id in 1..=3 {
        if let Some(replica) = cluster.replica(id) {
            assert!(
                replica.log().children().is_empty(),
                "seed {seed}: node {id}"
            );
            assert_eq!(replica.log().range(), Some((0, u64::MAX)), "node {id}");
        }
    }
    // The voters stopped at the entry.
    for id in 1..=3 {
        assert!(
            cluster.replica(id).is_none(),
            "seed {seed}: node {id} went on"
        );
    }
    // Reopened, a replica applies the entry again and does not split.
    let _ = cluster.restart(1);
    cluster.run(20).unwrap();
    if let Some(replica) = cluster.replica(1) {
        assert!(replica.log().children().is_empty(), "seed {seed}: reopened");
        assert_eq!(replica.log().range(), Some((0, u64::MAX)), "reopened");
    }
}

/// A split entry applied while a learner joins is refused by every
/// replica (the group's membership is changing). After the learner is
/// promoted and a replica is killed and restarted, the entry applied again
/// is decided as it was: before, it was decided under the membership
/// recovered, the learner's promotion included, and that replica alone
/// split — its child's copy lacked what the others went on writing.
#[test]
fn a_split_refused_while_a_learner_joined_stays_refused_after_a_restart() {
    use raft::eraftpb::ConfChangeType;
    let seed = tidepool_testkit::seed_from_env("SIM_SEED");
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = splittable_group(seed, dir.path());
    let slot = cluster.change_membership(ConfChangeType::AddLearnerNode, 4);
    applied(&mut cluster, &slot, "adding the learner");
    cluster.run(20).unwrap();
    // The application state saved with the learner's addition applied
    // (entries before the split are not applied again after the restart:
    // none puts the membership of the split's time back).
    for id in 1..=3 {
        cluster.replica(id).unwrap().engine().flush().unwrap();
    }
    split(&mut cluster);
    let slot = cluster.change_membership(ConfChangeType::AddNode, 4);
    applied(&mut cluster, &slot, "promoting the learner");
    cluster.run(20).unwrap();
    let restarted = restart_a_follower(&mut cluster);
    for id in cluster.ids() {
        let replica = cluster.replica(id).unwrap();
        assert!(
            replica.log().children().is_empty(),
            "node {id} (restarted: {restarted}) carried the refused split out, seed {seed}"
        );
        assert_eq!(replica.log().range(), Some((0, u64::MAX)), "node {id}");
    }
}

/// A split carried out just before a learner joins stays carried out on
/// a replica killed and restarted after both: decided again under the
/// membership recovered (a learner joining), the split was refused there
/// and that replica kept the whole range — as leader it would have
/// acknowledged writes of the half the child owns.
#[test]
fn a_split_carried_out_before_a_learner_joined_stays_carried_out_after_a_restart() {
    use raft::eraftpb::ConfChangeType;
    let seed = tidepool_testkit::seed_from_env("SIM_SEED");
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = splittable_group(seed, dir.path());
    split(&mut cluster);
    let slot = cluster.change_membership(ConfChangeType::AddLearnerNode, 4);
    applied(&mut cluster, &slot, "adding the learner");
    let restarted = restart_a_follower(&mut cluster);
    for id in 1..=3 {
        let replica = cluster.replica(id).unwrap();
        assert_eq!(
            replica.log().range(),
            Some((0, SPLIT_AT - 1)),
            "node {id} (restarted: {restarted}), seed {seed}"
        );
        assert_eq!(
            replica
                .log()
                .children()
                .iter()
                .map(|c| c.shard_id)
                .collect::<Vec<_>>(),
            vec![CHILD],
            "node {id}"
        );
    }
}

/// As above, with a membership change between the last saved application
/// state and the split: applied again after the restart, raft-rs computes
/// it on top of the newest configuration (the learner already promoted),
/// not what it made the first time — decided under that, the split every
/// replica refused was carried out on the restarted one. The membership
/// recovered for the split's entry is the one recorded then.
#[test]
fn a_split_refused_after_a_membership_change_stays_refused_after_a_restart() {
    use raft::eraftpb::ConfChangeType;
    let seed = tidepool_testkit::seed_from_env("SIM_SEED");
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = splittable_group(seed, dir.path());
    cluster.add_node(5, &[]);
    for node in [4, 5] {
        let slot = cluster.change_membership(ConfChangeType::AddLearnerNode, node);
        applied(&mut cluster, &slot, "adding a learner");
    }
    cluster.run(20).unwrap();
    for id in 1..=3 {
        cluster.replica(id).unwrap().engine().flush().unwrap();
    }
    // After the saved state: learner 5 leaves (applied again on top of the
    // newest configuration, where 5 is no member, it changes nothing).
    let slot = cluster.change_membership(ConfChangeType::RemoveNode, 5);
    applied(&mut cluster, &slot, "removing learner 5");
    split(&mut cluster);
    let slot = cluster.change_membership(ConfChangeType::AddNode, 4);
    applied(&mut cluster, &slot, "promoting learner 4");
    cluster.run(20).unwrap();
    // Twice, the same replica: applying the membership change again
    // recorded raft-rs's recomputation, which the second restart took for
    // the configuration the change made.
    let restarted = restart_a_follower(&mut cluster);
    for round in 0..2 {
        if round == 1 {
            cluster.kill(restarted);
            cluster.restart(restarted).unwrap();
            cluster.run(50).unwrap();
        }
        for id in 1..=4 {
            let replica = cluster.replica(id).unwrap();
            assert!(
                replica.log().children().is_empty(),
                "restart {round}: node {id} (restarted: {restarted}) carried the refused split out, seed {seed}"
            );
            assert_eq!(
                replica.log().range(),
                Some((0, u64::MAX)),
                "restart {round}: node {id}, seed {seed}"
            );
        }
    }
}

/// Whether every replica of `cluster` says its listings are complete
/// (`names::is_complete`), by node.
fn listings_complete(cluster: &mut SimCluster) -> Vec<(u64, bool)> {
    cluster
        .ids()
        .into_iter()
        .map(|id| {
            let engine = cluster.replica(id).unwrap().engine().clone();
            let names = engine.key_space(crate::names::NAMES_KEY_SPACE).unwrap();
            (id, crate::names::is_complete(&engine, names).unwrap())
        })
        .collect()
}

/// A put of `kind` under `key` as the SDK's node proposes it, with `name`.
fn named_put(
    key: [u8; 32],
    kind: tidepool_proto::v1::BlobKind,
    name: &[u8],
) -> crate::command::Command {
    let content = key.to_vec();
    let value = crate::blob::encode(kind, &crate::blob::sha256(&content), &content);
    crate::command::Command::Write(vec![crate::command::WriteOp {
        name: name.to_vec(),
        ..crate::sim::put_op(key, value)
    }])
}

/// A put applied without its name — proposed by a version whose commands
/// carry none — leaves a blob the name index cannot list: every replica
/// then says its listings are incomplete (they said complete, and a
/// garbage collector working from a listing deleted what that blob
/// references). An SDK chunk, never listed, changes nothing.
#[test]
fn a_put_applied_without_its_name_makes_listings_incomplete() {
    use tidepool_proto::v1::BlobKind;
    let mut cluster = SimCluster::new(21, 3, Durability::Synced);
    assert!(cluster.run_until(200, |c| c.leader().is_some()).unwrap());
    let all = |cluster: &mut SimCluster, want: bool| {
        listings_complete(cluster)
            .into_iter()
            .all(|(_, complete)| complete == want)
    };
    for (i, (kind, name)) in [
        (BlobKind::Data, &b"named"[..]),
        (BlobKind::Chunk, b""),
        (BlobKind::Data, b""),
    ]
    .into_iter()
    .enumerate()
    {
        let leader = cluster.leader().unwrap();
        let slot = cluster.propose(leader, &named_put(key(i as u64), kind, name));
        applied(&mut cluster, &slot, "put");
        cluster.run(20).unwrap();
        let unnamed_data = kind == BlobKind::Data && name.is_empty();
        assert!(
            all(&mut cluster, !unnamed_data),
            "after put {i}: {:?}",
            listings_complete(&mut cluster)
        );
    }
    // Kept across a restart.
    let follower = cluster
        .ids()
        .into_iter()
        .find(|id| Some(*id) != cluster.leader())
        .unwrap();
    cluster.power_off(follower);
    cluster.restart(follower).unwrap();
    assert!(
        all(&mut cluster, false),
        "{:?}",
        listings_complete(&mut cluster)
    );
}

/// A replica installed from the snapshot of a leader whose engine holds
/// blobs and no indexing state (an older version's, from before names were
/// indexed) says its listings are incomplete — as a replica opened on such
/// an engine does — not complete with an index that lacks those blobs.
#[test]
fn a_replica_installed_from_a_snapshot_without_indexing_state_says_so() {
    use raft::eraftpb::ConfChangeType;
    use tidepool_proto::v1::BlobKind;
    let mut cluster = SimCluster::new(22, 3, Durability::Synced);
    assert!(cluster.run_until(200, |c| c.leader().is_some()).unwrap());
    let leader = cluster.leader().unwrap();
    let slot = cluster.propose(leader, &named_put(key(1), BlobKind::Data, b"one"));
    applied(&mut cluster, &slot, "put");
    cluster.run(20).unwrap();
    assert!(listings_complete(&mut cluster).iter().all(|(_, c)| *c));
    let engine = cluster.replica(leader).unwrap().engine().clone();
    let names = engine.key_space(crate::names::NAMES_KEY_SPACE).unwrap();
    crate::names::forget_state(&engine, names).unwrap();
    cluster.add_node(4, &[]);
    let slot = cluster.change_membership(ConfChangeType::AddLearnerNode, 4);
    applied(&mut cluster, &slot, "add a learner");
    assert!(
        cluster
            .run_until(500, |c| c.replica(4).is_some_and(|r| {
                let space = r.engine().key_space("blobs").unwrap();
                r.engine().get(space, &key(1)).unwrap().is_some()
            }))
            .unwrap(),
        "the new replica never got the blob"
    );
    let complete: Vec<_> = listings_complete(&mut cluster);
    assert!(
        complete.contains(&(4, false)),
        "node 4 installed blobs it cannot list and says complete: {complete:?}"
    );
}

/// A follower compacts its log while its engine's own snapshot comes in
/// the middle (the maintenance task's, every few seconds, at any moment)
/// and the process dies before the compaction is durable: every applied
/// write is in the restarted replica's index. Before, the new first index
/// was saved before the applied entries' index changes were flushed: the
/// snapshot held it with a replay position before those changes, the
/// restart re-applied from the new first index only, and the writes were
/// gone from this replica.
#[test]
fn a_snapshot_in_the_middle_of_a_compaction_loses_no_applied_write() {
    let mut options = crate::sim::SimOptions::new(crate::replica::ReplicaConfig::new(0, 0));
    options.engine.snapshot_interval_ms = 3_600_000;
    let mut cluster = SimCluster::with_options(23, 3, options);
    assert!(cluster.run_until(200, |c| c.leader().is_some()).unwrap());
    let pending: Vec<_> = (0..40)
        .map(|i| cluster.put(key(i), vec![i as u8; 300]))
        .collect();
    assert!(
        cluster
            .run_until(300, |_| pending.iter().all(|p| p.lock().unwrap().is_some()))
            .unwrap()
    );
    cluster.run(20).unwrap();
    let follower = cluster
        .ids()
        .into_iter()
        .find(|id| Some(*id) != cluster.leader())
        .unwrap();
    let image = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (taken, disk) = (image.clone(), cluster.storage(follower));
    let replica = cluster.replica(follower).unwrap();
    replica.log().compact_hook = Some(Box::new(move |engine| {
        engine.write_control_snapshot().unwrap();
        *taken.lock().unwrap() = Some(disk.restart_process());
    }));
    let applied = replica.log().applied();
    replica.log().compact(applied).unwrap();
    let image = image.lock().unwrap().take().expect("the hook ran");
    cluster.kill_as_of(follower, image);
    cluster.restart(follower).unwrap();
    let engine = cluster.replica(follower).unwrap().engine().clone();
    let space = engine.key_space("blobs").unwrap();
    let missing: Vec<u64> = (0..40)
        .filter(|i| engine.get(space, &key(*i)).unwrap().is_none())
        .collect();
    assert!(missing.is_empty(), "applied writes lost: {missing:?}");
}

/// A drop of epochs the retention recorded in the group keeps (computed
/// under a shorter retention that a retain entry replaced: in the log
/// with its commit delayed, or sent by a deposed coordinator) is refused
/// by every replica alike; a retain entry from an older map is ignored;
/// once a shorter retention is recorded, the drop it allows applies.
///
/// Also after a kill -9: the refused drop, applied again after a restart
/// (the application state is saved only at engine snapshots), was judged
/// under the retention saved before it and the epoch the engine recovered
/// (the newest) — a mix no replica ever had — and allowed there: that
/// replica alone dropped a blob the retention recorded since (retain 5)
/// keeps. A retain entry now makes the engine snapshot at once, so no
/// entry before it is applied again after it.
#[test]
fn a_drop_the_recorded_retention_does_not_allow_is_refused_by_every_replica() {
    use crate::command::{Command, WriteOp};
    use crate::raftlog::Retained;
    let seed = tidepool_testkit::seed_from_env("SIM_SEED");
    let mut options = crate::sim::SimOptions::new(crate::replica::ReplicaConfig::new(0, 0));
    // No engine snapshot of its own during the test: the restarted replica
    // applies again every entry since the last one a retain entry made.
    options.engine.snapshot_interval_ms = 3_600_000;
    let mut cluster = SimCluster::with_options(seed, 3, options);
    assert!(cluster.run_until(300, |c| c.leader().is_some()).unwrap());
    let propose = |cluster: &mut SimCluster, command: Command, what: &str| {
        let leader = cluster.leader().unwrap();
        let slot = cluster.propose(leader, &command);
        applied(cluster, &slot, what);
        cluster.run(20).unwrap();
    };
    for epoch in 2..=4 {
        propose(
            &mut cluster,
            Command::AdvanceEpoch(epoch),
            "an epoch advance",
        );
    }
    // A blob of namespace 1 written in epoch 3.
    let write = WriteOp {
        epoch: 3,
        ..crate::sim::put_op(key(1), b"kept".to_vec())
    };
    propose(&mut cluster, Command::Write(vec![write]), "the put");
    propose(
        &mut cluster,
        Command::Retain {
            namespace: 1,
            epochs: 3,
            map_version: 10,
        },
        "retain 3",
    );
    // Computed under "retain 1" at epoch 4: drops epochs 1 to 3, which
    // "retain 3" keeps until epoch 5 ends.
    propose(
        &mut cluster,
        Command::DropEpochs {
            namespace: 1,
            below: 4,
        },
        "the stale drop",
    );
    propose(
        &mut cluster,
        Command::Retain {
            namespace: 1,
            epochs: 1,
            map_version: 9,
        },
        "an older map's retain",
    );
    // Lengthened to 5 (the blob stays through epoch 7), then two advances:
    // at epoch 6, "retain 3" would allow the stale drop.
    let held = Retained {
        epochs: 5,
        map_version: 12,
    };
    propose(
        &mut cluster,
        Command::Retain {
            namespace: 1,
            epochs: 5,
            map_version: 12,
        },
        "retain 5",
    );
    for epoch in 5..=6 {
        propose(
            &mut cluster,
            Command::AdvanceEpoch(epoch),
            "an epoch advance",
        );
    }
    let follower = (1..=3).find(|id| Some(*id) != cluster.leader()).unwrap();
    cluster.kill(follower);
    cluster.restart(follower).unwrap();
    assert!(cluster.run_until(300, |c| c.leader().is_some()).unwrap());
    cluster.run(50).unwrap();
    let present = |cluster: &mut SimCluster, id: u64| {
        let engine = cluster.replica(id).unwrap().engine().clone();
        let space = engine.key_space("blobs").unwrap();
        engine.get(space, &key(1)).unwrap().is_some()
    };
    for id in 1..=3 {
        assert!(
            present(&mut cluster, id),
            "node {id} (restarted: {follower}) dropped a blob the recorded retention keeps, seed {seed}"
        );
        let log = cluster.replica(id).unwrap().log();
        assert_eq!(
            log.retained().get(&1),
            Some(&held),
            "node {id}, seed {seed}"
        );
        assert_eq!(log.drops().get(&1), None, "node {id}, seed {seed}");
    }
    // Shortened to 2 epochs (a newer map): at epoch 6 the epochs below 5 go.
    propose(
        &mut cluster,
        Command::Retain {
            namespace: 1,
            epochs: 2,
            map_version: 13,
        },
        "retain 2",
    );
    propose(
        &mut cluster,
        Command::DropEpochs {
            namespace: 1,
            below: 5,
        },
        "the drop retain 2 allows",
    );
    for id in 1..=3 {
        assert!(!present(&mut cluster, id), "node {id}, seed {seed}");
        assert_eq!(
            cluster.replica(id).unwrap().log().drops().get(&1),
            Some(&5),
            "node {id}, seed {seed}"
        );
    }
}

/// The leader's replica stamps a sessioned write's time as it proposes it,
/// from its session clock in the term it leads: whatever time the request
/// carried (a stamp taken before a change of leadership would run from an
/// earlier term's anchor) is not what the shard's sessions see.
#[test]
fn the_leader_stamps_session_times_as_it_proposes() {
    let mut template = ReplicaConfig::new(0, 0);
    template.session_clock = Some(Arc::new(crate::session::SessionClock::default()));
    let mut cluster = SimCluster::with_config(7, 3, template);
    assert!(cluster.run_until(200, |c| c.leader().is_some()).unwrap());
    let leader = cluster.leader().unwrap();
    let mut op = crate::sim::put_op(key(1), vec![1; 100]);
    op.session = Some(crate::session::SessionTag {
        id: 42,
        seq: 1,
        opens: true,
        time_ms: 40 * 60 * 1000,
    });
    let pending = cluster.propose(leader, &Command::Write(vec![op]));
    applied(&mut cluster, &pending, "the sessioned put");
    cluster.run(20).unwrap();
    for id in cluster.ids() {
        let clock = cluster.replica(id).unwrap().log().sessions().clock_ms();
        assert!(clock < 60_000, "node {id}: shard clock {clock}");
    }
}
