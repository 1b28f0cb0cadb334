//! The index store: index blobs in the index log — written by flushes,
//! read whole when a cell loads, searched in place (mapped) or by window
//! (`pread`) for optimistic lookups.

use std::borrow::Cow;

use crate::error::{Error, Result};
use crate::index::blob::{self, BlobKind, DiskRef};
use crate::index::bloom::Bloom;
use crate::index::entry::{Entry, Key};
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

    /// Appends the sorted `entries` (live ones only for a base), keys of
    /// `key_len` bytes, as one blob of `kind` in the smallest entry format
    /// that holds them; `None` for no entries.
    pub fn write(
        &self,
        key_len: usize,
        entries: &[(Key, Entry)],
        kind: BlobKind,
    ) -> Result<Option<(DiskRef, Bloom)>> {
        if entries.is_empty() {
            return Ok(None);
        }
        let blob::Encoded {
            body,
            bloom,
            bloom_len,
            format: entry_format,
        } = blob::encode(key_len, entries, self.bits_per_key, kind);
        let len = format::record_len(body.len());
        let (position, ()) = self.log.append(len, |buf, position| {
            format::write_plain(buf, position, Kind::IndexBlob, &body)
        })?;
        let disk = DiskRef {
            position,
            count: entries.len() as u32,
            bloom_len,
            format: entry_format,
        };
        Ok(Some((disk, bloom)))
    }

    /// Appends the sorted `entries` as blobs of `kind` ([`Self::write`]):
    /// one, or as many as it takes for each to fit in a record of the index
    /// log — a cell's index may outgrow an index segment (a base merged
    /// from many flushes, or a flush of many changes), and a record larger
    /// than a segment was refused at every flush, which poisoned the
    /// engine again after every reopen. The parts hold disjoint runs of
    /// keys, in order, of about equal length; empty for no entries.
    pub fn write_parts(
        &self,
        key_len: usize,
        entries: &[(Key, Entry)],
        kind: BlobKind,
    ) -> Result<Vec<(DiskRef, Bloom)>> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let most = blob::max_entries(key_len, self.bits_per_key, self.log.max_record_bytes());
        let parts = entries.len().div_ceil(most.max(1));
        let per_part = entries.len().div_ceil(parts);
        entries
            .chunks(per_part)
            .map(|part| {
                self.write(key_len, part, kind)
                    .map(|written| written.expect("a part holds entries"))
            })
            .collect()
    }

    /// Reads and verifies a whole blob of `kind`.
    pub fn load(
        &self,
        key_len: usize,
        disk: &DiskRef,
        kind: BlobKind,
    ) -> Result<(Vec<(Key, Entry)>, Bloom)> {
        let bytes = self.log.read(disk.position, disk.record_len(key_len))?;
        let view = RecordView::verify(disk.position, &bytes)
            .map_err(|m| self.corrupt(disk.position, m.0))?;
        if view.header.kind != Kind::IndexBlob {
            return Err(self.corrupt(disk.position, "not an index blob record"));
        }
        blob::decode(key_len, view.body, disk, kind).map_err(|m| self.corrupt(disk.position, m.0))
    }

    /// Copies the blob `disk` to the end of the index log: the same body
    /// (entries and bloom filter), verified, under a new record header.
    /// Returns where the copy is.
    pub fn copy(&self, key_len: usize, disk: &DiskRef) -> Result<DiskRef> {
        let bytes = self.log.read(disk.position, disk.record_len(key_len))?;
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
        key_len: usize,
        disk: &DiskRef,
        bound: Option<&Key>,
        guess: usize,
    ) -> Result<lookup::Below> {
        let layout = &disk.layout(key_len);
        self.with_entries(key_len, disk, |_, read| {
            lookup::entries_below(layout, disk.count as usize, bound, guess, self.window, read)
        })?
        .map_err(|e| self.lookup_error(key_len, disk, e))
    }

    /// Runs `search` with a blob's entries: all of them in place when the
    /// index log's segment is mapped (`Some`), and a reader `read(first,
    /// n)` of entries `first..first + n` — borrowed from the mapping, else
    /// read with `pread`.
    fn with_entries<R>(
        &self,
        key_len: usize,
        disk: &DiskRef,
        search: impl for<'r> FnOnce(
            Option<&'r [u8]>,
            &mut dyn FnMut(usize, usize) -> Result<Cow<'r, [u8]>>,
        ) -> R,
    ) -> Result<R> {
        let size = disk.layout(key_len).size();
        let first = disk.entry_position(key_len, 0);
        match self.log.mapped(first, disk.count as usize * size)? {
            Some(all) => Ok(search(Some(&all), &mut |from, n| {
                Ok(Cow::Borrowed(&all[from * size..(from + n) * size]))
            })),
            None => Ok(search(None, &mut |from, n| {
                self.log
                    .read(disk.entry_position(key_len, from), n * size)
                    .map(Cow::Owned)
            })),
        }
    }

    fn lookup_error(&self, key_len: usize, disk: &DiskRef, e: LookupError<Error>) -> Error {
        match e {
            LookupError::Read(error) => error,
            LookupError::Corrupt { entry } => self.corrupt(
                disk.entry_position(key_len, entry),
                "index entry checksum mismatch",
            ),
        }
    }

    /// Looks `key` up in a blob: in place when the index log's segment is
    /// mapped, else with the optimistic window lookup (`pread`).
    pub fn lookup(&self, key_len: usize, disk: &DiskRef, key: &Key, guess: usize) -> Result<Found> {
        let layout = &disk.layout(key_len);
        self.with_entries(key_len, disk, |all, read| match all {
            Some(all) => lookup::lookup_in_place(layout, all, key, guess)
                .map(|entry| Found { entry, reads: 1 }),
            None => lookup::lookup(layout, disk.count as usize, key, guess, self.window, read),
        })?
        .map_err(|e| self.lookup_error(key_len, disk, e))
    }
}
