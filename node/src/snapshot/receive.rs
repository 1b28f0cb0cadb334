//! Receiving a snapshot's files into a replica's spare slot.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tidepool_engine::storage::{Storage, StorageFile};
use tidepool_proto::v1::{SnapshotChunk, SnapshotManifest};

use crate::error::{NodeError, Result};
use crate::store::ReplicaStore;

/// Writes the files of one snapshot, chunk by chunk, in manifest order.
/// After a broken stream, ask the sender again from
/// [`Receiver::resume_point`]; a chunk that does not continue exactly
/// there, fails its CRC, or completes a file with the wrong SHA-256 is an
/// error and nothing is marked complete.
pub struct Receiver {
    manifest: SnapshotManifest,
    store: ReplicaStore,
    dir: PathBuf,
    /// The file being written, and how much of it is written.
    file: usize,
    offset: u64,
    out: Option<Arc<dyn StorageFile>>,
    hasher: Sha256,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver")
            .field("snapshot", &self.manifest.snapshot_id)
            .field("file", &self.file)
            .field("offset", &self.offset)
            .finish()
    }
}

fn malformed(message: String) -> NodeError {
    NodeError::Malformed(message)
}

/// A manifest path must stay inside the slot.
fn checked_path(path: &str) -> Result<PathBuf> {
    let candidate = Path::new(path);
    let safe = !path.is_empty()
        && candidate
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if safe {
        Ok(candidate.to_path_buf())
    } else {
        Err(malformed(format!(
            "snapshot file path {path:?} leaves the replica directory"
        )))
    }
}

/// Most files one snapshot may name (a shard's WAL and index segments,
/// control data: far fewer).
pub const MAX_SNAPSHOT_FILES: usize = 100_000;

/// Largest file a snapshot may name (its length, holes included; a WAL
/// segment is tens of MiB).
pub const MAX_SNAPSHOT_FILE_BYTES: u64 = 1 << 40;

/// What a manifest may ask this node to create: a bounded number of files
/// of bounded length whose copied bytes fit the volume's free space. A
/// manifest is data from the network; without this, one naming huge files
/// made a node fill its disk before the first chunk arrived. Only the
/// copied bytes take disk: past them a file stays a hole (see `advance`),
/// so a replica whose segments are mostly unwritten is not refused for
/// their full length. ([`Receiver::start`] asks the two halves apart, the
/// free space once the spare slot is emptied.)
#[cfg(test)]
pub(super) fn check_bounds(manifest: &SnapshotManifest, store: &ReplicaStore) -> Result<()> {
    check_fits(check_shape(manifest)?, store)
}

/// [`check_bounds`] without the free space: counts and sizes. Returns the
/// bytes to copy.
fn check_shape(manifest: &SnapshotManifest) -> Result<u64> {
    if manifest.files.len() > MAX_SNAPSHOT_FILES {
        return Err(malformed(format!(
            "a snapshot of {} files (at most {MAX_SNAPSHOT_FILES})",
            manifest.files.len()
        )));
    }
    if let Some(file) = manifest
        .files
        .iter()
        .find(|f| f.file_size > MAX_SNAPSHOT_FILE_BYTES)
    {
        return Err(malformed(format!(
            "snapshot file {} of {} bytes (at most {MAX_SNAPSHOT_FILE_BYTES})",
            file.path, file.file_size
        )));
    }
    manifest
        .files
        .iter()
        .try_fold(0u64, |sum, f| sum.checked_add(f.size))
        .ok_or_else(|| malformed("snapshot file sizes overflow".into()))
}

/// Whether `copied` bytes fit the volume's free space. Asked once the
/// spare slot is emptied: the files of an earlier transfer left there (one
/// cut off, or whose snapshot was never installed) hold their space until
/// then, and counted against the next one refused every transfer of a
/// snapshot as large as they were, on a volume less than twice as free.
fn check_fits(copied: u64, store: &ReplicaStore) -> Result<()> {
    let free = store
        .storage()
        .available_bytes(store.dir())
        .map_err(|e| NodeError::Malformed(format!("cannot read the free space: {e}")))?;
    if copied > free {
        return Err(malformed(format!(
            "a snapshot of {copied} bytes does not fit the {free} bytes free"
        )));
    }
    Ok(())
}

/// Makes `dir`, whose parent must exist; one already there is fine.
fn make_dir(storage: &dyn Storage, dir: &Path) -> Result<()> {
    match storage.create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(NodeError::Engine(tidepool_engine::Error::io(dir, e))),
    }
}

impl Receiver {
    /// Starts receiving `manifest` into `store`'s spare slot, emptying it
    /// first.
    pub fn start(manifest: SnapshotManifest, store: &ReplicaStore) -> Result<Receiver> {
        let copied = check_shape(&manifest)?;
        let mut named = std::collections::BTreeSet::new();
        for file in &manifest.files {
            let path = checked_path(&file.path)?;
            // Only the engine's own files, each once: a slot is emptied
            // of those alone, so any other name stayed for good (and,
            // named again, failed every later transfer as existing).
            if !tidepool_engine::is_engine_file(&path) || !named.insert(path) {
                return Err(malformed(format!(
                    "snapshot file {:?} is not an engine file, or is named twice",
                    file.path
                )));
            }
            if file.file_size < file.size || file.sha256.len() != 32 {
                return Err(malformed(format!(
                    "snapshot file {}: size {} > file size {}, or a digest of {} bytes",
                    file.path,
                    file.size,
                    file.file_size,
                    file.sha256.len()
                )));
            }
        }
        store.clear_spare()?;
        check_fits(copied, store)?;
        let dir = store.spare_dir()?;
        // The slot, never the replica's directory above it: a replica
        // deleted before its transfer began is not made again.
        make_dir(&**store.storage(), &dir)?;
        let mut receiver = Receiver {
            dir,
            store: store.clone(),
            manifest,
            file: 0,
            offset: 0,
            out: None,
            hasher: Sha256::new(),
        };
        receiver.advance()?;
        Ok(receiver)
    }

    /// The snapshot being received.
    pub fn manifest(&self) -> &SnapshotManifest {
        &self.manifest
    }

    /// Where to ask the sender to continue: file index and byte offset.
    pub fn resume_point(&self) -> (u32, u64) {
        (self.file as u32, self.offset)
    }

    /// Bytes written so far: the files done and the current one's part.
    pub fn received_bytes(&self) -> u64 {
        let done: u64 = self.manifest.files[..self.file.min(self.manifest.files.len())]
            .iter()
            .map(|f| f.size)
            .sum();
        done.saturating_add(self.offset)
    }

    /// Whether every file is written and verified.
    pub fn is_complete(&self) -> bool {
        self.file >= self.manifest.files.len()
    }

    fn storage(&self) -> &Arc<dyn Storage> {
        self.store.storage()
    }

    fn io(&self, path: &Path, error: std::io::Error) -> NodeError {
        NodeError::Engine(tidepool_engine::Error::io(path, error))
    }

    /// Makes the directories from the slot down to `parent` (inside it),
    /// never the slot itself nor anything above it. A replica that stops
    /// waits only so long for its transfer to notice
    /// ([`crate::shard::ShardHandle::stop`]); should one outlive that wait
    /// (a write stuck on the disk), its next file fails with `NotFound`
    /// once the replica's directory is deleted, instead of making it again
    /// and leaving files no replica owns.
    fn make_dirs_below(&self, parent: &Path) -> Result<()> {
        let below = parent
            .strip_prefix(&self.dir)
            .map_err(|_| malformed(format!("{} is outside the slot", parent.display())))?;
        let mut at = self.dir.clone();
        for component in below.components() {
            at.push(component);
            make_dir(&**self.storage(), &at)?;
        }
        Ok(())
    }

    /// Opens the current file if needed, and finishes every file whose
    /// bytes are all written (verifying and syncing it).
    fn advance(&mut self) -> Result<()> {
        while let Some(file) = self.manifest.files.get(self.file) {
            let path = self.dir.join(checked_path(&file.path)?);
            if self.out.is_none() {
                let parent = path.parent().unwrap_or(&self.dir).to_path_buf();
                self.make_dirs_below(&parent)?;
                // Disk reserved for the bytes copied only: past them the
                // file is zeros, a hole here as in the sender's sparse
                // segment, and the engine reserves ahead of its writes as
                // it does in any segment it reopens.
                let out = self
                    .storage()
                    .create_sparse(&path, file.file_size, file.size)
                    .map_err(|e| self.io(&path, e))?;
                self.out = Some(out);
                self.hasher = Sha256::new();
            }
            if self.offset < file.size {
                return Ok(());
            }
            let digest = std::mem::take(&mut self.hasher).finalize();
            if digest[..] != file.sha256[..] {
                return Err(malformed(format!(
                    "snapshot file {} does not match its SHA-256",
                    file.path
                )));
            }
            let out = self.out.take().expect("opened above");
            out.sync_all().map_err(|e| self.io(&path, e))?;
            self.file += 1;
            self.offset = 0;
        }
        Ok(())
    }

    /// Writes one chunk; it must continue exactly at the resume point.
    pub fn accept(&mut self, chunk: &SnapshotChunk) -> Result<()> {
        let (file, offset) = self.resume_point();
        if chunk.file_index != file || chunk.offset != offset {
            return Err(malformed(format!(
                "snapshot chunk at file {} offset {}, expected file {file} offset {offset}",
                chunk.file_index, chunk.offset
            )));
        }
        let Some(meta) = self.manifest.files.get(self.file) else {
            return Err(malformed("snapshot chunk after the last file".into()));
        };
        if crc32fast::hash(&chunk.data) != chunk.crc32 {
            return Err(malformed(format!(
                "snapshot chunk at file {file} offset {offset} fails its CRC"
            )));
        }
        if offset + chunk.data.len() as u64 > meta.size || chunk.data.is_empty() {
            return Err(malformed(format!(
                "snapshot chunk of {} bytes at offset {offset} does not fit file {} ({} bytes)",
                chunk.data.len(),
                meta.path,
                meta.size
            )));
        }
        let out = self.out.as_ref().expect("advance opens the file");
        out.write_at(&chunk.data, offset)
            .map_err(|e| self.io(&self.dir.join(&meta.path), e))?;
        self.hasher.update(&chunk.data);
        self.offset += chunk.data.len() as u64;
        self.advance()
    }

    /// Makes the received snapshot durable and marks the spare slot
    /// complete. Fails unless every file was received.
    pub fn finish(self) -> Result<u64> {
        if !self.is_complete() {
            return Err(malformed(format!(
                "snapshot {} incomplete: stopped at file {} offset {}",
                self.manifest.snapshot_id, self.file, self.offset
            )));
        }
        // Every file must still be in the slot: something emptying it under
        // the transfer (a replica reopening did) would otherwise leave a
        // slot marked complete without the files written before.
        for file in &self.manifest.files {
            let path = self.dir.join(&file.path);
            if !self.storage().exists(&path) {
                return Err(NodeError::Failed(format!(
                    "snapshot {}: file {} left the spare slot before the snapshot was complete",
                    self.manifest.snapshot_id, file.path
                )));
            }
        }
        let mut dirs: Vec<PathBuf> = self
            .manifest
            .files
            .iter()
            .filter_map(|f| self.dir.join(&f.path).parent().map(Path::to_path_buf))
            .collect();
        dirs.sort();
        dirs.dedup();
        for dir in dirs {
            self.storage()
                .sync_dir(&dir)
                .map_err(|e| self.io(&dir, e))?;
        }
        self.store.mark_spare_complete(self.manifest.snapshot_id)?;
        Ok(self.manifest.snapshot_id)
    }
}
