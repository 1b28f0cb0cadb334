//! Cluster-wide epochs: which epochs each namespace's retention lets go,
//! and how far every shard has got. See `docs/design/epochs-cluster.md`.
//!
//! A blob written or touched in epoch `e` in a namespace that retains `N`
//! epochs stays readable while the cluster epoch is below `e + N`. So at
//! cluster epoch `c` the epochs below `c + 1 - N` have expired, and that
//! is the drop each shard is ordered to apply. Epochs start at 1, so a
//! target of 1 or less drops nothing and is not ordered.

use tidepool_proto::v1::{EpochStatus, Namespace, NamespaceDropStatus, ShardDropProgress};

use crate::plan::ShardView;
use crate::schema::retained_epochs;

/// The `below` bound of the drop a namespace needs at cluster epoch
/// `epoch`, or `None` when it keeps everything (durable, or too young).
pub fn drop_target(namespace: &Namespace, epoch: u64) -> Option<u64> {
    let keep = retained_epochs(namespace)?;
    let target = (epoch + 1).checked_sub(u64::from(keep))?;
    (target >= 2).then_some(target)
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
