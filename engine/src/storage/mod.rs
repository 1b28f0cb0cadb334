//! The storage seam: every byte the engine reads or writes goes through the
//! [`Storage`] and [`StorageFile`] traits, and every `unsafe` block of the
//! engine lives in this module.
//!
//! Two implementations:
//! - [`FileStorage`]: real files, `mmap` for appends, `pread` or read-only
//!   mappings (advised random) for reads,
//!   `fallocate` so a mapped write can never hit a full disk, and
//!   `POSIX_FADV_RANDOM` so a read costs one small disk read rather than a
//!   readahead window.
//! - [`FaultStorage`]: an in-memory twin that keeps what is *written*
//!   (the page cache) apart from what is *durable* (the disk), can fail or
//!   "crash" at the N-th operation, can run out of space, and can reboot into
//!   what a real machine would find after power loss — including torn
//!   pages of unsynced data.
//!
//! Appends go through a [`Mapping`]: a writable view of a whole file whose
//! bytes are handed out by one atomic claim cursor. Each [`RegionMut`] is a
//! range no other region overlaps, so many threads write into one mapping at
//! once without a lock and without data races.

mod atomic_file;
mod fault;
mod file;
mod mapping;

use std::fmt;
use std::io;
use std::path::Path;
use std::sync::Arc;

pub use atomic_file::{read_whole_file, write_file_atomically};
pub use fault::{FaultConfig, FaultStorage};
pub use file::FileStorage;
pub(crate) use mapping::LARGEST_FOLIO_BYTES;
pub use mapping::{ClaimError, Mapping, ReadMapping, RegionMut, prefetch_line};

/// A directory tree of files, as the engine needs it.
///
/// Directory changes (create, rename, remove) are durable only after
/// [`Storage::sync_dir`] on the parent directory, as on a POSIX file system.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Creates a new file of exactly `len` bytes, all zero, with its disk
    /// space reserved (so writes through a mapping never fail for lack of
    /// space). Fails if the file exists.
    fn create(&self, path: &Path, len: u64) -> io::Result<Arc<dyn StorageFile>>;
    /// Creates a new file of exactly `len` bytes, all zero, with the disk
    /// space of only its first `reserved` bytes reserved (the rest is a
    /// hole: [`StorageFile::reserve_to`] reserves more). Writes through a
    /// mapping must stay below the reserved end. Fails if the file exists.
    fn create_sparse(
        &self,
        path: &Path,
        len: u64,
        reserved: u64,
    ) -> io::Result<Arc<dyn StorageFile>>;
    /// Opens an existing file for reading and writing.
    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>>;
    /// Removes a file.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Makes `to` another name of the file `from` (a hard link: one file,
    /// two names; removing either leaves the other). Storages that cannot
    /// (and files on another file system) fail, and callers copy instead.
    fn hard_link(&self, from: &Path, to: &Path) -> io::Result<()> {
        let _ = (from, to);
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }
    /// How many names the file has (more than one: another engine holds a
    /// hard link to it, and deleting this name frees no space). Storages
    /// without hard links answer 1.
    fn link_count(&self, path: &Path) -> io::Result<u64> {
        let _ = path;
        Ok(1)
    }
    /// Renames a file, replacing `to` if it exists.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Names of the files in a directory (not recursive), sorted.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Creates a directory and its parents.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Creates one directory whose parent exists: fails with
    /// [`io::ErrorKind::NotFound`] if the parent does not (so a writer
    /// whose directory was deleted under it cannot make it again), and
    /// with [`io::ErrorKind::AlreadyExists`] if `dir` exists.
    fn create_dir(&self, dir: &Path) -> io::Result<()>;
    /// Makes the directory's entries (creates, renames, removes) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Whether a file exists.
    fn exists(&self, path: &Path) -> bool;
    /// Free bytes on the volume that holds `dir`.
    fn available_bytes(&self, dir: &Path) -> io::Result<u64>;
    /// Takes the exclusive hold on `dir` that every open engine keeps, so
    /// that no second engine — in this process or another — opens the same
    /// directory while the first is alive. Fails with
    /// [`io::ErrorKind::WouldBlock`] if someone holds it.
    fn lock(&self, dir: &Path) -> io::Result<DirLock>;
}

/// The name of the lock file [`FileStorage`] keeps in a locked directory.
pub const LOCK_FILE: &str = "LOCK";

/// What [`Storage::lock`] fails with when someone holds `what`.
fn held(what: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::WouldBlock,
        format!("{} is locked by another open engine", what.display()),
    )
}

/// A hold on a directory from [`Storage::lock`]; dropping it lets go.
pub struct DirLock {
    _hold: Box<dyn Send + Sync>,
}

impl DirLock {
    /// Wraps whatever keeps the hold until dropped.
    pub fn new(hold: impl Send + Sync + 'static) -> Self {
        Self {
            _hold: Box::new(hold),
        }
    }
}

impl fmt::Debug for DirLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DirLock")
    }
}

/// One open file.
pub trait StorageFile: Send + Sync + fmt::Debug {
    /// Length in bytes.
    fn len(&self) -> u64;
    /// Bytes from the start whose disk space is reserved (the whole length,
    /// except for a file made by [`Storage::create_sparse`]; for a file
    /// opened again, what the file system says is allocated).
    fn reserved(&self) -> u64;
    /// Reserves the disk space of the bytes below `end` (clipped to the
    /// length), so that writes through a mapping there cannot fail for
    /// lack of space; fails (disk full) without changing what was reserved.
    fn reserve_to(&self, end: u64) -> io::Result<()>;
    /// Whether the file is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// [`StorageFile::read_at`] if the bytes are in memory (the page
    /// cache): `Ok(false)` where reading them would wait for the disk
    /// (`buf` then holds nothing useful). A storage that never waits for a
    /// disk reads.
    fn read_at_if_cached(&self, buf: &mut [u8], offset: u64) -> io::Result<bool> {
        self.read_at(buf, offset).map(|()| true)
    }
    /// Writes all of `data` at `offset` (for small files; logs are appended
    /// through [`StorageFile::map`]). The file must be long enough.
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
    /// Writes the bytes of `pieces`, in order, at `offset` (`pwritev`):
    /// how a log appends a large record without copying it into its
    /// mapping. Also on a mapped file, into a range the caller claimed
    /// (no writer goes through the mapping there) and below the reserved
    /// end.
    fn write_vectored_at(&self, pieces: &[io::IoSlice<'_>], offset: u64) -> io::Result<()>;
    /// A writable mapping of the whole file, its pages faulted in (read-only
    /// until written) where the storage can. At most one per file.
    /// `page_folios` asks for page-sized page-cache folios (see
    /// `docs/design/wal-format.md`): a sync then writes back only the pages
    /// written since the last one, where a large folio is written back
    /// whole each time it was written into.
    fn map(&self, page_folios: bool) -> io::Result<Mapping>;
    /// A read-only mapping of the whole file, advised for random access (a
    /// read of a page not in memory fetches that page, not a readahead
    /// window). Any number per file, also while it is mapped writable.
    fn map_read(&self) -> io::Result<ReadMapping>;
    /// Makes the bytes written in `[offset, offset + len)` durable.
    fn sync_range(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Makes every written byte of the file durable.
    fn sync_all(&self) -> io::Result<()>;
    /// Drops the file's clean pages from memory, so the next reads go to the
    /// disk (used by cold-read tests and benchmarks).
    fn evict_cache(&self) -> io::Result<()>;
}

/// Bytes of this process's mappings of `path` that `/proc/self/smaps` counts
/// under the given fields (for example `"Rss:"`: pages mapped now;
/// `"Shared_Dirty:"`: mapped pages the kernel marked dirty). For tests.
#[cfg(test)]
pub(crate) fn mapped_bytes(path: &Path, fields: &[&str]) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let path = path.to_str().expect("a UTF-8 path");
    let mut in_mapping = false;
    let mut bytes = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if !first.ends_with(':') {
            // A mapping's header: "start-end perms offset dev inode path".
            in_mapping = line.ends_with(path);
        } else if in_mapping && fields.contains(&first) {
            let kib: u64 = line
                .split_whitespace()
                .nth(1)
                .and_then(|n| n.parse().ok())
                .expect("a number of kB");
            bytes += kib << 10;
        }
    }
    bytes
}
