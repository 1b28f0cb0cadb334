//! Shard splits, the coordinator's part (`docs/design/splits.md`, steps 1,
//! 2 and 5): it decides a split by recording an intent in the map (the new
//! shard's id, and where the range is cut), has the shard's leader propose
//! the split entry until some replica reports it applied, and publishes the
//! new shard once its group has a leader. Every step is driven from what
//! the map and the nodes' reports say, so a coordinator that takes over
//! halfway carries on from there.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use tidepool_proto::v1::{ClusterMap, NodeStatus, ReplicaStatus, ShardInfo, SplitIntent};

use crate::CoordinatorError;
use crate::core::Shared;
use crate::plan::ShardView;

/// The id the next new shard gets: never one used before.
pub fn next_shard_id(map: &ClusterMap) -> u32 {
    let above_all = map.shards.iter().map(|s| s.shard_id).max().unwrap_or(0) + 1;
    map.next_shard_id.max(above_all)
}

/// Where a shard `[start, end]` is cut in two halves of equal width: the
/// first position of the upper half (`None`: a single position cannot be
/// cut).
pub fn middle(start: u64, end: u64) -> Option<u64> {
    (start < end).then(|| start + (end - start) / 2 + 1)
}

/// Records a split of `shard_id` at `at` (0: the middle) in `map`: returns
/// the new shard's id and the cut, and whether the map changed (a shard
/// with a split under way answers that one).
pub fn decide(
    map: &mut ClusterMap,
    shard_id: u32,
    at: u64,
) -> Result<((u32, u64), bool), CoordinatorError> {
    let child = next_shard_id(map);
    let shard = map
        .shards
        .iter_mut()
        .find(|s| s.shard_id == shard_id)
        .ok_or_else(|| CoordinatorError::InvalidArgument(format!("no shard {shard_id}")))?;
    if let Some(intent) = &shard.split {
        return Ok(((intent.child_shard_id, intent.at), false));
    }
    let (start, end) = (shard.hash_start, shard.hash_end);
    let at = match at {
        0 => middle(start, end).ok_or_else(|| {
            CoordinatorError::InvalidArgument(format!(
                "shard {shard_id} owns one hash position and cannot split"
            ))
        })?,
        at if start < at && at <= end => at,
        at => {
            return Err(CoordinatorError::InvalidArgument(format!(
                "{at:#018x} does not cut shard {shard_id}'s range {start:#018x}..={end:#018x}"
            )));
        }
    };
    shard.split = Some(SplitIntent {
        child_shard_id: child,
        at,
    });
    map.next_shard_id = child + 1;
    Ok(((child, at), true))
}

/// Publishes a split whose new group reported a leader (`leader`, whose
/// status is `status`): the parent's range ends before the cut, the new
/// shard follows it with the group's members, up to the parent's end in
/// the map. Returns whether the map changed (not if the intent is gone, or
/// the new group's replicated range does not start at the cut or reaches
/// past the map's range).
///
/// The new group's range ends before the map's when the parent's group
/// owned less than the map said (a split the map lost, `restore-map
/// --allow-unanswered`, or a later split of the new group): published with
/// the map's end all the same — nodes serve only their group's range, and
/// [`adopt_lost`] then puts the groups owning the rest back after it.
/// Refused instead, the intent stayed for ever and kept `adopt_lost` from
/// the parent.
pub fn publish(map: &mut ClusterMap, parent: u32, leader: u64, status: &ReplicaStatus) -> bool {
    let Some(position) = map.shards.iter().position(|s| s.shard_id == parent) else {
        return false;
    };
    let shard = &mut map.shards[position];
    let Some(intent) = shard.split else {
        return false;
    };
    let covered = status
        .range
        .as_ref()
        .is_some_and(|r| r.start == intent.at && r.start <= r.end && r.end <= shard.hash_end);
    if status.shard_id != intent.child_shard_id || !covered {
        return false;
    }
    let child = ShardInfo {
        shard_id: intent.child_shard_id,
        hash_start: intent.at,
        hash_end: shard.hash_end,
        replicas: status.members.clone(),
        leader_hint: leader,
        conf_version: status.conf_version,
        split: None,
    };
    shard.hash_end = intent.at - 1;
    shard.split = None;
    map.shards.insert(position + 1, child);
    map.next_shard_id = map.next_shard_id.max(intent.child_shard_id + 1);
    true
}

/// The leaders' statuses of groups the nodes run that `map` does not list,
/// by shard (the highest term's where several claim to lead).
pub fn unlisted_leaders(
    map: &ClusterMap,
    reports: &BTreeMap<u64, NodeStatus>,
) -> BTreeMap<u32, (u64, ReplicaStatus)> {
    let listed: BTreeSet<u32> = map.shards.iter().map(|s| s.shard_id).collect();
    let mut leaders: BTreeMap<u32, (u64, ReplicaStatus)> = BTreeMap::new();
    for (node, report) in reports {
        for replica in &report.replicas {
            if !replica.is_leader || replica.range.is_none() || listed.contains(&replica.shard_id) {
                continue;
            }
            let newer = leaders
                .get(&replica.shard_id)
                .is_none_or(|(_, known)| known.term < replica.term);
            if newer {
                leaders.insert(replica.shard_id, (*node, replica.clone()));
            }
        }
    }
    leaders
}

/// Puts back the groups split off `parent` that the map lost — a map
/// restored from one older than the split (`restore-map
/// --allow-unanswered` without the nodes holding the newer map), while the
/// group had applied it: its leader reports `parent_range`, ending before
/// the map's range does, and no request reaches the rest (the group answers
/// `WRONG_SHARD`; the map names no other). When leaders of groups the map
/// does not list (`unlisted`: node, status) report ranges that exactly
/// cover the rest, from the parent's end to the map's, the parent's range
/// ends where its group's does and those shards follow it with their
/// groups' members, as if each split had been published. Ranges only
/// shrink (a split is a committed entry), so a leader's report is never
/// wider than the truth; one from a leader behind a later split is wider,
/// and the rest is put back in a later round, from its group's report.
/// Returns the shards put back (none: the map did not change).
pub fn adopt_lost(
    map: &mut ClusterMap,
    parent: u32,
    parent_range: (u64, u64),
    unlisted: &BTreeMap<u32, (u64, ReplicaStatus)>,
) -> Vec<u32> {
    let listed: BTreeSet<u32> = map.shards.iter().map(|s| s.shard_id).collect();
    let Some(position) = map.shards.iter().position(|s| s.shard_id == parent) else {
        return Vec::new();
    };
    let shard = &map.shards[position];
    if shard.split.is_some()
        || parent_range.0 != shard.hash_start
        || parent_range.1 >= shard.hash_end
    {
        return Vec::new();
    }
    let end = shard.hash_end;
    let mut pieces = Vec::new();
    let mut next = parent_range.1 + 1;
    loop {
        let mut starting = unlisted.iter().filter(|(id, (_, status))| {
            !listed.contains(id) && status.range.as_ref().is_some_and(|r| r.start == next)
        });
        // None, or two groups claiming the same range: not put back.
        let (Some((id, (leader, status))), None) = (starting.next(), starting.next()) else {
            return Vec::new();
        };
        let Some(range) = status
            .range
            .as_ref()
            .filter(|r| r.end <= end && r.start <= r.end)
        else {
            return Vec::new();
        };
        pieces.push(ShardInfo {
            shard_id: *id,
            hash_start: range.start,
            hash_end: range.end,
            replicas: status.members.clone(),
            leader_hint: *leader,
            conf_version: status.conf_version,
            split: None,
        });
        if range.end == end {
            break;
        }
        next = range.end + 1;
    }
    let adopted: Vec<u32> = pieces.iter().map(|p| p.shard_id).collect();
    map.shards[position].hash_end = parent_range.1;
    let highest = adopted.iter().copied().max().unwrap_or(0);
    map.next_shard_id = map.next_shard_id.max(highest.saturating_add(1));
    for (offset, piece) in pieces.into_iter().enumerate() {
        map.shards.insert(position + 1 + offset, piece);
    }
    adopted
}

/// Withdraws the intent to split `parent` into `child` (the group cannot
/// split). Returns whether the map changed.
pub fn withdraw(map: &mut ClusterMap, parent: u32, child: u32) -> bool {
    let Some(shard) = map.shards.iter_mut().find(|s| s.shard_id == parent) else {
        return false;
    };
    if shard.split.is_none_or(|s| s.child_shard_id != child) {
        return false;
    }
    shard.split = None;
    true
}

/// Whether a split at `at` can never apply to the group whose leader
/// reports `status`: the cut lies outside the range the group replicates.
/// The map's range is then wider than the group's (a split the map lost,
/// `restore-map --allow-unanswered`), and the intent, refused by the node
/// every round, would also keep [`adopt_lost`] from putting the lost split
/// back. Only for a group that has not split at this cut already (its
/// range then ends just before it).
pub fn cut_outside_group(status: &ReplicaStatus, child: u32, at: u64) -> bool {
    if status.split_off.contains(&child) {
        return false;
    }
    status
        .range
        .as_ref()
        .is_some_and(|r| !(r.start < at && at <= r.end))
}

/// Nodes holding a replica of `shard_id` (as the map says) whose report in
/// `reports` lacks the split capability: they run a version that cannot
/// apply the split entry. A split waits until there are none. A node not
/// heard from does not hold it up: splits go on while a node is down (it
/// catches up from the log or a snapshot when it returns, normally
/// upgraded, or is replaced), and it counts again once it reports.
pub fn unable_to_split(
    map: &ClusterMap,
    shard_id: u32,
    reports: &BTreeMap<u64, NodeStatus>,
) -> Vec<u64> {
    lacking(map, shard_id, reports, tidepool_proto::capabilities::SPLIT)
}

/// Nodes holding a replica of `shard_id` (as the map says) whose report in
/// `reports` lacks `capability`; a node not heard from is not counted (see
/// [`unable_to_split`]).
pub fn lacking(
    map: &ClusterMap,
    shard_id: u32,
    reports: &BTreeMap<u64, NodeStatus>,
    capability: &str,
) -> Vec<u64> {
    let Some(shard) = map.shards.iter().find(|s| s.shard_id == shard_id) else {
        return Vec::new();
    };
    shard
        .replicas
        .iter()
        .map(|r| r.node_id)
        .filter(|node| {
            reports
                .get(node)
                .is_some_and(|status| !status.capabilities.iter().any(|c| c == capability))
        })
        .collect()
}

/// Shards whose leader reports another range than the map lists: the map
/// lost a split of the group ([`adopt_lost`] puts it back) or the report
/// is from before a split. None is split meanwhile: a split decided on the
/// map's range (each round, on size or load) left an intent that kept the
/// shard from the repair, withdrawn the next round and decided again.
pub fn misranged(map: &ClusterMap, views: &[ShardView]) -> BTreeSet<u32> {
    views
        .iter()
        .filter_map(|view| {
            let reported = view.leader_status()?.range.as_ref()?;
            let listed = map.shards.iter().find(|s| s.shard_id == view.shard_id)?;
            ((reported.start, reported.end) != (listed.hash_start, listed.hash_end))
                .then_some(view.shard_id)
        })
        .collect()
}

/// Shards to split because their leader's engine holds more than `limit`
/// bytes of values, largest first, with those bytes: not one with a split
/// under way, a membership change under way (learners), no size known yet
/// (no census since its replica opened or its range changed: a shard just
/// split still counts the other half until then), or in `unsplittable`.
pub fn over_limit(
    map: &ClusterMap,
    views: &[ShardView],
    limit: u64,
    unsplittable: &BTreeSet<u32>,
) -> Vec<(u32, u64)> {
    let mut over: Vec<(u32, u64)> = views
        .iter()
        .filter(|v| v.learners.is_empty() && !unsplittable.contains(&v.shard_id))
        .filter(|v| {
            map.shards
                .iter()
                .any(|s| s.shard_id == v.shard_id && s.split.is_none() && s.hash_start < s.hash_end)
        })
        .filter_map(|v| {
            let bytes = v.leader_status()?.data_bytes?;
            (bytes > limit).then_some((v.shard_id, bytes))
        })
        .collect();
    over.sort_by_key(|(id, bytes)| (std::cmp::Reverse(*bytes), *id));
    over
}

/// What a hot shard's load allows (from [`HotShards::round`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Hot {
    /// Hot for long enough: split at `at`, where its leader's recent
    /// requests divide most evenly.
    Split {
        /// The shard.
        shard_id: u32,
        /// The first hash position of the upper half.
        at: u64,
        /// Its leader's requests per second.
        requests_per_second: f64,
    },
    /// Hot for long enough, but its load sits on a few keys that no cut
    /// spreads (reported once per shard and range).
    NoCut {
        /// The shard.
        shard_id: u32,
        /// Its leader's requests per second.
        requests_per_second: f64,
    },
}

/// Shards whose leader has reported more than the load limit in every
/// round since some moment (splits by load, `docs/design/splits.md`).
/// Keyed by shard and range end, so a shard whose range narrowed (it split)
/// starts its clock again.
#[derive(Debug, Default)]
pub struct HotShards {
    since: BTreeMap<(u32, u64), (Instant, bool)>,
}

impl HotShards {
    /// Forgets every shard (a new coordinator term).
    pub fn clear(&mut self) {
        self.since.clear();
    }

    /// Takes this round's reports at `now`: a shard stays hot while its
    /// leader reports more than `limit` requests per second (not one with a
    /// split under way, learners, a single hash position, or in
    /// `unsplittable`); one hot for `sustain` is returned to split at its
    /// leader's balanced cut, busiest first, and its clock starts again.
    pub fn round(
        &mut self,
        map: &ClusterMap,
        views: &[ShardView],
        limit: f64,
        sustain: Duration,
        now: Instant,
        unsplittable: &BTreeSet<u32>,
    ) -> Vec<Hot> {
        let mut hot_now = BTreeMap::new();
        for view in views {
            let Some(shard) = map.shards.iter().find(|s| s.shard_id == view.shard_id) else {
                continue;
            };
            let eligible = view.learners.is_empty()
                && shard.split.is_none()
                && shard.hash_start < shard.hash_end
                && !unsplittable.contains(&view.shard_id);
            let Some(status) = view.leader_status() else {
                continue;
            };
            if eligible && status.requests_per_second > limit {
                hot_now.insert((view.shard_id, shard.hash_end), status);
            }
        }
        self.since.retain(|key, _| hot_now.contains_key(key));
        let mut due = Vec::new();
        for (key, status) in hot_now {
            let (since, warned) = self.since.entry(key).or_insert((now, false));
            if now.saturating_duration_since(*since) < sustain {
                continue;
            }
            let (shard_id, end) = key;
            let requests_per_second = status.requests_per_second;
            let range_start = map
                .shards
                .iter()
                .find(|s| s.shard_id == shard_id)
                .map_or(0, |s| s.hash_start);
            match status.load_split_at {
                Some(at) if range_start < at && at <= end => {
                    *since = now;
                    due.push(Hot::Split {
                        shard_id,
                        at,
                        requests_per_second,
                    });
                }
                _ if !*warned => {
                    *warned = true;
                    due.push(Hot::NoCut {
                        shard_id,
                        requests_per_second,
                    });
                }
                _ => {}
            }
        }
        let load = |hot: &Hot| match hot {
            Hot::Split {
                requests_per_second,
                ..
            }
            | Hot::NoCut {
                requests_per_second,
                ..
            } => *requests_per_second,
        };
        due.sort_by(|a, b| load(b).total_cmp(&load(a)));
        due
    }
}

impl Shared {
    /// Decides a split of `shard_id` at `at` (0: the middle); the
    /// reconciler carries it out. Returns the new shard's id and the cut.
    pub async fn split_shard(
        &self,
        shard_id: u32,
        at: u64,
    ) -> Result<(u32, u64), CoordinatorError> {
        let reports = crate::reconcile::alive(self).await?;
        let unable = unable_to_split(&self.map(), shard_id, &reports);
        if !unable.is_empty() {
            return Err(CoordinatorError::Conflict(format!(
                "shard {shard_id} cannot split while nodes {unable:?} hold its replicas: they run a version that cannot apply a split; upgrade them first"
            )));
        }
        let mut decided = (0, 0);
        self.update_map(|map| {
            let (split, changed) = decide(map, shard_id, at)?;
            decided = split;
            Ok(changed.then(Vec::new))
        })
        .await?;
        tracing::info!(
            shard_id,
            child_shard_id = decided.0,
            at = decided.1,
            "shard split decided"
        );
        Ok(decided)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidepool_proto::v1::{HashRange, ReplicaInfo};

    fn map_of(ranges: &[(u32, u64, u64)]) -> ClusterMap {
        ClusterMap {
            shards: ranges
                .iter()
                .map(|&(shard_id, hash_start, hash_end)| ShardInfo {
                    shard_id,
                    hash_start,
                    hash_end,
                    ..ShardInfo::default()
                })
                .collect(),
            ..ClusterMap::default()
        }
    }

    /// A shard whose leader, on node 1, reports `status`.
    fn led_by_node_1(status: ReplicaStatus) -> ShardView {
        let mut view = ShardView {
            shard_id: status.shard_id,
            leader: Some(1),
            ..ShardView::default()
        };
        view.replicas.insert(
            1,
            ReplicaStatus {
                is_leader: true,
                ..status
            },
        );
        view
    }

    #[test]
    fn shards_whose_group_owns_another_range_than_the_map_are_misranged() {
        let map = map_of(&[(1, 0, 99), (2, 100, 199), (3, 200, u64::MAX)]);
        let views = [
            led_by_node_1(leading(1, 0, 99, 1)),
            // A split the map lost: the group owns less.
            led_by_node_1(leading(2, 100, 149, 1)),
            // No leader: nothing known.
            ShardView {
                shard_id: 3,
                ..ShardView::default()
            },
        ];
        assert_eq!(misranged(&map, &views), BTreeSet::from([2]));
    }

    #[test]
    fn the_middle_cuts_a_range_in_two_non_empty_halves() {
        assert_eq!(middle(0, u64::MAX), Some(1 << 63));
        assert_eq!(middle(5, 6), Some(6));
        assert_eq!(middle(5, 7), Some(7));
        assert_eq!(middle(5, 5), None);
        assert_eq!(middle(u64::MAX - 1, u64::MAX), Some(u64::MAX));
    }

    #[test]
    fn a_decided_split_takes_a_new_id_and_is_answered_again_until_published() {
        let mut map = map_of(&[(1, 0, 99), (2, 100, u64::MAX)]);
        let ((child, at), changed) = decide(&mut map, 1, 0).unwrap();
        assert!(changed);
        assert_eq!((child, at), (3, 50));
        assert_eq!(map.next_shard_id, 4);
        // Asked again, even elsewhere: the split under way.
        assert_eq!(decide(&mut map, 1, 70).unwrap(), ((3, 50), false));
        let ((other, _), _) = decide(&mut map, 2, 0).unwrap();
        assert_eq!(other, 4, "ids are never reused");
        assert!(decide(&mut map, 9, 0).is_err());
        let mut map = map_of(&[(1, 0, 99)]);
        assert!(decide(&mut map, 1, 100).is_err(), "past the end");
        assert!(decide(&mut map, 1, 0).is_ok());
    }

    #[test]
    fn shards_over_the_limit_split_largest_first_once_their_size_is_known() {
        let mut map = map_of(&[(1, 0, 99), (2, 100, 199), (3, 200, 299), (4, 300, 300)]);
        let view = |shard_id: u32, data_bytes: Option<u64>| {
            led_by_node_1(ReplicaStatus {
                shard_id,
                data_bytes,
                ..ReplicaStatus::default()
            })
        };
        let views = vec![
            view(1, Some(150)),
            view(2, Some(300)),
            view(3, None),
            view(4, Some(500)),
        ];
        let none = BTreeSet::new();
        // Shard 3's size is unknown; shard 4 is one position wide.
        assert_eq!(over_limit(&map, &views, 100, &none), [(2, 300), (1, 150)]);
        assert_eq!(over_limit(&map, &views, 200, &none), [(2, 300)]);
        assert_eq!(
            over_limit(&map, &views, 100, &BTreeSet::from([2])),
            [(1, 150)]
        );
        decide(&mut map, 2, 0).unwrap();
        assert_eq!(
            over_limit(&map, &views, 100, &none),
            [(1, 150)],
            "under way"
        );
        let mut moving = views.clone();
        moving[0].learners.insert(4);
        assert!(over_limit(&map, &moving, 100, &none).is_empty());
        let ((child, _), _) = decide(&mut map, 1, 0).unwrap();
        assert!(withdraw(&mut map, 1, child));
        assert!(!withdraw(&mut map, 1, child), "once");
        assert!(map.shards[0].split.is_none());
    }

    #[test]
    fn a_shard_splits_by_load_once_hot_for_long_enough_and_only_where_a_cut_spreads_it() {
        let view = |shard_id: u32, rps: f64, at: Option<u64>| {
            led_by_node_1(ReplicaStatus {
                shard_id,
                requests_per_second: rps,
                load_split_at: at,
                ..ReplicaStatus::default()
            })
        };
        let t0 = Instant::now();
        // A round at second `s` with a limit of 500/s held for 10 s.
        let round = |hot: &mut HotShards,
                     map: &ClusterMap,
                     views: &[ShardView],
                     s: u64,
                     unsplittable: &BTreeSet<u32>| {
            let at = t0 + Duration::from_secs(s);
            hot.round(map, views, 500.0, Duration::from_secs(10), at, unsplittable)
        };
        let none = BTreeSet::new();
        let mut map = map_of(&[(1, 0, 999), (2, 1000, 1999), (3, 2000, 2999)]);
        let mut hot = HotShards::default();
        // Shard 1 hot with a cut, 2 hot on one key, 3 cool.
        let views = [
            view(1, 900.0, Some(400)),
            view(2, 1200.0, None),
            view(3, 100.0, Some(2500)),
        ];
        for s in [0, 9] {
            assert!(round(&mut hot, &map, &views, s, &none).is_empty());
        }
        let due = round(&mut hot, &map, &views, 10, &none);
        let expected = [
            Hot::NoCut {
                shard_id: 2,
                requests_per_second: 1200.0,
            },
            Hot::Split {
                shard_id: 1,
                at: 400,
                requests_per_second: 900.0,
            },
        ];
        assert_eq!(due, expected, "busiest first");
        // The shard without a cut is reported once; the split one's clock
        // started again.
        assert!(round(&mut hot, &map, &views, 11, &none).is_empty());
        // A round below the limit starts a shard's clock again.
        let mut cooled = views.clone();
        cooled[0] = view(1, 100.0, Some(400));
        for (views, s) in [(&cooled, 12), (&views, 13), (&views, 22)] {
            assert!(round(&mut hot, &map, views, s, &none).is_empty());
        }
        assert_eq!(round(&mut hot, &map, &views, 23, &none).len(), 1);
        // A split under way, learners, or an unsplittable shard: not hot.
        decide(&mut map, 1, 400).unwrap();
        for s in [24, 40] {
            assert!(round(&mut hot, &map, &views, s, &none).is_empty());
        }
        let mut map = map_of(&[(1, 0, 999)]);
        let mut moving = [view(1, 900.0, Some(400))];
        moving[0].learners.insert(4);
        let alone = [view(1, 900.0, Some(400))];
        let blocked = BTreeSet::from([1]);
        for (views, unsplittable) in [(&moving, &none), (&alone, &blocked)] {
            let mut hot = HotShards::default();
            for s in [0, 20] {
                assert!(round(&mut hot, &map, views, s, unsplittable).is_empty());
            }
        }
        // A cut outside the range (a stale report): no split.
        let mut hot = HotShards::default();
        let stale = [view(1, 900.0, Some(1500))];
        assert!(round(&mut hot, &map, &stale, 0, &none).is_empty());
        assert!(matches!(
            round(&mut hot, &map, &stale, 20, &none)[..],
            [Hot::NoCut { shard_id: 1, .. }]
        ));
        // Once the range narrows the clock starts again.
        map.shards[0].hash_end = 399;
        let narrowed = [view(1, 900.0, Some(200))];
        assert!(round(&mut hot, &map, &narrowed, 21, &none).is_empty());
        assert_eq!(round(&mut hot, &map, &narrowed, 31, &none).len(), 1);
    }

    #[test]
    fn a_shard_waits_for_every_replicas_node_to_report_it_can_split() {
        let mut map = map_of(&[(1, 0, 99), (2, 100, u64::MAX)]);
        for shard in &mut map.shards {
            shard.replicas = [1, 2, 3]
                .map(|node_id| ReplicaInfo { node_id, role: 1 })
                .to_vec();
        }
        let report = |capabilities: &[&str]| NodeStatus {
            capabilities: capabilities.iter().map(|c| c.to_string()).collect(),
            ..NodeStatus::default()
        };
        let now = tidepool_proto::capabilities::ALL;
        // Node 2 runs an older version; node 3 is down (not heard from:
        // splits go on without it).
        let mut reports = BTreeMap::from([(1, report(now)), (2, report(&[]))]);
        assert_eq!(unable_to_split(&map, 1, &reports), [2]);
        reports.insert(3, report(&["something-else"]));
        assert_eq!(unable_to_split(&map, 2, &reports), [2, 3]);
        reports.insert(2, report(now));
        reports.insert(3, report(now));
        assert!(unable_to_split(&map, 1, &reports).is_empty());
        assert!(
            unable_to_split(&map, 9, &reports).is_empty(),
            "no such shard"
        );
    }

    #[test]
    fn publishing_needs_the_new_group_to_own_the_upper_half() {
        let mut map = map_of(&[(1, 0, 99), (2, 100, u64::MAX)]);
        decide(&mut map, 1, 40).unwrap();
        let mut status = ReplicaStatus {
            shard_id: 3,
            is_leader: true,
            range: Some(HashRange { start: 41, end: 99 }),
            members: vec![ReplicaInfo {
                node_id: 7,
                role: 1,
            }],
            conf_version: 1,
            ..ReplicaStatus::default()
        };
        assert!(!publish(&mut map, 1, 7, &status), "not from the cut");
        status.range = Some(HashRange {
            start: 40,
            end: 100,
        });
        assert!(!publish(&mut map, 1, 7, &status), "past the map's range");
        status.range = Some(HashRange { start: 40, end: 99 });
        let before = map.clone();
        assert!(publish(&mut map, 1, 7, &status));
        assert_ne!(map, before);
        let ranges: Vec<_> = map
            .shards
            .iter()
            .map(|s| (s.shard_id, s.hash_start, s.hash_end))
            .collect();
        assert_eq!(ranges, [(1, 0, 39), (3, 40, 99), (2, 100, u64::MAX)]);
        assert_eq!(map.shards[1].replicas, status.members);
        assert_eq!(map.shards[1].leader_hint, 7);
        assert!(map.shards[0].split.is_none());
        assert!(!publish(&mut map, 1, 7, &status), "published once");
    }

    /// A split decided on a map whose range for the shard is wider than
    /// its group's (a split the map lost): the new group owns less than
    /// the map's upper half. Published all the same (the intent used to
    /// stay for ever, holding off the repair of the lost split), and the
    /// lost group is then put back after it.
    #[test]
    fn a_split_whose_new_group_owns_less_than_the_maps_upper_half_is_published() {
        let mut map = map_of(&[(1, 0, 99), (2, 100, u64::MAX)]);
        map.next_shard_id = 6;
        // Shard 1's group owns 0..=69 (its split at 70 into 5 was lost).
        let (child, at) = decide(&mut map, 1, 0).unwrap().0;
        assert_eq!((child, at), (6, 50));
        assert!(publish(&mut map, 1, 7, &leading(6, 50, 69, 1)));
        assert_eq!(ranges(&map), [(1, 0, 49), (6, 50, 99), (2, 100, u64::MAX)]);
        let unlisted = BTreeMap::from([(5, (8, leading(5, 70, 99, 4)))]);
        assert_eq!(adopt_lost(&mut map, 6, (50, 69), &unlisted), [5]);
        assert_eq!(
            ranges(&map),
            [(1, 0, 49), (6, 50, 69), (5, 70, 99), (2, 100, u64::MAX)]
        );
        assert_eq!(next_shard_id(&map), 7, "no id used again");
    }

    fn leading(shard_id: u32, start: u64, end: u64, term: u64) -> ReplicaStatus {
        ReplicaStatus {
            shard_id,
            is_leader: true,
            term,
            range: Some(HashRange { start, end }),
            members: vec![ReplicaInfo {
                node_id: 7,
                role: 1,
            }],
            conf_version: 3,
            ..ReplicaStatus::default()
        }
    }

    fn ranges(map: &ClusterMap) -> Vec<(u32, u64, u64)> {
        map.shards
            .iter()
            .map(|s| (s.shard_id, s.hash_start, s.hash_end))
            .collect()
    }

    #[test]
    fn a_split_the_map_lost_is_put_back_from_the_groups_ranges() {
        let mut map = map_of(&[(1, 0, 99), (2, 100, u64::MAX)]);
        map.next_shard_id = 3;
        let unlisted = BTreeMap::from([(5, (7, leading(5, 40, 99, 2)))]);
        // The parent's group owns the whole range: nothing split off.
        assert!(adopt_lost(&mut map, 1, (0, 99), &unlisted).is_empty());
        // Another range than the map's start: not this shard's group.
        assert!(adopt_lost(&mut map, 1, (10, 39), &unlisted).is_empty());
        // A gap between the parent's range and the unlisted group's.
        assert!(adopt_lost(&mut map, 1, (0, 29), &unlisted).is_empty());
        assert_eq!(ranges(&map), [(1, 0, 99), (2, 100, u64::MAX)]);

        assert_eq!(adopt_lost(&mut map, 1, (0, 39), &unlisted), [5]);
        assert_eq!(ranges(&map), [(1, 0, 39), (5, 40, 99), (2, 100, u64::MAX)]);
        assert_eq!(map.shards[1].leader_hint, 7);
        assert_eq!(map.shards[1].conf_version, 3);
        assert_eq!(map.shards[1].replicas.len(), 1);
        assert_eq!(map.next_shard_id, 6);
        // Listed now: not put back twice.
        assert!(adopt_lost(&mut map, 1, (0, 39), &unlisted).is_empty());
    }

    #[test]
    fn splits_of_splits_the_map_lost_are_put_back_when_their_ranges_cover_the_rest() {
        // 1 split at 40 into 5, then 5 at 70 into 6, then 1 at 20 into 8.
        let mut map = map_of(&[(1, 0, 99), (2, 100, u64::MAX)]);
        let mut unlisted = BTreeMap::from([
            (8, (7, leading(8, 20, 39, 1))),
            (5, (7, leading(5, 40, 69, 1))),
        ]);
        // 70..=99 not covered yet (no leader of 6 reported): nothing.
        assert!(adopt_lost(&mut map, 1, (0, 19), &unlisted).is_empty());
        // A range past the map's end: nothing.
        unlisted.insert(6, (7, leading(6, 70, 120, 1)));
        assert!(adopt_lost(&mut map, 1, (0, 19), &unlisted).is_empty());
        unlisted.insert(6, (7, leading(6, 70, 99, 1)));
        assert_eq!(adopt_lost(&mut map, 1, (0, 19), &unlisted), [8, 5, 6]);
        assert_eq!(
            ranges(&map),
            [
                (1, 0, 19),
                (8, 20, 39),
                (5, 40, 69),
                (6, 70, 99),
                (2, 100, u64::MAX)
            ]
        );
        assert_eq!(map.next_shard_id, 9);
    }

    #[test]
    fn a_stale_wider_report_is_put_back_and_narrowed_in_a_later_round() {
        let mut map = map_of(&[(1, 0, 99)]);
        // 5's leader reports from before 5 split at 70 into 6.
        let unlisted = BTreeMap::from([
            (5, (7, leading(5, 40, 99, 1))),
            (6, (7, leading(6, 70, 99, 1))),
        ]);
        assert_eq!(adopt_lost(&mut map, 1, (0, 39), &unlisted), [5]);
        let unlisted = BTreeMap::from([(6, (7, leading(6, 70, 99, 1)))]);
        assert_eq!(adopt_lost(&mut map, 5, (40, 69), &unlisted), [6]);
        assert_eq!(ranges(&map), [(1, 0, 39), (5, 40, 69), (6, 70, 99)]);
    }

    #[test]
    fn a_shard_with_a_split_under_way_is_left_to_it() {
        let mut map = map_of(&[(1, 0, 99)]);
        decide(&mut map, 1, 40).unwrap();
        let child = map.shards[0].split.unwrap().child_shard_id;
        let unlisted = BTreeMap::from([(child, (7, leading(child, 40, 99, 1)))]);
        assert!(adopt_lost(&mut map, 1, (0, 39), &unlisted).is_empty());
    }

    #[test]
    fn only_leaders_of_unlisted_groups_count_the_newest_term_first() {
        let map = map_of(&[(1, 0, 99)]);
        let node = |replicas: Vec<ReplicaStatus>| NodeStatus {
            replicas,
            ..NodeStatus::default()
        };
        let follower = ReplicaStatus {
            is_leader: false,
            ..leading(5, 40, 99, 9)
        };
        let reports = BTreeMap::from([
            (1, node(vec![leading(1, 0, 39, 4), leading(5, 40, 99, 2)])),
            (2, node(vec![follower, leading(5, 40, 69, 3)])),
            (
                3,
                node(vec![ReplicaStatus {
                    range: None,
                    ..leading(6, 70, 99, 1)
                }]),
            ),
        ]);
        let leaders = unlisted_leaders(&map, &reports);
        assert_eq!(leaders.keys().copied().collect::<Vec<_>>(), [5]);
        assert_eq!(leaders[&5].0, 2);
        assert_eq!(leaders[&5].1.term, 3);
    }

    #[test]
    fn a_cut_outside_the_groups_range_can_never_apply() {
        let status = ReplicaStatus {
            range: Some(HashRange { start: 0, end: 99 }),
            ..ReplicaStatus::default()
        };
        // The map says 0..=199 (a split at 100 it lost); a cut at 150 is
        // the group's to refuse for ever, one at 50 may apply.
        assert!(cut_outside_group(&status, 7, 150));
        assert!(cut_outside_group(&status, 7, 0));
        assert!(!cut_outside_group(&status, 7, 50));
        assert!(!cut_outside_group(&status, 7, 99));
        // Split at this cut already: the range ends before it, by design.
        let split = ReplicaStatus {
            split_off: vec![7],
            ..status.clone()
        };
        assert!(!cut_outside_group(&split, 7, 100));
        // A group that reports no range is not judged.
        assert!(!cut_outside_group(&ReplicaStatus::default(), 7, 150));
    }
}
