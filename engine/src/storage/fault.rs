//! The fault-injecting twin of [`super::FileStorage`], for crash tests.
//!
//! Every file has two images: *volatile* (what the page cache holds: every
//! write, through `write_at` or a mapping) and *durable* (what the disk
//! holds: only bytes that were synced). Directory entries likewise become
//! durable only at `sync_dir`. The storage can:
//! - fail the N-th counted operation (create, remove, rename, write, sync) and
//!   every operation after it — a crash at that point;
//! - be crashed at any moment with [`FaultStorage::crash`];
//! - refuse to create files beyond a byte capacity (disk full);
//! - [`FaultStorage::reboot`] into the files a real machine would find after
//!   power loss: durable bytes, plus a random subset of 512-byte sectors of
//!   unsynced data (torn writes), chosen by a printed seed;
//! - [`FaultStorage::restart_process`] into what survives a `kill -9`: the
//!   whole volatile image.

#![allow(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{DirLock, Mapping, ReadMapping, Storage, StorageFile};

const SECTOR_BYTES: usize = 512;

/// Settings of a [`FaultStorage`].
#[derive(Clone, Debug, Default)]
pub struct FaultConfig {
    /// Fail the N-th counted operation (1-based) and everything after it.
    pub crash_at_op: Option<u64>,
    /// Total bytes of live files allowed; creating past it fails with
    /// "no space left on device".
    pub capacity_bytes: Option<u64>,
}

/// In-memory storage with injectable faults. Cloning shares the same files.
#[derive(Clone, Debug)]
pub struct FaultStorage {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    ops: AtomicU64,
    crash_at_op: AtomicU64,
    crashed: AtomicBool,
    capacity_bytes: AtomicU64,
    /// Calls of `evict_cache`, and those on files with unsynced bytes.
    evictions: AtomicU64,
    unsynced_evictions: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    files: BTreeMap<u64, Arc<FaultFile>>,
    live: BTreeMap<PathBuf, u64>,
    durable: BTreeMap<PathBuf, u64>,
    dirs: BTreeSet<PathBuf>,
    /// Directories held by [`Storage::lock`] (a process's locks: a reboot
    /// or restart starts without any).
    locks: BTreeSet<PathBuf>,
    next_id: u64,
}

impl Default for FaultStorage {
    fn default() -> Self {
        Self::new(FaultConfig::default())
    }
}

impl FaultStorage {
    /// Calls of [`StorageFile::evict_cache`] on this storage's files, and
    /// how many of them found bytes not yet synced.
    pub fn evictions(&self) -> (u64, u64) {
        (
            self.inner.evictions.load(Ordering::SeqCst),
            self.inner.unsynced_evictions.load(Ordering::SeqCst),
        )
    }

    /// An empty storage with the given faults.
    pub fn new(config: FaultConfig) -> Self {
        let inner = Inner {
            state: Mutex::new(State::default()),
            ops: AtomicU64::new(0),
            crash_at_op: AtomicU64::new(config.crash_at_op.unwrap_or(0)),
            crashed: AtomicBool::new(false),
            capacity_bytes: AtomicU64::new(config.capacity_bytes.unwrap_or(u64::MAX)),
            evictions: AtomicU64::new(0),
            unsynced_evictions: AtomicU64::new(0),
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Counted operations so far.
    pub fn ops(&self) -> u64 {
        self.inner.ops.load(Ordering::SeqCst)
    }

    /// Fail the N-th counted operation from the start (1-based) and every
    /// one after it; 0 turns crashing off.
    pub fn crash_at_op(&self, op: u64) {
        self.inner.crash_at_op.store(op, Ordering::SeqCst);
    }

    /// Crash now: every further operation fails; nothing more becomes
    /// durable.
    pub fn crash(&self) {
        self.inner.crashed.store(true, Ordering::SeqCst);
    }

    /// Whether the storage has crashed.
    pub fn crashed(&self) -> bool {
        self.inner.crashed.load(Ordering::SeqCst)
    }

    /// Changes the capacity (disk full when live files exceed it).
    pub fn set_capacity_bytes(&self, capacity: Option<u64>) {
        self.inner
            .capacity_bytes
            .store(capacity.unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Bytes reserved by live files (the whole length, but for the holes
    /// of sparse files).
    pub fn used_bytes(&self) -> u64 {
        used(&self.inner.state.lock())
    }

    /// What the disk holds after a power loss: the durable directory
    /// entries and bytes, plus each unsynced 512-byte sector with
    /// probability one half (torn writes), drawn from `seed`.
    ///
    /// Call only after the engine using this storage has been dropped.
    pub fn reboot(&self, seed: u64) -> FaultStorage {
        let mut rng = SmallRng::seed_from_u64(seed);
        let state = self.inner.state.lock();
        let image = state.durable.iter().map(|(path, id)| {
            let file = &state.files[id];
            let mut bytes = file.durable.lock().clone();
            let volatile = file.volatile.snapshot();
            for (disk, cache) in bytes
                .chunks_mut(SECTOR_BYTES)
                .zip(volatile.chunks(SECTOR_BYTES))
            {
                if disk != cache && rng.random_bool(0.5) {
                    disk.copy_from_slice(cache);
                }
            }
            (path.clone(), bytes)
        });
        Self::from_image(image.collect(), state.dirs.clone())
    }

    /// What survives a `kill -9` of the process: every directory entry and
    /// every written byte (the page cache outlives the process).
    ///
    /// Call only after the engine using this storage has been dropped.
    pub fn restart_process(&self) -> FaultStorage {
        let state = self.inner.state.lock();
        let image = state
            .live
            .iter()
            .map(|(path, id)| (path.clone(), state.files[id].volatile.snapshot()))
            .collect();
        Self::from_image(image, state.dirs.clone())
    }

    fn from_image(files: Vec<(PathBuf, Vec<u8>)>, dirs: BTreeSet<PathBuf>) -> FaultStorage {
        let storage = FaultStorage::default();
        {
            let mut state = storage.inner.state.lock();
            state.dirs = dirs;
            for (path, bytes) in files {
                let id = state.next_id;
                state.next_id += 1;
                let file = FaultFile::from_bytes(Arc::downgrade(&storage.inner), bytes);
                state.files.insert(id, Arc::new(file));
                state.live.insert(path.clone(), id);
                state.durable.insert(path, id);
            }
        }
        storage
    }

    /// Damages a file in place (both images): the corruption tests use it to
    /// flip bytes on "disk".
    pub fn corrupt(&self, path: &Path, offset: u64, xor: u8) -> io::Result<()> {
        let file = self.live_file(path)?;
        file.volatile.xor_byte(offset, xor)?;
        let mut durable = file.durable.lock();
        let byte = durable
            .get_mut(offset as usize)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "offset past end"))?;
        *byte ^= xor;
        Ok(())
    }

    /// Makes every read of a file fail with EIO (a bad sector under it),
    /// or read again.
    pub fn fail_reads(&self, path: &Path, fail: bool) -> io::Result<()> {
        let file = self.live_file(path)?;
        file.read_fails.store(fail, Ordering::SeqCst);
        Ok(())
    }

    /// Replaces a file's content (both images) with its first `len` bytes.
    pub fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let mut state = self.inner.state.lock();
        let id = *state.live.get(path).ok_or_else(not_found)?;
        let mut bytes = state.files[&id].volatile.snapshot();
        bytes.truncate(len as usize);
        let file = FaultFile::from_bytes(Arc::downgrade(&self.inner), bytes);
        state.files.insert(id, Arc::new(file));
        Ok(())
    }

    /// Names of every live file, with full paths.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.inner.state.lock().live.keys().cloned().collect()
    }

    fn live_file(&self, path: &Path) -> io::Result<Arc<FaultFile>> {
        let state = self.inner.state.lock();
        let id = state.live.get(path).ok_or_else(not_found)?;
        Ok(state.files[id].clone())
    }
}

impl Inner {
    /// Counts an operation; fails if the storage has crashed or this is the
    /// operation chosen to crash at.
    fn op(&self) -> io::Result<()> {
        let n = self.ops.fetch_add(1, Ordering::SeqCst) + 1;
        let crash_at = self.crash_at_op.load(Ordering::SeqCst);
        if crash_at != 0 && n >= crash_at {
            self.crashed.store(true, Ordering::SeqCst);
        }
        if self.crashed.load(Ordering::SeqCst) {
            return Err(io::Error::other(format!("injected crash (operation {n})")));
        }
        Ok(())
    }
}

fn not_found() -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, "no such file")
}

fn parent(path: &Path) -> PathBuf {
    path.parent().map(Path::to_path_buf).unwrap_or_default()
}

/// A hold on a directory of a [`FaultStorage`].
struct FaultLock {
    inner: Weak<Inner>,
    dir: PathBuf,
}

impl Drop for FaultLock {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.state.lock().locks.remove(&self.dir);
        }
    }
}

impl Storage for FaultStorage {
    fn lock(&self, dir: &Path) -> io::Result<DirLock> {
        if !self.inner.state.lock().locks.insert(dir.to_path_buf()) {
            return Err(super::held(dir));
        }
        Ok(DirLock::new(FaultLock {
            inner: Arc::downgrade(&self.inner),
            dir: dir.to_path_buf(),
        }))
    }

    fn create(&self, path: &Path, len: u64) -> io::Result<Arc<dyn StorageFile>> {
        self.create_sparse(path, len, len)
    }

    fn create_sparse(
        &self,
        path: &Path,
        len: u64,
        reserved: u64,
    ) -> io::Result<Arc<dyn StorageFile>> {
        self.inner.op()?;
        let reserved = reserved.min(len);
        let mut state = self.inner.state.lock();
        if state.live.contains_key(path) {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, "file exists"));
        }
        if !state.dirs.contains(&parent(path)) {
            return Err(not_found());
        }
        if used(&state).saturating_add(reserved) > self.inner.capacity_bytes.load(Ordering::SeqCst)
        {
            return Err(io::Error::from_raw_os_error(28));
        }
        let id = state.next_id;
        state.next_id += 1;
        let file = Arc::new(FaultFile::from_bytes(
            Arc::downgrade(&self.inner),
            vec![0; len as usize],
        ));
        file.reserved.store(reserved, Ordering::SeqCst);
        file.durable.lock().clear();
        state.files.insert(id, file.clone());
        state.live.insert(path.to_path_buf(), id);
        Ok(file)
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        if self.crashed() {
            return Err(io::Error::other("injected crash"));
        }
        Ok(self.live_file(path)?)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        self.inner.op()?;
        let mut state = self.inner.state.lock();
        state.live.remove(path).map(|_| ()).ok_or_else(not_found)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.inner.op()?;
        let mut state = self.inner.state.lock();
        let id = state.live.remove(from).ok_or_else(not_found)?;
        state.live.insert(to.to_path_buf(), id);
        Ok(())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let state = self.inner.state.lock();
        if !state.dirs.contains(dir) {
            return Err(not_found());
        }
        Ok(state
            .live
            .keys()
            .filter(|path| path.parent() == Some(dir))
            .filter_map(|path| path.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect())
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.inner.state.lock();
        for ancestor in dir.ancestors() {
            state.dirs.insert(ancestor.to_path_buf());
        }
        Ok(())
    }

    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.inner.state.lock();
        if state.dirs.contains(dir) || state.live.contains_key(dir) {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, "exists"));
        }
        if !state.dirs.contains(&parent(dir)) {
            return Err(not_found());
        }
        state.dirs.insert(dir.to_path_buf());
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.inner.op()?;
        let mut state = self.inner.state.lock();
        let State { live, durable, .. } = &mut *state;
        durable.retain(|path, _| path.parent() != Some(dir));
        for (path, id) in live.iter().filter(|(path, _)| path.parent() == Some(dir)) {
            durable.insert(path.clone(), *id);
        }
        Ok(())
    }

    fn exists(&self, path: &Path) -> bool {
        let state = self.inner.state.lock();
        state.live.contains_key(path) || state.dirs.contains(path)
    }

    fn available_bytes(&self, _dir: &Path) -> io::Result<u64> {
        let capacity = self.inner.capacity_bytes.load(Ordering::SeqCst);
        Ok(capacity.saturating_sub(self.used_bytes()))
    }
}

/// Raw memory of a file's volatile image: written through mappings and
/// `write_at` without a lock, like the page cache.
struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain heap memory. Concurrent access is governed by
// the engine's contract with the storage seam: mapped writers use disjoint
// claimed regions, and reads (`read_at`, snapshots) only touch bytes no
// writer is writing at the time — completed records, or a quiescent storage
// (after the engine was dropped) for reboots.
unsafe impl Send for Buffer {}
// SAFETY: see `Send`.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({} bytes)", self.len)
    }
}

impl Buffer {
    fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        let boxed: Box<[u8]> = bytes.into_boxed_slice();
        let ptr = NonNull::new(Box::into_raw(boxed).cast::<u8>()).expect("box pointer is non-null");
        Buffer { ptr, len }
    }

    fn check(&self, offset: u64, len: usize) -> io::Result<usize> {
        let start = usize::try_from(offset).map_err(|_| past_end())?;
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(start),
            _ => Err(past_end()),
        }
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = self.check(offset, buf.len())?;
        // SAFETY: the range is inside the buffer (checked); per the seam's
        // contract no writer is writing these bytes now.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(start), buf.as_mut_ptr(), buf.len())
        };
        Ok(())
    }

    fn write(&self, data: &[u8], offset: u64) -> io::Result<()> {
        let start = self.check(offset, data.len())?;
        // SAFETY: the range is inside the buffer (checked); `write_at` is
        // refused on mapped files, `write_vectored_at` writes only ranges a
        // log claimed (which no writer reaches through the mapping), and
        // the engine never writes one range of a file from two threads at
        // once.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(start), data.len())
        };
        Ok(())
    }

    fn xor_byte(&self, offset: u64, xor: u8) -> io::Result<()> {
        let mut byte = [0u8];
        self.read(&mut byte, offset)?;
        byte[0] ^= xor;
        self.write(&byte, offset)
    }

    fn snapshot(&self) -> Vec<u8> {
        let mut bytes = vec![0; self.len];
        self.read(&mut bytes, 0).expect("whole buffer is in range");
        bytes
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of
        // this length and are freed exactly once, here.
        drop(unsafe { Box::from_raw(slice) });
    }
}

/// One in-memory file.
#[derive(Debug)]
struct FaultFile {
    storage: std::sync::Weak<Inner>,
    len: u64,
    /// Bytes from the start whose space is reserved (counted against the
    /// capacity); a write through the mapping past them fails the next
    /// sync of that range, as it would kill a real process (SIGBUS on a
    /// full disk).
    reserved: AtomicU64,
    volatile: Arc<Buffer>,
    durable: Mutex<Vec<u8>>,
    mapped: Arc<AtomicBool>,
    /// The page cache, modelled for the whole file: `evict_cache` drops it
    /// (reads that must not wait then fail) and a read brings it back.
    evicted: AtomicBool,
    /// Every read fails with EIO ([`FaultStorage::fail_reads`]).
    read_fails: AtomicBool,
}

/// Keeps a mapped buffer alive and marks the file unmapped when dropped.
struct MappedBuffer {
    _buffer: Arc<Buffer>,
    mapped: Arc<AtomicBool>,
}

impl super::mapping::MappedMemory for MappedBuffer {}
impl super::mapping::MappedMemory for Arc<Buffer> {}

impl Drop for MappedBuffer {
    fn drop(&mut self) {
        self.mapped.store(false, Ordering::SeqCst);
    }
}

impl FaultFile {
    fn from_bytes(storage: std::sync::Weak<Inner>, bytes: Vec<u8>) -> Self {
        Self {
            storage,
            len: bytes.len() as u64,
            reserved: AtomicU64::new(bytes.len() as u64),
            durable: Mutex::new(bytes.clone()),
            volatile: Arc::new(Buffer::from_vec(bytes)),
            mapped: Arc::new(AtomicBool::new(false)),
            evicted: AtomicBool::new(false),
            read_fails: AtomicBool::new(false),
        }
    }

    fn op(&self) -> io::Result<()> {
        match self.storage.upgrade() {
            Some(inner) => inner.op(),
            None => Err(io::Error::other("storage dropped")),
        }
    }

    /// Reserves up to `end` (clipped to the length) against the capacity.
    fn reserve(&self, end: u64) -> io::Result<()> {
        let inner = self
            .storage
            .upgrade()
            .ok_or_else(|| io::Error::other("storage dropped"))?;
        let state = inner.state.lock();
        let end = end.min(self.len);
        let reserved = self.reserved.load(Ordering::SeqCst);
        if end <= reserved {
            return Ok(());
        }
        if used(&state).saturating_add(end - reserved) > inner.capacity_bytes.load(Ordering::SeqCst)
        {
            return Err(io::Error::from_raw_os_error(28));
        }
        self.reserved.store(end, Ordering::SeqCst);
        Ok(())
    }

    fn persist(&self, offset: u64, len: u64) -> io::Result<()> {
        let start = self.volatile.check(offset, len as usize)?;
        let reserved = self.reserved.load(Ordering::SeqCst);
        if offset + len > reserved {
            let from = offset.max(reserved);
            let mut beyond = vec![0u8; (offset + len - from) as usize];
            self.volatile.read(&mut beyond, from)?;
            if beyond.iter().any(|&b| b != 0) {
                return Err(io::Error::other(format!(
                    "bytes written past the reserved end {reserved} (a real process would \
                     get SIGBUS there on a full disk)"
                )));
            }
        }
        let mut durable = self.durable.lock();
        if durable.len() < self.len as usize {
            durable.resize(self.len as usize, 0);
        }
        self.volatile
            .read(&mut durable[start..start + len as usize], offset)
    }
}

/// Bytes reserved by the live files.
fn used(state: &State) -> u64 {
    state
        .live
        .values()
        .map(|id| state.files[id].reserved.load(Ordering::SeqCst))
        .sum()
}

fn past_end() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "range past end of file")
}

impl StorageFile for FaultFile {
    fn len(&self) -> u64 {
        self.len
    }

    fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::SeqCst)
    }

    fn reserve_to(&self, end: u64) -> io::Result<()> {
        self.op()?;
        self.reserve(end)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if self.read_fails.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(5));
        }
        self.volatile.read(buf, offset)?;
        self.evicted.store(false, Ordering::SeqCst);
        Ok(())
    }

    fn read_at_if_cached(&self, buf: &mut [u8], offset: u64) -> io::Result<bool> {
        if self.evicted.load(Ordering::SeqCst) {
            return Ok(false);
        }
        self.volatile.read(buf, offset).map(|()| true)
    }

    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.op()?;
        if self.mapped.load(Ordering::SeqCst) {
            return Err(io::Error::other("write_at on a mapped fault-storage file"));
        }
        // Writing into a hole allocates it (or fails: disk full).
        self.reserve(offset + data.len() as u64)?;
        self.volatile.write(data, offset)
    }

    fn write_vectored_at(&self, pieces: &[io::IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.op()?;
        // As through a mapping: into reserved bytes only (a write into a
        // hole would allocate; the logs claim below the reserved end).
        let len: u64 = pieces.iter().map(|p| p.len() as u64).sum();
        if offset + len > self.reserved() {
            return Err(io::Error::other(format!(
                "vectored write of [{offset}, {}) past the reserved end {}",
                offset + len,
                self.reserved()
            )));
        }
        let mut at = offset;
        for piece in pieces {
            self.volatile.write(piece, at)?;
            at += piece.len() as u64;
        }
        Ok(())
    }

    fn map(&self, _page_folios: bool) -> io::Result<Mapping> {
        if self.mapped.swap(true, Ordering::SeqCst) {
            return Err(io::Error::other("fault-storage file mapped twice"));
        }
        // SAFETY: the buffer is `len` bytes of heap memory kept alive by the
        // `Arc` the mapping owns; only this one mapping writes it (second
        // mappings and `write_at` are refused above).
        let owner = MappedBuffer {
            _buffer: self.volatile.clone(),
            mapped: self.mapped.clone(),
        };
        Ok(unsafe { Mapping::from_raw(self.volatile.ptr, self.len, Box::new(owner)) })
    }

    fn map_read(&self) -> io::Result<ReadMapping> {
        // SAFETY: the buffer is `len` bytes of heap memory kept alive by the
        // `Arc` the read mapping owns.
        Ok(unsafe {
            ReadMapping::from_raw(self.volatile.ptr, self.len, Box::new(self.volatile.clone()))
        })
    }

    fn sync_range(&self, offset: u64, len: u64) -> io::Result<()> {
        self.op()?;
        self.persist(offset, len)
    }

    fn sync_all(&self) -> io::Result<()> {
        self.op()?;
        self.persist(0, self.len)
    }

    fn evict_cache(&self) -> io::Result<()> {
        // Dropping clean pages loses nothing (a real kernel writes dirty
        // ones back first); count the call, and whether the file still had
        // unsynced bytes — an engine should only release what it synced.
        let unsynced = {
            let durable = self.durable.lock();
            let mut volatile = vec![0u8; self.len as usize];
            self.volatile.read(&mut volatile, 0)?;
            durable.len() != volatile.len() || *durable != volatile
        };
        self.evicted.store(true, Ordering::SeqCst);
        if let Some(inner) = self.storage.upgrade() {
            inner.evictions.fetch_add(1, Ordering::SeqCst);
            if unsynced {
                inner.unsynced_evictions.fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        PathBuf::from("/db")
    }

    fn storage_with_dir() -> FaultStorage {
        let s = FaultStorage::default();
        s.create_dir_all(&dir()).unwrap();
        s
    }

    #[test]
    fn unsynced_bytes_and_entries_vanish_at_reboot() {
        let s = storage_with_dir();
        let path = dir().join("a");
        let f = s.create(&path, 1024).unwrap();
        f.write_at(b"hello", 0).unwrap();
        // Entry not synced: the file is gone after a reboot.
        assert!(!s.reboot(1).exists(&path));
        s.sync_dir(&dir()).unwrap();
        f.sync_all().unwrap();
        f.write_at(b"HELLO", 0).unwrap();
        let rebooted = s.reboot(7);
        let mut buf = [0u8; 5];
        rebooted.open(&path).unwrap().read_at(&mut buf, 0).unwrap();
        // One sector, synced as "hello", rewritten unsynced: either image.
        assert!(&buf == b"hello" || &buf == b"HELLO", "{buf:?}");
        let mut buf = [0u8; 5];
        s.restart_process()
            .open(&path)
            .unwrap()
            .read_at(&mut buf, 0)
            .unwrap();
        assert_eq!(&buf, b"HELLO");
    }

    #[test]
    fn crash_at_op_fails_that_op_and_all_later() {
        let s = storage_with_dir();
        s.crash_at_op(2);
        let f = s.create(&dir().join("a"), 8).unwrap();
        assert!(f.sync_all().is_err());
        assert!(s.sync_dir(&dir()).is_err());
        assert!(s.crashed());
    }

    #[test]
    fn capacity_makes_create_fail_with_disk_full() {
        let s = storage_with_dir();
        s.set_capacity_bytes(Some(100));
        s.create(&dir().join("a"), 60).unwrap();
        let err = s.create(&dir().join("b"), 60).unwrap_err();
        assert!(crate::error::is_disk_full(&err), "{err}");
        assert_eq!(s.available_bytes(&dir()).unwrap(), 40);
    }

    #[test]
    fn mapped_writes_are_volatile_until_synced() {
        let s = storage_with_dir();
        let path = dir().join("m");
        let f = s.create(&path, 4096).unwrap();
        s.sync_dir(&dir()).unwrap();
        let map = f.map(true).unwrap();
        map.claim(4).unwrap().copy_from_slice(b"abcd");
        map.claim(4).unwrap().copy_from_slice(b"efgh");
        f.sync_range(0, 4).unwrap();
        let mut buf = [0u8; 8];
        s.restart_process()
            .open(&path)
            .unwrap()
            .read_at(&mut buf, 0)
            .unwrap();
        assert_eq!(&buf, b"abcdefgh");
        // Power loss keeps the synced half for sure; "efgh" shares the
        // sector, so the sector is either wholly old-durable or new.
        let mut buf = [0u8; 8];
        s.reboot(3)
            .open(&path)
            .unwrap()
            .read_at(&mut buf, 0)
            .unwrap();
        assert_eq!(&buf[..4], b"abcd");
    }
}
