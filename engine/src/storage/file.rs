//! Real files: `mmap` for appends, `pread` for reads.

#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use rustix::fs::{Advice, FallocateFlags, FlockOperation};

use super::mapping::MappedMemory;
use super::{DirLock, LOCK_FILE, Mapping, ReadMapping, Storage, StorageFile};

/// The production storage: files in a real directory tree.
#[derive(Debug, Default, Clone)]
pub struct FileStorage;

impl FileStorage {
    /// A storage on the machine's file systems.
    pub fn new() -> Self {
        FileStorage
    }
}

impl Storage for FileStorage {
    fn lock(&self, dir: &Path) -> io::Result<DirLock> {
        let path = dir.join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)?;
        // An flock belongs to this open file: a second open of the same
        // directory, even in this process, is refused, and the hold ends
        // when the file is closed — also when the process dies. A child
        // being spawned by another thread holds a copy of every descriptor
        // until its exec closes them, and with it a just-released lock:
        // try again for a second before calling the directory taken.
        for attempt in 0.. {
            match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(DirLock::new(file)),
                Err(rustix::io::Errno::WOULDBLOCK) if attempt < 50 => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(rustix::io::Errno::WOULDBLOCK) => break,
                Err(error) => return Err(error.into()),
            }
        }
        Err(super::held(&path))
    }

    fn create(&self, path: &Path, len: u64) -> io::Result<Arc<dyn StorageFile>> {
        // Reserve the blocks now: a write through a mapping into a sparse
        // file on a full disk would kill the process with SIGBUS.
        self.create_sparse(path, len, len)
    }

    fn create_sparse(
        &self,
        path: &Path,
        len: u64,
        reserved: u64,
    ) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        let made = file.set_len(len).map(|()| DiskFile::new(file, len));
        let file = match made {
            Ok(Ok(file)) => file,
            Ok(Err(error)) | Err(error) => {
                let _ = std::fs::remove_file(path);
                return Err(error);
            }
        };
        file.reserved.store(0, Ordering::Release);
        if let Err(error) = file.reserve_to(reserved) {
            drop(file);
            let _ = std::fs::remove_file(path);
            return Err(error);
        }
        Ok(Arc::new(file))
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let metadata = file.metadata()?;
        let len = metadata.len();
        let file = DiskFile::new(file, len)?;
        // What the file system allocated (a sparse segment's reserved part).
        let allocated = std::os::unix::fs::MetadataExt::blocks(&metadata).saturating_mul(512);
        file.reserved.store(allocated.min(len), Ordering::Release);
        Ok(Arc::new(file))
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn hard_link(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::hard_link(from, to)
    }

    fn link_count(&self, path: &Path) -> io::Result<u64> {
        Ok(std::os::unix::fs::MetadataExt::nlink(&std::fs::metadata(
            path,
        )?))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                names.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        names.sort();
        Ok(names)
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        // Every directory made here is made durable in its parent: a file
        // synced in a directory whose own entry is not can vanish with it
        // at a power loss (POSIX leaves it so; ext4 and XFS happen to order
        // the entry by their journal).
        let missing: Vec<&Path> = dir
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .collect();
        std::fs::create_dir_all(dir)?;
        for made in missing.iter().rev() {
            let parent = match made.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            File::open(parent)?.sync_all()?;
        }
        Ok(())
    }

    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir(dir)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn available_bytes(&self, dir: &Path) -> io::Result<u64> {
        let stat = rustix::fs::statvfs(dir)?;
        Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
    }
}

/// An open file on disk.
#[derive(Debug)]
struct DiskFile {
    file: File,
    len: u64,
    /// Bytes from the start whose blocks are reserved.
    reserved: AtomicU64,
    /// Held while reserving more.
    reserving: Mutex<()>,
}

impl DiskFile {
    fn new(file: File, len: u64) -> io::Result<Self> {
        // Reads are random point reads of values and index windows: turn off
        // readahead so each costs what it asks for, not a readahead window.
        rustix::fs::fadvise(&file, 0, None, Advice::Random)?;
        Ok(Self {
            file,
            len,
            reserved: AtomicU64::new(len),
            reserving: Mutex::new(()),
        })
    }

    /// The file's length as a mapping length: refused if empty or larger
    /// than the address space.
    fn mappable_len(&self) -> io::Result<usize> {
        let len = usize::try_from(self.len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file too large to map"))?;
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cannot map an empty file",
            ));
        }
        Ok(len)
    }
}

/// At most this many pieces in one `pwritev` (the kernel's `IOV_MAX`).
const MOST_PIECES: usize = 1024;

/// Writes every byte of `pieces` at `offset` through `write` (one
/// positioned vectored write: the bytes it took, which may be fewer than
/// offered), at most [`MOST_PIECES`] pieces a call; a short write goes on
/// from where it stopped, an interrupted one is retried, a write that takes
/// nothing is an error (`WriteZero`).
fn write_all_vectored_at(
    pieces: &[io::IoSlice<'_>],
    offset: u64,
    mut write: impl FnMut(&[io::IoSlice<'_>], u64) -> io::Result<usize>,
) -> io::Result<()> {
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    let mut done = 0usize;
    let (mut first, mut skip) = (0usize, 0usize);
    while done < total {
        let mut batch: Vec<io::IoSlice<'_>> = Vec::with_capacity(MOST_PIECES.min(pieces.len()));
        batch.push(io::IoSlice::new(&pieces[first][skip..]));
        batch.extend(
            pieces[first + 1..]
                .iter()
                .take(MOST_PIECES - 1)
                .map(|p| io::IoSlice::new(p)),
        );
        let written = match write(&batch, offset + done as u64) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        done += written;
        // Move past what was written.
        let mut left = written;
        while left > 0 {
            let rest = pieces[first].len() - skip;
            if left < rest {
                skip += left;
                left = 0;
            } else {
                left -= rest;
                first += 1;
                skip = 0;
            }
        }
        while first < pieces.len() && pieces[first].len() == skip {
            first += 1;
            skip = 0;
        }
    }
    Ok(())
}

impl StorageFile for DiskFile {
    fn len(&self) -> u64 {
        self.len
    }

    fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Acquire)
    }

    fn reserve_to(&self, end: u64) -> io::Result<()> {
        let end = end.min(self.len);
        let _one = self.reserving.lock();
        let start = self.reserved.load(Ordering::Acquire);
        if start < end {
            // A write through a mapping into a hole on a full disk would
            // kill the process with SIGBUS: writers stay below this.
            rustix::fs::fallocate(&self.file, FallocateFlags::empty(), start, end - start)?;
            self.reserved.store(end, Ordering::Release);
        }
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn read_at_if_cached(&self, buf: &mut [u8], offset: u64) -> io::Result<bool> {
        // `preadv2(RWF_NOWAIT)` reads what the page cache holds and fails
        // with EAGAIN where it would have to wait for the disk (a short
        // count: the pages after it are not in memory).
        let mut done = 0;
        while done < buf.len() {
            let mut piece = [io::IoSliceMut::new(&mut buf[done..])];
            match rustix::io::preadv2(
                &self.file,
                &mut piece,
                offset + done as u64,
                rustix::io::ReadWriteFlags::NOWAIT,
            ) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => done += n,
                Err(rustix::io::Errno::AGAIN) => return Ok(false),
                // A kernel or file system without it: say it would wait.
                Err(rustix::io::Errno::OPNOTSUPP) => return Ok(false),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(true)
    }

    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(data, offset)
    }

    fn write_vectored_at(&self, pieces: &[io::IoSlice<'_>], offset: u64) -> io::Result<()> {
        write_all_vectored_at(pieces, offset, |batch, at| {
            rustix::io::pwritev(&self.file, batch, at).map_err(io::Error::from)
        })
    }

    fn map(&self, page_folios: bool) -> io::Result<Mapping> {
        let len = self.mappable_len()?;
        // SAFETY: the engine owns its data directory; no other process is
        // expected to truncate or write these files while they are mapped
        // (if one did, accesses could fault — the usual mmap caveat). The
        // space is reserved by `fallocate`, so writes cannot fault on a full
        // disk.
        let mut map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&self.file)? };
        // Page-sized folios: faults of a mapping advised random read no
        // readahead window, so each page gets a folio of its own. Without
        // it, readahead gives large folios (up to 2 MiB on ext4).
        if page_folios {
            map.advise(memmap2::Advice::Random)?;
        }
        // Pages are faulted in by `Mapping::populate_to`, a window ahead of
        // the writers (the log's allocator sizes it to the write rate).
        let base = NonNull::new(map.as_mut_ptr())
            .ok_or_else(|| io::Error::other("mmap returned a null pointer"))?;
        let owner = FileMap {
            map,
            file: self.file.try_clone()?,
        };
        // SAFETY: `base` points to the `len` bytes of `map`, which the mapping
        // owns and which stay mapped until it is dropped; only the mapping
        // writes them (file reads go through `pread`, which is fine).
        Ok(unsafe { Mapping::from_raw(base, len as u64, Box::new(owner)) })
    }

    fn map_read(&self) -> io::Result<ReadMapping> {
        let len = self.mappable_len()?;
        // SAFETY: as for `map`: the engine owns these files and never
        // truncates one while it is mapped. The mapping is read-only; pages
        // written through the file's writable mapping or by the kernel are
        // the same page-cache pages.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map(&self.file)? };
        // Fault in one page per access, never a readahead window.
        map.advise(memmap2::Advice::Random)?;
        let base = NonNull::new(map.as_ptr().cast_mut())
            .ok_or_else(|| io::Error::other("mmap returned a null pointer"))?;
        // SAFETY: `base` points to the `len` bytes of `map`, which the read
        // mapping owns and which stay mapped until it is dropped.
        Ok(unsafe { ReadMapping::from_raw(base, len as u64, Box::new(map)) })
    }

    fn sync_range(&self, _offset: u64, _len: u64) -> io::Result<()> {
        // `fdatasync` writes back every dirty page of the file, including
        // pages dirtied through the mapping, plus the metadata needed to read
        // them (the conversion of fallocated extents).
        rustix::fs::fdatasync(&self.file).map_err(io::Error::from)
    }

    fn sync_all(&self) -> io::Result<()> {
        self.file.sync_all()
    }

    fn evict_cache(&self) -> io::Result<()> {
        rustix::fs::fadvise(&self.file, 0, None, Advice::DontNeed).map_err(io::Error::from)
    }
}

/// A writable shared mapping of a file, with a descriptor of the file for
/// the advice that works on the file's page cache rather than the mapping.
struct FileMap {
    map: memmap2::MmapMut,
    file: File,
}

impl MappedMemory for FileMap {
    fn fault_in_writable(&self, offset: usize, len: usize) {
        self.map.fault_in_writable(offset, len);
    }

    fn release(&self, offset: usize, len: usize) {
        self.map.release(offset, len);
    }

    fn use_page_folios(&self, offset: usize, len: usize) {
        // 1. Unmap the range (its pages stay in the page cache, see
        //    `release`), since the kernel drops no page still mapped.
        self.map.release(offset, len);
        // 2. Drop the range's clean page-cache pages: zeros read from the
        //    file's unwritten (fallocated) blocks. A page dirtied meanwhile
        //    is kept, and a folio reaching outside the range is kept whole.
        let _ = rustix::fs::fadvise(
            &self.file,
            offset as u64,
            std::num::NonZeroU64::new(len as u64),
            Advice::DontNeed,
        );
        // 3. Faults of a range advised random read no readahead window, so
        //    each page is faulted in with a folio of its own, as in
        //    `DiskFile::map` with `page_folios` (`Mapping` populates the
        //    part it had populated again).
        let _ = self.map.advise_range(memmap2::Advice::Random, offset, len);
    }

    fn populate(&self, offset: usize, len: usize) {
        self.map.populate(offset, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Directories made with their parents, each synced into its parent
    /// (the syncs need the parents to exist and open: a path that cannot
    /// be made fails as before); made again, nothing changes.
    #[test]
    fn nested_directories_are_made_and_made_again() {
        let root = tempfile::tempdir().unwrap();
        let deep = root.path().join("a").join("b").join("c");
        FileStorage.create_dir_all(&deep).unwrap();
        assert!(deep.is_dir());
        FileStorage.create_dir_all(&deep).unwrap();
        let file = root.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(FileStorage.create_dir_all(&file.join("under")).is_err());
    }

    /// A writer that takes at most `most` bytes a call (and, every third
    /// call, is interrupted), recording them at their offsets.
    fn short_writer(
        out: &mut Vec<u8>,
        most: usize,
    ) -> impl FnMut(&[io::IoSlice<'_>], u64) -> io::Result<usize> + '_ {
        let mut calls = 0;
        move |batch, at| {
            calls += 1;
            assert!(batch.len() <= MOST_PIECES);
            if calls % 3 == 0 {
                return Err(io::ErrorKind::Interrupted.into());
            }
            let mut taken = 0;
            for piece in batch {
                for &byte in piece.iter() {
                    if taken == most {
                        return Ok(taken);
                    }
                    let at = at as usize + taken;
                    if out.len() <= at {
                        out.resize(at + 1, 0);
                    }
                    out[at] = byte;
                    taken += 1;
                }
            }
            Ok(taken)
        }
    }

    #[test]
    fn vectored_writes_go_on_after_short_and_interrupted_writes() {
        // Pieces of every length around the short write's size, empty ones
        // among them, and more pieces than one call may carry.
        let bytes: Vec<Vec<u8>> = (0..2_500u32)
            .map(|i| {
                (0..(i % 13) as u8)
                    .map(|b| b.wrapping_add(i as u8))
                    .collect()
            })
            .collect();
        let pieces: Vec<io::IoSlice<'_>> = bytes.iter().map(|b| io::IoSlice::new(b)).collect();
        let expected: Vec<u8> = bytes.concat();
        for most in [1, 5, 12, 13, 4096, usize::MAX] {
            let mut out = vec![0u8; 3];
            write_all_vectored_at(&pieces, 3, short_writer(&mut out, most)).unwrap();
            assert_eq!(&out[3..], &expected[..], "at most {most} bytes a write");
        }
        // A write that takes nothing is an error, not a loop.
        let err = write_all_vectored_at(&pieces, 0, |_, _| Ok(0)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WriteZero);
        // Nothing to write: no call.
        write_all_vectored_at(&[io::IoSlice::new(&[])], 0, |_, _| panic!("called")).unwrap();
    }

    fn dirty_bytes(path: &Path) -> u64 {
        crate::storage::mapped_bytes(path, &["Shared_Dirty:", "Private_Dirty:"])
    }

    /// A new 1 MiB file, mapped writable (large folios).
    fn mapped_segment() -> (
        tempfile::TempDir,
        std::path::PathBuf,
        Arc<dyn StorageFile>,
        Mapping,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("segment");
        let file = FileStorage::new().create(&path, 1 << 20).expect("create");
        let mapping = file.map(false).expect("map");
        (dir, path, file, mapping)
    }

    #[test]
    fn faulting_in_makes_pages_writable_ahead_and_changes_no_byte() {
        let (_dir, path, file, mapping) = mapped_segment();
        let len = file.len();
        mapping.claim(4096).expect("claim").fill(7);
        let before = dirty_bytes(&path);
        assert!(before < 256 << 10, "{before} dirty bytes before");

        mapping.fault_in_writable(256 << 10, 256 << 10);
        // Clipped at the end, and a range past the end: no effect, no panic.
        mapping.fault_in_writable(len - 4096, 1 << 20);
        mapping.fault_in_writable(len + 4096, 4096);
        let after = dirty_bytes(&path);
        assert!(
            after >= before + (256 << 10),
            "{before} dirty bytes before, {after} after"
        );

        drop(mapping);
        let mut bytes = vec![0u8; len as usize];
        file.read_at(&mut bytes, 0).expect("read");
        assert!(bytes[..4096].iter().all(|&b| b == 7));
        assert!(bytes[4096..].iter().all(|&b| b == 0));
    }

    #[test]
    fn releasing_unmaps_whole_written_pages_and_keeps_their_bytes() {
        let (_dir, path, file, mapping) = mapped_segment();
        let len = file.len();
        let written = (512 << 10) + 100;
        mapping.claim(written).expect("claim").fill(9);
        let before = dirty_bytes(&path);
        assert!(before >= written, "{before} dirty bytes mapped");

        mapping.release_below(written);
        let after = dirty_bytes(&path);
        // The 128 whole pages left the page tables; the partly written
        // last page is still mapped (and dirty).
        assert!(
            after + (512 << 10) <= before && after >= 4096,
            "{before} dirty bytes mapped before, {after} after"
        );
        // Released already, or below: nothing changes.
        mapping.release_below(written);
        mapping.release_below(4096);
        assert_eq!(dirty_bytes(&path), after);

        // Writing on still works, and every byte is the file's: in the page
        // cache, and on the disk after a sync (the dirty bits were kept).
        mapping.claim(4000).expect("claim").fill(5);
        let check = |what: &str| {
            let mut bytes = vec![0u8; len as usize];
            file.read_at(&mut bytes, 0).expect("read");
            let end = written as usize + 4000;
            assert!(bytes[..written as usize].iter().all(|&b| b == 9), "{what}");
            assert!(
                bytes[written as usize..end].iter().all(|&b| b == 5),
                "{what}"
            );
            assert!(bytes[end..].iter().all(|&b| b == 0), "{what}");
        };
        check("from the page cache");
        file.sync_all().expect("sync");
        file.evict_cache().expect("evict");
        check("after a sync and eviction");
    }
}
