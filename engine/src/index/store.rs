//! The index store: index blobs in the index log — written by flushes,
//! read whole when a cell loads, searched in place (mapped) or by window
//! (`pread`) for optimistic lookups.

use std::borrow::Cow;

use crate::error::{Error, Result};
use crate::index::blob::{self, BlobKind, DiskRef};
use crate::index::bloom::Bloom;
use crate::index::entry::{Entry, EntryLayout, Key};
use crate::index::lookup::{self, Found, LookupError};
use crate::types::WalPosition;
use crate::wal::Log;
use crate::wal::format::{self, Kind, RecordView};

/// Index blobs in the index log.
#[derive(Debug)]
pub(crate) struct IndexStore {
    pub log: Log,
    pub bits_per_key: u32,
    pub window: usize,
}

impl IndexStore {
    fn corrupt(&self, position: WalPosition, detail: impl Into<String>) -> Error {
        Error::Corrupt {
            file: "index log".into(),
            position,
            detail: detail.into(),
        }
    }

    /// Appends the sorted `entries` (live ones only for a base) as one
    /// blob of `kind`; `None` for no entries.
    pub fn write(
        &self,
        layout: &EntryLayout,
        entries: &[(Key, Entry)],
        kind: BlobKind,
    ) -> Result<Option<(DiskRef, Bloom)>> {
        if entries.is_empty() {
            return Ok(None);
        }
        let (body, bloom, bloom_len) = blob::encode(layout, entries, self.bits_per_key, kind);
        let len = format::record_len(body.len());
        let (position, ()) = self.log.append(len, |buf, position| {
            format::write_plain(buf, position, Kind::IndexBlob, &body)
        })?;
        let disk = DiskRef {
            position,
            count: entries.len() as u32,
            bloom_len,
        };
        Ok(Some((disk, bloom)))
    }

    /// Reads and verifies a whole blob of `kind`.
    pub fn load(
        &self,
        layout: &EntryLayout,
        disk: &DiskRef,
        kind: BlobKind,
    ) -> Result<(Vec<(Key, Entry)>, Bloom)> {
        let bytes = self.log.read(disk.position, disk.record_len(layout))?;
        let view = RecordView::verify(disk.position, &bytes)
            .map_err(|m| self.corrupt(disk.position, m.0))?;
        if view.header.kind != Kind::IndexBlob {
            return Err(self.corrupt(disk.position, "not an index blob record"));
        }
        blob::decode(layout, view.body, disk, kind).map_err(|m| self.corrupt(disk.position, m.0))
    }

    /// Copies the blob `disk` to the end of the index log: the same body
    /// (entries and bloom filter), verified, under a new record header.
    /// Returns where the copy is.
    pub fn copy(&self, layout: &EntryLayout, disk: &DiskRef) -> Result<DiskRef> {
        let bytes = self.log.read(disk.position, disk.record_len(layout))?;
        let view = RecordView::verify(disk.position, &bytes)
            .map_err(|m| self.corrupt(disk.position, m.0))?;
        if view.header.kind != Kind::IndexBlob {
            return Err(self.corrupt(disk.position, "not an index blob record"));
        }
        let len = format::record_len(view.body.len());
        let (position, ()) = self.log.append(len, |buf, position| {
            format::write_plain(buf, position, Kind::IndexBlob, view.body)
        })?;
        Ok(DiskRef { position, ..*disk })
    }

    /// Reads and verifies a blob's bloom filter.
    pub fn load_bloom(&self, disk: &DiskRef) -> Result<Bloom> {
        let bytes = self
            .log
            .read(disk.header_position(), disk.header_and_bloom_len())?;
        blob::decode_bloom(&bytes, disk).map_err(|m| self.corrupt(disk.header_position(), m.0))
    }

    /// The entries of a blob just below `bound` (`None`: its last ones),
    /// ending at the largest, from one window read (usually).
    pub fn entries_below(
        &self,
        layout: &EntryLayout,
        disk: &DiskRef,
        bound: Option<&Key>,
        guess: usize,
    ) -> Result<lookup::Below> {
        self.with_entries(layout, disk, |_, read| {
            lookup::entries_below(layout, disk.count as usize, bound, guess, self.window, read)
        })?
        .map_err(|e| self.lookup_error(layout, disk, e))
    }

    /// Runs `search` with a blob's entries: all of them in place when the
    /// index log's segment is mapped (`Some`), and a reader `read(first,
    /// n)` of entries `first..first + n` — borrowed from the mapping, else
    /// read with `pread`.
    fn with_entries<R>(
        &self,
        layout: &EntryLayout,
        disk: &DiskRef,
        search: impl for<'r> FnOnce(
            Option<&'r [u8]>,
            &mut dyn FnMut(usize, usize) -> Result<Cow<'r, [u8]>>,
        ) -> R,
    ) -> Result<R> {
        let size = layout.size();
        let first = disk.entry_position(layout, 0);
        match self.log.mapped(first, disk.count as usize * size)? {
            Some(all) => Ok(search(Some(&all), &mut |from, n| {
                Ok(Cow::Borrowed(&all[from * size..(from + n) * size]))
            })),
            None => Ok(search(None, &mut |from, n| {
                self.log
                    .read(disk.entry_position(layout, from), n * size)
                    .map(Cow::Owned)
            })),
        }
    }

    fn lookup_error(&self, layout: &EntryLayout, disk: &DiskRef, e: LookupError<Error>) -> Error {
        match e {
            LookupError::Read(error) => error,
            LookupError::Corrupt { entry } => self.corrupt(
                disk.entry_position(layout, entry),
                "index entry checksum mismatch",
            ),
        }
    }

    /// Looks `key` up in a blob: in place when the index log's segment is
    /// mapped, else with the optimistic window lookup (`pread`).
    pub fn lookup(
        &self,
        layout: &EntryLayout,
        disk: &DiskRef,
        key: &Key,
        guess: usize,
    ) -> Result<Found> {
        self.with_entries(layout, disk, |all, read| match all {
            Some(all) => lookup::lookup_in_place(layout, all, key, guess)
                .map(|entry| Found { entry, reads: 1 }),
            None => lookup::lookup(layout, disk.count as usize, key, guess, self.window, read),
        })?
        .map_err(|e| self.lookup_error(layout, disk, e))
    }
}
