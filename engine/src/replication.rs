//! The low-level API a replication layer builds on, so that a replicated
//! write reaches the disk once: the Raft entry that carries a put *is* the
//! WAL record holding the value.
//!
//! 1. [`Engine::append`] writes a record — opaque metadata (the Raft index,
//!    term, ...) plus puts and deletes — without applying it, and says where
//!    it and each item landed. Recovery does not replay such records: the
//!    replication layer decides which are committed.
//! 2. [`Engine::wait_synced`] makes it durable (before a follower
//!    acknowledges it).
//! 3. [`Engine::apply`] points the index at the items of an appended record
//!    once it is committed: no value byte is written again. Applying twice
//!    is harmless (the same versions).
//! 4. [`Engine::read_record`] reads a record back by position (to send it
//!    to a lagging follower, or to re-apply it after a restart).
//! 5. [`Engine::set_app_state`] stores a small opaque state (Raft hard state,
//!    applied index) persisted with every snapshot — or
//!    [`Engine::set_app_state_source`] names an [`AppStateSource`] that
//!    produces it when a snapshot is written, for a state too large to copy
//!    at every change;
//!    [`Engine::recovered_replay_from`] tells where the index's durable
//!    state ends: committed records at or after it must be applied again
//!    after a restart.

use std::sync::Arc;

use crate::engine::{Engine, Inner};
use crate::error::{Error, Result};
use crate::index::entry::{Entry, Key, key_array};
use crate::types::{Epoch, KeySpace, Tag, WalPosition};
use crate::wal::format::{
    self, HeaderRead, ItemSpec, Kind, Op, RECORD_HEADER_BYTES, RecordHeader, RecordView,
};

/// Produces the application state a snapshot persists (see
/// [`Engine::set_app_state_source`]). Called from the engine's snapshot
/// thread, or from the caller of [`Engine::flush`] or
/// [`Engine::checkpoint`]; it must not call back into the engine.
pub trait AppStateSource: Send + Sync {
    /// The state as of now, with `capture` run under the same hold of it
    /// as the state is read: whatever the application applies to the
    /// engine while holding its state (and records in it) is either
    /// wholly before both or wholly after both. A snapshot reads its index
    /// state in `capture`. `capture` only takes engine locks that the
    /// application's appliers take after their hold of the state, never
    /// before it.
    fn app_state_with(&self, capture: &mut dyn FnMut()) -> Vec<u8>;

    /// The state as of now.
    fn app_state(&self) -> Vec<u8> {
        self.app_state_with(&mut || {})
    }
}

/// The application state: bytes, or a source asked at each snapshot.
pub(crate) enum AppState {
    Bytes(Vec<u8>),
    Source(Arc<dyn AppStateSource>),
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AppState::Bytes(bytes) => write!(f, "AppState({} bytes)", bytes.len()),
            AppState::Source(_) => f.write_str("AppState(source)"),
        }
    }
}

/// The application state now. The source is asked outside the engine's
/// lock, so whatever it locks never orders against engine locks.
pub(crate) fn current_app_state(inner: &Inner) -> Vec<u8> {
    app_state_with(inner, &mut || {})
}

/// The application state now, with `capture` run under the source's hold
/// of it ([`AppStateSource::app_state_with`]); state set as bytes is read
/// first.
pub(crate) fn app_state_with(inner: &Inner, capture: &mut dyn FnMut()) -> Vec<u8> {
    let source = match &*inner.app_state.lock() {
        AppState::Bytes(bytes) => {
            let bytes = bytes.clone();
            capture();
            return bytes;
        }
        AppState::Source(source) => source.clone(),
    };
    source.app_state_with(capture)
}

/// What an item of a replicated record does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItemOp {
    /// Store a value.
    Put,
    /// Delete the key.
    Delete,
    /// Move the key's entry to another epoch (only read back: an engine
    /// records touches itself, see [`Engine::touch`]).
    Touch,
}

/// An item to append.
#[derive(Clone, Copy, Debug)]
pub struct ItemInput<'a> {
    /// Key space.
    pub space: KeySpace,
    /// Put or delete.
    pub op: ItemOp,
    /// The key.
    pub key: &'a [u8],
    /// The value (empty for deletes).
    pub value: &'a [u8],
    /// Epoch stamped on the entry (the replication layer chooses it, so that
    /// every replica stores the same one).
    pub epoch: Epoch,
    /// Application tag.
    pub tag: Tag,
}

/// Where an appended item landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendedItem {
    space: u8,
    key: Key,
    entry: Entry,
    /// Position of the record holding the item.
    record: u64,
}

impl AppendedItem {
    /// WAL position of the item.
    pub fn position(&self) -> WalPosition {
        WalPosition(self.entry.location)
    }

    /// Whether it is a delete.
    pub fn is_delete(&self) -> bool {
        self.entry.tombstone()
    }
}

/// A record written by [`Engine::append`] (or read back by
/// [`Engine::read_record`]), ready to be applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Appended {
    /// Position of the record.
    pub position: WalPosition,
    /// Position just after it: wait for this to be synced before
    /// acknowledging the record.
    pub end: WalPosition,
    /// Its items.
    pub items: Vec<AppendedItem>,
}

/// A record read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordData {
    /// The opaque metadata.
    pub meta: Vec<u8>,
    /// The items.
    pub items: Vec<ItemData>,
    /// The record's position and where it and its items landed.
    pub appended: Appended,
}

/// An item read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemData {
    /// Key space.
    pub space: KeySpace,
    /// Put or delete.
    pub op: ItemOp,
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// Epoch.
    pub epoch: Epoch,
    /// Tag.
    pub tag: Tag,
}

impl Engine {
    /// Appends a record without applying it (see the module docs). Waits
    /// only until it is processed (copied, and every earlier record too).
    pub fn append(&self, meta: &[u8], items: &[ItemInput<'_>]) -> Result<Appended> {
        let inner = &*self.inner;
        inner.health.check()?;
        let specs: Vec<ItemSpec<'_>> = items
            .iter()
            .map(|i| {
                let op = match i.op {
                    ItemOp::Put => Op::Put,
                    ItemOp::Delete => Op::Delete,
                    ItemOp::Touch => {
                        return Err(Error::Config(
                            "append carries puts and deletes; touches are applied with Engine::touch".into(),
                        ));
                    }
                };
                inner.item(i.space, op, i.key, i.value, i.epoch, i.tag)
            })
            .collect::<Result<_>>()?;
        if meta.len() > u32::MAX as usize || specs.len() > usize::from(u16::MAX) {
            return Err(Error::TooLarge {
                what: "record metadata or item count",
                got: meta.len().max(specs.len()) as u64,
                max: u64::from(u16::MAX),
            });
        }
        let len = format::entry_record_len(meta.len(), &specs);
        // Large records through the file (no zero-filled pages, no faults);
        // nothing reads them before the caller applies them.
        let pwrite_min = inner.config.append_pwrite_min_bytes;
        let (position, locations) = if pwrite_min > 0 && len as u64 >= pwrite_min {
            let (position, gathered) = inner.values.append_gathered(len, |position| {
                format::gather_entry(position, 0, meta, &specs)
            })?;
            crate::metrics::Metrics::add(&inner.metrics.counters().wal_bytes_pwritten, len as u64);
            (position, gathered.locations)
        } else {
            inner.values.append(len, |buf, position| {
                format::write_entry(buf, position, 0, meta, &specs)
            })?
        };
        let end = position.plus(len as u64);
        inner.values.wait_processed(end)?;
        crate::metrics::Metrics::add(&inner.metrics.counters().wal_bytes_written, len as u64);
        let items = specs
            .iter()
            .zip(&locations)
            .map(|(spec, location)| AppendedItem {
                space: spec.key_space,
                key: key_array(spec.key),
                entry: Entry::written(
                    location.position.0,
                    location.len,
                    spec.op == Op::Delete,
                    spec.epoch,
                    spec.tag,
                ),
                record: position.0,
            })
            .collect();
        Ok(Appended {
            position,
            end,
            items,
        })
    }

    /// Points the index at every item of an appended record.
    pub fn apply(&self, appended: &Appended) -> Result<()> {
        self.inner.health.check()?;
        for item in &appended.items {
            self.apply_appended(item)?;
        }
        Ok(())
    }

    /// Points the index at one item of an appended record (for an
    /// application that applies only some of a record's items). Applying
    /// it again is harmless.
    pub fn apply_item(&self, item: &AppendedItem) -> Result<()> {
        self.inner.health.check()?;
        self.apply_appended(item)
    }

    /// An item appended since the engine opened is newer than anything
    /// the index holds for its key (its position is its version); one
    /// from before may be older than a relocated copy of itself, a drop's
    /// marker or a later write, and is compared with the key's whole
    /// current entry, on disk too (only re-applies after a restart pay
    /// for that).
    fn apply_appended(&self, item: &AppendedItem) -> Result<()> {
        let inner = &*self.inner;
        if item.record >= inner.opened_at {
            inner.apply(item.space, item.key, item.entry, item.record);
            Ok(())
        } else {
            inner.apply_unless_superseded(item.space, &item.key, item.entry, item.record)
        }
    }

    /// Reads the record at `position` back, verifying it.
    pub fn read_record(&self, position: WalPosition) -> Result<RecordData> {
        let inner = &*self.inner;
        inner.health.check()?;
        let corrupt = |detail: String| Error::Corrupt {
            file: "value WAL".into(),
            position,
            detail,
        };
        let head = inner.values.read(position, RECORD_HEADER_BYTES)?;
        let header = match RecordHeader::decode(&head) {
            HeaderRead::Header(h) if h.kind == Kind::Entry => h,
            _ => return Err(Error::NoRecord(position)),
        };
        // Its buffer goes back to the read buffers once the items are copied.
        let bytes = crate::buffers::freeze(inner.values.read(position, header.record_len())?);
        let view = RecordView::verify(position, &bytes).map_err(|m| corrupt(m.0))?;
        let items = view
            .items()
            .map(|(_, item)| ItemData {
                space: KeySpace(item.key_space),
                op: item_op(item.op),
                key: item.key.to_vec(),
                value: item.value.to_vec(),
                epoch: item.epoch,
                tag: item.tag,
            })
            .collect();
        Ok(RecordData {
            meta: view.meta().to_vec(),
            items,
            appended: appended_from_view(position, &view),
        })
    }

    /// Visits, in log order, every record a replication layer appended
    /// (with [`Engine::append`]) from `from` (a record position) to the end of
    /// the log: its position, metadata and where its items are. For a
    /// replication layer rebuilding its log index after a restart.
    pub fn scan_appended(
        &self,
        from: WalPosition,
        mut visit: impl FnMut(WalPosition, &[u8], Appended) -> Result<()>,
    ) -> Result<()> {
        let inner = &*self.inner;
        inner.health.check()?;
        let processed = inner.values.processed();
        let segments: std::collections::BTreeMap<_, _> = inner
            .values
            .segments()
            .into_iter()
            .map(|s| (s.id, s))
            .collect();
        // Start in the first segment that still exists at or after `from`
        // (older ones may have been reclaimed).
        let size = inner.values.options().segment_size;
        let from = match segments
            .range(crate::types::SegmentId(from.0 / size)..)
            .next()
        {
            Some((id, _)) if id.0 * size > from.0 => WalPosition(id.0 * size),
            Some(_) => from,
            None => return Ok(()),
        };
        crate::wal::replay::replay(inner.values.options(), &segments, from, |position, view| {
            let appended_by_application = view.header.kind == Kind::Entry && view.header.flags == 0;
            if position < processed && appended_by_application {
                visit(position, view.meta(), appended_from_view(position, view))?;
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Replaces the application state persisted with the next snapshot
    /// (and forgets a source set before).
    pub fn set_app_state(&self, state: &[u8]) {
        *self.inner.app_state.lock() = AppState::Bytes(state.to_vec());
    }

    /// From now on every snapshot persists what `source` produces when the
    /// snapshot is written. The snapshot reads its index state under the
    /// source's hold of the application state
    /// ([`AppStateSource::app_state_with`]), so every record the
    /// application applied before producing the state is either in the
    /// snapshot's index or at or after its replay position
    /// ([`Engine::recovered_replay_from`]), and none it applied after is
    /// in the snapshot's on-disk index.
    pub fn set_app_state_source(&self, source: Arc<dyn AppStateSource>) {
        *self.inner.app_state.lock() = AppState::Source(source);
    }

    /// The application state (as last set, produced by the source, or as
    /// recovered).
    pub fn app_state(&self) -> Vec<u8> {
        current_app_state(&self.inner)
    }

    /// The replay position of the snapshot the engine was opened from (or of
    /// the latest snapshot since): index changes from records before it are
    /// durable in the index; committed records at or after it must be
    /// applied again after a restart.
    pub fn recovered_replay_from(&self) -> WalPosition {
        self.inner
            .last_snapshot
            .lock()
            .as_ref()
            .map_or(WalPosition(0), |c| c.replay_from)
    }

    /// The application applied again what a restart left it
    /// ([`Engine::recovered_replay_from`] onward): snapshots may move the
    /// replay position on ([`Config::hold_replay_until_released`](crate::Config::hold_replay_until_released)).
    pub fn release_replay_hold(&self) {
        self.inner
            .replay_hold
            .store(u64::MAX, std::sync::atomic::Ordering::Release);
    }

    /// Starts a new epoch: rolls the WAL to a new segment belonging to it.
    /// Epochs only grow.
    pub fn advance_epoch(&self, epoch: Epoch) -> Result<()> {
        let current = self.epoch();
        if epoch <= current {
            return Err(Error::Config(format!(
                "epoch {} is not after the current {}",
                epoch.0, current.0
            )));
        }
        self.inner.values.advance_epoch(epoch)
    }
}

fn item_op(op: Op) -> ItemOp {
    match op {
        Op::Put => ItemOp::Put,
        Op::Delete => ItemOp::Delete,
        Op::Touch => ItemOp::Touch,
    }
}

/// Where a verified record's items are, as an [`Appended`].
fn appended_from_view(position: WalPosition, view: &RecordView<'_>) -> Appended {
    let items = view
        .items()
        .map(|(offset, item)| {
            let location = position.0 + offset as u64;
            AppendedItem {
                space: item.key_space,
                key: key_array(item.key),
                entry: Entry::of_item(location, &item),
                record: position.0,
            }
        })
        .collect();
    Appended {
        position,
        end: position.plus(view.header.record_len() as u64),
        items,
    }
}
