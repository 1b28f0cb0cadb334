//! Compare-and-set on one key's index entry: the primitive relocation, epoch
//! drops and touches are built on.
//!
//! `update_entry` finds the key's *current* entry — in the cell's unflushed
//! changes, its loaded index, or (reading the disk) its on-disk layers — and
//! hands it to a closure that returns the replacement, or `None` to leave it.
//! The decision and the change happen under the cell's lock, so a write that
//! lands in between is never overwritten: the closure sees it and declines.

use crate::engine::Inner;
use crate::error::{Error, Result};
use crate::index::entry::{Entry, Key};
use crate::index::layers::{Layers, same_layers};
use crate::table::SpaceTable;
use crate::table::cell::{Cell, Probe};

/// Attempts before giving up when the cell's on-disk index keeps changing.
const ATTEMPTS: usize = 16;

/// Where a compare-and-set may look for the current entry on disk.
#[derive(Clone, Debug)]
pub(crate) enum DiskAccess {
    /// Read the on-disk index if needed.
    Read,
    /// Do no I/O (the caller holds a WAL claim): if the current entry is
    /// only on disk, use this earlier lookup when the cell still has the
    /// same on-disk layers, else decline.
    Known(Option<(Layers, Option<Entry>)>),
}

enum Step {
    Done(bool),
    ReadDisk(Layers),
}

impl Inner {
    /// Replaces the current entry of `key` with `update(current)`, recorded
    /// as carried by the WAL record at `record`. Returns whether it did.
    pub(crate) fn update_entry(
        &self,
        space_index: u8,
        key: &Key,
        record: u64,
        access: DiskAccess,
        update: impl Fn(&Entry) -> Option<Entry>,
    ) -> Result<bool> {
        self.set_entry(space_index, key, record, access, false, |current| {
            current.and_then(&update)
        })
    }

    /// Records `entry` for `key`, carried by the WAL record at `record`,
    /// unless the key's current entry — in the cell's changes, its loaded
    /// index, or its on-disk layers (read if needed) — is newer. For items
    /// applied again after a restart, which may be older than what the
    /// index holds (a relocated copy of the same write, an epoch drop's
    /// marker, a later write): [`Inner::apply`] compares with the changes
    /// alone, and lookups that do not load a cell read its on-disk layers
    /// newest first, so an older entry must never reach them.
    pub(crate) fn apply_unless_superseded(
        &self,
        space_index: u8,
        key: &Key,
        entry: Entry,
        record: u64,
    ) -> Result<()> {
        // The key's cell is made if needed (a prefix new since the last
        // snapshot): without it the item was dropped, and its write lost.
        let applied = self.set_entry(
            space_index,
            key,
            record,
            DiskAccess::Read,
            true,
            |current| match current {
                Some(current) if !entry.replaces(current) => None,
                _ => Some(entry),
            },
        )?;
        if applied {
            // As `Inner::apply` does: a cell past the threshold is flushed.
            let space = &self.table.spaces[usize::from(space_index)];
            let id = space.cell_of(key);
            let threshold = self.config.flush_dirty_entries as usize;
            let queue = space.with_cell(&id, |cell| {
                let queue = cell.changes.len() >= threshold && !cell.queued && !cell.flushing;
                cell.queued |= queue;
                queue
            });
            if queue == Some(true) {
                self.flush_queue.push_and_wake(space_index, id);
            }
        }
        Ok(())
    }

    /// [`Inner::update_entry`] whose `update` also decides for a key
    /// without an entry (`None`); with `create`, the key's cell is made if
    /// it does not exist (a prefixed key space's).
    fn set_entry(
        &self,
        space_index: u8,
        key: &Key,
        record: u64,
        access: DiskAccess,
        create: bool,
        update: impl Fn(Option<&Entry>) -> Option<Entry>,
    ) -> Result<bool> {
        let space = &self.table.spaces[usize::from(space_index)];
        let id = space.cell_of(key);
        let no_io = matches!(access, DiskAccess::Known(_));
        let mut from_disk: Option<(Layers, Option<Entry>)> = match access {
            DiskAccess::Known(known) => known,
            DiskAccess::Read => None,
        };
        for _ in 0..ATTEMPTS {
            let in_cell = |cell: &mut Cell| {
                self.update_in_cell(space, cell, key, record, from_disk.as_ref(), &update)
            };
            let step = if create {
                Some(space.with_cell_or_create(&id, in_cell))
            } else {
                space.with_cell(&id, in_cell)
            };
            match step {
                None | Some(Step::Done(false)) => return Ok(false),
                Some(Step::Done(true)) => return Ok(true),
                Some(Step::ReadDisk(_)) if no_io => {
                    return Ok(false);
                }
                Some(Step::ReadDisk(layers)) => {
                    let _reading = self.index_gc.read();
                    match self.lookup_layers(space, &id, key, &layers) {
                        Ok(entry) => from_disk = Some((layers, entry)),
                        Err(Error::NoRecord(_)) => from_disk = None,
                        Err(error) => return Err(error),
                    }
                }
            }
        }
        Err(Error::Io {
            path: "index log".into(),
            source: std::io::Error::other("a cell's index kept changing under a compare-and-set"),
        })
    }

    /// The decision under the cell's lock.
    fn update_in_cell(
        &self,
        space: &SpaceTable,
        cell: &mut Cell,
        key: &Key,
        record: u64,
        from_disk: Option<&(Layers, Option<Entry>)>,
        update: &impl Fn(Option<&Entry>) -> Option<Entry>,
    ) -> Step {
        let current = match cell.probe(key, space.key_len()) {
            Probe::Found(current) => current,
            Probe::Filtered => None,
            Probe::Disk(layers) => match from_disk {
                Some((read_from, entry)) if same_layers(read_from, &layers) => *entry,
                _ => return Step::ReadDisk(layers),
            },
        };
        let Some(replacement) = update(current.as_ref()) else {
            return Step::Done(false);
        };
        let added = cell.apply(*key, replacement, record);
        self.table.account(added.unwrap_or(0) as isize);
        Step::Done(added.is_some())
    }
}
