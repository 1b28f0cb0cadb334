//! Pure reconcile logic: what the nodes report, turned into a view of each
//! shard, and the next membership step that moves a shard toward its
//! desired replicas. No I/O; the reconciler (`reconcile.rs`) executes the
//! steps.
//!
//! One shard moves one replica at a time: add a learner, let it catch up,
//! promote it, then remove the replica it replaces (transferring leadership
//! away first if that replica leads). Every step that changes the voters
//! checks that a majority of the resulting voters is live, so no move ever
//! takes a shard below a live majority.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use tidepool_proto::v1::{ClusterMap, MoveStep, NodeStatus, ReplicaRole, ReplicaStatus};

/// One shard as the latest reports show it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardView {
    /// The shard.
    pub shard_id: u32,
    /// Node of the replica that leads (highest term among those claiming
    /// to), if any.
    pub leader: Option<u64>,
    /// Voters in the leader's configuration (the map's when leaderless).
    pub voters: BTreeSet<u64>,
    /// Learners in the leader's configuration.
    pub learners: BTreeSet<u64>,
    /// The leader's `conf_version`.
    pub conf_version: u64,
    /// Every replica a node reports, by node.
    pub replicas: BTreeMap<u64, ReplicaStatus>,
    /// Members whose node reported this round without a replica of the
    /// shard: it never opened one (a split child's replica on a node that
    /// closed the parent before reaching the split, or failed to open the
    /// child) or has not yet (just published or added).
    pub absent: BTreeSet<u64>,
}

impl ShardView {
    /// Voters and learners.
    pub fn members(&self) -> BTreeSet<u64> {
        self.voters.union(&self.learners).copied().collect()
    }

    /// The leader's status.
    pub fn leader_status(&self) -> Option<&ReplicaStatus> {
        self.leader.and_then(|id| self.replicas.get(&id))
    }

    /// Nodes whose replica is down though its node is live: its files are
    /// missing, or its engine failed and has not reopened, or the node
    /// holds no replica of the shard at all (it neither votes nor answers).
    /// No step counts it live.
    pub fn down(&self) -> BTreeSet<u64> {
        self.replicas
            .iter()
            .filter(|(_, r)| r.files_missing || r.failed)
            .map(|(node, _)| *node)
            .chain(self.absent.iter().copied())
            .collect()
    }

    /// Nodes whose replica reports its files missing: down for good (it
    /// neither votes nor answers) though its node is live.
    pub fn files_missing(&self) -> BTreeSet<u64> {
        self.replicas
            .iter()
            .filter(|(_, r)| r.files_missing)
            .map(|(node, _)| *node)
            .collect()
    }
}

/// Every (shard, node) whose replica reports its files missing: placement
/// bars those pairs until the replica is closed, so the shard is rebuilt
/// without it.
pub fn files_missing(views: &[ShardView]) -> BTreeSet<(u32, u64)> {
    views
        .iter()
        .flat_map(|v| v.files_missing().into_iter().map(|n| (v.shard_id, n)))
        .collect()
}

/// Views of every shard in `map` from the nodes' reports.
pub fn shard_views(map: &ClusterMap, reports: &BTreeMap<u64, NodeStatus>) -> Vec<ShardView> {
    map.shards
        .iter()
        .map(|shard| {
            let mut view = ShardView {
                shard_id: shard.shard_id,
                ..ShardView::default()
            };
            for (node, report) in reports {
                if let Some(replica) = report
                    .replicas
                    .iter()
                    .find(|r| r.shard_id == shard.shard_id)
                {
                    view.replicas.insert(*node, replica.clone());
                }
            }
            // A claim to lead counts only in the newest term any replica
            // reports: a leader cut off while quiesced does not tick, so
            // never steps down, and goes on claiming the group in its old
            // term — with the real leader silent for a round, its old
            // configuration went into the map and replicas added since were
            // closed as strays. Such a shard is leaderless for the round.
            // (`conf_version` cannot order claims: a replica that installed
            // a snapshot reports the snapshot's index, others the index of
            // the last change.)
            let newest_term = view.replicas.values().map(|r| r.term).max().unwrap_or(0);
            view.leader = view
                .replicas
                .iter()
                .filter(|(_, r)| r.is_leader && r.term >= newest_term)
                .max_by_key(|(_, r)| r.term)
                .map(|(node, _)| *node);
            let (members, conf_version) = match view.leader_status() {
                Some(leader) => (leader.members.clone(), leader.conf_version),
                None => (shard.replicas.clone(), shard.conf_version),
            };
            for member in members {
                if member.role == ReplicaRole::Learner as i32 {
                    view.learners.insert(member.node_id);
                } else {
                    view.voters.insert(member.node_id);
                }
            }
            view.conf_version = conf_version;
            view.absent = view
                .members()
                .into_iter()
                .filter(|node| reports.contains_key(node) && !view.replicas.contains_key(node))
                .collect();
            view
        })
        .collect()
}

/// Learners catching up, watched for progress: one that makes none for the
/// stall bound is given up on — its pair (shard, node) is barred from
/// placement for a while, so the next round removes it and places the
/// replica elsewhere — instead of holding one of the few move slots for
/// ever (a snapshot that keeps failing on a nearly full disk, a source it
/// cannot reach). Progress is a higher applied index, or more bytes of a
/// snapshot received than at the last observation. A transfer that starts
/// again from nothing (its source restarted, leadership moved) makes
/// progress as soon as its bytes grow: measured against the most bytes any
/// earlier transfer reached, a restarted transfer of a large shard had to
/// pass that mark within the stall bound and was given up on. A snapshot
/// that fails and starts again over and over is bounded apart: more than
/// [`RESTARTS`] restarts with no applied progress give the learner up too.
/// A learner within the catch-up slack waits for something else (a
/// majority to promote it with) and is not timed.
#[derive(Debug, Default)]
pub struct LearnerWatch {
    watched: BTreeMap<(u32, u64), Watched>,
    /// Pairs given up on, until when.
    barred: BTreeMap<(u32, u64), Instant>,
    /// Pairs whose replica could not be added (opened, or made a learner)
    /// that many rounds in a row.
    failed_adds: BTreeMap<(u32, u64), u32>,
}

/// Rounds in a row a replica may fail to be added to a node before the
/// pair is barred like a stalled learner.
pub const FAILED_ADDS: u32 = 3;

/// Snapshot transfers to a learner that may start again from nothing (its
/// received bytes fall) while its applied index stays put, before it is
/// given up on as stalled.
pub const RESTARTS: u32 = 5;

#[derive(Debug)]
struct Watched {
    applied: u64,
    /// Snapshot bytes received at the last observation.
    received: u64,
    /// When progress was last seen.
    since: Instant,
    /// Transfers started again since the applied index last grew.
    restarts: u32,
}

impl LearnerWatch {
    /// Looks at this round's learners. Returns those that made no progress
    /// for `stall`, which are now barred for `bar`.
    pub fn observe(
        &mut self,
        now: Instant,
        views: &[ShardView],
        slack: u64,
        stall: Duration,
        bar: Duration,
    ) -> Vec<(u32, u64)> {
        self.barred.retain(|_, until| *until > now);
        let mut timed = BTreeSet::new();
        let mut stalled = Vec::new();
        for view in views {
            if view.leader.is_none() {
                // Nothing moves without a leader; its learners keep their
                // clocks as they were.
                timed.extend(
                    self.watched
                        .keys()
                        .filter(|(shard, _)| *shard == view.shard_id)
                        .copied(),
                );
                continue;
            }
            for &node in &view.learners {
                if caught_up(view, node, slack) {
                    continue;
                }
                let pair = (view.shard_id, node);
                timed.insert(pair);
                // Not reported this round (its node missed the poll): no
                // observation; its clock runs on. Taken as 0 bytes, a
                // missed poll counted as a transfer started again.
                let Some(replica) = view.replicas.get(&node) else {
                    if let Some(watched) = self.watched.get(&pair)
                        && now.duration_since(watched.since) >= stall
                    {
                        stalled.push(pair);
                    }
                    continue;
                };
                let applied = replica.applied_index;
                let received = replica.snapshot_bytes_received;
                let watched = self.watched.entry(pair).or_insert(Watched {
                    applied,
                    received,
                    since: now,
                    restarts: 0,
                });
                if applied > watched.applied {
                    watched.restarts = 0;
                    watched.since = now;
                } else if received > watched.received {
                    watched.since = now;
                } else if received < watched.received && replica.receiving_snapshot {
                    // Fewer bytes of a transfer under way: one started
                    // again (a transfer that ended reports none, and is
                    // not receiving).
                    watched.restarts += 1;
                }
                watched.applied = watched.applied.max(applied);
                watched.received = received;
                if watched.restarts > RESTARTS || now.duration_since(watched.since) >= stall {
                    stalled.push(pair);
                }
            }
        }
        self.watched.retain(|pair, _| timed.contains(pair));
        for pair in &stalled {
            self.watched.remove(pair);
            self.barred.insert(*pair, now + bar);
        }
        stalled
    }

    /// The outcome of adding the replica of `pair` (opening it on its
    /// node and making it a learner). After [`FAILED_ADDS`] failures in a
    /// row the pair is barred for `bar` and `true` returned: a node that
    /// cannot open replicas (its volume read-only) but stays live and
    /// ranks first for placement held a move slot with the same failing
    /// step every round, and shards of a dead node waiting behind it never
    /// got one.
    pub fn added(&mut self, pair: (u32, u64), ok: bool, now: Instant, bar: Duration) -> bool {
        if ok {
            self.failed_adds.remove(&pair);
            return false;
        }
        let failures = self.failed_adds.entry(pair).or_default();
        *failures += 1;
        if *failures < FAILED_ADDS {
            return false;
        }
        self.failed_adds.remove(&pair);
        self.barred.insert(pair, now + bar);
        true
    }

    /// The pairs barred now.
    pub fn barred(&self) -> BTreeSet<(u32, u64)> {
        self.barred.keys().copied().collect()
    }

    /// Forgets everything (a new coordinator term starts the clocks
    /// again).
    pub fn clear(&mut self) {
        self.watched.clear();
        self.barred.clear();
        self.failed_adds.clear();
    }
}

/// Why a shard waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// The shard has no known leader.
    NoLeader,
    /// A learner is catching up.
    CatchUp(u64),
    /// The step would leave fewer live voters than a majority.
    Unsafe,
    /// The node that would get a replica is not live.
    TargetDown(u64),
}

/// The next thing to do to a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Open an empty replica on the node and add it as a learner.
    AddLearner(u64),
    /// Close a leftover replica on a node outside the configuration (an
    /// earlier member) before adding it afresh.
    ClearStale(u64),
    /// Make a caught-up learner a voter.
    Promote(u64),
    /// Remove a replica (learner or voter) from the configuration.
    Remove(u64),
    /// Move leadership to this voter (before removing the leader).
    TransferLeader(u64),
    /// Nothing can be done yet.
    Wait(Wait),
}

impl Step {
    /// The step as the status API names it.
    pub fn move_step(&self) -> MoveStep {
        match self {
            Step::AddLearner(_) | Step::ClearStale(_) => MoveStep::AddLearner,
            Step::Wait(Wait::CatchUp(_)) => MoveStep::CatchUp,
            Step::Promote(_) => MoveStep::Promote,
            Step::Remove(_) | Step::TransferLeader(_) => MoveStep::RemoveOld,
            Step::Wait(_) => MoveStep::AddLearner,
        }
    }
}

fn majority(voters: usize) -> usize {
    voters / 2 + 1
}

/// Whether the replica on `node` has applied close enough to the leader.
fn caught_up(view: &ShardView, node: u64, slack: u64) -> bool {
    let (Some(leader), Some(replica)) = (view.leader_status(), view.replicas.get(&node)) else {
        return false;
    };
    !replica.receiving_snapshot
        && replica.applied_index > 0
        && replica.applied_index + slack >= leader.commit_index
}

/// The next step toward `desired` for a shard, or `None` when its
/// configuration already is `desired` (all voters). `live` holds the nodes
/// that answered this round; a replica whose files are missing, or whose
/// engine failed, counts as down whatever its node does.
pub fn next_step(
    view: &ShardView,
    desired: &BTreeSet<u64>,
    live: &BTreeSet<u64>,
    slack: u64,
) -> Option<Step> {
    let Some(leader) = view.leader else {
        return Some(Step::Wait(Wait::NoLeader));
    };
    let live: &BTreeSet<u64> = &live.difference(&view.down()).copied().collect();
    let live_voters = view.voters.intersection(live).count();
    // Learners first: finish or undo a move in progress.
    if let Some(&learner) = view.learners.iter().find(|l| !desired.contains(l)) {
        return Some(Step::Remove(learner));
    }
    if let Some(&learner) = view.learners.iter().next() {
        if !caught_up(view, learner, slack) {
            return Some(Step::Wait(Wait::CatchUp(learner)));
        }
        if live_voters + 1 < majority(view.voters.len() + 1) {
            return Some(Step::Wait(Wait::Unsafe));
        }
        return Some(Step::Promote(learner));
    }
    // Then add what is missing, one at a time.
    let members = view.members();
    if let Some(&target) = desired.iter().find(|n| !members.contains(n)) {
        if !live.contains(&target) {
            return Some(Step::Wait(Wait::TargetDown(target)));
        }
        let leftover = view
            .replicas
            .get(&target)
            .is_some_and(|r| r.last_index > 0 || r.applied_index > 0);
        return Some(if leftover {
            Step::ClearStale(target)
        } else {
            Step::AddLearner(target)
        });
    }
    // Then remove what is extra: dead replicas first.
    let mut extra: Vec<u64> = view
        .voters
        .iter()
        .copied()
        .filter(|v| !desired.contains(v))
        .collect();
    // A voter still pulling a snapshot, or holding its votes until it
    // catches up (a replaced disk), answers but holds less than what was
    // committed: not a whole copy.
    let partial = |v: &u64| {
        view.replicas
            .get(v)
            .is_some_and(|r| r.receiving_snapshot || r.votes_held)
    };
    let whole = |v: &u64| live.contains(v) && !partial(v);
    extra.sort_by_key(|v| (whole(v), *v));
    let &victim = extra.first()?;
    let remaining: BTreeSet<u64> = view
        .voters
        .iter()
        .copied()
        .filter(|v| *v != victim)
        .collect();
    // A whole victim goes only while every live voter that remains is
    // whole too: counting a partial one let a healthy voter be removed with
    // fewer whole copies left than voters (with two such voters of three,
    // one copy and no quorum). Waiting costs only time. A dead or partial
    // victim (chosen first) is no whole copy: removing it only lowers the
    // quorum.
    if remaining.intersection(live).count() < majority(remaining.len())
        || (whole(&victim) && remaining.iter().any(|v| live.contains(v) && partial(v)))
    {
        return Some(Step::Wait(Wait::Unsafe));
    }
    if victim == leader {
        let successor = remaining
            .iter()
            .copied()
            .filter(|v| live.contains(v))
            .max_by_key(|v| view.replicas.get(v).map_or(0, |r| r.applied_index));
        return Some(match successor {
            Some(to) => Step::TransferLeader(to),
            None => Step::Wait(Wait::Unsafe),
        });
    }
    Some(Step::Remove(victim))
}

#[cfg(test)]
mod tests {
    use tidepool_proto::v1::ReplicaInfo;

    use super::*;

    fn replica(leader: bool, applied: u64) -> ReplicaStatus {
        ReplicaStatus {
            shard_id: 1,
            is_leader: leader,
            term: 2,
            commit_index: applied,
            applied_index: applied,
            last_index: applied,
            ..ReplicaStatus::default()
        }
    }

    fn view(voters: &[u64], learners: &[u64], leader: u64) -> ShardView {
        let mut v = ShardView {
            shard_id: 1,
            leader: Some(leader),
            voters: voters.iter().copied().collect(),
            learners: learners.iter().copied().collect(),
            conf_version: 5,
            replicas: BTreeMap::new(),
            absent: BTreeSet::new(),
        };
        for &n in voters.iter().chain(learners) {
            v.replicas.insert(n, replica(n == leader, 100));
        }
        v
    }

    fn set(ids: &[u64]) -> BTreeSet<u64> {
        ids.iter().copied().collect()
    }

    #[test]
    fn a_move_adds_then_promotes_then_removes() {
        let live = set(&[1, 2, 3, 4]);
        let desired = set(&[1, 2, 4]);
        let v = view(&[1, 2, 3], &[], 1);
        assert_eq!(
            next_step(&v, &desired, &live, 10),
            Some(Step::AddLearner(4))
        );
        let mut v = view(&[1, 2, 3], &[4], 1);
        v.replicas.get_mut(&4).unwrap().applied_index = 3;
        assert_eq!(
            next_step(&v, &desired, &live, 10),
            Some(Step::Wait(Wait::CatchUp(4)))
        );
        v.replicas.get_mut(&4).unwrap().applied_index = 95;
        assert_eq!(next_step(&v, &desired, &live, 10), Some(Step::Promote(4)));
        let v = view(&[1, 2, 3, 4], &[], 1);
        assert_eq!(next_step(&v, &desired, &live, 10), Some(Step::Remove(3)));
        let v = view(&[1, 2, 4], &[], 1);
        assert_eq!(next_step(&v, &desired, &live, 10), None);
    }

    #[test]
    fn the_leader_hands_over_before_it_is_removed() {
        let live = set(&[1, 2, 3, 4]);
        let mut v = view(&[1, 2, 3, 4], &[], 3);
        v.replicas.get_mut(&2).unwrap().applied_index = 120;
        assert_eq!(
            next_step(&v, &set(&[1, 2, 4]), &live, 10),
            Some(Step::TransferLeader(2))
        );
    }

    #[test]
    fn no_step_leaves_fewer_live_voters_than_a_majority() {
        // Voters 1, 2, 3; 2 and 3 are down: promoting 4 makes 2 of 4 live.
        let live = set(&[1, 4]);
        let v = view(&[1, 2, 3], &[4], 1);
        assert_eq!(
            next_step(&v, &set(&[1, 4, 5]), &live, 10),
            Some(Step::Wait(Wait::Unsafe))
        );
        // Removing a live voter while two others are down would leave 1 of 3.
        let v = view(&[1, 2, 3, 4], &[], 1);
        assert_eq!(
            next_step(&v, &set(&[1, 3, 4]), &set(&[1, 2]), 10),
            Some(Step::Wait(Wait::Unsafe))
        );
        // A dead voter goes first, and that is safe.
        let live = set(&[1, 2, 4]);
        assert_eq!(
            next_step(&v, &set(&[1, 2, 4]), &live, 10),
            Some(Step::Remove(3))
        );
    }

    #[test]
    fn a_live_voter_stays_while_a_remaining_voter_pulls_a_snapshot() {
        let live = set(&[1, 2, 3, 4]);
        let desired = set(&[1, 2, 4]);
        for mark in [
            |r: &mut ReplicaStatus| r.receiving_snapshot = true,
            |r: &mut ReplicaStatus| r.votes_held = true,
        ] {
            // 4 was promoted and then fell behind; 1 and 2 are whole, and
            // removing 3 would leave two whole copies of three voters.
            let mut v = view(&[1, 2, 3, 4], &[], 1);
            mark(v.replicas.get_mut(&4).unwrap());
            assert_eq!(
                next_step(&v, &desired, &live, 10),
                Some(Step::Wait(Wait::Unsafe))
            );
            // A dead 3 goes anyway: it holds nothing reachable.
            assert_eq!(
                next_step(&v, &desired, &set(&[1, 2, 4]), 10),
                Some(Step::Remove(3))
            );
            // Once 4 has caught up, 3 goes.
            let v = view(&[1, 2, 3, 4], &[], 1);
            assert_eq!(next_step(&v, &desired, &live, 10), Some(Step::Remove(3)));
            // Two extra, one of them partial: the partial one goes first
            // (no whole copy), not the whole one waiting on it for ever.
            let mut v = view(&[1, 2, 3, 4, 5], &[], 1);
            mark(v.replicas.get_mut(&5).unwrap());
            assert_eq!(
                next_step(&v, &set(&[1, 2, 3]), &set(&[1, 2, 3, 4, 5]), 10),
                Some(Step::Remove(5))
            );
        }
    }

    #[test]
    fn unwanted_learners_are_removed_and_leftovers_cleared() {
        let live = set(&[1, 2, 3, 4, 5]);
        let v = view(&[1, 2, 3], &[5], 1);
        assert_eq!(
            next_step(&v, &set(&[1, 2, 4]), &live, 10),
            Some(Step::Remove(5))
        );
        let mut v = view(&[1, 2, 3], &[], 1);
        v.replicas.insert(4, replica(false, 40));
        assert_eq!(
            next_step(&v, &set(&[1, 2, 4]), &live, 10),
            Some(Step::ClearStale(4))
        );
        v.replicas.insert(4, replica(false, 0));
        assert_eq!(
            next_step(&v, &set(&[1, 2, 4]), &live, 10),
            Some(Step::AddLearner(4))
        );
        assert_eq!(
            next_step(&v, &set(&[1, 2, 9]), &live, 10),
            Some(Step::Wait(Wait::TargetDown(9)))
        );
    }

    #[test]
    fn views_follow_the_highest_term_leader_and_its_configuration() {
        let mut map = ClusterMap::default();
        map.shards.push(tidepool_proto::v1::ShardInfo {
            shard_id: 1,
            ..Default::default()
        });
        let member = |node_id, role: ReplicaRole| ReplicaInfo {
            node_id,
            role: role as i32,
        };
        let mut stale = replica(true, 10);
        stale.term = 1;
        stale.members = vec![member(1, ReplicaRole::Voter)];
        let mut fresh = replica(true, 20);
        fresh.term = 3;
        fresh.conf_version = 9;
        fresh.members = vec![
            member(1, ReplicaRole::Voter),
            member(2, ReplicaRole::Voter),
            member(3, ReplicaRole::Learner),
        ];
        let report = |r: ReplicaStatus| NodeStatus {
            replicas: vec![r],
            ..Default::default()
        };
        let reports = BTreeMap::from([(1, report(stale)), (2, report(fresh))]);
        let views = shard_views(&map, &reports);
        assert_eq!(views[0].leader, Some(2));
        assert_eq!(views[0].voters, set(&[1, 2]));
        assert_eq!(views[0].learners, set(&[3]));
        assert_eq!(views[0].conf_version, 9);
    }

    /// A leader claim from an older term than another replica reports (a
    /// quiesced leader cut off from its group, which never steps down) is
    /// not the shard's leader: with the real leader silent, the shard is
    /// leaderless for the round and nothing is planned from the stale
    /// configuration. A claim is not judged by `conf_version` (a replica
    /// that installed a snapshot reports the snapshot's index).
    #[test]
    fn a_stale_leader_claim_is_not_believed() {
        let mut map = ClusterMap::default();
        map.shards.push(tidepool_proto::v1::ShardInfo {
            shard_id: 1,
            conf_version: 5000,
            ..Default::default()
        });
        let report = |r: ReplicaStatus| NodeStatus {
            replicas: vec![r],
            ..Default::default()
        };
        let mut stale = replica(true, 10);
        stale.term = 2;
        stale.conf_version = 100;
        let mut follower = replica(false, 20);
        follower.term = 3;
        let reports = BTreeMap::from([(1, report(stale.clone())), (3, report(follower))]);
        assert_eq!(shard_views(&map, &reports)[0].leader, None);
        // In the newest term reported, with a lower conf_version than the
        // map's (the map's came from a replica that installed a snapshot).
        let reports = BTreeMap::from([(1, report(stale))]);
        assert_eq!(shard_views(&map, &reports)[0].leader, Some(1));
    }

    /// A replica that cannot be added to a node (opening it fails there)
    /// several rounds in a row bars the pair, as a stalled learner does; a
    /// success in between starts the count again.
    #[test]
    fn a_replica_that_keeps_failing_to_be_added_is_placed_elsewhere() {
        let mut watch = LearnerWatch::default();
        let now = Instant::now();
        let bar = Duration::from_secs(100);
        let pair = (7, 4);
        for _ in 1..FAILED_ADDS {
            assert!(!watch.added(pair, false, now, bar));
        }
        assert!(!watch.added(pair, true, now, bar), "a success starts again");
        for _ in 1..FAILED_ADDS {
            assert!(!watch.added(pair, false, now, bar));
        }
        assert!(watch.barred().is_empty());
        assert!(watch.added(pair, false, now, bar));
        assert_eq!(watch.barred(), BTreeSet::from([pair]));
    }

    /// The learner watch: progress is a higher applied index or more
    /// snapshot bytes than before; a snapshot started again from nothing
    /// is none; a caught-up learner and a leaderless shard are not timed;
    /// a bar ends.
    #[test]
    fn a_learner_is_given_up_on_only_when_it_stops_making_progress() {
        let stall = Duration::from_secs(10);
        let bar = Duration::from_secs(100);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut watch = LearnerWatch::default();
        let mut v = view(&[1, 2, 3], &[4], 1);
        let learner = |v: &mut ShardView, applied: u64, received: u64| {
            let r = v.replicas.get_mut(&4).unwrap();
            r.applied_index = applied;
            r.snapshot_bytes_received = received;
            r.receiving_snapshot = received > 0;
        };
        learner(&mut v, 0, 0);
        let mut observe =
            |v: &ShardView, s: u64| watch.observe(at(s), std::slice::from_ref(v), 10, stall, bar);
        assert!(observe(&v, 0).is_empty());
        // Snapshot bytes keep coming: never given up on.
        for s in 1..=5 {
            learner(&mut v, 0, s * 1_000);
            assert!(observe(&v, s * 8).is_empty());
        }
        // The transfer starts again from nothing: no progress at the
        // restart, but its bytes growing from there are (measured against
        // the 5,000 bytes the first one reached, it was given up on at
        // second 50).
        learner(&mut v, 0, 2_000);
        assert!(observe(&v, 45).is_empty());
        learner(&mut v, 0, 4_000);
        assert!(observe(&v, 49).is_empty());
        // Leaderless meanwhile: the clock neither stops nor restarts.
        let mut leaderless = v.clone();
        leaderless.leader = None;
        assert!(observe(&leaderless, 52).is_empty());
        assert!(observe(&v, 58).is_empty());
        assert_eq!(observe(&v, 59), vec![(1, 4)]);
        assert_eq!(watch.barred(), BTreeSet::from([(1, 4)]));
        // The bar ends.
        watch.observe(at(158), std::slice::from_ref(&v), 10, stall, bar);
        assert_eq!(watch.barred(), BTreeSet::from([(1, 4)]));
        watch.observe(at(160), &[], 10, stall, bar);
        assert!(watch.barred().is_empty());

        // Transfers that keep starting again, each getting somewhere: given
        // up on after RESTARTS of them with nothing applied; an applied
        // snapshot starts the count again.
        let mut watch = LearnerWatch::default();
        let mut observe =
            |v: &ShardView, s: u64| watch.observe(at(s), std::slice::from_ref(v), 10, stall, bar);
        learner(&mut v, 0, 0);
        assert!(observe(&v, 200).is_empty());
        let mut s = 200;
        let mut restart = |v: &mut ShardView, applied: u64| {
            let mut stalled = Vec::new();
            for bytes in [3_000, 6_000, 1_000] {
                s += 1;
                learner(v, applied, bytes);
                stalled = observe(v, s);
            }
            stalled
        };
        for _ in 0..RESTARTS {
            assert!(restart(&mut v, 0).is_empty());
        }
        // A snapshot applied: the count starts again.
        for _ in 0..RESTARTS {
            assert!(restart(&mut v, 5).is_empty());
        }
        assert_eq!(restart(&mut v, 5), vec![(1, 4)]);

        // A round its node missed (not reported) is no restart, and the
        // bytes it shows next are no progress from nothing: five missed
        // polls in a long transfer gave a healthy learner up.
        let mut watch = LearnerWatch::default();
        learner(&mut v, 0, 1_000);
        let mut s = 300;
        for _ in 0..=RESTARTS {
            let mut missed = v.clone();
            missed.replicas.remove(&4);
            s += 1;
            assert!(
                watch
                    .observe(at(s), std::slice::from_ref(&missed), 10, stall, bar)
                    .is_empty()
            );
            let received = v.replicas[&4].snapshot_bytes_received + 1_000;
            learner(&mut v, 0, received);
            s += 1;
            assert!(
                watch
                    .observe(at(s), std::slice::from_ref(&v), 10, stall, bar)
                    .is_empty()
            );
        }
        // Stalled at the same bytes, every other poll missed: no progress
        // (taken as 0 bytes, each report after a miss looked like some).
        let start = s;
        let mut stalled = Vec::new();
        for round in 1..=12 {
            let mut seen = v.clone();
            if round % 2 == 1 {
                seen.replicas.remove(&4);
            }
            stalled = watch.observe(
                at(start + round),
                std::slice::from_ref(&seen),
                10,
                stall,
                bar,
            );
            if !stalled.is_empty() {
                assert_eq!(round, 10, "given up at the stall bound");
                break;
            }
        }
        assert_eq!(stalled, vec![(1, 4)]);
        let mut watch = LearnerWatch::default();
        let s = start + 20;
        assert!(
            watch
                .observe(at(s), std::slice::from_ref(&v), 10, stall, bar)
                .is_empty()
        );
        // Missed for the whole stall bound: given up on all the same.
        let mut missed = v.clone();
        missed.replicas.remove(&4);
        assert!(
            watch
                .observe(at(s + 9), std::slice::from_ref(&missed), 10, stall, bar)
                .is_empty()
        );
        assert_eq!(
            watch.observe(at(s + 10), std::slice::from_ref(&missed), 10, stall, bar),
            vec![(1, 4)]
        );

        // Applied entries count as progress; a caught-up learner (waiting
        // to be promoted) is not timed.
        let mut watch = LearnerWatch::default();
        learner(&mut v, 10, 0);
        assert!(
            watch
                .observe(at(0), std::slice::from_ref(&v), 10, stall, bar)
                .is_empty()
        );
        learner(&mut v, 50, 0);
        assert!(
            watch
                .observe(at(9), std::slice::from_ref(&v), 10, stall, bar)
                .is_empty()
        );
        learner(&mut v, 95, 0);
        assert!(
            watch
                .observe(at(30), std::slice::from_ref(&v), 10, stall, bar)
                .is_empty()
        );
        assert!(
            watch
                .observe(at(60), std::slice::from_ref(&v), 10, stall, bar)
                .is_empty()
        );
        // Behind again: timed from when it fell behind.
        learner(&mut v, 80, 0);
        assert!(
            watch
                .observe(at(61), std::slice::from_ref(&v), 10, stall, bar)
                .is_empty()
        );
        assert!(
            watch
                .observe(at(70), std::slice::from_ref(&v), 10, stall, bar)
                .is_empty()
        );
        assert_eq!(
            watch.observe(at(71), std::slice::from_ref(&v), 10, stall, bar),
            vec![(1, 4)]
        );
    }

    /// A replica whose files are missing counts as down though its node
    /// answers: a learner is not promoted on its count. Voters 1, 2, 3
    /// with node 3's replica lost and node 2 down: promoting learner 4
    /// would make four voters with two up (1 and 4), short of three.
    #[test]
    fn a_replica_whose_files_are_missing_counts_as_down() {
        let desired = set(&[1, 2, 4]);
        let mut v = view(&[1, 2, 3], &[4], 1);
        v.replicas.get_mut(&3).unwrap().files_missing = true;
        let live = set(&[1, 3, 4]);
        assert_eq!(
            next_step(&v, &desired, &live, 10),
            Some(Step::Wait(Wait::Unsafe))
        );
        v.replicas.get_mut(&3).unwrap().files_missing = false;
        assert_eq!(next_step(&v, &desired, &live, 10), Some(Step::Promote(4)));
        assert_eq!(files_missing(&[v.clone()]), BTreeSet::new());
        // One whose engine failed (not reopening) is down the same way.
        v.replicas.get_mut(&3).unwrap().failed = true;
        assert_eq!(
            next_step(&v, &desired, &live, 10),
            Some(Step::Wait(Wait::Unsafe))
        );
        assert_eq!(v.down(), BTreeSet::from([3]));
        // And no voter's removal counts it toward the majority left: voters
        // 1, 2, 3 and 4 with 3 failed and 2 down, removing 4 would leave 1
        // of 3 up.
        let v4 = {
            let mut v4 = view(&[1, 2, 3, 4], &[], 1);
            v4.replicas.get_mut(&3).unwrap().failed = true;
            v4
        };
        assert_eq!(
            next_step(&v4, &set(&[1, 2, 3]), &set(&[1, 3, 4]), 10),
            Some(Step::Wait(Wait::Unsafe))
        );
    }

    /// A member whose live node reports no replica of the shard (a split
    /// child's replica on a node that never opened it) counts as down:
    /// before, only what nodes reported could be down, so such a voter
    /// counted as live — the shard ran on fewer replicas than it showed,
    /// and a removal could pass its majority check.
    #[test]
    fn a_member_whose_node_reports_no_replica_counts_as_down() {
        use tidepool_proto::v1::{ReplicaInfo, ShardInfo};
        let map = ClusterMap {
            shards: vec![ShardInfo {
                shard_id: 9,
                replicas: [1, 2, 3]
                    .iter()
                    .map(|n| ReplicaInfo {
                        node_id: *n,
                        ..ReplicaInfo::default()
                    })
                    .collect(),
                ..ShardInfo::default()
            }],
            ..ClusterMap::default()
        };
        let report = |node: u64, with: bool| NodeStatus {
            node_id: node,
            replicas: if with {
                vec![ReplicaStatus {
                    shard_id: 9,
                    ..ReplicaStatus::default()
                }]
            } else {
                Vec::new()
            },
            ..NodeStatus::default()
        };
        // Node 3 answers without the replica; node 2 does not answer.
        let reports = BTreeMap::from([(1, report(1, true)), (3, report(3, false))]);
        let [v] = &shard_views(&map, &reports)[..] else {
            panic!("one shard")
        };
        assert_eq!(v.absent, BTreeSet::from([3]));
        assert_eq!(v.down(), BTreeSet::from([3]));
        let reports = BTreeMap::from([(1, report(1, true)), (3, report(3, true))]);
        assert!(shard_views(&map, &reports)[0].absent.is_empty());
    }
}
