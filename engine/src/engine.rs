//! The engine: the public handle and the foreground paths (writes, reads).
//!
//! A write is one WAL record. The writer claims its space, copies the record
//! in, points the Large Table at the new items — all before the tracker may
//! count the record as processed — and then waits for the durability it
//! asked for. A read looks the key up in the Large Table (memory, bloom
//! filter, or one window of the on-disk index) and reads the item with one
//! `pread`, verifying its checksum and key.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use bytes::Bytes;
use parking_lot::Mutex;

use crate::cache::EngineCache;
use crate::config::Config;
use crate::control::ControlData;
use crate::error::{Error, Result};
use crate::health::Health;
use crate::index::entry::{Entry, Key, key_array};
use crate::index::layers::{Layer, Layers};
use crate::index::store::IndexStore;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::storage::{FileStorage, Storage};
use crate::table::cell::{BASE_ENTRY_BYTES, CellState, Probe};
use crate::table::{CellId, LargeTable, SpaceTable};
use crate::types::{Durability, Epoch, KeySpace, MAX_KEY_BYTES, Tag, WalPosition};
use crate::wal::Log;
use crate::wal::format::{self, FLAG_APPLIED, ItemSpec, Op};

/// Times a lookup retries when the index blob it read was replaced and
/// collected under it.
const LOOKUP_ATTEMPTS: usize = 8;
/// A value at most this much longer than the prefix [`Engine::get_head`]
/// asks for is read whole (and verified).
const HEAD_WHOLE_BYTES: usize = 16 << 10;

/// A write prefetches the index cells of at most this many of its items
/// (one cell's lock and fields per item; a large batch would only evict).
const PREFETCHED_ITEMS: usize = 4;

/// Everything the foreground paths and background tasks share.
#[derive(Debug)]
pub(crate) struct Inner {
    pub config: Config,
    pub storage: Arc<dyn Storage>,
    pub health: Arc<Health>,
    pub log_id: [u8; 16],
    pub values: Log,
    /// The highest replay position a snapshot may record (`u64::MAX`:
    /// none): the open's, until the application releases it
    /// ([`Config::hold_replay_until_released`]).
    pub replay_hold: std::sync::atomic::AtomicU64,
    /// The end of the WAL when the engine opened: an item of a record
    /// below it may be applied again (a replication layer re-applies from
    /// its replay position) while the index holds something newer for its
    /// key ([`Inner::apply_unless_superseded`]).
    pub opened_at: u64,
    pub index: IndexStore,
    pub table: LargeTable,
    pub cache: EngineCache,
    pub metrics: Metrics,
    /// Opaque state of the application (the Raft layer), persisted with
    /// each snapshot.
    pub app_state: Mutex<crate::replication::AppState>,
    /// Serializes snapshots; holds the last control data written.
    pub last_snapshot: Mutex<Option<ControlData>>,
    /// Readers of index blobs hold it shared; index garbage collection holds
    /// it exclusively while deleting segments.
    pub index_gc: crate::striped::StripedRwLock,
    /// Cells waiting for a flusher.
    pub flush_queue: crate::flush::FlushQueue,
    pub shutdown: AtomicBool,
    /// Relocation's turn, filter, log retention and census.
    pub relocation: crate::relocation::RelocationState,
    /// The hold on the directory, let go when the engine stops.
    pub dir_lock: Mutex<Option<crate::storage::DirLock>>,
}

/// A value read with [`Engine::get_stored`], and its entry's metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The value.
    pub value: Bytes,
    /// Epoch of the key's last write or touch.
    pub epoch: Epoch,
    /// Application tag of the write.
    pub tag: Tag,
}

/// The start of a value read with [`Engine::get_head`], its length and its
/// entry's metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredHead {
    /// The value's first bytes (all of it if it is shorter than asked).
    pub prefix: Bytes,
    /// The value's length, bytes.
    pub len: u64,
    /// Epoch of the key's last write or touch.
    pub epoch: Epoch,
    /// Application tag of the write.
    pub tag: Tag,
}

/// A Tidepool storage engine over one directory.
///
/// `Engine` is `Send + Sync`: share it by reference or in an `Arc`. Call
/// [`Engine::close`] for a clean shutdown (it flushes the index and writes a
/// snapshot, so the next open replays nothing); dropping it without closing
/// is safe too — acknowledged writes are in the WAL and are replayed.
#[derive(Debug)]
pub struct Engine {
    pub(crate) inner: Arc<Inner>,
    /// Its background tasks (maintenance, relocation, flushers); its logs
    /// hold theirs.
    pub(crate) tasks: Mutex<Vec<crate::pool::Task>>,
}

/// A key space's name and the engine's identifier for it.
pub(crate) fn space_index(inner: &Inner, space: KeySpace) -> Result<&SpaceTable> {
    inner
        .table
        .spaces
        .get(space.index())
        .ok_or_else(|| Error::UnknownKeySpace(format!("#{}", space.index())))
}

impl Engine {
    /// The most items one record (one [`WriteBatch`](crate::WriteBatch))
    /// may hold.
    pub const MAX_RECORD_ITEMS: usize = u16::MAX as usize;

    /// The most bytes one record may take in the WAL (its items' keys and
    /// values, with their framing): a segment less its header.
    pub fn max_record_bytes(&self) -> u64 {
        self.inner.values.max_record_bytes()
    }

    /// Opens (or creates) the engine in `config.dir` on real files.
    pub fn open(config: Config) -> Result<Engine> {
        Self::open_with_storage(config, Arc::new(FileStorage::new()))
    }

    /// Opens (or creates) the engine on the given storage (for tests: a
    /// [`crate::storage::FaultStorage`]).
    /// [`crate::storage::FaultStorage`]). Its background work runs on a
    /// small pool of its own.
    pub fn open_with_storage(config: Config, storage: Arc<dyn Storage>) -> Result<Engine> {
        crate::recovery::open(config, storage, None)
    }

    /// Opens (or creates) the engine on `storage` as one of a node's:
    /// its background work runs in the host's pool (so that an engine has
    /// no thread of its own) and its index and value cache count against
    /// the host's memory budget (`config.index_memory_bytes` and
    /// `config.value_cache_bytes` are not used).
    pub fn open_in(
        config: Config,
        storage: Arc<dyn Storage>,
        host: &crate::memory::Host,
    ) -> Result<Engine> {
        crate::recovery::open(config, storage, Some(host.clone()))
    }

    /// The key space called `name`.
    pub fn key_space(&self, name: &str) -> Result<KeySpace> {
        self.inner
            .table
            .spaces
            .iter()
            .position(|s| s.config.name == name)
            .map(|i| KeySpace(i as u8))
            .ok_or_else(|| Error::UnknownKeySpace(name.to_string()))
    }

    /// Stores `value` under `key`.
    pub fn put(
        &self,
        space: KeySpace,
        key: &[u8],
        value: &[u8],
        durability: Durability,
    ) -> Result<WalPosition> {
        let epoch = self.epoch();
        self.inner.write(
            &[self.inner.item(space, Op::Put, key, value, epoch, Tag(0))?],
            durability,
        )
    }

    /// Deletes `key` (writes a tombstone; deleting a missing key is fine).
    pub fn delete(
        &self,
        space: KeySpace,
        key: &[u8],
        durability: Durability,
    ) -> Result<WalPosition> {
        let epoch = self.epoch();
        self.inner.write(
            &[self
                .inner
                .item(space, Op::Delete, key, &[], epoch, Tag(0))?],
            durability,
        )
    }

    /// The value stored under `key`.
    pub fn get(&self, space: KeySpace, key: &[u8]) -> Result<Option<Bytes>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let start = Instant::now();
        let (space_table, key) = inner.key(space, key)?;
        Metrics::add(&inner.metrics.counters().gets, 1);
        let value = inner.get_value(space_table, &key)?;
        inner.metrics.get_latency().record_since(start);
        Ok(value)
    }

    /// The value stored under `key` with its entry's epoch and tag.
    pub fn get_stored(&self, space: KeySpace, key: &[u8]) -> Result<Option<Stored>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let start = Instant::now();
        let (space_table, key) = inner.key(space, key)?;
        Metrics::add(&inner.metrics.counters().gets, 1);
        let found = inner.get_entry_value(space_table, &key)?;
        inner.metrics.get_latency().record_since(start);
        Ok(found.map(|(value, entry)| Stored {
            value,
            epoch: entry.epoch,
            tag: entry.tag,
        }))
    }

    /// [`Engine::get_stored`] if it can be answered from memory — the index
    /// in memory and the value in the value cache or the page cache —
    /// without waiting for a disk or a lock: for callers on threads that
    /// must not block (an async runtime's). `Ok(None)`: it would wait; ask
    /// `get_stored` where blocking is fine.
    pub fn get_stored_now(&self, space: KeySpace, key: &[u8]) -> Result<Option<Option<Stored>>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let start = Instant::now();
        let (space_table, key) = inner.key(space, key)?;
        let Some(found) = inner.get_entry_value_now(space_table, &key)? else {
            return Ok(None);
        };
        Metrics::add(&inner.metrics.counters().gets, 1);
        inner.metrics.get_latency().record_since(start);
        Ok(Some(found.map(|(value, entry)| Stored {
            value,
            epoch: entry.epoch,
            tag: entry.tag,
        })))
    }

    /// [`Engine::get_stored`], asking `admit` with the stored length of the
    /// value found (from the index: nothing read yet) before reading it,
    /// so a caller bounding what its reads hold refuses before the bytes
    /// are allocated. `None` when there is no value or `admit` said no
    /// (the caller knows which). `admit` may be asked again (the value
    /// moved between the lookup and the read).
    pub fn get_stored_admitted(
        &self,
        space: KeySpace,
        key: &[u8],
        admit: &mut dyn FnMut(u64) -> bool,
    ) -> Result<Option<Stored>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let start = Instant::now();
        let (space_table, key) = inner.key(space, key)?;
        Metrics::add(&inner.metrics.counters().gets, 1);
        let found = inner.get_entry_value_admitted(space_table, &key, admit)?;
        inner.metrics.get_latency().record_since(start);
        Ok(found.map(|(value, entry)| Stored {
            value,
            epoch: entry.epoch,
            tag: entry.tag,
        }))
    }

    /// [`Engine::get_stored_admitted`] from memory alone, as
    /// [`Engine::get_stored_now`]: `Ok(None)` where it would wait.
    pub fn get_stored_admitted_now(
        &self,
        space: KeySpace,
        key: &[u8],
        admit: &mut dyn FnMut(u64) -> bool,
    ) -> Result<Option<Option<Stored>>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let start = Instant::now();
        let (space_table, key) = inner.key(space, key)?;
        let entry = match inner.lookup_now(space_table, &key) {
            None => return Ok(None),
            Some(None) => return Ok(Some(None)),
            Some(Some(entry)) => entry,
        };
        if !admit(u64::from(entry.len)) {
            return Ok(Some(None));
        }
        let value = match inner.read_value_now(space_table, &key, &entry) {
            Ok(Some(value)) => value,
            Ok(None) | Err(Error::NoRecord(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        Metrics::add(&inner.metrics.counters().gets, 1);
        inner.metrics.get_latency().record_since(start);
        Ok(Some(Some(Stored {
            value,
            epoch: entry.epoch,
            tag: entry.tag,
        })))
    }

    /// The first `n` bytes of the value under `key` and its length, without
    /// reading the rest: for a header stored at the start of large values.
    /// A value up to 16 KiB longer than `n` (or in the value cache) is read
    /// whole and verified; of a longer one only the item's header, key and
    /// the `n` bytes are read — checked for consistency with the index
    /// (length, key), but not by the item's CRC, which covers the whole
    /// item: a reader of the whole value gets it verified.
    pub fn get_head(&self, space: KeySpace, key: &[u8], n: usize) -> Result<Option<StoredHead>> {
        self.get_head_checked(space, key, n, true)
    }

    /// [`Engine::get_head`] without checking the value: the first `n`
    /// bytes as stored, even when the value would fail its checksum (a
    /// small value is otherwise read whole and checked). For comparing
    /// with another copy, never to be trusted alone.
    pub fn get_head_unchecked(
        &self,
        space: KeySpace,
        key: &[u8],
        n: usize,
    ) -> Result<Option<StoredHead>> {
        self.get_head_checked(space, key, n, false)
    }

    fn get_head_checked(
        &self,
        space: KeySpace,
        key: &[u8],
        n: usize,
        checked: bool,
    ) -> Result<Option<StoredHead>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let (space_table, key) = inner.key(space, key)?;
        Metrics::add(&inner.metrics.counters().gets, 1);
        for _ in 0..LOOKUP_ATTEMPTS {
            let Some(entry) = inner.lookup(space_table, &key)? else {
                return Ok(None);
            };
            match inner.read_value_head_checked(space_table, &key, &entry, n, true, checked) {
                Err(Error::NoRecord(_)) => continue,
                result => {
                    return result.map(|head| {
                        let (prefix, len) = head.expect("a waiting read returns the value");
                        Some(StoredHead {
                            prefix,
                            len,
                            epoch: entry.epoch,
                            tag: entry.tag,
                        })
                    });
                }
            }
        }
        Err(Error::Corrupt {
            file: "value WAL".into(),
            position: WalPosition(0),
            detail: "the index keeps pointing at a missing segment".into(),
        })
    }

    /// [`Engine::get_head`] from memory alone; `Ok(None)` where it would
    /// wait (see [`Engine::get_stored_now`]).
    pub fn get_head_now(
        &self,
        space: KeySpace,
        key: &[u8],
        n: usize,
    ) -> Result<Option<Option<StoredHead>>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let (space_table, key) = inner.key(space, key)?;
        let Some(found) = inner.lookup_now(space_table, &key) else {
            return Ok(None);
        };
        let Some(entry) = found else {
            Metrics::add(&inner.metrics.counters().gets, 1);
            return Ok(Some(None));
        };
        match inner.read_value_head(space_table, &key, &entry, n, false) {
            Ok(Some((prefix, len))) => {
                Metrics::add(&inner.metrics.counters().gets, 1);
                Ok(Some(Some(StoredHead {
                    prefix,
                    len,
                    epoch: entry.epoch,
                    tag: entry.tag,
                })))
            }
            Ok(None) | Err(Error::NoRecord(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// [`Engine::epoch_of`] from the index in memory alone; `Ok(None)`
    /// where it would wait (see [`Engine::get_stored_now`]).
    pub fn epoch_of_now(&self, space: KeySpace, key: &[u8]) -> Result<Option<Option<Epoch>>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let (space_table, key) = inner.key(space, key)?;
        let Some(found) = inner.lookup_now(space_table, &key) else {
            return Ok(None);
        };
        Metrics::add(&inner.metrics.counters().exists_checks, 1);
        Ok(Some(found.map(|entry| entry.epoch)))
    }

    /// The epoch of `key`'s last write or touch, if it has a value. Never
    /// reads the value.
    pub fn epoch_of(&self, space: KeySpace, key: &[u8]) -> Result<Option<Epoch>> {
        let inner = &*self.inner;
        inner.health.check()?;
        let (space_table, key) = inner.key(space, key)?;
        Metrics::add(&inner.metrics.counters().exists_checks, 1);
        Ok(inner.lookup(space_table, &key)?.map(|entry| entry.epoch))
    }

    /// Whether `key` has a value. Never reads the value.
    pub fn exists(&self, space: KeySpace, key: &[u8]) -> Result<bool> {
        let inner = &*self.inner;
        inner.health.check()?;
        let (space_table, key) = inner.key(space, key)?;
        Metrics::add(&inner.metrics.counters().exists_checks, 1);
        Ok(inner.lookup(space_table, &key)?.is_some())
    }

    /// `Ok` while the engine is open and not poisoned.
    pub fn health(&self) -> Result<()> {
        self.inner.health.check()
    }

    /// The current epoch.
    pub fn epoch(&self) -> Epoch {
        self.inner.values.epoch()
    }

    /// Position below which every write is complete (and indexed, for
    /// applied writes).
    pub fn processed_position(&self) -> WalPosition {
        self.inner.values.processed()
    }

    /// Position below which every write is durable against power loss.
    pub fn synced_position(&self) -> WalPosition {
        self.inner.values.synced()
    }

    /// Blocks until everything below `position` is durable.
    pub fn wait_synced(&self, position: WalPosition) -> Result<()> {
        self.inner.values.wait_synced(position)
    }

    /// Flushes every unflushed index change, runs an index log cleaning
    /// pass, and writes a control-region snapshot: after it, recovery
    /// replays nothing written before the call.
    pub fn flush(&self) -> Result<()> {
        self.inner.health.check()?;
        crate::flush::flush_all(&self.inner)?;
        crate::index_cleaning::clean(&self.inner)?;
        crate::snapshot::write_snapshot(&self.inner)
    }

    /// Writes a control-region snapshot of the index as it stands, flushing
    /// nothing first — what the maintenance task does every snapshot
    /// interval, at whatever moment it comes. For tests of what such a
    /// snapshot, taken at a chosen moment, lets recovery see.
    pub fn write_control_snapshot(&self) -> Result<()> {
        self.inner.health.check()?;
        crate::snapshot::write_snapshot(&self.inner)
    }

    /// Counters, latency histograms and gauges.
    pub fn metrics(&self) -> MetricsSnapshot {
        let inner = &*self.inner;
        let mut snapshot = inner.metrics.snapshot();
        snapshot.index_memory_bytes = inner.table.memory_bytes();
        snapshot.cache_bytes = inner.cache.bytes();
        snapshot.wal_processed = inner.values.processed().0;
        snapshot.wal_synced = inner.values.synced().0;
        snapshot.wal_released_bytes = inner.values.released_bytes();
        snapshot.segments = inner.relocation.last_census();
        snapshot.relocation_lag_bytes = snapshot
            .segments
            .iter()
            .filter(|s| s.sealed)
            .map(|s| s.size_bytes.saturating_sub(s.live_bytes))
            .sum();
        let mut index = crate::index_cleaning::Census::new(inner);
        inner.table.for_each_cell(|space, _, cell| {
            index.add(inner.table.spaces[space].key_len(), cell);
            let slot = match cell.state() {
                CellState::Empty => 0,
                CellState::Loaded => 1,
                CellState::DirtyLoaded => 2,
                CellState::Unloaded => 3,
                CellState::DirtyUnloaded => 4,
            };
            snapshot.cell_states[slot] += 1;
        });
        snapshot.index_live_bytes = index.usage.live_bytes;
        snapshot.index_garbage_bytes = index
            .usage
            .sealed_bytes
            .saturating_sub(index.usage.sealed_live_bytes);
        snapshot
    }

    /// Unloads every loaded cell whose changes are flushed (their on-disk
    /// index stays), returning the in-memory index to its minimum. Useful
    /// under memory pressure, and in tests.
    pub fn release_memory(&self) {
        let inner = &*self.inner;
        inner.table.for_each_cell(|_, _, cell| {
            let freed = cell.unload();
            inner.table.account(-(freed as isize));
        });
    }

    /// Syncs the value WAL and the index log and asks the kernel to drop
    /// their cached pages, so the next reads go to the disk (for cold-read
    /// tests and benchmarks).
    pub fn drop_page_cache(&self) -> Result<()> {
        for log in [&self.inner.values, &self.inner.index.log] {
            log.sync_now()?;
            for segment in log.segments() {
                segment
                    .file
                    .evict_cache()
                    .map_err(|e| Error::io(&segment.path, e))?;
            }
        }
        Ok(())
    }

    /// Bytes of the engine's files on disk (value WAL and index log
    /// segments, spares included).
    pub fn disk_bytes(&self) -> u64 {
        self.inner.values.disk_bytes() + self.inner.index.log.disk_bytes()
    }

    /// Closes the engine: stops the background tasks, flushes the index,
    /// syncs the WAL and writes a final snapshot, so the next open replays
    /// nothing. Afterwards every call fails with [`Error::Closed`] and the
    /// directory may be opened again. A write racing with `close` either
    /// fails or is in the WAL (and replayed). A poisoned engine is shut
    /// down (see [`Engine::shutdown`]) and its poison returned.
    pub fn close(&self) -> Result<()> {
        let inner = &*self.inner;
        let healthy = inner.health.check();
        self.stop_threads();
        let result = healthy
            .and_then(|()| crate::flush::flush_all(inner))
            .and_then(|()| crate::snapshot::write_snapshot(inner));
        self.release();
        result
    }

    /// Stops the engine without a final flush, sync or snapshot (background
    /// work already under way finishes first; nothing starts after) — what
    /// a killed process would leave, which the next open recovers
    /// (everything acknowledged as durable is). For an owner that
    /// gave up on this engine and will reopen its directory. Afterwards
    /// every call fails with [`Error::Closed`] (handles may still be held
    /// elsewhere) and the directory may be opened again.
    pub fn shutdown(&self) {
        self.stop_threads();
        self.release();
    }

    fn stop_threads(&self) {
        crate::flush::stop(&self.inner);
        for task in self.tasks.lock().drain(..) {
            task.stop();
        }
    }

    /// Refuses further calls, stops the logs' threads (removing unused
    /// spare segments) and lets go of the directory, in that order: nothing
    /// of this engine touches the directory once another may open it.
    fn release(&self) {
        let inner = &*self.inner;
        inner.health.close();
        inner.values.shutdown();
        inner.index.log.shutdown();
        inner.dir_lock.lock().take();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop_threads();
        self.release();
    }
}

impl Inner {
    /// Checks a key against its key space.
    pub fn key(&self, space: KeySpace, key: &[u8]) -> Result<(&SpaceTable, Key)> {
        let table = space_index(self, space)?;
        if key.len() != table.key_len() {
            return Err(Error::WrongKeyLength {
                key_space: table.config.name.clone(),
                expected: table.key_len(),
                got: key.len(),
            });
        }
        Ok((table, key_array(key)))
    }

    /// Builds a checked item.
    pub fn item<'a>(
        &self,
        space: KeySpace,
        op: Op,
        key: &'a [u8],
        value: &'a [u8],
        epoch: Epoch,
        tag: Tag,
    ) -> Result<ItemSpec<'a>> {
        self.key(space, key)?;
        if value.len() as u64 > self.config.max_value_bytes {
            return Err(Error::TooLarge {
                what: "value",
                got: value.len() as u64,
                max: self.config.max_value_bytes,
            });
        }
        Ok(ItemSpec {
            op,
            key_space: space.0,
            key,
            value,
            epoch,
            tag,
            version: 0,
        })
    }

    /// Writes `items` as one applied record and waits for `durability`.
    pub fn write(&self, items: &[ItemSpec<'_>], durability: Durability) -> Result<WalPosition> {
        self.health.check()?;
        if items.len() > Engine::MAX_RECORD_ITEMS {
            return Err(Error::TooLarge {
                what: "batch (items)",
                got: items.len() as u64,
                max: u64::from(u16::MAX),
            });
        }
        let start = Instant::now();
        for item in items.iter().take(PREFETCHED_ITEMS) {
            if let Some(space) = self.table.spaces.get(usize::from(item.key_space)) {
                space.prefetch(&key_array(item.key));
            }
        }
        let len = format::entry_record_len(0, items);
        let (position, ()) = self.values.append(len, |buf, position| {
            let locations = format::write_entry(buf, position, FLAG_APPLIED, &[], items);
            for (item, location) in items.iter().zip(&locations) {
                let delete = item.op == Op::Delete;
                let entry = Entry::written(
                    location.position.0,
                    location.len,
                    delete,
                    item.epoch,
                    item.tag,
                );
                self.apply(item.key_space, key_array(item.key), entry, position.0);
            }
        })?;
        let counters = &self.metrics.counters();
        let deletes = items.iter().filter(|i| i.op == Op::Delete).count() as u64;
        Metrics::add(&counters.puts, items.len() as u64 - deletes);
        Metrics::add(&counters.deletes, deletes);
        Metrics::add(&counters.wal_bytes_written, len as u64);
        self.wait_durable(position.plus(len as u64), durability)?;
        self.metrics.put_latency().record_since(start);
        Ok(position)
    }

    /// Points the index at `entry`, carried by the WAL record at `record`
    /// (the newer version wins), and queues the cell for flushing when it has
    /// gathered enough changes.
    pub fn apply(&self, space: u8, key: Key, entry: Entry, record: u64) {
        let table = &self.table.spaces[usize::from(space)];
        let id = table.cell_of(&key);
        let threshold = self.config.flush_dirty_entries as usize;
        let queue = table.with_cell_or_create(&id, |cell| {
            let added = cell.apply(key, entry, record).unwrap_or(0);
            self.table.account(added as isize);
            let queue = cell.changes.len() >= threshold && !cell.queued && !cell.flushing;
            cell.queued |= queue;
            queue
        });
        if queue {
            self.flush_queue.push_and_wake(space, id);
        }
    }

    /// The entry, if it is a live value (not deleted or dropped).
    fn live(&self, entry: Option<Entry>) -> Option<Entry> {
        entry.filter(|e| !e.tombstone())
    }

    /// The live entry for `key`, from memory or the on-disk index.
    pub fn lookup(&self, space: &SpaceTable, key: &Key) -> Result<Option<Entry>> {
        let id = space.cell_of(key);
        for _ in 0..LOOKUP_ATTEMPTS {
            let Some(probe) = space.with_cell(&id, |cell| cell.probe(key, space.key_len())) else {
                return Ok(None);
            };
            let layers = match probe {
                Probe::Found(entry) => return Ok(self.live(entry)),
                Probe::Filtered => {
                    Metrics::add(&self.metrics.counters().bloom_negatives, 1);
                    return Ok(None);
                }
                Probe::Disk(layers) => layers,
            };
            match self.lookup_disk(space, &id, key, &layers) {
                Err(Error::NoRecord(_)) => continue,
                result => return result.map(|entry| self.live(entry)),
            }
        }
        Err(Error::Io {
            path: "index log".into(),
            source: std::io::Error::other("index blobs kept changing under a lookup"),
        })
    }

    /// [`Inner::lookup`] from memory alone: `None` where it would read the
    /// on-disk index or wait for a cell's lock.
    pub fn lookup_now(&self, space: &SpaceTable, key: &Key) -> Option<Option<Entry>> {
        let id = space.cell_of(key);
        match space.try_with_cell(&id, |cell| cell.probe(key, space.key_len()))? {
            None => Some(None),
            Some(Probe::Found(entry)) => Some(self.live(entry)),
            Some(Probe::Filtered) => {
                Metrics::add(&self.metrics.counters().bloom_negatives, 1);
                Some(None)
            }
            Some(Probe::Disk(_)) => None,
        }
    }

    /// Looks `key` up in the cell's on-disk index: loads the whole cell if
    /// the memory budget allows, else searches its blobs newest first (one
    /// window each, for the blobs whose bloom filters let the key through).
    fn lookup_disk(
        &self,
        space: &SpaceTable,
        id: &CellId,
        key: &Key,
        layers: &Layers,
    ) -> Result<Option<Entry>> {
        let _reading = self.index_gc.read();
        let entries: u64 = layers.iter().map(|l| u64::from(l.disk.count)).sum();
        let loaded_bytes = entries * BASE_ENTRY_BYTES as u64;
        if !self.table.load_fits(loaded_bytes) {
            return self.lookup_layers(space, id, key, layers);
        }
        let (entries, loaded) = self.index.load_layers(space.key_len(), layers)?;
        let found = entries
            .binary_search_by(|(k, _)| k.cmp(key))
            .ok()
            .map(|i| entries[i].1);
        let entries = Arc::new(entries);
        space.with_cell(id, |cell| {
            self.table
                .account(cell.install_base(&loaded, entries) as isize)
        });
        Metrics::add(&self.metrics.counters().cell_loads, 1);
        Ok(found)
    }

    /// The newest entry of `key` in the on-disk `layers` of cell `id`
    /// (a tombstone if deleted there), without loading the cell. Bloom
    /// filters read on the way are kept in the cell. The caller holds the
    /// index-GC read lock.
    pub(crate) fn lookup_layers(
        &self,
        space: &SpaceTable,
        id: &CellId,
        key: &Key,
        layers: &[Layer],
    ) -> Result<Option<Entry>> {
        let found = self
            .index
            .lookup_layers(space.key_len(), layers, key, |count| {
                space.rank_guess(id, key, count)
            })?;
        if !found.blooms.is_empty() {
            space.with_cell(id, |cell| {
                for (disk, bloom) in found.blooms {
                    self.table.account(cell.install_bloom(disk, bloom) as isize);
                }
            });
        }
        let counters = &self.metrics.counters();
        if found.searched == 0 {
            Metrics::add(&counters.bloom_negatives, 1);
        } else {
            Metrics::add(&counters.disk_lookups, 1);
            Metrics::add(&counters.disk_lookup_blobs, u64::from(found.searched));
            Metrics::add(&counters.disk_lookup_reads, u64::from(found.reads));
        }
        Ok(found.entry)
    }

    /// The live value of `key`. If relocation deleted the value's segment
    /// between the lookup and the read, the index already points at the
    /// copy: look again.
    pub fn get_value(&self, space: &SpaceTable, key: &Key) -> Result<Option<Bytes>> {
        Ok(self.get_entry_value(space, key)?.map(|(value, _)| value))
    }

    /// The live value of `key` and the entry that points at it.
    pub fn get_entry_value(&self, space: &SpaceTable, key: &Key) -> Result<Option<(Bytes, Entry)>> {
        for _ in 0..LOOKUP_ATTEMPTS {
            let Some(entry) = self.lookup(space, key)? else {
                return Ok(None);
            };
            match self.read_value(space, key, &entry) {
                Err(Error::NoRecord(_)) => continue,
                result => return result.map(|value| Some((value, entry))),
            }
        }
        Err(Error::Corrupt {
            file: "value WAL".into(),
            position: WalPosition(0),
            detail: "the index keeps pointing at a missing segment".into(),
        })
    }

    /// [`Inner::get_entry_value`], asking `admit` with the value's stored
    /// length before each read; `None` if absent or refused.
    fn get_entry_value_admitted(
        &self,
        space: &SpaceTable,
        key: &Key,
        admit: &mut dyn FnMut(u64) -> bool,
    ) -> Result<Option<(Bytes, Entry)>> {
        for _ in 0..LOOKUP_ATTEMPTS {
            let Some(entry) = self.lookup(space, key)? else {
                return Ok(None);
            };
            if !admit(u64::from(entry.len)) {
                return Ok(None);
            }
            match self.read_value(space, key, &entry) {
                Err(Error::NoRecord(_)) => continue,
                result => return result.map(|value| Some((value, entry))),
            }
        }
        Err(Error::Corrupt {
            file: "value WAL".into(),
            position: WalPosition(0),
            detail: "the index keeps pointing at a missing segment".into(),
        })
    }

    /// [`Inner::get_entry_value`] from memory alone: `None` where it would
    /// wait (for the disk or a lock), or the value's segment just went (the
    /// waiting read looks again).
    pub fn get_entry_value_now(
        &self,
        space: &SpaceTable,
        key: &Key,
    ) -> Result<Option<Option<(Bytes, Entry)>>> {
        let Some(found) = self.lookup_now(space, key) else {
            return Ok(None);
        };
        let Some(entry) = found else {
            return Ok(Some(None));
        };
        match self.read_value_now(space, key, &entry) {
            Ok(Some(value)) => Ok(Some(Some((value, entry)))),
            Ok(None) | Err(Error::NoRecord(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads and verifies the value an entry points at; `NoRecord` if its
    /// segment is gone.
    pub fn read_value(&self, space: &SpaceTable, key: &Key, entry: &Entry) -> Result<Bytes> {
        self.read_value_with(space, key, entry, true)
            .map(|value| value.expect("a waiting read returns the value"))
    }

    /// [`Inner::read_value`] if the value is in memory (the value cache or
    /// the page cache); `Ok(None)` where reading it would wait for the disk.
    pub fn read_value_now(
        &self,
        space: &SpaceTable,
        key: &Key,
        entry: &Entry,
    ) -> Result<Option<Bytes>> {
        self.read_value_with(space, key, entry, false)
    }

    /// The first `n` bytes of the value an entry points at and its length
    /// (see [`Engine::get_head`]); `Ok(None)` if `wait` is false and that
    /// would wait for the disk.
    fn read_value_head(
        &self,
        space: &SpaceTable,
        key: &Key,
        entry: &Entry,
        n: usize,
        wait: bool,
    ) -> Result<Option<(Bytes, u64)>> {
        self.read_value_head_checked(space, key, entry, n, wait, true)
    }

    /// [`Inner::read_value_head`]; `checked` false never reads the whole
    /// value to check it (a small one otherwise is).
    fn read_value_head_checked(
        &self,
        space: &SpaceTable,
        key: &Key,
        entry: &Entry,
        n: usize,
        wait: bool,
        checked: bool,
    ) -> Result<Option<(Bytes, u64)>> {
        let head = |value: Bytes| {
            let len = value.len() as u64;
            (value.slice(..n.min(value.len())), len)
        };
        let len = entry.len as usize;
        if checked && (len <= HEAD_WHOLE_BYTES + n || self.cache.get(entry.location).is_some()) {
            return Ok(self.read_value_with(space, key, entry, wait)?.map(head));
        }
        let position = WalPosition(entry.location);
        let read = |want: usize| {
            if wait {
                self.values.read(position, want.min(len)).map(Some)
            } else {
                self.values.read_if_cached(position, want.min(len))
            }
        };
        let Some(mut bytes) = read(format::ITEM_HEADER_BYTES + MAX_KEY_BYTES + n)? else {
            return Ok(None);
        };
        let corrupt = |detail: String| Error::Corrupt {
            file: "value WAL".into(),
            position,
            detail,
        };
        let span = format::item_span(&bytes).map_err(|m| corrupt(m.0))?;
        let need = span.value_at + n.min(span.value_len);
        if span.len() != len || span.op != Op::Put {
            return Err(corrupt("the index points at another item".into()));
        }
        if bytes.len() < need {
            // A long metadata block before the key.
            bytes = match read(need)? {
                Some(bytes) => bytes,
                None => return Ok(None),
            };
        }
        if bytes[span.key_at..span.key_at + span.key_len] != key[..space.key_len()] {
            return Err(corrupt("the index points at another item".into()));
        }
        Metrics::add(&self.metrics.counters().cache_misses, 1);
        let prefix = Bytes::from(bytes[span.value_at..need].to_vec());
        Ok(Some((prefix, span.value_len as u64)))
    }

    fn read_value_with(
        &self,
        space: &SpaceTable,
        key: &Key,
        entry: &Entry,
        wait: bool,
    ) -> Result<Option<Bytes>> {
        let counters = &self.metrics.counters();
        if let Some(value) = self.cache.get(entry.location) {
            Metrics::add(&counters.cache_hits, 1);
            return Ok(Some(value));
        }
        let position = WalPosition(entry.location);
        let bytes = if wait {
            self.values.read(position, entry.len as usize)?
        } else {
            match self.values.read_if_cached(position, entry.len as usize)? {
                Some(bytes) => bytes,
                // Counted as a miss by the waiting read that follows.
                None => return Ok(None),
            }
        };
        Metrics::add(&counters.cache_misses, 1);
        let corrupt = |detail: String| Error::Corrupt {
            file: "value WAL".into(),
            position,
            detail,
        };
        let item = format::decode_item(position, &bytes).map_err(|m| corrupt(m.0))?;
        if item.key != &key[..space.key_len()] || item.op != Op::Put {
            return Err(corrupt("the index points at another item".into()));
        }
        // The value is the end of the item.
        let value_end = item.len;
        let value_start = value_end - item.value.len();
        let value = crate::buffers::freeze(bytes).slice(value_start..value_end);
        self.cache.insert(entry.location, value.clone());
        Ok(Some(value))
    }
}
