//! Raft snapshots as files: a shard's engine checkpoint (its WAL segments,
//! the index segments in use and the control file) shipped to a new or
//! lagging replica.
//!
//! Sender: when raft-rs needs a snapshot, the leader's log takes an engine
//! checkpoint at its applied index ([`Prepared`]), hashes the files on a
//! background thread, and offers it to the node's [`Outbox`]; the Raft
//! snapshot message carries only the [`SnapshotManifest`] (file names,
//! sizes, SHA-256). Receiver: the node's transport sees the message, pulls
//! the files into the replica's spare slot with a [`Receiver`] (resumable,
//! every chunk CRC-checked and every file SHA-256-checked), and only then
//! steps the message into raft-rs, whose Ready hands it to the replica to
//! install. See `docs/design/replication.md`.

mod receive;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use parking_lot::Mutex;
use prost::Message as _;
use raft::eraftpb::{ConfState, Snapshot, SnapshotMetadata};
use sha2::{Digest, Sha256};
use tidepool_engine::Checkpoint;
use tidepool_proto::v1::{NodeAddress, SnapshotChunk, SnapshotFile, SnapshotManifest};

use crate::error::{NodeError, Result};
pub use receive::Receiver;

/// Largest chunk of file data per message.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Snapshots a node keeps per shard (older ones are gone).
const KEPT_PER_SHARD: usize = 2;
/// A prepared snapshot nobody pulled from for this long is dropped (with
/// the WAL segments its checkpoint pinned); a receiver that comes back
/// later asks again and gets a fresh one.
pub const SNAPSHOT_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

/// A snapshot prepared by a shard leader; see the module docs.
#[derive(Debug)]
pub struct Prepared {
    /// The shard.
    pub shard_id: u32,
    /// Unique per shard on this node.
    pub id: u64,
    /// Raft index and term it covers.
    pub index: u64,
    /// Term of `index`.
    pub term: u64,
    conf_state: ConfState,
    source: NodeAddress,
    checkpoint: Checkpoint,
    /// The manifest, once every file is hashed (or why hashing failed).
    manifest: OnceLock<std::result::Result<SnapshotManifest, String>>,
    /// Last time a receiver pulled from it.
    pub last_activity: Mutex<Instant>,
    /// Chunks served, per receiving node (so the leader can tell a stalled
    /// transfer from a slow one).
    pulls: Mutex<BTreeMap<u64, u64>>,
}

impl Prepared {
    /// The configuration the snapshot carries.
    pub fn conf_state(&self) -> &ConfState {
        &self.conf_state
    }

    /// A snapshot of `checkpoint`, which holds the state at `index`.
    pub fn new(
        shard_id: u32,
        index: u64,
        term: u64,
        conf_state: ConfState,
        source: NodeAddress,
        checkpoint: Checkpoint,
    ) -> Self {
        Self {
            shard_id,
            id: rand::random::<u64>() | 1,
            index,
            term,
            conf_state,
            source,
            checkpoint,
            manifest: OnceLock::new(),
            last_activity: Mutex::new(Instant::now()),
            pulls: Mutex::new(BTreeMap::new()),
        }
    }

    /// Hashes every file and publishes the manifest (run off the Raft
    /// thread: it reads the whole checkpoint).
    pub fn hash(&self) {
        let started = Instant::now();
        let manifest = self.build_manifest().map_err(|e| e.to_string());
        tracing::info!(
            shard_id = self.shard_id,
            snapshot = self.id,
            index = self.index,
            hash_ms = started.elapsed().as_millis() as u64,
            "snapshot ready to send"
        );
        // Idle time counts from when it can be sent.
        *self.last_activity.lock() = Instant::now();
        let _ = self.manifest.set(manifest);
    }

    fn build_manifest(&self) -> Result<SnapshotManifest> {
        let mut files = Vec::with_capacity(self.checkpoint.files.len());
        let mut buf = vec![0; CHUNK_BYTES];
        for file in &self.checkpoint.files {
            let mut hasher = Sha256::new();
            let mut offset = 0;
            while offset < file.len {
                let n = (file.len - offset).min(CHUNK_BYTES as u64) as usize;
                file.read_at(&mut buf[..n], offset)?;
                hasher.update(&buf[..n]);
                offset += n as u64;
            }
            files.push(SnapshotFile {
                path: file.path.to_string_lossy().into_owned(),
                size: file.len,
                sha256: hasher.finalize().to_vec(),
                file_size: file.file_len,
            });
        }
        Ok(SnapshotManifest {
            shard_id: self.shard_id,
            snapshot_id: self.id,
            raft_index: self.index,
            raft_term: self.term,
            files,
            source: Some(self.source.clone()),
        })
    }

    /// Whether hashing finished (successfully or not).
    pub fn is_hashed(&self) -> bool {
        self.manifest.get().is_some()
    }

    /// The Raft snapshot to send: `None` while hashing, an error if hashing
    /// failed.
    pub fn raft_snapshot(&self) -> Option<Result<Snapshot>> {
        let manifest = match self.manifest.get()? {
            Ok(manifest) => manifest,
            Err(error) => return Some(Err(NodeError::Malformed(error.clone()))),
        };
        let mut snapshot = Snapshot {
            data: manifest.encode_to_vec(),
            ..Snapshot::default()
        };
        snapshot.set_metadata(SnapshotMetadata {
            conf_state: Some(self.conf_state.clone()),
            index: self.index,
            term: self.term,
        });
        Some(Ok(snapshot))
    }

    /// Chunks served to node `to` so far.
    pub fn pulls(&self, to: u64) -> u64 {
        self.pulls.lock().get(&to).copied().unwrap_or(0)
    }

    /// The chunk of file `file_index` starting at `offset`, for node `to`:
    /// at most [`CHUNK_BYTES`], empty at the file's end.
    pub fn chunk(&self, to: u64, file_index: u32, offset: u64) -> Result<SnapshotChunk> {
        *self.last_activity.lock() = Instant::now();
        *self.pulls.lock().entry(to).or_default() += 1;
        let file = self
            .checkpoint
            .files
            .get(file_index as usize)
            .ok_or_else(|| NodeError::Malformed(format!("snapshot has no file {file_index}")))?;
        if offset > file.len {
            return Err(NodeError::Malformed(format!(
                "offset {offset} past the end of snapshot file {} ({} bytes)",
                file.path.display(),
                file.len
            )));
        }
        let n = (file.len - offset).min(CHUNK_BYTES as u64) as usize;
        let mut data = vec![0; n];
        file.read_at(&mut data, offset)?;
        Ok(SnapshotChunk {
            file_index,
            offset,
            crc32: crc32fast::hash(&data),
            data,
        })
    }

    /// Every chunk from `(file_index, offset)` to the end, in order, read
    /// lazily.
    pub fn chunks(
        self: &Arc<Self>,
        to: u64,
        file_index: u32,
        offset: u64,
    ) -> impl Iterator<Item = Result<SnapshotChunk>> + Send + 'static {
        let this = self.clone();
        let (mut file, mut offset, mut failed) = (file_index, offset, false);
        std::iter::from_fn(move || {
            loop {
                if failed {
                    return None;
                }
                let len = this.checkpoint.files.get(file as usize)?.len;
                if offset >= len {
                    // Next file (an empty file has no chunk).
                    (file, offset) = (file + 1, 0);
                    continue;
                }
                let chunk = this.chunk(to, file, offset);
                match &chunk {
                    Ok(c) => offset += c.data.len() as u64,
                    Err(_) => failed = true,
                }
                return Some(chunk);
            }
        })
    }
}

/// The snapshots a node offers to receivers, by shard and id.
#[derive(Debug, Default)]
pub struct Outbox {
    snapshots: Mutex<BTreeMap<(u32, u64), Arc<Prepared>>>,
}

impl Outbox {
    /// Offers `prepared`, retiring the shard's oldest beyond the few kept.
    pub fn insert(&self, prepared: Arc<Prepared>) {
        let mut snapshots = self.snapshots.lock();
        let shard = prepared.shard_id;
        snapshots.insert((shard, prepared.id), prepared);
        let mut of_shard: Vec<(Instant, u64)> = snapshots
            .iter()
            .filter(|((s, _), _)| *s == shard)
            .map(|((_, id), p)| (*p.last_activity.lock(), *id))
            .collect();
        of_shard.sort();
        let excess = of_shard.len().saturating_sub(KEPT_PER_SHARD);
        for (_, id) in of_shard.into_iter().take(excess) {
            snapshots.remove(&(shard, id));
        }
    }

    /// Chunks node `to` pulled from every offered snapshot of `shard`: a
    /// receiver may still be pulling an older one after a newer one was
    /// prepared for another (a learner added meanwhile).
    pub fn pulls(&self, shard: u32, to: u64) -> u64 {
        self.snapshots
            .lock()
            .iter()
            .filter(|((s, _), _)| *s == shard)
            .map(|(_, p)| p.pulls(to))
            .sum()
    }

    /// Snapshot `id` of `shard`, if still offered.
    pub fn get(&self, shard: u32, id: u64) -> Option<Arc<Prepared>> {
        self.snapshots.lock().get(&(shard, id)).cloned()
    }

    /// Drops the hashed snapshots nobody pulled from for `idle` (one still
    /// being hashed stays). Returns how many.
    pub fn expire_idle(&self, idle: std::time::Duration) -> usize {
        let mut snapshots = self.snapshots.lock();
        let before = snapshots.len();
        snapshots.retain(|_, p| !p.is_hashed() || p.last_activity.lock().elapsed() < idle);
        before - snapshots.len()
    }

    /// Stops offering every snapshot of `shard`.
    pub fn remove_shard(&self, shard: u32) {
        self.snapshots.lock().retain(|(s, _), _| *s != shard);
    }
}

/// Decodes the manifest a Raft snapshot carries.
pub fn manifest_of(snapshot: &Snapshot) -> Result<SnapshotManifest> {
    SnapshotManifest::decode(&snapshot.data[..])
        .map_err(|e| NodeError::Malformed(format!("snapshot manifest: {e}")))
}

#[cfg(test)]
mod tests;
