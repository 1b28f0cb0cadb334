//! Applying a split (`docs/design/splits.md`, step 3): the group's range is
//! cut at `at`; a new group, the child, starts on this node from this
//! replica's state at the split entry and owns the upper part.
//!
//! The child's directory is made under a temporary name next to the
//! parent's (`.split-<child>`), from an engine checkpoint whose sealed
//! segments are hard links, its application state rewritten as a new
//! group's, then renamed into place: a crash leaves either no child (the
//! temporary directory is removed when the entry is applied again, or at
//! the node's next start) or the whole child. Only then does the parent
//! record the split in its own state.

use std::path::Path;

use prost::Message as _;
use tidepool_engine::storage::{read_whole_file, write_file_atomically};
use tidepool_engine::{Decision, EntryInfo, KeySpace, RelocationFilter};
use tidepool_proto::v1::{ReplicaInfo, ReplicaRole, ShardInfo};

use super::{BLOB_KEY_SPACE, Replica};
use crate::error::{NodeError, Result};
use crate::raftlog::{RaftLog, SplitChild};
use crate::store::{SHARD_FILE, making_dirs};

/// Prefix of a child directory being made.
pub const SPLIT_TEMP_PREFIX: &str = ".split-";

/// For crash tests only (`server/tests/splits.rs`): the
/// environment variable naming a point of a split's apply where the
/// process aborts, as a kill -9 there would stop it. Never set otherwise.
pub const CRASH_POINT_VAR: &str = "TIDEPOOL_SPLIT_CRASH_POINT";

/// Aborts the process if [`CRASH_POINT_VAR`] names `point`.
fn crash_point(point: &str) {
    static CHOSEN: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let chosen = CHOSEN.get_or_init(|| std::env::var(CRASH_POINT_VAR).ok());
    if chosen.as_deref() == Some(point) {
        eprintln!("{CRASH_POINT_VAR}={point}: aborting");
        std::process::abort();
    }
}

/// The relocation filter of a group owning `range`: drops the blobs
/// outside it (after a split, both groups start with every key of the
/// parent; each sheds the other's half as relocation passes over them),
/// keeps everything else. Not deterministic across replicas in timing, and
/// need not be: those keys are never read (`check_owned`), written or
/// applied (`Refusal::WrongShard`) by this group again.
pub(crate) struct OutsideRange {
    /// The blobs' key space (the name index's keys are not positions).
    pub blobs: KeySpace,
    /// The group's range.
    pub range: (u64, u64),
}

impl RelocationFilter for OutsideRange {
    fn decide(&self, entry: &EntryInfo<'_>) -> Decision {
        let Some(prefix) = entry.key.first_chunk::<8>() else {
            return Decision::Keep;
        };
        let position = u64::from_be_bytes(*prefix);
        let (start, end) = self.range;
        if entry.key_space != self.blobs || (start <= position && position <= end) {
            Decision::Keep
        } else {
            Decision::Drop
        }
    }
}

fn io_error(path: &Path, error: std::io::Error) -> NodeError {
    NodeError::Engine(tidepool_engine::Error::io(path, error))
}

/// Whether the existing directory `dir` of the child's name is the child
/// `child` starting at `start`: its `SHARD` file (none yet: the node is
/// opening the child empty, to receive a snapshot) names them — a group's
/// start never moves, splits cut its upper part off. Otherwise the
/// directory holds another group of that id (one the coordinator's store
/// lost in the middle of its split, and whose id it gave again): taken for
/// the child, the parent gave its upper half away with no group to hold
/// it, and shed it from its segments. The replica fails instead (and
/// again at each reopen) with its range whole, until an operator looks.
fn existing_child(
    storage: &dyn tidepool_engine::storage::Storage,
    dir: &Path,
    child: u32,
    start: u64,
) -> Result<()> {
    let path = dir.join(SHARD_FILE);
    let Some(bytes) = read_whole_file(storage, &path).map_err(|e| io_error(&path, e))? else {
        return Ok(());
    };
    let info = ShardInfo::decode(&bytes[..])
        .map_err(|e| NodeError::Malformed(format!("{}: {e}", path.display())))?;
    if info.shard_id == child && info.hash_start == start {
        return Ok(());
    }
    tracing::error!(
        dir = %dir.display(),
        child,
        start,
        holds = info.shard_id,
        holds_start = info.hash_start,
        "a split's child directory holds another group; the split is not carried out"
    );
    Err(NodeError::Failed(format!(
        "{} holds shard {} from {:#018x}, not the split's child {child} from {start:#018x}",
        dir.display(),
        info.shard_id,
        info.hash_start
    )))
}

/// Removes `dir` and everything in it, if it exists.
fn remove_tree(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(io_error(dir, error)),
        _ => Ok(()),
    }
}

/// Why the split entry at hand is not carried out, if it is not. Depends
/// only on replicated state, so every replica decides alike.
fn refusal(
    range: Option<(u64, u64)>,
    conf: &raft::eraftpb::ConfState,
    children: &[SplitChild],
    child: u32,
    at: u64,
) -> Option<String> {
    let Some((start, end)) = range else {
        return Some("the group has no recorded range".into());
    };
    if children.iter().any(|c| c.shard_id == child) {
        return Some(format!("shard {child} was split off already"));
    }
    if !(start < at && at <= end) {
        return Some(format!(
            "{at:#018x} does not cut the range {start:#018x}..={end:#018x}"
        ));
    }
    if !conf.learners.is_empty() || !conf.voters_outgoing.is_empty() {
        return Some("the group's membership is changing".into());
    }
    None
}

impl Replica {
    /// Applies `Split { child, at }` at entry `index`.
    ///
    /// Decided once: an entry the saved state holds decided (applied again
    /// after a restart) is not decided again — carried out, the state
    /// holds its range and child; refused, nothing is to be done. One not
    /// yet decided there is decided under the configuration as of the
    /// entry, not the one recovered: a membership change applied after it
    /// (and before a kill -9) made this replica alone carry out a split
    /// every replica had refused (a learner was being added), or refuse
    /// one every other carried out — its range left whole, it went on
    /// applying, and as leader acknowledging, writes of the given-away half.
    pub(crate) fn apply_split(&mut self, index: u64, child: u32, at: u64) -> Result<()> {
        if self.log().sessions().decided(index) {
            return Ok(());
        }
        let range = self.log().range();
        let conf = self.log().conf_before(index).cloned().ok_or_else(|| {
            NodeError::Malformed(format!(
                "no configuration recovered from before split entry {index}"
            ))
        })?;
        if let Some(why) = refusal(range, &conf, self.log().children(), child, at) {
            // Proposed again by a coordinator that did not see the first
            // one apply, or refused: nothing to do, as on every replica.
            tracing::info!(index, child, at, %why, "split not carried out");
            self.log().sessions().finish_entry(index, Vec::new());
            return Ok(());
        }
        let (start, end) = range.expect("refusal checks the range");
        self.make_child(child, (at, end), &conf.voters)?;
        let born = SplitChild {
            shard_id: child,
            start: at,
            end,
        };
        self.log().record_split((start, at - 1), born);
        // After the split is recorded: a saved state holding the entry
        // decided holds its range and child too.
        self.log().sessions().finish_entry(index, Vec::new());
        self.show_range();
        tracing::info!(index, child, at, "split applied");
        crash_point("recorded");
        Ok(())
    }

    /// Makes the child's directory next to this replica's, unless it exists
    /// (made before a crash, or opened empty by the node to receive a
    /// snapshot: either way the child group exists on this node — if its
    /// `SHARD` file, once written, names the child and its start; see
    /// [`existing_child`]).
    fn make_child(&mut self, child: u32, range: (u64, u64), voters: &[u64]) -> Result<()> {
        let parent_dir = self.store.dir().to_path_buf();
        let shards_dir = parent_dir
            .parent()
            .ok_or_else(|| NodeError::Config("a replica directory has no parent".into()))?
            .to_path_buf();
        let final_dir = shards_dir.join(child.to_string());
        let temp = shards_dir.join(format!("{SPLIT_TEMP_PREFIX}{child}"));
        let storage = self.store.storage().clone();
        if storage.exists(&final_dir) {
            return existing_child(&*storage, &final_dir, child, range.0);
        }
        remove_tree(&temp)?;
        let child_store = self.store.sibling(&temp);
        let engine_dir = child_store.first_slot_dir();
        {
            let checkpoint = self.engine().checkpoint()?;
            checkpoint.materialize(&*storage, &engine_dir)?;
        }
        crash_point("copied");
        let engine = child_store.open_live()?;
        let space = engine.key_space(BLOB_KEY_SPACE)?;
        drop(RaftLog::split_child(engine.clone(), space, voters, range)?);
        engine.close()?;
        drop(engine);
        let info = ShardInfo {
            shard_id: child,
            hash_start: range.0,
            hash_end: range.1,
            replicas: voters
                .iter()
                .map(|&node_id| ReplicaInfo {
                    node_id,
                    role: ReplicaRole::Voter as i32,
                })
                .collect(),
            ..ShardInfo::default()
        };
        let shard_file = temp.join(SHARD_FILE);
        write_file_atomically(&*storage, &shard_file, &info.encode_to_vec())
            .map_err(|e| io_error(&shard_file, e))?;
        storage.sync_dir(&temp).map_err(|e| io_error(&temp, e))?;
        crash_point("rewritten");
        let making = making_dirs();
        if storage.exists(&final_dir) {
            drop(making);
            existing_child(&*storage, &final_dir, child, range.0)?;
            return remove_tree(&temp);
        }
        storage
            .rename(&temp, &final_dir)
            .map_err(|e| io_error(&final_dir, e))?;
        storage
            .sync_dir(&shards_dir)
            .map_err(|e| io_error(&shards_dir, e))?;
        drop(making);
        crash_point("renamed");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use raft::eraftpb::ConfState;

    fn voters() -> ConfState {
        ConfState {
            voters: vec![1, 2, 3],
            ..ConfState::default()
        }
    }

    #[test]
    fn a_group_sheds_only_blobs_outside_its_range() {
        let storage = tidepool_engine::storage::FaultStorage::new(Default::default());
        let engine = crate::sim::replica_store(&storage).open_live().unwrap();
        let blobs = engine.key_space(BLOB_KEY_SPACE).unwrap();
        let names = engine.key_space(crate::names::NAMES_KEY_SPACE).unwrap();
        let filter = OutsideRange {
            blobs,
            range: (100, 200),
        };
        let decide = |space: KeySpace, position: u64| {
            let mut key = [7u8; 32];
            key[..8].copy_from_slice(&position.to_be_bytes());
            filter.decide(&EntryInfo {
                key_space: space,
                key: &key,
                epoch: tidepool_engine::Epoch(1),
                tag: tidepool_engine::Tag(1),
                item_bytes: 100,
                position: tidepool_engine::WalPosition(0),
            })
        };
        assert_eq!(decide(blobs, 100), Decision::Keep);
        assert_eq!(decide(blobs, 200), Decision::Keep);
        assert_eq!(decide(blobs, 99), Decision::Drop);
        assert_eq!(decide(blobs, 201), Decision::Drop);
        assert_eq!(decide(names, 5), Decision::Keep, "the name index");
    }

    #[test]
    fn a_split_must_cut_the_range_of_a_settled_group() {
        let range = Some((100, 200));
        assert_eq!(refusal(range, &voters(), &[], 9, 150), None);
        assert_eq!(refusal(range, &voters(), &[], 9, 200), None);
        assert!(
            refusal(range, &voters(), &[], 9, 100).is_some(),
            "empty parent"
        );
        assert!(refusal(range, &voters(), &[], 9, 201).is_some());
        assert!(refusal(range, &voters(), &[], 9, 50).is_some());
        assert!(refusal(None, &voters(), &[], 9, 150).is_some());
        let done = [SplitChild {
            shard_id: 9,
            start: 150,
            end: 200,
        }];
        assert!(refusal(range, &voters(), &done, 9, 120).is_some());
        let mut learning = voters();
        learning.learners = vec![4];
        assert!(refusal(range, &learning, &[], 9, 150).is_some());
        let mut joint = voters();
        joint.voters_outgoing = vec![1, 2, 4];
        assert!(refusal(range, &joint, &[], 9, 150).is_some());
    }
}
