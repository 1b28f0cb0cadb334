//! Epochs: whole-file expiry.
//!
//! Every WAL segment belongs to the epoch that was current when it started
//! (advancing the epoch rolls the segment), and every entry carries the
//! epoch of its last write or touch. `drop_epochs_below(E)` removes the
//! entries of epochs below `E` that the filter does not keep — an index
//! walk, no value read — and deletes whole the old segments left with no
//! live entry; background relocation reclaims the others by their garbage
//! ratio, like any segment. `touch` moves an
//! entry into the current epoch with a tiny WAL record and no value copy.
//!
//! Both are deterministic in what they leave visible: given the same
//! sequence of writes, touches, epoch advances and drops (and a
//! deterministic filter), every replica ends with the same keys, values and
//! epochs, whatever its physical layout. See `docs/design/epochs.md`.

use std::collections::BTreeSet;

use crate::engine::Engine;
use crate::entry_update::DiskAccess;
use crate::error::{Error, Result};
use crate::index::entry::Entry;
use crate::metrics::Metrics;
use crate::relocation::{Decision, Mover, RelocationFilter, RelocationReport};
use crate::table::cell::Probe;
use crate::types::{Durability, Epoch, KeySpace, Tag, WalPosition};
use crate::wal::format::{self, FLAG_APPLIED, ItemSpec, Op};

impl Engine {
    /// Drops every entry whose epoch is below `below` unless `filter` keeps
    /// it — an index walk, no value read — then deletes whole the segments
    /// of those epochs left holding no live entry. The others (holding
    /// kept entries, or entries touched into later epochs) are left to
    /// background relocation, which copies their live entries forward
    /// and deletes them once their garbage ratio calls for it, as for any
    /// segment, at its rate limit: a drop never copies a value, so it does
    /// not stall the writer that applies it, and data kept for good is not
    /// rewritten at every drop. The drop is durable when this returns.
    ///
    /// A `Stop` from the filter keeps that entry and every one after it (in
    /// key-space and key order).
    pub fn drop_epochs_below(
        &self,
        below: Epoch,
        filter: &dyn RelocationFilter,
    ) -> Result<RelocationReport> {
        let inner = &*self.inner;
        inner.health.check()?;
        if below > self.epoch() {
            return Err(Error::Config(format!(
                "cannot drop epochs below {}: the current epoch is {}",
                below.0,
                self.epoch().0
            )));
        }
        let _turn = inner.relocation.take_turn_first();
        let size = inner.config.wal_segment_bytes;
        let doomed: BTreeSet<u64> = inner
            .sealed_segments()
            .iter()
            .filter(|s| s.epoch < below)
            .map(|s| s.id.0)
            .collect();
        let in_doomed = |entry: &Entry| doomed.contains(&(entry.location / size));
        let mut holding_live: BTreeSet<u64> = BTreeSet::new();
        let mut mover = Mover::new(inner, None);
        let mut stopped = false;
        // Entries dropped from segments of later epochs (an old entry that
        // relocation copied forward, or one in the active segment): their
        // garbage is not reclaimed here.
        let mut garbage_elsewhere = false;
        for (space_index, space) in inner.table.spaces.iter().enumerate() {
            let space_index = space_index as u8;
            for id in space.cell_ids() {
                for (key, entry) in inner.cell_entries(space, &id)? {
                    let decision = if stopped || entry.epoch >= below {
                        Decision::Keep
                    } else {
                        let info = inner.info(space_index, &key[..space.key_len()], &entry);
                        filter.decide(&info)
                    };
                    match decision {
                        Decision::Drop => {
                            garbage_elsewhere |= !in_doomed(&entry);
                            mover.drop_entry(space_index, &key, entry)?
                        }
                        Decision::Keep | Decision::Stop => {
                            stopped |= decision == Decision::Stop;
                            if in_doomed(&entry) {
                                holding_live.insert(entry.location / size);
                            }
                        }
                    }
                }
            }
        }
        mover.finish()?;
        let mut report = std::mem::take(&mut mover.report);
        report.stopped = stopped;
        holding_live.extend(&mover.kept_segments);
        let emptied: Vec<_> = doomed
            .difference(&holding_live)
            .map(|id| crate::types::SegmentId(*id))
            .collect();
        inner.reclaim(&emptied, &mut report)?;
        if !holding_live.is_empty() || garbage_elsewhere {
            // Their garbage is new, and came with no write (background
            // passes otherwise take a census only after writes): the next
            // pass takes one and relocates them by their garbage ratio.
            inner.relocation.request_census();
        }
        Ok(report)
    }

    /// Moves `key`'s entry into the current epoch, so an epoch drop counts
    /// its age from now. Writes a small record, never the value. Returns
    /// whether the key exists.
    pub fn touch(&self, space: KeySpace, key: &[u8], durability: Durability) -> Result<bool> {
        self.touch_to(space, key, self.epoch(), durability)
    }

    /// Moves `key`'s entry into `epoch` if it is older (a replication layer
    /// passes the epoch the proposer chose, so every replica moves it to the
    /// same one). Returns whether the key exists.
    pub fn touch_to(
        &self,
        space: KeySpace,
        key: &[u8],
        epoch: Epoch,
        durability: Durability,
    ) -> Result<bool> {
        let inner = &*self.inner;
        inner.health.check()?;
        let (table, key) = inner.key(space, key)?;
        let key_len = table.key_len();
        // A concurrent write may supersede the entry between the lookup and
        // the record; then look again.
        for _ in 0..8 {
            let id = table.cell_of(&key);
            let disk = table.with_cell(&id, |cell| match cell.probe(&key, key_len) {
                Probe::Disk(layers) => Some(layers),
                Probe::Found(_) | Probe::Filtered => None,
            });
            let Some(current) = inner.lookup(table, &key)? else {
                return Ok(false);
            };
            if current.epoch >= epoch {
                return Ok(true);
            }
            let known = disk.flatten().map(|d| (d, Some(current)));
            let item = ItemSpec {
                op: Op::Touch,
                key_space: space.0,
                key: &key[..key_len],
                value: &[],
                epoch,
                tag: Tag(0),
                version: current.version,
            };
            let len = format::entry_record_len(0, &[item]);
            // The index changes before the record counts as processed, as
            // for every applied write.
            let (position, touched) = inner.values.append(len, |buf, position| {
                format::write_entry(buf, position, FLAG_APPLIED, &[], &[item]);
                inner.update_entry(space.0, &key, position.0, DiskAccess::Known(known), |now| {
                    (now.version == current.version && !now.tombstone())
                        .then_some(Entry { epoch, ..*now })
                })
            })?;
            inner.wait_durable(position.plus(len as u64), durability)?;
            if touched? {
                Metrics::add(&inner.metrics.counters().touches, 1);
                return Ok(true);
            }
        }
        Err(Error::Io {
            path: "index".into(),
            source: std::io::Error::other("the key kept changing under a touch"),
        })
    }
}

impl crate::engine::Inner {
    /// Waits for `end` to be processed or synced.
    pub(crate) fn wait_durable(&self, end: WalPosition, durability: Durability) -> Result<()> {
        match durability {
            Durability::Buffered => self.values.wait_processed(end),
            Durability::Synced => self.values.wait_synced(end),
        }
    }
}
