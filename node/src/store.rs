//! A replica's directory: two engine slots and a pointer to the live one.
//!
//! ```text
//! <replica dir>/CURRENT   "a" or "b" (replaced atomically; missing = "a")
//! <replica dir>/VOTES_HELD while a founding replica has not caught up with
//!                         a leader (`replica/votes.rs`)
//! <replica dir>/a/        an engine directory
//! <replica dir>/b/        the other slot: empty, or a snapshot being
//!                         received, with `b/SNAPSHOT` (the snapshot id)
//!                         once every file of it is durable
//! ```
//!
//! Installing a snapshot fills the spare slot, then flips `CURRENT`: a crash
//! before the flip leaves the old engine live (the leader sends the
//! snapshot again), after it the new one; either way one complete engine is
//! live and the other slot is emptied at the next open.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tidepool_engine::storage::{FileStorage, Storage, read_whole_file, write_file_atomically};
use tidepool_engine::{Config, Engine, Host, engine_exists, remove_engine_files};

use crate::error::{NodeError, Result};

const CURRENT: &str = "CURRENT";
/// The file in a replica's directory recording its shard (a `ShardInfo`,
/// protobuf), written once the replica exists; a directory without it is
/// not a replica.
pub const SHARD_FILE: &str = "SHARD";

/// Held while a replica directory is made: by a node opening a replica,
/// and by a split moving its new group's directory into place, so the two
/// never make the same directory at once (`docs/design/splits.md`).
static MAKING_DIRS: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Holds [`MAKING_DIRS`].
pub(crate) fn making_dirs() -> parking_lot::MutexGuard<'static, ()> {
    MAKING_DIRS.lock()
}
const SLOTS: [&str; 2] = ["a", "b"];
/// Present while the replica holds its votes (`replica/votes.rs`): it
/// founded its group and has not yet caught up with a leader. Outside the
/// slots, so a snapshot's install keeps it.
const VOTES_HELD: &str = "VOTES_HELD";
/// Marks a spare slot whose snapshot is complete and durable.
const SNAPSHOT_MARK: &str = "SNAPSHOT";

/// The directory of one replica; see the module docs.
#[derive(Clone, Debug)]
pub struct ReplicaStore {
    storage: Arc<dyn Storage>,
    dir: PathBuf,
    /// Engine settings; `dir` is replaced by the slot's.
    engine: Config,
    /// Where its engines' background work runs and whose memory they use
    /// (`None`: a pool and budget of each engine's own).
    host: Option<Host>,
}

fn io_error(path: &Path, error: std::io::Error) -> NodeError {
    NodeError::Engine(tidepool_engine::Error::io(path, error))
}

impl ReplicaStore {
    /// A replica directory on `storage`.
    pub fn new(storage: Arc<dyn Storage>, dir: impl Into<PathBuf>, engine: Config) -> Self {
        Self {
            storage,
            dir: dir.into(),
            engine,
            host: None,
        }
    }

    /// Runs its engines' background work in the host's pool (the node's)
    /// and counts their memory against its budget.
    pub fn with_host(mut self, host: Host) -> Self {
        self.host = Some(host);
        self
    }

    fn open_engine(&self, slot: usize) -> Result<Arc<Engine>> {
        let config = self.engine_config(slot);
        let storage = self.storage.clone();
        Ok(Arc::new(match &self.host {
            Some(host) => Engine::open_in(config, storage, host)?,
            None => Engine::open_with_storage(config, storage)?,
        }))
    }

    /// A replica directory like this one (same storage, engine settings
    /// and host) in `dir`.
    pub fn sibling(&self, dir: impl Into<PathBuf>) -> ReplicaStore {
        ReplicaStore {
            dir: dir.into(),
            ..self.clone()
        }
    }

    /// The directory the live engine of a new replica directory goes in
    /// (`CURRENT` missing means the first slot).
    pub fn first_slot_dir(&self) -> PathBuf {
        self.slot_dir(0)
    }

    /// A replica directory on real files.
    pub fn on_files(dir: impl Into<PathBuf>, engine: Config) -> Self {
        Self::new(Arc::new(FileStorage::new()), dir, engine)
    }

    /// The storage.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// The replica's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn slot_dir(&self, slot: usize) -> PathBuf {
        self.dir.join(SLOTS[slot])
    }

    fn live_slot(&self) -> Result<usize> {
        let path = self.dir.join(CURRENT);
        let bytes = read_whole_file(&*self.storage, &path).map_err(|e| io_error(&path, e))?;
        match bytes.as_deref() {
            None | Some(b"a") => Ok(0),
            Some(b"b") => Ok(1),
            Some(other) => Err(NodeError::Malformed(format!(
                "{}: {:?} is not a slot",
                path.display(),
                String::from_utf8_lossy(other)
            ))),
        }
    }

    fn engine_config(&self, slot: usize) -> Config {
        let mut config = self.engine.clone();
        config.dir = self.slot_dir(slot);
        config
    }

    /// Fails with [`NodeError::FilesMissing`] unless the live slot holds
    /// an engine: what a replica that existed must find before it is
    /// opened again (after a failure, or when its node restarts), so that
    /// files lost under it never turn into an empty replica with its id.
    pub fn expect_existing(&self) -> Result<()> {
        let live = self.slot_dir(self.live_slot()?);
        if engine_exists(&*self.storage, &live) {
            return Ok(());
        }
        Err(NodeError::FilesMissing(format!(
            "{} holds no engine (its files were deleted, or the volume that held them is not \
             mounted); the replica is not re-created empty, which would let it vote with a \
             forgotten log: restore the files, or let the coordinator rebuild the replica",
            live.display()
        )))
    }

    /// Whether the replica holds its votes (`VOTES_HELD` in its directory;
    /// `replica/votes.rs`).
    pub fn votes_held(&self) -> bool {
        self.storage.exists(&self.dir.join(VOTES_HELD))
    }

    /// Records, durably, that the replica holds its votes.
    pub fn hold_votes(&self) -> Result<()> {
        let path = self.dir.join(VOTES_HELD);
        write_file_atomically(&*self.storage, &path, b"").map_err(|e| io_error(&path, e))
    }

    /// Ends the hold on the replica's votes, durably.
    pub fn release_votes(&self) -> Result<()> {
        let path = self.dir.join(VOTES_HELD);
        if self.storage.exists(&path) {
            self.storage.remove(&path).map_err(|e| io_error(&path, e))?;
            self.storage
                .sync_dir(&self.dir)
                .map_err(|e| io_error(&self.dir, e))?;
        }
        Ok(())
    }

    /// Opens the live engine, emptying the spare slot first.
    pub fn open_live(&self) -> Result<Arc<Engine>> {
        self.storage
            .create_dir_all(&self.dir)
            .map_err(|e| io_error(&self.dir, e))?;
        let live = self.live_slot()?;
        self.clear_spare()?;
        self.open_engine(live)
    }

    /// The spare slot's directory, where a snapshot is received.
    pub fn spare_dir(&self) -> Result<PathBuf> {
        Ok(self.slot_dir(1 - self.live_slot()?))
    }

    /// Empties the spare slot.
    pub fn clear_spare(&self) -> Result<()> {
        let dir = self.spare_dir()?;
        let mark = dir.join(SNAPSHOT_MARK);
        if self.storage.exists(&mark) {
            self.storage.remove(&mark).map_err(|e| io_error(&mark, e))?;
            self.storage.sync_dir(&dir).map_err(|e| io_error(&dir, e))?;
        }
        remove_engine_files(&*self.storage, &dir)?;
        Ok(())
    }

    /// Records that the spare slot holds all of snapshot `id`, durably
    /// (every file in it must be synced already).
    pub fn mark_spare_complete(&self, id: u64) -> Result<()> {
        let path = self.spare_dir()?.join(SNAPSHOT_MARK);
        write_file_atomically(&*self.storage, &path, &id.to_le_bytes())
            .map_err(|e| io_error(&path, e))
    }

    /// The id of the complete snapshot in the spare slot, if any.
    pub fn spare_snapshot(&self) -> Result<Option<u64>> {
        let path = self.spare_dir()?.join(SNAPSHOT_MARK);
        let bytes = read_whole_file(&*self.storage, &path).map_err(|e| io_error(&path, e))?;
        Ok(bytes.and_then(|b| Some(u64::from_le_bytes(b.try_into().ok()?))))
    }

    /// Opens the engine in the spare slot, which must hold one: a slot
    /// without an engine's control file would open as an empty engine,
    /// and a snapshot installed so would claim entries it has no data for.
    pub fn open_spare(&self) -> Result<Arc<Engine>> {
        let spare = 1 - self.live_slot()?;
        let dir = self.slot_dir(spare);
        if !engine_exists(&*self.storage, &dir) {
            return Err(NodeError::Failed(format!(
                "the snapshot in {} holds no engine (its control file is missing)",
                dir.display()
            )));
        }
        self.open_engine(spare)
    }

    /// Makes the spare slot the live one (the point of no return of an
    /// install).
    pub fn flip(&self) -> Result<()> {
        let spare = 1 - self.live_slot()?;
        let path = self.dir.join(CURRENT);
        write_file_atomically(&*self.storage, &path, SLOTS[spare].as_bytes())
            .map_err(|e| io_error(&path, e))
    }
}
