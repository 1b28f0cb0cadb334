//! The Raft log of one shard replica, stored in the shard engine's WAL.
//!
//! Entries are engine records appended with [`Engine::append`] (their Write
//! values are the records' items, written once); hard state and
//! configuration are small state records. An in-memory map from index to
//! record position serves raft-rs's [`Storage`] reads. See
//! `docs/design/replication.md`.

mod meta;

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::{MappedMutexGuard, Mutex, MutexGuard};
use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};
use tidepool_engine::{AppStateSource, Appended, Durability, Engine, KeySpace, WalPosition};
use tidepool_proto::v1::NodeAddress;

use crate::command::Reader;
use crate::error::{NodeError, Result};
use crate::session::Sessions;
use crate::snapshot::{Outbox, Prepared};
use meta::LogRecord;

/// What a leader needs to offer snapshots of its shard.
#[derive(Debug)]
pub struct SnapshotSender {
    /// The shard.
    pub shard_id: u32,
    /// This node, named in manifests as the place to fetch from.
    pub source: NodeAddress,
    /// Where prepared snapshots are offered.
    pub outbox: Arc<Outbox>,
    /// The latest snapshot prepared, while the outbox still offers it (the
    /// outbox holds it, and lets it go once idle: its checkpoint pins WAL
    /// segments).
    current: Mutex<std::sync::Weak<Prepared>>,
    /// Hash snapshot files on the Raft thread instead of a background one
    /// (the simulated cluster, whose time must not depend on threads).
    pub hash_inline: bool,
}

impl SnapshotSender {
    /// Offers snapshots of `shard_id` from `source` through `outbox`.
    pub fn new(shard_id: u32, source: NodeAddress, outbox: Arc<Outbox>) -> Self {
        Self {
            shard_id,
            source,
            outbox,
            current: Mutex::new(std::sync::Weak::new()),
            hash_inline: false,
        }
    }
}

/// Magic of the replica's application state in the engine.
const APP_STATE_MAGIC: &[u8; 4] = b"TPRM";
/// Version 2 added the epoch drops applied per namespace; version 3 the
/// length of the raft state record and the write sessions after it;
/// version 4 the hash range; version 5 the groups split off; version 6 the
/// retentions recorded per namespace (written only once the group holds
/// one, so that a node of an older version reads the state of a group
/// that never received a retain entry — `capabilities::RETAIN`).
const APP_STATE_VERSION: u8 = 6;
/// Before the retentions were part of it (still written without them).
const APP_STATE_VERSION_5: u8 = 5;
/// Before the groups split off were part of it.
const APP_STATE_VERSION_4: u8 = 4;
/// Before the shard's hash range was part of it.
const APP_STATE_VERSION_3: u8 = 3;
/// The version before write sessions (still read).
const APP_STATE_VERSION_2: u8 = 2;

/// The replica's application state as the engine persists it: the log's
/// own small state, encoded at every change, and the write sessions,
/// encoded only when a snapshot is written (they may be large). One lock
/// covers both, so a snapshot never sees sessions from one moment and an
/// applied index from another, and the engine reads its index state under
/// it too (`AppStateSource::app_state_with`).
#[derive(Default)]
pub(crate) struct AppStateCell(Mutex<CellState>);

#[derive(Default)]
struct CellState {
    /// Everything up to and including the raft state record.
    base: Vec<u8>,
    sessions: Sessions,
}

/// The engine reads its index state in `capture` under the same hold as
/// the sessions: the applier holds them for each entry it applies (its
/// index effects and its sessions' records of them), so a snapshot holds
/// both of an entry or neither.
impl AppStateSource for AppStateCell {
    fn app_state_with(&self, capture: &mut dyn FnMut()) -> Vec<u8> {
        let cell = self.0.lock();
        capture();
        let mut bytes = cell.base.clone();
        cell.sessions.encode(&mut bytes);
        bytes
    }
}

/// A group split off this one (`docs/design/splits.md`): its shard id and
/// the hash range it took, as the split entry named them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitChild {
    /// The new group's shard id.
    pub shard_id: u32,
    /// First hash position it owns.
    pub start: u64,
    /// Last hash position it owns (inclusive).
    pub end: u64,
}

/// A namespace's retention as the group's replicated state holds it (a
/// retain entry applied: `docs/design/epochs-cluster.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retained {
    /// Epochs retained; 0: durable (no drop allowed).
    pub epochs: u32,
    /// The cluster map version it was read from.
    pub map_version: u64,
}

impl Retained {
    /// Whether a drop of the epochs below `below` is allowed at group
    /// epoch `epoch`: a blob of epoch `e` stays while the epoch is below
    /// `e + epochs`, so the epochs below `epoch + 1 - epochs` may go.
    pub fn allows_drop(&self, below: u32, epoch: u32) -> bool {
        self.epochs != 0 && u64::from(below) + u64::from(self.epochs) <= u64::from(epoch) + 1
    }
}

/// Retentions recorded, by namespace id.
pub type Retentions = BTreeMap<u32, Retained>;

/// Where an entry's record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Located {
    position: WalPosition,
    term: u64,
}

/// What a test runs in the middle of a compaction ([`RaftLog::compact`]).
#[cfg(test)]
pub(crate) type CompactHook = Box<dyn FnMut(&Arc<Engine>) + Send>;

/// The replica's Raft log and state, on its engine.
pub struct RaftLog {
    engine: Arc<Engine>,
    space: KeySpace,
    entries: BTreeMap<u64, Located>,
    /// Items of entries appended by this process and not applied yet.
    unapplied: BTreeMap<u64, Appended>,
    /// The entry before the first available one: (index, term).
    truncated: (u64, u64),
    /// Epoch drops applied: namespace id → blobs below this epoch are gone.
    drops: BTreeMap<u32, u32>,
    /// Retentions recorded by retain entries: drops they do not allow are
    /// refused at apply.
    retained: Retentions,
    /// The hash range the group owns (inclusive), as replicated: set when
    /// the group is founded, carried by snapshots, changed only by applying
    /// an entry (`docs/design/splits.md`). `None` for a group founded
    /// before ranges were recorded: its writes are not range-checked.
    range: Option<(u64, u64)>,
    /// The groups split off this one, in the order of their splits.
    children: Vec<SplitChild>,
    hard_state: HardState,
    conf_state: ConfState,
    /// Index of the entry that made `conf_state` (0: the founding one).
    conf_index: u64,
    /// The configurations recovered at open — the saved application
    /// state's and every later state record's — by the index of the entry
    /// that made each: what an entry applied again after a restart was
    /// decided under ([`RaftLog::conf_before`]).
    recovered_confs: BTreeMap<u64, ConfState>,
    applied: u64,
    /// Where recovery starts scanning the WAL for the log.
    scan_from: WalPosition,
    /// Snapshot preparation (none: this log cannot send snapshots).
    snapshots: Option<SnapshotSender>,
    /// What the engine persists at each snapshot (shared with it).
    app_state: Arc<AppStateCell>,
    /// Run by [`RaftLog::compact`] once the new first index is in the
    /// application state, before it is made durable (tests: a snapshot or
    /// a crash at that moment).
    #[cfg(test)]
    pub(crate) compact_hook: Option<CompactHook>,
}

impl std::fmt::Debug for RaftLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftLog")
            .field("first_index", &self.first())
            .field("last_index", &self.last())
            .field("applied", &self.applied)
            .field("hard_state", &self.hard_state)
            .finish()
    }
}

/// Index of the founding configuration (see `RaftLog::found`).
pub const FOUNDING_INDEX: u64 = 1;
/// Term of the founding configuration.
pub const FOUNDING_TERM: u64 = 1;

impl RaftLog {
    /// Opens the log on `engine`: for a new replica (empty engine), with
    /// `initial_voters` as its configuration (empty for a replica that will
    /// be added to an existing group); otherwise recovered from the WAL.
    pub fn open(engine: Arc<Engine>, space: KeySpace, initial_voters: &[u64]) -> Result<RaftLog> {
        Self::open_with_range(engine, space, initial_voters, None, |_| Ok(()))
    }

    /// [`RaftLog::open`]; a group founded here owns `range` (a hash range,
    /// inclusive), recorded in its replicated state. `before_found` runs
    /// before a new replica founds its group (then durable), with the
    /// founding voters.
    pub fn open_with_range(
        engine: Arc<Engine>,
        space: KeySpace,
        initial_voters: &[u64],
        range: Option<(u64, u64)>,
        before_found: impl FnOnce(&[u64]) -> Result<()>,
    ) -> Result<RaftLog> {
        let stored = engine.app_state();
        let mut log = RaftLog {
            scan_from: WalPosition(0),
            engine,
            space,
            entries: BTreeMap::new(),
            unapplied: BTreeMap::new(),
            truncated: (0, 0),
            drops: BTreeMap::new(),
            retained: Retentions::new(),
            range: None,
            children: Vec::new(),
            hard_state: HardState::default(),
            conf_state: ConfState::default(),
            conf_index: 0,
            recovered_confs: BTreeMap::new(),
            applied: 0,
            snapshots: None,
            app_state: Arc::default(),
            #[cfg(test)]
            compact_hook: None,
        };
        // The application state is durable only at engine snapshots: after
        // an early crash it may be missing although the WAL holds a log.
        // What the WAL holds decides whether the replica is new.
        if !stored.is_empty() {
            log.restore_app_state(&stored)?;
        }
        log.engine.set_app_state_source(log.app_state.clone());
        let found_state = log.scan()?;
        if stored.is_empty() && !found_state {
            if initial_voters.is_empty() {
                // Joins an existing group: it learns everything, the
                // configuration included, from the leader's snapshot.
                let end = log.persist_state()?;
                log.engine.wait_synced(end)?;
            } else {
                before_found(initial_voters)?;
                log.found(initial_voters, range)?;
            }
        }
        // Entries are applied only once committed, but a Ready's committed
        // entries are applied before its hard state (the new commit index)
        // is written, and an engine snapshot between the two saves an
        // applied index above the saved commit; a crash right there left
        // `applied > commit`, which raft-rs refuses. What was applied was
        // committed: say so.
        if log.applied > log.hard_state.commit && log.applied <= log.last() {
            log.hard_state.commit = log.applied;
        }
        log.save_app_state();
        // Relocation must never delete a segment holding entries of the
        // log: keep everything from where the log's records start.
        log.engine.set_log_retention(log.scan_from);
        Ok(log)
    }

    /// Founds a group: the log starts after a notional snapshot at
    /// `FOUNDING_INDEX` holding the initial configuration and no data. A
    /// replica added later therefore always starts from a snapshot, which
    /// carries the configuration; replaying entries from index 1 would
    /// never tell it who the founding voters were. Durable (in the engine's
    /// control data) when this returns; a crash before that leaves an empty
    /// replica that founds again identically.
    fn found(&mut self, voters: &[u64], range: Option<(u64, u64)>) -> Result<()> {
        self.conf_state.voters = voters.to_vec();
        self.range = range;
        self.conf_index = FOUNDING_INDEX;
        self.truncated = (FOUNDING_INDEX, FOUNDING_TERM);
        self.applied = FOUNDING_INDEX;
        self.hard_state.term = FOUNDING_TERM;
        self.hard_state.commit = FOUNDING_INDEX;
        self.app_state.0.lock().sessions = Sessions::starting_at(FOUNDING_INDEX);
        self.save_app_state();
        self.engine.flush()?;
        Ok(())
    }

    /// Rebuilds the index map and the latest state from the WAL. Returns
    /// whether a state record was found.
    fn scan(&mut self) -> Result<bool> {
        let first = self.first();
        let (mut entries, mut state) = (BTreeMap::new(), None);
        let mut confs = BTreeMap::new();
        let mut malformed = None;
        self.engine
            .scan_appended(self.scan_from, |position, meta, _| {
                match meta::parse(meta) {
                    Ok(LogRecord::Entry(head)) if head.index >= first => {
                        // A later record for an index replaces it and all after.
                        entries.split_off(&head.index);
                        entries.insert(
                            head.index,
                            Located {
                                position,
                                term: head.term,
                            },
                        );
                    }
                    Ok(LogRecord::Entry(_)) => {}
                    Ok(LogRecord::State(hs, cs, ci)) => {
                        // The first record of a configuration is the one
                        // its entry made.
                        confs.entry(ci).or_insert_with(|| cs.clone());
                        state = Some((hs, cs, ci));
                    }
                    Err(error) => {
                        malformed.get_or_insert(error);
                    }
                }
                Ok(())
            })?;
        if let Some(error) = malformed {
            return Err(error);
        }
        self.entries = entries;
        for (index, conf) in confs {
            self.recovered_confs.entry(index).or_insert(conf);
        }
        let found = state.is_some();
        if let Some((hs, cs, conf_index)) = state {
            self.hard_state = hs;
            self.conf_state = cs;
            self.conf_index = conf_index;
        }
        self.check_contiguous()?;
        Ok(found)
    }

    fn check_contiguous(&self) -> Result<()> {
        for (expected, index) in (self.first()..).zip(self.entries.keys()) {
            if *index != expected {
                return Err(NodeError::Malformed(format!(
                    "raft log has a gap: found {index}, expected {expected}"
                )));
            }
        }
        Ok(())
    }

    /// First index available.
    pub fn first(&self) -> u64 {
        self.truncated.0 + 1
    }

    /// Last index in the log.
    pub fn last(&self) -> u64 {
        self.entries
            .keys()
            .next_back()
            .copied()
            .unwrap_or(self.truncated.0)
    }

    /// The applied index this log knows of.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The hard state.
    pub fn hard_state(&self) -> &HardState {
        &self.hard_state
    }

    /// The configuration.
    pub fn conf_state(&self) -> &ConfState {
        &self.conf_state
    }

    /// The configuration entry `index` applies under: the one made by the
    /// last configuration entry before it. After a restart, up to the last
    /// configuration recovered, that is the recovered one: entries are
    /// applied again from the last saved application state, while raft-rs
    /// starts from the newest configuration the WAL holds (a membership
    /// change applied just before a kill -9), and a configuration entry
    /// applied again is computed on top of that one — not what it made the
    /// first time. Past them, the current one. `None` if no configuration
    /// recovered is older than `index` (never for an entry after the saved
    /// applied index).
    pub fn conf_before(&self, index: u64) -> Option<&ConfState> {
        match self.recovered_confs.keys().next_back() {
            Some(last) if index <= *last => self
                .recovered_confs
                .range(..index)
                .next_back()
                .map(|(_, conf)| conf),
            _ if self.conf_index < index => Some(&self.conf_state),
            _ => None,
        }
    }

    /// The configuration that configuration entry `index` made when first
    /// applied, if recovered at open (the entry is being applied again).
    pub fn recovered_conf_made_by(&self, index: u64) -> Option<&ConfState> {
        self.recovered_confs.get(&index)
    }

    /// Lets this log prepare snapshots (when it leads).
    pub fn set_snapshot_sender(&mut self, sender: SnapshotSender) {
        self.snapshots = Some(sender);
    }

    /// Takes the snapshot sender (to move it to an installed log).
    pub fn take_snapshot_sender(&mut self) -> Option<SnapshotSender> {
        self.snapshots.take()
    }

    /// The log of a replica that has just received snapshot `meta` into
    /// `engine` (opened from the replica's spare slot): empty, starting after
    /// the snapshot's index, with the snapshot's configuration and this
    /// replica's own term and vote. Durable when this returns; the engine's
    /// copy of the sender's log records is never read (scanning starts
    /// after them) and is garbage for relocation.
    pub fn installed(
        engine: Arc<Engine>,
        space: KeySpace,
        meta: &SnapshotMetadata,
        hard_state: &HardState,
    ) -> Result<RaftLog> {
        let mut hard_state = hard_state.clone();
        hard_state.commit = hard_state.commit.max(meta.index);
        let saved = Self::copied_state(&engine)?;
        // The sender's sessions as of its applied index, the snapshot's (a
        // sender from before sessions had none).
        let mut sessions = saved.sessions.unwrap_or_default();
        sessions.finish_entry(meta.index, Vec::new());
        // The sender's drops, range and children, from the application
        // state it saved in the copied engine (its applied index was the
        // snapshot's).
        Self::start_after(
            engine,
            space,
            meta,
            hard_state,
            (saved.drops, saved.retained),
            (saved.range, saved.children),
            sessions,
        )
    }

    /// The log of a group split off another (`docs/design/splits.md`):
    /// `engine` is a copy of the parent's engine as of the split entry
    /// (its application state the parent's); the group starts after a
    /// notional snapshot at [`FOUNDING_INDEX`] with the parent's `voters`,
    /// owning `range`, with the parent's drops and write sessions (so a
    /// write the parent applied before the split and retried here is
    /// recognized). Durable when this returns.
    pub fn split_child(
        engine: Arc<Engine>,
        space: KeySpace,
        voters: &[u64],
        range: (u64, u64),
    ) -> Result<RaftLog> {
        let saved = Self::copied_state(&engine)?;
        let meta = SnapshotMetadata {
            index: FOUNDING_INDEX,
            term: FOUNDING_TERM,
            conf_state: Some(ConfState {
                voters: voters.to_vec(),
                ..ConfState::default()
            }),
        };
        let hard_state = HardState {
            term: FOUNDING_TERM,
            vote: 0,
            commit: FOUNDING_INDEX,
        };
        let sessions = saved
            .sessions
            .unwrap_or_default()
            .restarted_at(FOUNDING_INDEX);
        Self::start_after(
            engine,
            space,
            &meta,
            hard_state,
            (saved.drops, saved.retained),
            (Some(range), Vec::new()),
            sessions,
        )
    }

    /// The application state saved in a copied engine (empty: none).
    fn copied_state(engine: &Engine) -> Result<AppState> {
        match engine.app_state() {
            bytes if bytes.is_empty() => Ok(AppState::default()),
            bytes => AppState::decode(&bytes),
        }
    }

    /// A log starting empty after `meta` on a copied engine.
    fn start_after(
        engine: Arc<Engine>,
        space: KeySpace,
        meta: &SnapshotMetadata,
        hard_state: HardState,
        (drops, retained): (BTreeMap<u32, u32>, Retentions),
        (range, children): (Option<(u64, u64)>, Vec<SplitChild>),
        sessions: Sessions,
    ) -> Result<RaftLog> {
        let app_state = Arc::new(AppStateCell::default());
        app_state.0.lock().sessions = sessions;
        engine.set_app_state_source(app_state.clone());
        let mut log = RaftLog {
            scan_from: engine.processed_position(),
            engine,
            space,
            entries: BTreeMap::new(),
            unapplied: BTreeMap::new(),
            truncated: (meta.index, meta.term),
            drops,
            retained,
            range,
            children,
            hard_state,
            conf_state: meta.get_conf_state().clone(),
            conf_index: meta.index,
            recovered_confs: BTreeMap::new(),
            applied: meta.index,
            snapshots: None,
            app_state,
            #[cfg(test)]
            compact_hook: None,
        };
        log.persist_state()?;
        log.save_app_state();
        // Makes the state record, the application state and the received
        // index durable in one control snapshot.
        log.engine.flush()?;
        log.engine.set_log_retention(log.scan_from);
        Ok(log)
    }

    /// Discards the log up to and including `to` (which must be applied):
    /// `first_index` moves to `to + 1`. The values stay: the engine's
    /// index points at them, and relocation moves them out of the old
    /// segments before it deletes them. Durable when this returns.
    pub fn compact(&mut self, to: u64) -> Result<()> {
        if to < self.first() {
            return Ok(());
        }
        if to > self.applied {
            return Err(NodeError::Malformed(format!(
                "compaction to {to} past the applied index {}",
                self.applied
            )));
        }
        let term =
            self.entries.get(&to).map(|l| l.term).ok_or_else(|| {
                NodeError::Malformed(format!("compaction to {to}: no such entry"))
            })?;
        // Everything applied through `to` reaches the on-disk index first,
        // under the state as it is: a snapshot the engine takes on its own
        // (its maintenance, any moment) must never hold the new first index
        // with a replay position before those entries' unflushed effects —
        // a restart re-applies from the first index only, and their writes
        // were lost from this replica's index. Nothing applies meanwhile:
        // compaction runs where entries are applied.
        self.engine.flush()?;
        self.truncated = (to, term);
        self.entries = self.entries.split_off(&(to + 1));
        self.scan_from = match self.entries.values().next() {
            Some(first) => first.position,
            None => self.engine.processed_position(),
        };
        // The sessions' forgotten decisions and the new first index change
        // together (one hold of the cell): a snapshot between the two held
        // the old first index without the records of the ops its entries
        // refused, and re-applied after a crash they were applied.
        let base = self.encode_app_state_base();
        {
            let mut cell = self.app_state.0.lock();
            cell.sessions.forget_before(to + 1);
            cell.base = base;
        }
        #[cfg(test)]
        if let Some(hook) = self.compact_hook.as_mut() {
            hook(&self.engine);
        }
        // The new first index and scan start become durable before
        // relocation may delete the segments of the discarded entries.
        self.engine.flush()?;
        self.engine.set_log_retention(self.scan_from);
        Ok(())
    }

    /// Chunks of this shard's offered snapshots served to node `to` (any
    /// of them: before, only the latest counted, and a follower pulling an
    /// older one after a newer was prepared for another was given up on as
    /// idle, and sent yet another snapshot).
    pub fn snapshot_pulls(&self, to: u64) -> u64 {
        self.snapshots
            .as_ref()
            .map_or(0, |s| s.outbox.pulls(s.shard_id, to))
    }

    /// WAL bytes from the first entry's record to the record after entry
    /// `index` (to the end of the WAL if there is none): what compacting to
    /// `index` would let relocation reclaim.
    pub fn wal_bytes_through(&self, index: u64) -> u64 {
        let end = self
            .entries
            .get(&(index + 1))
            .map_or_else(|| self.engine.processed_position(), |l| l.position);
        end.0.saturating_sub(self.scan_from.0)
    }

    /// Returns the latest usable snapshot, or prepares one (an engine
    /// checkpoint of the applied state, hashed on a background thread) and
    /// asks raft-rs to try again later.
    fn snapshot_for(&self, request_index: u64) -> Result<Option<Snapshot>> {
        let Some(sender) = &self.snapshots else {
            return Ok(None);
        };

        let mut current = sender.current.lock();
        // A snapshot is reused only while it carries the current
        // configuration: a replica added since would find itself missing
        // from it and reject it, forever.
        if let Some(prepared) = current.upgrade().as_ref()
            && prepared.index >= self.truncated.0
            && prepared.index >= request_index
            && *prepared.conf_state() == self.conf_state
        {
            match prepared.raft_snapshot() {
                Some(Ok(snapshot)) => {
                    sender.outbox.insert(prepared.clone());
                    return Ok(Some(snapshot));
                }
                None => return Ok(None),
                Some(Err(_)) => {} // hashing failed: prepare another
            }
        }
        let index = self.applied;
        let term = if index == self.truncated.0 {
            self.truncated.1
        } else {
            self.entries
                .get(&index)
                .map(|l| l.term)
                .ok_or_else(|| NodeError::Malformed(format!("no entry {index} to snapshot")))?
        };
        tracing::info!(
            shard_id = sender.shard_id,
            index,
            first_index = self.first(),
            superseded = current.upgrade().map_or(0, |p| p.index),
            "preparing a snapshot"
        );
        let checkpoint = self.engine.checkpoint()?;
        let prepared = Arc::new(Prepared::new(
            sender.shard_id,
            index,
            term,
            self.conf_state.clone(),
            sender.source.clone(),
            checkpoint,
        ));
        *current = Arc::downgrade(&prepared);
        sender.outbox.insert(prepared.clone());
        if sender.hash_inline {
            prepared.hash();
            return prepared.raft_snapshot().transpose();
        }
        std::thread::Builder::new()
            .name(format!("snapshot-{}", sender.shard_id))
            .spawn(move || prepared.hash())
            .map_err(|e| NodeError::Malformed(format!("cannot start a thread: {e}")))?;
        Ok(None)
    }

    /// Appends entries (replacing any at or after the first one's index).
    /// Returns the end of the last record written, to wait on.
    pub fn append(&mut self, entries: &[Entry]) -> Result<Option<WalPosition>> {
        let Some(first) = entries.first() else {
            return Ok(None);
        };
        if first.index < self.first() {
            return Err(NodeError::Malformed(format!(
                "append of index {} before the first index {}",
                first.index,
                self.first()
            )));
        }
        self.entries.split_off(&first.index);
        self.unapplied.split_off(&first.index);
        let mut end = None;
        for entry in entries {
            let split = meta::split_entry(entry)?;
            let items = meta::items(self.space, &split.ops);
            let appended = self.engine.append(&split.meta, &items)?;
            self.entries.insert(
                entry.index,
                Located {
                    position: appended.position,
                    term: entry.term,
                },
            );
            end = Some(appended.end);
            self.unapplied.insert(entry.index, appended);
        }
        Ok(end)
    }

    /// The index of the entry that made the current configuration.
    pub fn conf_index(&self) -> u64 {
        self.conf_index
    }

    /// Records a new hard state and/or configuration (made by entry
    /// `conf_state.1`). Returns the end of the state record, to wait on.
    pub fn set_state(
        &mut self,
        hard_state: Option<&HardState>,
        conf_state: Option<(&ConfState, u64)>,
    ) -> Result<Option<WalPosition>> {
        if hard_state.is_none() && conf_state.is_none() {
            return Ok(None);
        }
        if let Some(hs) = hard_state {
            self.hard_state = hs.clone();
        }
        if let Some((cs, index)) = conf_state {
            self.conf_state = cs.clone();
            self.conf_index = index;
        }
        let end = self.persist_state()?;
        self.save_app_state();
        Ok(Some(end))
    }

    fn persist_state(&mut self) -> Result<WalPosition> {
        let record = meta::encode_state(&self.hard_state, &self.conf_state, self.conf_index);
        Ok(self.engine.append(&record, &[])?.end)
    }

    /// Waits until everything up to `end` has the cluster's durability.
    pub fn wait(&self, end: Option<WalPosition>, durability: Durability) -> Result<()> {
        let Some(end) = end else {
            return Ok(());
        };
        match durability {
            Durability::Synced => self.engine.wait_synced(end)?,
            Durability::Buffered => {}
        }
        Ok(())
    }

    /// The entry at `index`, read back from the WAL.
    pub fn entry(&self, index: u64) -> Result<Entry> {
        let located = self
            .entries
            .get(&index)
            .ok_or_else(|| NodeError::Malformed(format!("no entry {index} in the log")))?;
        let record = self.engine.read_record(located.position)?;
        let LogRecord::Entry(head) = meta::parse(&record.meta)? else {
            return Err(NodeError::Malformed(format!(
                "record of entry {index} is not an entry"
            )));
        };
        if head.index != index || head.term != located.term {
            return Err(NodeError::Malformed(format!(
                "record at {} is not entry {index}",
                located.position
            )));
        }
        meta::rebuild_entry(head, record.items)
    }

    /// Where the items of entry `index` are, for applying it.
    pub fn appended(&mut self, index: u64) -> Result<Appended> {
        if let Some(appended) = self.unapplied.remove(&index) {
            return Ok(appended);
        }
        let located = self
            .entries
            .get(&index)
            .ok_or_else(|| NodeError::Malformed(format!("no entry {index} to apply")))?;
        Ok(self.engine.read_record(located.position)?.appended)
    }

    /// WAL position of entry `index`'s record.
    pub fn position(&self, index: u64) -> Option<WalPosition> {
        self.entries.get(&index).map(|l| l.position)
    }

    /// Epoch drops applied, by namespace id: blobs last written or touched
    /// below the value are gone.
    pub fn drops(&self) -> &BTreeMap<u32, u32> {
        &self.drops
    }

    /// Records an applied epoch drop (persisted with the application
    /// state; a drop lost in a crash is re-applied with its entry).
    pub fn record_drop(&mut self, namespace: u32, below: u32) {
        let bound = self.drops.entry(namespace).or_insert(0);
        *bound = (*bound).max(below);
        self.save_app_state();
    }

    /// Retentions recorded by retain entries, by namespace id.
    pub fn retained(&self) -> &Retentions {
        &self.retained
    }

    /// Records a retain entry's retention of `namespace` unless the group
    /// holds one from a newer map version; whether it did (persisted with
    /// the application state, as a drop).
    pub fn record_retain(&mut self, namespace: u32, retained: Retained) -> bool {
        if self
            .retained
            .get(&namespace)
            .is_some_and(|held| held.map_version > retained.map_version)
        {
            return false;
        }
        self.retained.insert(namespace, retained);
        self.save_app_state();
        true
    }

    /// Records that everything up to `index` is applied.
    pub fn set_applied(&mut self, index: u64) {
        self.applied = index;
        self.unapplied = self.unapplied.split_off(&(index + 1));
        self.save_app_state();
    }

    /// The application state persisted with every engine snapshot (the
    /// sessions are added when the engine asks: `AppStateCell`).
    fn save_app_state(&self) {
        let bytes = self.encode_app_state_base();
        self.app_state.0.lock().base = bytes;
    }

    /// The application state saved with every engine snapshot, up to and
    /// including the Raft state record (the sessions follow it).
    fn encode_app_state_base(&self) -> Vec<u8> {
        encode_base(
            [
                self.applied,
                self.truncated.0,
                self.truncated.1,
                self.scan_from.0,
            ],
            (&self.drops, &self.retained),
            (self.range, &self.children),
            &meta::encode_state(&self.hard_state, &self.conf_state, self.conf_index),
        )
    }

    fn restore_app_state(&mut self, bytes: &[u8]) -> Result<()> {
        let saved = AppState::decode(bytes)?;
        self.applied = saved.applied;
        self.truncated = saved.truncated;
        self.scan_from = saved.scan_from;
        self.drops = saved.drops;
        self.retained = saved.retained;
        self.range = saved.range;
        self.children = saved.children;
        self.hard_state = saved.hard_state;
        self.conf_state = saved.conf_state;
        self.conf_index = saved.conf_index;
        self.recovered_confs
            .insert(self.conf_index, self.conf_state.clone());
        // Saved before sessions existed: every applied entry applied all
        // its ops.
        self.app_state.0.lock().sessions = saved
            .sessions
            .unwrap_or_else(|| Sessions::starting_at(saved.applied));
        Ok(())
    }

    /// The hash range the group owns, as replicated (`None`: a group
    /// founded before ranges were recorded).
    pub fn range(&self) -> Option<(u64, u64)> {
        self.range
    }

    /// The groups split off this one.
    pub fn children(&self) -> &[SplitChild] {
        &self.children
    }

    /// Records an applied split: the group now owns `range` and `child`
    /// took the rest (persisted with the application state; a split lost
    /// in a crash is applied again with its entry).
    pub fn record_split(&mut self, range: (u64, u64), child: SplitChild) {
        self.range = Some(range);
        if !self.children.contains(&child) {
            self.children.push(child);
        }
        self.save_app_state();
    }

    /// The replica's write sessions, locked: the applier decides and
    /// records each entry's sessioned ops while holding them (see
    /// `session.rs`). Never held across a call that snapshots the engine
    /// (the snapshot takes this lock: it would wait for ever).
    pub(crate) fn sessions(&self) -> MappedMutexGuard<'_, Sessions> {
        MutexGuard::map(self.app_state.0.lock(), |cell| &mut cell.sessions)
    }
}

/// The application state without its sessions: magic, version, applied,
/// truncated index and term, scan start, drops, the hash range (a flag and
/// two bounds), the groups split off (a count, then id, start and end of
/// each), the raft state record.
fn encode_base(
    fields: [u64; 4],
    (drops, retained): (&BTreeMap<u32, u32>, &Retentions),
    (range, children): (Option<(u64, u64)>, &[SplitChild]),
    state: &[u8],
) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(128 + children.len() * 20 + retained.len() * 16);
    bytes.extend_from_slice(APP_STATE_MAGIC);
    bytes.push(if retained.is_empty() {
        APP_STATE_VERSION_5
    } else {
        APP_STATE_VERSION
    });
    for v in fields {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    bytes.extend_from_slice(&(drops.len() as u32).to_le_bytes());
    for (namespace, below) in drops {
        bytes.extend_from_slice(&namespace.to_le_bytes());
        bytes.extend_from_slice(&below.to_le_bytes());
    }
    let (flag, (start, end)) = range.map_or((0u8, (0, 0)), |r| (1, r));
    bytes.push(flag);
    bytes.extend_from_slice(&start.to_le_bytes());
    bytes.extend_from_slice(&end.to_le_bytes());
    bytes.extend_from_slice(&(children.len() as u32).to_le_bytes());
    for child in children {
        bytes.extend_from_slice(&child.shard_id.to_le_bytes());
        bytes.extend_from_slice(&child.start.to_le_bytes());
        bytes.extend_from_slice(&child.end.to_le_bytes());
    }
    if !retained.is_empty() {
        bytes.extend_from_slice(&(retained.len() as u32).to_le_bytes());
        for (namespace, held) in retained {
            bytes.extend_from_slice(&namespace.to_le_bytes());
            bytes.extend_from_slice(&held.epochs.to_le_bytes());
            bytes.extend_from_slice(&held.map_version.to_le_bytes());
        }
    }
    bytes.extend_from_slice(&(state.len() as u32).to_le_bytes());
    bytes.extend_from_slice(state);
    bytes
}

/// For the decoder fuzzing (`node/src/fuzzing.rs`): a saved application
/// state (with sessions).
pub(crate) fn fuzz_app_state(sessions: &Sessions) -> Vec<u8> {
    let cs = ConfState {
        voters: vec![1, 2, 3],
        ..ConfState::default()
    };
    let hs = HardState {
        term: 4,
        vote: 2,
        commit: 90,
    };
    let drops = BTreeMap::from([(3, 2), (5, 7)]);
    let retained = Retentions::from([(
        3,
        Retained {
            epochs: 4,
            map_version: 77,
        },
    )]);
    let mut bytes = encode_base(
        [90, 40, 3, 4096],
        (&drops, &retained),
        (
            Some((1 << 62, u64::MAX)),
            &[SplitChild {
                shard_id: 9,
                start: 1 << 63,
                end: u64::MAX,
            }],
        ),
        &meta::encode_state(&hs, &cs, 12),
    );
    sessions.encode(&mut bytes);
    bytes
}

/// Whether bytes decode as a saved application state.
pub(crate) fn fuzz_decode_app_state(bytes: &[u8]) -> bool {
    AppState::decode(bytes).is_ok()
}

/// For the decoder fuzzing: raft records' metadata as the log writes them
/// (a Write entry with sessions, a raw entry, a state record), and a
/// decoder that parses one and rebuilds its entry.
pub(crate) fn fuzz_record_meta(write: &Entry, raw: &Entry) -> Result<Vec<Vec<u8>>> {
    let cs = ConfState {
        voters: vec![1, 2],
        learners: vec![3],
        ..ConfState::default()
    };
    Ok(vec![
        meta::split_entry(write)?.meta,
        meta::split_entry(raw)?.meta,
        meta::encode_state(&HardState::default(), &cs, 7),
    ])
}

/// Parses record metadata and, for an entry, rebuilds it (with no items:
/// a Write's sessions then do not match, a typed error too).
pub(crate) fn fuzz_parse_meta(bytes: &[u8]) -> bool {
    match meta::parse(bytes) {
        Ok(LogRecord::Entry(head)) => {
            let _ = meta::rebuild_entry(head, Vec::new());
            true
        }
        Ok(LogRecord::State(..)) => true,
        Err(_) => false,
    }
}

/// A replica's application state as saved in the engine's control data.
#[derive(Default)]
struct AppState {
    applied: u64,
    truncated: (u64, u64),
    scan_from: WalPosition,
    drops: BTreeMap<u32, u32>,
    /// Empty in a state saved before retentions (or of a group without).
    retained: Retentions,
    /// `None` in a state saved before ranges (or of a group without one).
    range: Option<(u64, u64)>,
    /// Empty in a state saved before splits.
    children: Vec<SplitChild>,
    hard_state: HardState,
    conf_state: ConfState,
    conf_index: u64,
    /// `None` in a state saved before sessions.
    sessions: Option<Sessions>,
}

impl AppState {
    fn decode(bytes: &[u8]) -> Result<AppState> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(4)? != APP_STATE_MAGIC {
            return Err(NodeError::Malformed(
                "not a replica's application state".into(),
            ));
        }
        let version = r.u8()?;
        if ![
            APP_STATE_VERSION,
            APP_STATE_VERSION_5,
            APP_STATE_VERSION_4,
            APP_STATE_VERSION_3,
            APP_STATE_VERSION_2,
        ]
        .contains(&version)
        {
            return Err(NodeError::Malformed(format!(
                "replica application state of unknown version {version}"
            )));
        }
        let applied = r.u64()?;
        let truncated = (r.u64()?, r.u64()?);
        let scan_from = WalPosition(r.u64()?);
        let count = r.u32()?;
        let drops = (0..count)
            .map(|_| Ok((r.u32()?, r.u32()?)))
            .collect::<Result<_>>()?;
        let range = if version >= APP_STATE_VERSION_4 {
            let (flag, start, end) = (r.u8()?, r.u64()?, r.u64()?);
            match flag {
                0 => None,
                1 if start <= end => Some((start, end)),
                _ => {
                    return Err(NodeError::Malformed(format!(
                        "bad hash range in the application state: {flag} {start:#x} {end:#x}"
                    )));
                }
            }
        } else {
            None
        };
        let children = if version >= APP_STATE_VERSION_5 {
            let count = r.u32()?;
            let mut children = Vec::new();
            for _ in 0..count {
                let (shard_id, start, end) = (r.u32()?, r.u64()?, r.u64()?);
                if start > end {
                    return Err(NodeError::Malformed(format!(
                        "bad range of split-off shard {shard_id}: {start:#x} {end:#x}"
                    )));
                }
                children.push(SplitChild {
                    shard_id,
                    start,
                    end,
                });
            }
            children
        } else {
            Vec::new()
        };
        let mut retained = Retentions::new();
        if version >= APP_STATE_VERSION {
            for _ in 0..r.u32()? {
                let (namespace, epochs, map_version) = (r.u32()?, r.u32()?, r.u64()?);
                retained.insert(
                    namespace,
                    Retained {
                        epochs,
                        map_version,
                    },
                );
            }
        }
        let state = if version == APP_STATE_VERSION_2 {
            &bytes[r.at..]
        } else {
            let len = r.u32()? as usize;
            r.take(len)?
        };
        let LogRecord::State(hard_state, conf_state, conf_index) = meta::parse(state)? else {
            return Err(NodeError::Malformed(
                "application state lacks the raft state".into(),
            ));
        };
        let sessions = if version == APP_STATE_VERSION_2 {
            None
        } else {
            let sessions = Sessions::decode(&mut r)?;
            if r.at != bytes.len() {
                return Err(NodeError::Malformed(
                    "trailing bytes after the sessions".into(),
                ));
            }
            Some(sessions)
        };
        Ok(AppState {
            applied,
            truncated,
            scan_from,
            drops,
            retained,
            range,
            children,
            hard_state,
            conf_state,
            conf_index,
            sessions,
        })
    }
}

fn storage_error(error: NodeError) -> raft::Error {
    raft::Error::Store(StorageError::Other(Box::new(error)))
}

impl Storage for RaftLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState {
            hard_state: self.hard_state.clone(),
            conf_state: self.conf_state.clone(),
        })
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low < self.first() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last() + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let max_size = max_size.into();
        let mut entries = Vec::with_capacity((high - low) as usize);
        let mut size = 0u64;
        for index in low..high {
            let entry = self.entry(index).map_err(storage_error)?;
            size += entry.data.len() as u64 + entry.context.len() as u64 + 24;
            if !entries.is_empty() && max_size.is_some_and(|max| size > max) {
                break;
            }
            entries.push(entry);
        }
        Ok(entries)
    }

    fn term(&self, index: u64) -> raft::Result<u64> {
        if index == self.truncated.0 {
            return Ok(self.truncated.1);
        }
        if index < self.first() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        self.entries
            .get(&index)
            .map(|l| l.term)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.first())
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        match self.snapshot_for(request_index) {
            Ok(Some(snapshot)) => Ok(snapshot),
            Ok(None) => Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            )),
            Err(error) => Err(storage_error(error)),
        }
    }
}

#[cfg(test)]
mod tests;
