//! Sweeping the name index in the background (`docs/design/listing.md`,
//! "Sweeps"): each replica removes the names its group no longer lists —
//! those outside its range after a split, those of blobs an epoch drop
//! took — a bounded step per tick, on its owner, so neither a split nor a
//! drop holds the shard's writes for a time that grows with its names.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Replica;
use crate::error::Result;
use crate::names::{Swept, Walked};

/// Most leaves of the name index a replica examines per tick while it
/// sweeps...
const LEAVES_PER_TICK: usize = 512;
/// ... and most of its owner's time per tick (the owner's thread also runs
/// other replicas' rounds): about 170 leaves, at about 6 µs a leaf
/// examined or removed (`docs/design/listing.md`).
const TIME_PER_TICK: Duration = Duration::from_millis(1);

/// What a replica logs when it finished sweeping a namespace's names.
pub const SWEPT_LOG: &str = "name index swept";

/// A replica's sweeping of its name index.
#[derive(Debug, Default)]
pub(crate) struct Sweeping {
    /// What the index was last found swept to: nothing to do until it
    /// changes.
    clean: Option<Wanted>,
    /// The walk under way: its namespace, what it sweeps to, the last name
    /// examined, and the names it removed so far.
    walk: Option<Walk>,
}

#[derive(Debug)]
struct Walk {
    namespace: u32,
    want: Swept,
    after: Option<Vec<u8>>,
    removed: u64,
}

/// What every namespace's names should be swept to: the group's range, the
/// drops applied, the namespaces the node's map names.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Wanted {
    range: (u64, u64),
    drops: BTreeMap<u32, u32>,
    namespaces: Arc<Vec<u32>>,
}

impl Wanted {
    /// Namespace ids to look at: the map's, and any with a drop applied.
    fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        let dropped = self
            .drops
            .keys()
            .copied()
            .filter(|id| !self.namespaces.contains(id));
        self.namespaces.iter().copied().chain(dropped)
    }

    fn of(&self, namespace: u32) -> Swept {
        Swept {
            range: self.range,
            below: self.drops.get(&namespace).copied().unwrap_or(0),
        }
    }
}

impl Replica {
    /// In a tick: a step of sweeping the name index. Runs on the owner,
    /// between rounds, as apply does: no index change races a walk's
    /// removals. The index is each replica's own (not replicated), so
    /// replicas need not agree on when; listings skip what is still to
    /// sweep. A failing step is logged and ends sweeping until what is
    /// wanted changes.
    pub(crate) fn sweep_names(&mut self) {
        let wanted = Wanted {
            range: self.log().range().unwrap_or(Swept::NEVER.range),
            drops: self.log().drops().clone(),
            namespaces: self
                .config
                .namespaces
                .as_ref()
                .map(|cell| cell.load_full())
                .unwrap_or_default(),
        };
        if self.sweeping.clean.as_ref() == Some(&wanted) {
            return;
        }
        if let Err(error) = self.sweep_step(&wanted) {
            tracing::warn!(shard = self.config.shard_id, %error, "sweeping the name index stopped");
            self.sweeping = Sweeping {
                clean: Some(wanted),
                walk: None,
            };
        }
    }

    /// No walk under way, and the last tick found nothing left to sweep.
    pub(crate) fn sweep_idle(&self) -> bool {
        self.sweeping.walk.is_none() && self.sweeping.clean.is_some()
    }

    fn sweep_step(&mut self, wanted: &Wanted) -> Result<()> {
        let engine = self.engine().clone();
        let walk = match self.sweeping.walk.take() {
            // A walk toward what is wanted now goes on; one toward an older
            // want starts again (its namespace is looked at afresh).
            Some(walk) if walk.want == wanted.of(walk.namespace) => walk,
            _ => {
                let mut next = None;
                for id in wanted.ids() {
                    let want = wanted.of(id);
                    if !crate::names::swept(&engine, self.names, id)?.covers(&want) {
                        next = Some((id, want));
                        break;
                    }
                }
                let Some((namespace, want)) = next else {
                    self.sweeping.clean = Some(wanted.clone());
                    return Ok(());
                };
                Walk {
                    namespace,
                    want,
                    after: None,
                    removed: 0,
                }
            }
        };
        let step = crate::names::sweep_step(
            &engine,
            self.names,
            self.space,
            walk.namespace,
            walk.want,
            walk.after.as_deref(),
            (LEAVES_PER_TICK, Instant::now() + TIME_PER_TICK),
        )?;
        let removed = walk.removed + step.removed;
        match step.walked {
            Walked::Done => tracing::info!(
                shard = self.config.shard_id,
                namespace = walk.namespace,
                removed,
                "{SWEPT_LOG}"
            ),
            Walked::StoppedAfter(name) => {
                self.sweeping.walk = Some(Walk {
                    after: Some(name),
                    removed,
                    ..walk
                });
            }
        }
        Ok(())
    }
}
