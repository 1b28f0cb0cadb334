//! Moving entries: copies of live items re-appended at the WAL's tail in
//! batches (records flagged RELOCATED, which replay skips), then each index
//! entry repointed with a compare-and-set, and drop markers for entries the
//! filter removes.

use std::time::{Duration, Instant};

use crate::engine::Inner;
use crate::entry_update::DiskAccess;
use crate::error::Result;
use crate::index::entry::{Entry, Key};
use crate::metrics::Metrics;
use crate::table::cell::Change;
use crate::wal::format::{self, FLAG_RELOCATED, ItemSpec, Op};

/// Bytes of copies gathered before they are written as one record.
const BATCH_BYTES: usize = 256 << 10;
/// Items per record at most.
const BATCH_ITEMS: usize = 1024;

/// What a relocation or drop did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RelocationReport {
    /// Entries copied forward.
    pub entries_relocated: u64,
    /// Bytes of items copied forward.
    pub bytes_relocated: u64,
    /// Entries removed (by the filter, or by an epoch drop).
    pub entries_dropped: u64,
    /// Segment files deleted.
    pub segments_deleted: u64,
    /// Bytes of the deleted segment files.
    pub bytes_reclaimed: u64,
    /// Live entries whose value could not be read (corrupt, or an I/O
    /// error): left in place, their segments kept.
    pub entries_unreadable: u64,
    /// Whether the pass stopped before its end: the filter said stop, or
    /// (a background pass) an epoch drop or checkpoint took the turn.
    pub stopped: bool,
}

struct Pending {
    space: u8,
    key: Key,
    current: Entry,
    value: Vec<u8>,
}

/// Gathers copies and drops, and writes them.
pub(crate) struct Mover<'a> {
    inner: &'a Inner,
    pending: Vec<Pending>,
    pending_bytes: usize,
    /// Bytes per second to copy at most (`None`: unlimited).
    rate: Option<u64>,
    started: Instant,
    copied_bytes: u64,
    pub report: RelocationReport,
    /// Segments (ids) a drop found still holding the key's entry, changed
    /// since the filter saw it (a touch moves an entry to a later epoch in
    /// place): they hold a live entry and must not be reclaimed.
    pub kept_segments: std::collections::BTreeSet<u64>,
}

impl<'a> Mover<'a> {
    pub fn new(inner: &'a Inner, rate: Option<u64>) -> Self {
        Self {
            inner,
            pending: Vec::new(),
            pending_bytes: 0,
            rate,
            started: Instant::now(),
            copied_bytes: 0,
            report: RelocationReport::default(),
            kept_segments: std::collections::BTreeSet::new(),
        }
    }

    /// Queues a copy of `current` (whose value is `value`) to the tail.
    pub fn relocate(&mut self, space: u8, key: Key, current: Entry, value: Vec<u8>) -> Result<()> {
        // A batch is one record: keep it well inside a segment.
        let limit = BATCH_BYTES.min(self.inner.values.max_record_bytes() as usize / 2);
        let item_bytes = format::align8(format::ITEM_HEADER_BYTES + key.len() + value.len());
        if !self.pending.is_empty() && self.pending_bytes + item_bytes > limit {
            self.write_batch()?;
        }
        self.pending_bytes += item_bytes;
        self.pending.push(Pending {
            space,
            key,
            current,
            value,
        });
        if self.pending.len() >= BATCH_ITEMS {
            self.write_batch()?;
        }
        Ok(())
    }

    /// Removes `current` (if it is still the key's entry). If the key's
    /// entry changed since but lives on (a touch: same place, later epoch;
    /// or a newer write), its segment is recorded in `kept_segments`: the
    /// caller must not reclaim it, or the touched entry would point into a
    /// deleted segment.
    pub fn drop_entry(&mut self, space: u8, key: &Key, current: Entry) -> Result<()> {
        let still = std::cell::Cell::new(None);
        let dropped =
            self.inner
                .update_entry(space, key, Change::NO_RECORD, DiskAccess::Read, |now| {
                    if *now == current {
                        return Some(Entry::dropped(now));
                    }
                    still.set((!now.tombstone()).then_some(now.location));
                    None
                })?;
        if dropped {
            self.report.entries_dropped += 1;
            Metrics::add(&self.inner.metrics.counters().entries_dropped, 1);
        } else if let Some(location) = still.get() {
            self.kept_segments
                .insert(location / self.inner.config.wal_segment_bytes);
        }
        Ok(())
    }

    /// Writes what is queued and waits until it is processed.
    pub fn finish(&mut self) -> Result<()> {
        self.write_batch()
    }

    fn write_batch(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let pending = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        let specs: Vec<ItemSpec<'_>> = pending
            .iter()
            .map(|p| ItemSpec {
                op: Op::Put,
                key_space: p.space,
                key: &p.key[..self.inner.table.spaces[usize::from(p.space)].key_len()],
                value: &p.value,
                epoch: p.current.epoch,
                tag: p.current.tag,
                version: p.current.version,
            })
            .collect();
        let len = format::entry_record_len(0, &specs);
        let (position, locations) = self.inner.values.append(len, |buf, position| {
            format::write_entry(buf, position, FLAG_RELOCATED, &[], &specs)
        })?;
        self.inner
            .values
            .wait_processed(position.plus(len as u64))?;
        let mut moved_entries = 0;
        for (p, location) in pending.iter().zip(&locations) {
            // A write that landed since the copy was made wins: the copy is
            // then garbage.
            let moved = self.inner.update_entry(
                p.space,
                &p.key,
                Change::NO_RECORD,
                DiskAccess::Read,
                |now| {
                    let same =
                        now.version == p.current.version && now.location == p.current.location;
                    (same && !now.tombstone()).then_some(Entry {
                        location: location.position.0,
                        len: location.len,
                        ..*now
                    })
                },
            )?;
            if moved {
                moved_entries += 1;
                self.report.bytes_relocated += u64::from(location.len);
            }
        }
        self.report.entries_relocated += moved_entries;
        let counters = &self.inner.metrics.counters();
        Metrics::add(&counters.entries_relocated, moved_entries);
        Metrics::add(&counters.bytes_relocated, len as u64);
        self.copied_bytes += len as u64;
        self.throttle();
        Ok(())
    }

    /// Sleeps as needed to keep copying at or below the rate limit.
    fn throttle(&self) {
        let Some(rate) = self.rate.filter(|r| *r > 0) else {
            return;
        };
        let due = Duration::from_secs_f64(self.copied_bytes as f64 / rate as f64);
        // In steps, so that a drop or checkpoint waiting for the turn is
        // not kept waiting by the pause (the pass stops at its next entry).
        while let Some(wait) = due.checked_sub(self.started.elapsed()) {
            if self.inner.relocation.yielding() {
                return;
            }
            std::thread::sleep(wait.min(Duration::from_millis(10)));
        }
    }
}
