//! Cluster-wide epochs: which epochs each namespace's retention lets go,
//! and how far every shard has got. See `docs/design/epochs-cluster.md`.
//!
//! A blob written or touched in epoch `e` in a namespace that retains `N`
//! epochs stays readable while the cluster epoch is below `e + N`. So at
//! cluster epoch `c` the epochs below `c + 1 - N` have expired, and that
//! is the drop each shard is ordered to apply. Epochs start at 1, so a
//! target of 1 or less drops nothing and is not ordered.

use tidepool_proto::v1::{
    ClusterMap, EpochStatus, Namespace, NamespaceDropStatus, ReplicaStatus, RetainOp,
    ShardDropProgress,
};

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tidepool_proto::v1::{ProposeAdminRequest, propose_admin_request::Op as AdminOp};

use crate::CoordinatorError;
use crate::core::Shared;
use crate::nodes::NodeClients;
use crate::plan::{ShardView, shard_views};
use crate::schema::retained_epochs;

/// How long `SetRetention` goes on having shards record a retention.
const RECORD_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest wait for one shard's retain entry.
const RECORD_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between passes over the shards that have not recorded it yet.
const RECORD_PAUSE: Duration = Duration::from_millis(250);

/// The `below` bound of the drop a namespace needs at cluster epoch
/// `epoch`, or `None` when it keeps everything (durable, or too young).
pub fn drop_target(namespace: &Namespace, epoch: u64) -> Option<u64> {
    let keep = retained_epochs(namespace)?;
    let target = (epoch + 1).checked_sub(u64::from(keep))?;
    (target >= 2).then_some(target)
}

/// The epochs a shard records for `namespace` in a retain entry: those
/// its retention keeps, 0 for a durable one (no drop allowed).
pub fn recorded_epochs(namespace: &Namespace) -> u32 {
    retained_epochs(namespace).unwrap_or(0)
}

/// The retain entry `namespace` needs on every shard for `map`'s
/// retention to hold there whatever drop is still in flight.
pub fn retain_op(map: &ClusterMap, namespace: &Namespace) -> RetainOp {
    RetainOp {
        namespace_id: namespace.id,
        epochs: recorded_epochs(namespace),
        map_version: map.version,
    }
}

/// Whether the shard whose leader reports `status` holds what `op`
/// records: from a newer map, or from the same version with the same
/// epochs (a version written again after a restore of the store may have
/// other epochs).
pub fn holds_retention(status: &ReplicaStatus, op: &RetainOp) -> bool {
    status.retained.iter().any(|r| {
        r.namespace_id == op.namespace_id
            && (r.map_version > op.map_version
                || (r.map_version == op.map_version && r.epochs == op.epochs))
    })
}

/// The retain entry a shard's leader needs before the next drop: for the
/// first namespace of `map` with retention that the shard holds none of
/// (created since, or the shard's nodes were upgraded since the last
/// `SetRetention`), or whose retention it holds with other epochs
/// (shortened since: the drops the new one allows would be refused at
/// apply) from this map or an older one. Once per namespace and shard: an
/// idle cluster proposes none. A durable namespace the shard holds none of
/// needs none (no drop is ever computed for it).
pub fn retain_needed(map: &ClusterMap, status: &ReplicaStatus) -> Option<RetainOp> {
    map.namespaces.iter().find_map(|ns| {
        let needed = match status.retained.iter().find(|r| r.namespace_id == ns.id) {
            None => retained_epochs(ns).is_some(),
            Some(held) => held.epochs != recorded_epochs(ns) && held.map_version <= map.version,
        };
        needed.then(|| retain_op(map, ns))
    })
}

impl Shared {
    /// Has every shard with replicas record `namespace`'s retention as
    /// `map` (the map holding it, as written) has it: a retain entry
    /// applied by the shard's leader, or one from a newer map held. From
    /// then on no drop computed under an earlier retention — in a leader's
    /// log with its commit delayed, or still in transit from this or a
    /// deposed coordinator — applies there: every replica refuses it at
    /// apply. Shards split off meanwhile are included as the map lists
    /// them. A shard a node of which runs a version without retain entries
    /// is skipped (there the nodes' maps alone guard drops, as before; said
    /// in the log). Fails (`Unrecorded`, retryable) naming the shards that
    /// have not recorded it within `RECORD_TIMEOUT`: the map holds the new
    /// retention, and calling again finishes the job.
    pub(crate) async fn record_retention(
        &self,
        map: &ClusterMap,
        namespace: &Namespace,
    ) -> Result<(), CoordinatorError> {
        let op = retain_op(map, namespace);
        let deadline = tokio::time::Instant::now() + RECORD_TIMEOUT;
        let mut done = BTreeSet::new();
        let mut skipped = BTreeSet::new();
        let mut failures: BTreeMap<u32, String> = BTreeMap::new();
        loop {
            if self.leadership().is_none() {
                return Err(CoordinatorError::NotLeader);
            }
            let current = self.map();
            let reports = self.fresh_reports(&current).await?;
            let views = shard_views(&current, &reports);
            let mut calls = tokio::task::JoinSet::new();
            for shard in current.shards.iter().filter(|s| !s.replicas.is_empty()) {
                let id = shard.shard_id;
                if done.contains(&id) || skipped.contains(&id) {
                    continue;
                }
                let lacking = crate::splits::lacking(
                    &current,
                    id,
                    &reports,
                    tidepool_proto::capabilities::RETAIN,
                );
                if !lacking.is_empty() {
                    failures.remove(&id);
                    tracing::warn!(
                        shard_id = id,
                        nodes = ?lacking,
                        namespace = %namespace.name,
                        "retention not recorded in a shard whose nodes run a version without retain entries"
                    );
                    skipped.insert(id);
                    continue;
                }
                let view = views.iter().find(|v| v.shard_id == id);
                let Some((leader, status)) =
                    view.and_then(|v| Some((v.leader?, v.leader_status()?)))
                else {
                    failures.insert(id, "no leader known".into());
                    continue;
                };
                if holds_retention(status, &op) {
                    done.insert(id);
                    failures.remove(&id);
                    continue;
                }
                let Some(address) = current
                    .nodes
                    .iter()
                    .find(|n| n.node_id == leader)
                    .map(|n| n.address.clone())
                else {
                    failures.insert(id, format!("leader node {leader} not in the map"));
                    continue;
                };
                let mut client = match self.node_clients.admin(&address) {
                    Ok(client) => client,
                    Err(error) => {
                        failures.insert(id, error.to_string());
                        continue;
                    }
                };
                let request = ProposeAdminRequest {
                    shard_id: id,
                    op: Some(AdminOp::Retain(op)),
                };
                let wait = RECORD_CALL_TIMEOUT
                    .min(deadline.saturating_duration_since(tokio::time::Instant::now()));
                calls.spawn(async move {
                    let call = client.propose_admin(request);
                    (id, NodeClients::call("retain", wait, call).await)
                });
            }
            while let Some(joined) = calls.join_next().await {
                match joined {
                    Ok((id, Ok(_))) => {
                        done.insert(id);
                        failures.remove(&id);
                    }
                    Ok((id, Err(error))) => {
                        failures.insert(id, error.to_string());
                    }
                    Err(error) => tracing::warn!(%error, "a retain call failed to run"),
                }
            }
            // Every shard with replicas the map lists now, but those that
            // recorded it or were skipped (a call that ended without an
            // answer counts as not recorded).
            let pending: Vec<u32> = self
                .map()
                .shards
                .iter()
                .filter(|s| !s.replicas.is_empty())
                .map(|s| s.shard_id)
                .filter(|id| !done.contains(id) && !skipped.contains(id))
                .collect();
            if pending.is_empty() {
                tracing::info!(
                    namespace = %namespace.name,
                    epochs = op.epochs,
                    map_version = op.map_version,
                    shards = done.len(),
                    skipped = skipped.len(),
                    "retention recorded in the shards"
                );
                return Ok(());
            }
            if tokio::time::Instant::now() + RECORD_PAUSE >= deadline {
                let reason = failures
                    .iter()
                    .find(|(id, _)| pending.contains(id))
                    .map_or_else(String::new, |(id, reason)| {
                        format!(" (shard {id}: {reason})")
                    });
                return Err(CoordinatorError::Unrecorded(format!(
                    "namespace {:?}'s retention is in the cluster map (v{}), but shards {pending:?} have not recorded it yet{reason}; until they do, a drop computed under the former retention may still apply there: call again",
                    namespace.name, op.map_version
                )));
            }
            tokio::time::sleep(RECORD_PAUSE).await;
        }
    }
}

/// What a shard's leader reports it has dropped in `namespace`.
fn dropped(view: &ShardView, namespace: u32) -> Option<u64> {
    let status = view.leader_status()?;
    Some(
        status
            .drops
            .iter()
            .find(|d| d.namespace_id == namespace)
            .map_or(0, |d| d.dropped_below),
    )
}

/// Progress of every namespace with retention toward its drop target.
/// A shard without a reporting leader counts as pending at 0.
pub fn epoch_status(epoch: u64, namespaces: &[Namespace], views: &[ShardView]) -> EpochStatus {
    let namespaces = namespaces
        .iter()
        .filter(|ns| retained_epochs(ns).is_some())
        .map(|ns| {
            let target = drop_target(ns, epoch).unwrap_or(0);
            let mut status = NamespaceDropStatus {
                namespace: ns.name.clone(),
                drop_below: target,
                shards_done: 0,
                shards_total: views.len() as u32,
                pending: Vec::new(),
            };
            for view in views {
                let done = dropped(view, ns.id);
                if target == 0 || done.is_some_and(|d| d >= target) {
                    status.shards_done += 1;
                } else {
                    status.pending.push(ShardDropProgress {
                        shard_id: view.shard_id,
                        dropped_below: done.unwrap_or(0),
                    });
                }
            }
            status
        })
        .collect();
    EpochStatus {
        current_epoch: epoch,
        namespaces,
    }
}

#[cfg(test)]
mod tests {
    use tidepool_proto::v1::retention::{Policy, RetainEpochs};
    use tidepool_proto::v1::{EpochDropApplied, ReplicaStatus, Retention};

    use super::*;

    fn retaining(epochs: u32) -> Namespace {
        Namespace {
            name: "cache".into(),
            id: 2,
            retention: Some(Retention {
                policy: Some(Policy::Retain(RetainEpochs { epochs })),
            }),
            ..Namespace::default()
        }
    }

    #[test]
    fn drop_targets_follow_the_retention_rule() {
        // Retain 1: at epoch 2, epoch 1 has expired.
        assert_eq!(drop_target(&retaining(1), 1), None);
        assert_eq!(drop_target(&retaining(1), 2), Some(2));
        // Retain 3: a blob of epoch 1 is readable in epochs 1, 2, 3.
        assert_eq!(drop_target(&retaining(3), 3), None);
        assert_eq!(drop_target(&retaining(3), 4), Some(2));
        assert_eq!(drop_target(&retaining(3), 10), Some(8));
        let durable = Namespace {
            retention: Some(crate::schema::durable()),
            ..Namespace::default()
        };
        assert_eq!(drop_target(&durable, 100), None);
        assert_eq!(drop_target(&Namespace::default(), 100), None);
    }

    #[test]
    fn a_retention_held_with_other_epochs_is_recorded_again() {
        use tidepool_proto::v1::RetentionApplied;
        let map = ClusterMap {
            version: 9,
            namespaces: vec![retaining(2)],
            ..ClusterMap::default()
        };
        let holding = |epochs, map_version| ReplicaStatus {
            retained: vec![RetentionApplied {
                namespace_id: 2,
                epochs,
                map_version,
            }],
            ..ReplicaStatus::default()
        };
        let wanted = RetainOp {
            namespace_id: 2,
            epochs: 2,
            map_version: 9,
        };
        // None held (a namespace created, nodes upgraded), or other epochs
        // held from this map or an older one: recorded.
        assert_eq!(retain_needed(&map, &ReplicaStatus::default()), Some(wanted));
        assert_eq!(retain_needed(&map, &holding(5, 4)), Some(wanted));
        assert_eq!(retain_needed(&map, &holding(5, 9)), Some(wanted));
        assert_eq!(retain_needed(&map, &holding(2, 4)), None);
        // Held from a newer map (another coordinator's): not proposed from
        // an older one, which the apply would ignore.
        assert_eq!(retain_needed(&map, &holding(5, 10)), None);
        assert!(holds_retention(&holding(2, 9), &wanted));
        assert!(holds_retention(&holding(5, 10), &wanted));
        assert!(
            !holds_retention(&holding(5, 9), &wanted),
            "same version, other epochs"
        );
        assert!(!holds_retention(&holding(2, 8), &wanted));
        let other = RetainOp {
            namespace_id: 3,
            ..wanted
        };
        assert!(!holds_retention(&holding(2, 9), &other));
        // A durable namespace: recorded as 0 where some retention is held,
        // never proposed where none is.
        let durable = Namespace {
            retention: Some(crate::schema::durable()),
            ..retaining(1)
        };
        assert_eq!(recorded_epochs(&durable), 0);
        let map = ClusterMap {
            namespaces: vec![durable],
            ..map
        };
        assert_eq!(retain_needed(&map, &ReplicaStatus::default()), None);
        assert_eq!(
            retain_needed(&map, &holding(2, 4)).map(|op| op.epochs),
            Some(0)
        );
    }

    #[test]
    fn status_counts_shards_at_the_target() {
        let view = |shard_id, dropped_below| {
            let mut v = ShardView {
                shard_id,
                leader: Some(1),
                ..ShardView::default()
            };
            v.replicas.insert(
                1,
                ReplicaStatus {
                    drops: vec![EpochDropApplied {
                        namespace_id: 2,
                        dropped_below,
                    }],
                    ..ReplicaStatus::default()
                },
            );
            v
        };
        let views = [view(1, 4), view(2, 3), ShardView::default()];
        let status = epoch_status(4, &[retaining(1)], &views);
        let ns = &status.namespaces[0];
        assert_eq!(ns.drop_below, 4);
        assert_eq!((ns.shards_done, ns.shards_total), (1, 3));
        assert_eq!(ns.pending.len(), 2);
        assert_eq!(ns.pending[0].dropped_below, 3);
    }
}
