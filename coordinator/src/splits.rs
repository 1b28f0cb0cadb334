//! Shard splits, the coordinator's part (`docs/design/splits.md`, steps 1,
//! 2 and 5): it decides a split by recording an intent in the map (the new
//! shard's id, and where the range is cut), has the shard's leader propose
//! the split entry until some replica reports it applied, and publishes the
//! new shard once its group has a leader. Every step is driven from what
//! the map and the nodes' reports say, so a coordinator that takes over
//! halfway carries on from there.

use std::collections::BTreeSet;

use tidepool_proto::v1::{ClusterMap, ReplicaStatus, ShardInfo, SplitIntent};

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
/// shard follows it with the group's members. Returns whether the map
/// changed (not if the intent is gone, or the new group's replicated range
/// is not the one the intent names).
pub fn publish(map: &mut ClusterMap, parent: u32, leader: u64, status: &ReplicaStatus) -> bool {
    let Some(position) = map.shards.iter().position(|s| s.shard_id == parent) else {
        return false;
    };
    let shard = &mut map.shards[position];
    let Some(intent) = shard.split else {
        return false;
    };
    let range = status.range.as_ref().map(|r| (r.start, r.end));
    if status.shard_id != intent.child_shard_id || range != Some((intent.at, shard.hash_end)) {
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

impl Shared {
    /// Decides a split of `shard_id` at `at` (0: the middle); the
    /// reconciler carries it out. Returns the new shard's id and the cut.
    pub async fn split_shard(
        &self,
        shard_id: u32,
        at: u64,
    ) -> Result<(u32, u64), CoordinatorError> {
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
            let mut view = ShardView {
                shard_id,
                leader: Some(1),
                ..ShardView::default()
            };
            view.replicas.insert(
                1,
                ReplicaStatus {
                    shard_id,
                    is_leader: true,
                    data_bytes,
                    ..ReplicaStatus::default()
                },
            );
            view
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
    fn publishing_needs_the_new_group_to_own_exactly_the_upper_half() {
        let mut map = map_of(&[(1, 0, 99), (2, 100, u64::MAX)]);
        decide(&mut map, 1, 40).unwrap();
        let mut status = ReplicaStatus {
            shard_id: 3,
            is_leader: true,
            range: Some(HashRange { start: 40, end: 98 }),
            members: vec![ReplicaInfo {
                node_id: 7,
                role: 1,
            }],
            conf_version: 1,
            ..ReplicaStatus::default()
        };
        assert!(!publish(&mut map, 1, 7, &status), "wrong range");
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
}
