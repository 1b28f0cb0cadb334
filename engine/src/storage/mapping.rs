//! A writable view of a whole file, handed out in disjoint regions.
//!
//! The claim cursor is the engine's "one atomic allocation": a writer takes
//! the next `len` bytes with a single compare-and-swap and then owns them
//! exclusively, so copies into different regions run in parallel with no
//! lock. Because no two regions overlap and the memory outlives every region,
//! handing out `&mut [u8]` views is sound.

#![allow(unsafe_code)]

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a claim failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimError {
    /// Fewer than the requested bytes are left; `remaining` are.
    Full {
        /// Unclaimed bytes at the end of the mapping.
        remaining: u64,
    },
    /// The bytes fit the mapping but pass its claim limit (the reserved
    /// part of a sparse file): reserve more, raise the limit
    /// ([`Mapping::raise_limit`]) and claim again.
    Unreserved,
}

/// Keeps the mapped memory alive (an `MmapMut`, or a fault-storage buffer).
pub(crate) trait MappedMemory: Send + Sync {
    /// Takes the write faults of the pages of `[offset, offset + len)` now,
    /// where the memory has any (a shared file mapping: the kernel's
    /// page-mkwrite work, which marks the pages dirty). A hint: doing nothing
    /// is correct, only slower.
    fn fault_in_writable(&self, _offset: usize, _len: usize) {}
    /// Unmaps the pages of `[offset, offset + len)` (page-aligned) from this
    /// process, where the memory is a shared file mapping: the page cache
    /// keeps them, dirty ones stay dirty, and a later access maps them again.
    /// A hint: doing nothing is correct, only slower.
    fn release(&self, _offset: usize, _len: usize) {}
    /// Makes the pages of `[offset, offset + len)` (page-aligned, not yet
    /// written by anyone) page-sized page-cache folios from now on, where
    /// the memory is a shared file mapping whose clean pages sit in larger
    /// folios. A hint: doing nothing is correct, only costlier at syncs.
    fn use_page_folios(&self, _offset: usize, _len: usize) {}
    /// Reads the pages of `[offset, offset + len)` into memory now, where
    /// the memory is a shared file mapping (for a fresh segment: the
    /// kernel's zero-filling of page-cache pages), so writers do not take
    /// those faults. A hint: doing nothing is correct, only slower.
    fn populate(&self, _offset: usize, _len: usize) {}
}
impl MappedMemory for memmap2::MmapMut {
    fn fault_in_writable(&self, offset: usize, len: usize) {
        // Fails on kernels before 5.14 (no MADV_POPULATE_WRITE); the
        // writers then take the faults themselves, as they would anyway.
        let _ = self.advise_range(memmap2::Advice::PopulateWrite, offset, len);
    }
    fn populate(&self, offset: usize, len: usize) {
        // Fails on kernels before 5.14 (no MADV_POPULATE_READ): as above.
        let _ = self.advise_range(memmap2::Advice::PopulateRead, offset, len);
    }
    fn release(&self, offset: usize, len: usize) {
        // SAFETY: the mapping is a shared mapping of a file (`map_mut`), so
        // MADV_DONTNEED only removes this process's page-table entries: the
        // pages stay in the page cache (the kernel moves a dirty entry's
        // dirty bit to its page first), and the next access maps the same
        // bytes again. Nothing is zeroed or lost, whatever else points into
        // the range. A failure changes nothing, so it is ignored.
        let _ =
            unsafe { self.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
    }
}
impl MappedMemory for memmap2::Mmap {}
impl MappedMemory for Box<[u8]> {}

/// The page size [`Mapping::release_below`] aligns to. A larger real page size
/// only makes the advice fail, which changes nothing.
const PAGE_BYTES: u64 = 4096;

/// The largest page-cache folio (2 MiB on x86-64 with 4 KiB pages):
/// [`Mapping::use_page_folios_from`] starts on such a boundary, so that no
/// folio it meets lies partly before its range.
pub(crate) const LARGEST_FOLIO_BYTES: u64 = 2 << 20;

/// Cursor on its own cache line, so it does not share one with the fields
/// every reader touches.
#[repr(align(64))]
struct Cursor(AtomicU64);

/// A writable mapping of a file, with an atomic claim cursor.
pub struct Mapping {
    base: NonNull<u8>,
    len: u64,
    cursor: Cursor,
    /// Bytes below this (a page multiple) were released.
    released: Cursor,
    /// Bytes below this were populated (see [`Mapping::populate_to`]).
    populated: Cursor,
    /// Claims end at or below this (see [`Mapping::raise_limit`]).
    limit: Cursor,
    _owner: Box<dyn MappedMemory>,
}

// SAFETY: `Mapping` hands out each byte range at most once (the cursor only
// moves forward, and every claim is a compare-and-swap from the cursor's
// current value), so regions used on different threads never alias. The
// memory behind `base` is owned by `_owner`, which is `Send + Sync` and lives
// as long as the mapping.
unsafe impl Send for Mapping {}
// SAFETY: see `Send`: shared access only moves the atomic cursor; byte access
// goes through disjoint `RegionMut`s.
unsafe impl Sync for Mapping {}

impl fmt::Debug for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapping")
            .field("len", &self.len)
            .field("claimed", &self.claimed())
            .finish()
    }
}

impl Mapping {
    /// Wraps `len` bytes at `base`, kept alive by `owner`.
    ///
    /// # Safety
    ///
    /// `base` must point to `len` bytes that are valid for reads and writes
    /// for as long as `owner` lives, and nothing else may write those bytes
    /// while the mapping exists (reads through the file, such as `pread` by
    /// the kernel, are fine), except the ranges taken by
    /// [`Mapping::claim_range`], which no region covers.
    pub(crate) unsafe fn from_raw(
        base: NonNull<u8>,
        len: u64,
        owner: Box<dyn MappedMemory>,
    ) -> Self {
        Self {
            base,
            len,
            cursor: Cursor(AtomicU64::new(0)),
            released: Cursor(AtomicU64::new(0)),
            populated: Cursor(AtomicU64::new(0)),
            limit: Cursor(AtomicU64::new(len)),
            _owner: owner,
        }
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the mapping is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes claimed so far (the offset of the next claim).
    pub fn claimed(&self) -> u64 {
        self.cursor.0.load(Ordering::Acquire)
    }

    /// Moves the cursor to `offset` before any region is handed out (used
    /// when reopening a partly written file). Needs exclusive access, so no
    /// region can exist.
    pub fn start_at(&mut self, offset: u64) {
        assert!(
            offset <= self.len,
            "start offset {offset} beyond mapping of {}",
            self.len
        );
        *self.cursor.0.get_mut() = offset;
    }

    /// Sets the claim limit of a mapping nobody has claimed from yet (a
    /// fresh sparse segment: the end of its reserved part). Needs exclusive
    /// access.
    pub fn set_limit(&mut self, limit: u64) {
        *self.limit.0.get_mut() = limit.min(self.len);
    }

    /// Lets claims go up to `limit` (never lowers it; clipped to the
    /// mapping). For a sparse file, only once the bytes below `limit` are
    /// reserved: a write into a hole on a full disk is a SIGBUS.
    pub fn raise_limit(&self, limit: u64) {
        self.limit
            .0
            .fetch_max(limit.min(self.len), Ordering::AcqRel);
    }

    /// The claim limit.
    pub fn limit(&self) -> u64 {
        self.limit.0.load(Ordering::Acquire)
    }

    /// Claims the next `len` bytes.
    pub fn claim(&self, len: u64) -> Result<RegionMut<'_>, ClaimError> {
        self.claim_range(len).map(|start| self.region(start, len))
    }

    /// Claims the next `len` bytes for a writer that writes them through
    /// the file (`pwritev`), not through the mapping: their offset, and no
    /// region over them.
    pub fn claim_range(&self, len: u64) -> Result<u64, ClaimError> {
        let mut start = self.cursor.0.load(Ordering::Relaxed);
        loop {
            let end = start + len;
            if end > self.len {
                return Err(ClaimError::Full {
                    remaining: self.len - start,
                });
            }
            if end > self.limit.0.load(Ordering::Acquire) {
                return Err(ClaimError::Unreserved);
            }
            match self.cursor.0.compare_exchange_weak(
                start,
                end,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(start),
                Err(actual) => start = actual,
            }
        }
    }

    /// Takes the write faults of `[offset, offset + len)` (clipped to the
    /// mapping) now, on the calling thread, so that writers of that range
    /// later find its pages writable. Bytes are not changed. Pages made
    /// writable ahead of the data are written back as they are (zeros past
    /// the data) if a sync comes first, as any partly written page is.
    pub fn fault_in_writable(&self, offset: u64, len: u64) {
        // Not past the limit: a write fault in a hole allocates.
        let end = offset.saturating_add(len).min(self.limit());
        if offset < end {
            self._owner
                .fault_in_writable(offset as usize, (end - offset) as usize);
        }
    }

    /// Reads the pages below `end` (clipped to the mapping, rounded up to
    /// a page) not populated yet into memory now, on the calling thread, so
    /// that writers of that range do not take the kernel's zero-filling
    /// faults. Populating a whole segment up front would hold its length in
    /// memory for every log, idle ones included; logs populate a window
    /// ahead of their writers sized to their write rate instead (the log's
    /// allocator). Bytes are not changed. Returns the new watermark.
    pub fn populate_to(&self, end: u64) -> u64 {
        self.populate_ahead(0, end)
    }

    /// [`Mapping::populate_to`] `end`, skipping what lies below `from`
    /// (bytes already claimed: written, or being written, by their
    /// writers, through the mapping or through the file).
    pub fn populate_ahead(&self, from: u64, end: u64) -> u64 {
        let end = end
            .div_ceil(PAGE_BYTES)
            .saturating_mul(PAGE_BYTES)
            .min(self.limit());
        let start = self
            .populated
            .0
            .fetch_max(end, Ordering::AcqRel)
            .max(from / PAGE_BYTES * PAGE_BYTES);
        if start < end {
            self._owner.populate(start as usize, (end - start) as usize);
        }
        start.max(end)
    }

    /// Bytes populated so far (see [`Mapping::populate_to`]).
    pub fn populated(&self) -> u64 {
        self.populated.0.load(Ordering::Acquire)
    }

    /// Unmaps from this process the whole pages below `offset` not unmapped
    /// yet (the bytes stay in the file's page cache, dirty or not). For the
    /// part of a log no writer touches again: writing back a page still
    /// mapped writable costs a TLB shootdown per page (the kernel
    /// write-protects each page-table entry on its own, interrupting every
    /// CPU that runs this process), unmapping a range costs one. A later
    /// write below `offset` still works; it maps its page again.
    pub fn release_below(&self, offset: u64) {
        let end = offset.min(self.len) / PAGE_BYTES * PAGE_BYTES;
        let start = self.released.0.fetch_max(end, Ordering::AcqRel);
        if start < end {
            self._owner.release(start as usize, (end - start) as usize);
        }
    }

    /// Gives the bytes from `offset` (rounded up to a
    /// `LARGEST_FOLIO_BYTES` (2 MiB) boundary) to the end page-sized page-cache
    /// folios, for a log that was mapped with large folios and now syncs
    /// too little at a time for them (each sync writes the whole folio
    /// holding the log's tail back again). Only for bytes no writer has
    /// claimed: it drops their clean pages and faults them in again. Bytes
    /// are not changed, whatever runs at the same time: a page written or
    /// dirtied meanwhile is kept as it is.
    pub fn use_page_folios_from(&self, offset: u64) {
        let start = offset.div_ceil(LARGEST_FOLIO_BYTES) * LARGEST_FOLIO_BYTES;
        if start < self.len {
            self._owner
                .use_page_folios(start as usize, (self.len - start) as usize);
            // Its populated part was dropped with the rest: populate it again,
            // now in page folios.
            let populated = self.populated();
            if start < populated {
                self._owner
                    .populate(start as usize, (populated - start) as usize);
            }
        }
    }

    /// Claims every byte left, if any.
    pub fn claim_rest(&self) -> Option<RegionMut<'_>> {
        let start = self.cursor.0.swap(self.len, Ordering::AcqRel);
        (start < self.len).then(|| self.region(start, self.len - start))
    }

    fn region(&self, offset: u64, len: u64) -> RegionMut<'_> {
        debug_assert!(offset + len <= self.len);
        // SAFETY: `offset + len <= self.len`, so the pointer stays inside the
        // mapping (which is at most `isize::MAX` bytes, being a real
        // allocation or mapping).
        let ptr = unsafe { self.base.add(offset as usize) };
        RegionMut {
            ptr,
            len: len as usize,
            offset,
            _life: PhantomData,
        }
    }
}

/// Exclusive write access to one claimed range of a [`Mapping`].
pub struct RegionMut<'a> {
    ptr: NonNull<u8>,
    len: usize,
    offset: u64,
    _life: PhantomData<&'a mut [u8]>,
}

impl RegionMut<'_> {
    /// Offset of the region in its file.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl Deref for RegionMut<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the range was claimed exactly once through the cursor, so
        // this region is its only user; the memory lives as long as the
        // mapping this region borrows.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for RegionMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`; `&mut self` makes the access exclusive
        // within this region too.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// A read-only view of a whole file in memory, to read byte ranges without
/// a system call or a copy.
///
/// Its contract with the engine, as for every read through the seam: a
/// range is read only once it holds completed log records, which are never
/// written again — so no byte of a slice handed out changes while it lives.
pub struct ReadMapping {
    base: NonNull<u8>,
    len: u64,
    _owner: Box<dyn MappedMemory>,
}

// SAFETY: the memory behind `base` is owned by `_owner` (`Send + Sync`) and
// only read through this type; slices handed out cover bytes nobody writes
// (the contract above).
unsafe impl Send for ReadMapping {}
// SAFETY: see `Send`.
unsafe impl Sync for ReadMapping {}

impl fmt::Debug for ReadMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadMapping")
            .field("len", &self.len)
            .finish()
    }
}

impl ReadMapping {
    /// Wraps `len` readable bytes at `base`, kept alive by `owner`.
    ///
    /// # Safety
    ///
    /// `base` must point to `len` bytes that are valid for reads for as long
    /// as `owner` lives.
    pub(crate) unsafe fn from_raw(
        base: NonNull<u8>,
        len: u64,
        owner: Box<dyn MappedMemory>,
    ) -> Self {
        Self {
            base,
            len,
            _owner: owner,
        }
    }

    /// The bytes `[offset, offset + len)`, or `None` past the end.
    pub fn bytes(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let end = offset.checked_add(len as u64)?;
        if end > self.len {
            return None;
        }
        // SAFETY: the range is inside the mapping (checked), which lives as
        // long as `self`; per the contract nobody writes these bytes while
        // the slice lives.
        Some(unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset as usize), len) })
    }
}

/// Asks the CPU to load the cache line holding `at` into its caches: a
/// hint, not a read (no fault, whatever the address; nothing on other
/// architectures).
#[inline]
pub fn prefetch_line(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never dereferences its address or faults, and SSE
    // is part of every x86-64 CPU.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heap_mapping(len: usize) -> Mapping {
        let mut buf = vec![0u8; len].into_boxed_slice();
        let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
        // SAFETY: the boxed slice is `len` bytes, owned by the mapping, and
        // written only through it. Moving the box does not move its heap
        // memory.
        unsafe { Mapping::from_raw(ptr, len as u64, Box::new(buf)) }
    }

    #[test]
    fn claims_are_disjoint_and_stop_at_the_end() {
        let m = heap_mapping(100);
        let mut a = m.claim(40).expect("first");
        let mut b = m.claim(40).expect("second");
        assert_eq!((a.offset(), b.offset()), (0, 40));
        a.fill(1);
        b.fill(2);
        assert_eq!(m.claim(40).err(), Some(ClaimError::Full { remaining: 20 }));
        let rest = m.claim_rest().expect("rest");
        assert_eq!((rest.offset(), rest.len()), (80, 20));
        assert!(m.claim_rest().is_none());
    }

    #[test]
    fn concurrent_claims_never_overlap() {
        let m = heap_mapping(8 * 10_000);
        let m = &m;
        std::thread::scope(|s| {
            for t in 0..4u8 {
                s.spawn(move || {
                    while let Ok(mut r) = m.claim(8) {
                        r.fill(t + 1);
                    }
                });
            }
        });
        assert_eq!(m.claimed(), 80_000);
    }
}
