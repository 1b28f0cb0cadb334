//! Recycled buffers for reads of large values.
//!
//! A value read with `pread` needs a buffer; a fresh one of a megabyte is
//! memory the allocator may have to get from the kernel, which zeroes every
//! page as the read first touches it — measured at up to a quarter of a
//! node's CPU on 1 MiB gets (`benchmarks/RESULTS.md`). Buffers of values
//! of [`MIN_BYTES`] or more therefore come from a process-wide free list
//! and go back to it when the last `Bytes` of the value is dropped (sent,
//! or evicted from the value cache), up to [`KEEP_BYTES`] kept free.
//! Capacities are rounded up to a multiple of [`STEP_BYTES`], so a buffer
//! holds at most that much more than its value.

use std::collections::BTreeMap;

use bytes::Bytes;
use parking_lot::Mutex;

/// Values shorter than this get a buffer of their own.
pub(crate) const MIN_BYTES: usize = 64 << 10;
/// Buffer capacities are multiples of this.
const STEP_BYTES: usize = 64 << 10;
/// Bytes of free buffers kept, at most.
const KEEP_BYTES: usize = 64 << 20;

/// Free buffers by capacity, and their total.
struct FreeList {
    by_capacity: BTreeMap<usize, Vec<Vec<u8>>>,
    bytes: usize,
}

static FREE: Mutex<FreeList> = Mutex::new(FreeList {
    by_capacity: BTreeMap::new(),
    bytes: 0,
});

/// A buffer of `len` bytes (their content unspecified) to read into;
/// [`freeze`] makes the read bytes a `Bytes` that gives it back.
pub(crate) fn take(len: usize) -> Vec<u8> {
    if len < MIN_BYTES {
        return vec![0; len];
    }
    let capacity = len.div_ceil(STEP_BYTES) * STEP_BYTES;
    let recycled = {
        let mut free = FREE.lock();
        let found = free.by_capacity.get_mut(&capacity).and_then(Vec::pop);
        if found.is_some() {
            free.bytes -= capacity;
            if free.by_capacity.get(&capacity).is_some_and(Vec::is_empty) {
                free.by_capacity.remove(&capacity);
            }
        }
        found
    };
    let mut buf = recycled.unwrap_or_else(|| vec![0; capacity]);
    buf.truncate(len);
    buf
}

/// The bytes of `buf` (from [`take`]) as `Bytes`; its memory goes back to
/// the free list when the last clone is dropped.
pub(crate) fn freeze(buf: Vec<u8>) -> Bytes {
    if buf.capacity() < MIN_BYTES || !buf.capacity().is_multiple_of(STEP_BYTES) {
        return Bytes::from(buf);
    }
    Bytes::from_owner(Recycled(buf))
}

/// A buffer that returns to the free list when dropped.
struct Recycled(Vec<u8>);

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        let mut buf = std::mem::take(&mut self.0);
        let capacity = buf.capacity();
        let mut free = FREE.lock();
        if free.bytes + capacity > KEEP_BYTES {
            return;
        }
        // Whole again: `take` only truncates (the tail's bytes are
        // already in memory; writing them faults nothing in).
        buf.resize(capacity, 0);
        free.bytes += capacity;
        free.by_capacity.entry(capacity).or_default().push(buf);
    }
}

/// Free buffers kept of this capacity, and bytes of all kept.
#[cfg(test)]
fn kept(capacity: usize) -> (usize, usize) {
    let free = FREE.lock();
    (
        free.by_capacity.get(&capacity).map_or(0, Vec::len),
        free.bytes,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_come_back_and_small_ones_do_not() {
        let small = take(1000);
        assert_eq!((small.len(), small.capacity()), (1000, 1000));

        // A capacity class no other test reads (they share the list).
        let class = 37 * STEP_BYTES;
        let mut buf = take(class - 5);
        assert_eq!((buf.len(), buf.capacity()), (class - 5, class));
        buf.fill(7);
        let address = buf.as_ptr();
        let bytes = freeze(buf);
        let slice = bytes.slice(10..20);
        let (before, _) = kept(class);
        drop(bytes);
        assert_eq!(kept(class).0, before, "a slice still holds the buffer");
        assert_eq!(&slice[..], &[7; 10]);
        drop(slice);
        assert_eq!(kept(class).0, before + 1);
        // The next read of that class gets the same memory, at its length.
        let again = take(class - STEP_BYTES + 1);
        assert_eq!(again.as_ptr(), address);
        assert_eq!(again.len(), class - STEP_BYTES + 1);
        assert_eq!(kept(class).0, before);
        // Never more than KEEP_BYTES kept.
        let many: Vec<Bytes> = (0..KEEP_BYTES / STEP_BYTES + 8)
            .map(|_| freeze(take(STEP_BYTES)))
            .collect();
        drop(many);
        assert!(kept(class).1 <= KEEP_BYTES);
    }
}
