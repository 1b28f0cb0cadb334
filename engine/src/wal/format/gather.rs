//! Entry records laid out for one vectored write (`pwritev`) instead of a
//! copy into the log's mapping: the same bytes as [`super::write_entry`]
//! (headers, metadata, keys, padding and small values in a buffer of their
//! own; large values borrowed from the caller, so the kernel copies them
//! once, straight into the page cache). The checksums are computed from
//! the caller's bytes.

use std::io::IoSlice;
use std::ops::Range;

use super::{
    ItemLocation, ItemSpec, RECORD_HEADER_BYTES, SINGLE_HEADER_BYTES, align8, crc_start,
    entry_header, entry_record_len, item_header, put_u32, single,
};
use crate::types::WalPosition;

/// Values at least this long are written from the caller's memory; shorter
/// ones are copied into the record's own buffer (fewer, larger pieces).
const BORROW_MIN_BYTES: usize = 4096;

/// One piece of a gathered record, in order.
#[derive(Debug)]
enum Piece<'a> {
    /// A range of the record's own buffer.
    Own(Range<usize>),
    /// A value, written from the caller's memory.
    Value(&'a [u8]),
}

/// An entry record as pieces to write in order (see the module docs).
#[derive(Debug)]
pub(crate) struct Gathered<'a> {
    own: Vec<u8>,
    pieces: Vec<Piece<'a>>,
    /// Bytes of the record so far.
    len: usize,
    /// Where the run of own bytes not yet in a piece starts.
    open: usize,
    /// Where each item lands.
    pub locations: Vec<ItemLocation>,
}

impl<'a> Gathered<'a> {
    /// The record's bytes, in order, for `pwritev`.
    pub fn slices(&self) -> Vec<IoSlice<'_>> {
        self.pieces
            .iter()
            .map(|piece| match piece {
                Piece::Own(range) => IoSlice::new(&self.own[range.clone()]),
                Piece::Value(value) => IoSlice::new(value),
            })
            .collect()
    }

    /// Total bytes of the record.
    pub fn len(&self) -> usize {
        self.len
    }

    fn new(capacity: usize) -> Gathered<'a> {
        Gathered {
            own: Vec::with_capacity(capacity),
            pieces: Vec::new(),
            len: 0,
            open: 0,
            locations: Vec::new(),
        }
    }

    fn own(&mut self, bytes: &[u8]) {
        self.own.extend_from_slice(bytes);
        self.len += bytes.len();
    }

    fn zeros(&mut self, n: usize) {
        self.own.resize(self.own.len() + n, 0);
        self.len += n;
    }

    fn value(&mut self, value: &'a [u8]) {
        if value.len() < BORROW_MIN_BYTES {
            self.own(value);
            return;
        }
        self.close_own();
        self.pieces.push(Piece::Value(value));
        self.len += value.len();
    }

    /// Ends the run of own bytes not yet in a piece.
    fn close_own(&mut self) {
        if self.open < self.own.len() {
            self.pieces.push(Piece::Own(self.open..self.own.len()));
            self.open = self.own.len();
        }
    }
}

/// The entry record [`super::write_entry`] would write at `position`, as
/// pieces: byte for byte the same record.
pub(crate) fn gather_entry<'a>(
    position: WalPosition,
    flags: u8,
    meta: &[u8],
    items: &[ItemSpec<'a>],
) -> Gathered<'a> {
    let record_len = entry_record_len(meta.len(), items);
    if let Some(item) = single::as_single(meta.len(), items) {
        let mut out = Gathered::new(SINGLE_HEADER_BYTES + meta.len() + 256);
        let (head, end) = single::header(record_len, flags, meta.len(), item);
        let mut crc = single::crc_start(position, &head);
        crc.update(meta);
        crc.update(item.key);
        crc.update(item.value);
        out.own(&head);
        put_u32(&mut out.own, 8, crc.finalize());
        out.own(meta);
        out.own(item.key);
        out.value(item.value);
        out.zeros(record_len - end);
        out.close_own();
        out.locations.push(ItemLocation {
            position,
            len: end as u32,
        });
        return out;
    }
    let head = entry_header(flags, meta.len(), items);
    let mut out = Gathered::new(RECORD_HEADER_BYTES + align8(meta.len()) + items.len() * 64);
    let mut record_crc = crc_start(position, &head);
    record_crc.update(meta);
    out.own(&head);
    out.own(meta);
    out.zeros(align8(meta.len()) - meta.len());
    for item in items {
        let at = out.len;
        let item_len = item.len();
        let mut header = item_header(item);
        let mut crc = crc32fast::Hasher::new();
        crc.update(&header);
        crc.update(item.key);
        crc.update(item.value);
        put_u32(&mut header, 24, crc.finalize());
        record_crc.update(&header);
        out.own(&header);
        out.own(item.key);
        out.value(item.value);
        out.zeros(align8(item_len) - item_len);
        out.locations.push(ItemLocation {
            position: position.plus(at as u64),
            len: item_len as u32,
        });
    }
    put_u32(&mut out.own, 8, record_crc.finalize());
    out.close_own();
    debug_assert_eq!(out.len, record_len);
    out
}
