//! Opening an engine: create a fresh one, or recover: read the control
//! region, restore every cell as Unloaded (or Empty), replay the value WAL
//! from `replay_from` into the cells, cut the log at the first record that
//! is not valid, and resume writing in a fresh segment.
//!
//! Reads are served as soon as replay ends; cells load on demand.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use parking_lot::Mutex;

use crate::cache::EngineCache;
use crate::config::{Config, RecoveryMode};
use crate::control::{CONTROL_FILE, ControlData};
use crate::engine::{Engine, Inner};
use crate::error::{Error, Result};
use crate::health::Health;
use crate::index::entry::{Entry, key_array};
use crate::index::store::IndexStore;
use crate::memory::{Host, MemoryBudget};
use crate::metrics::Metrics;
use crate::pool::{Lane, Next, Task, WorkerPool, guarded};
use crate::storage::{Storage, read_whole_file, write_file_atomically};
use crate::table::cell::Cell;
use crate::table::{CellId, LargeTable};
use crate::types::{Epoch, SegmentId, WalPosition};
use crate::wal::format::{FLAG_APPLIED, FLAG_RELOCATED, Kind, Op, RecordView};
use crate::wal::replay::{self, Stop};
use crate::wal::segment::LogKind;
use crate::wal::{Log, LogOptions};

/// The epoch of a new engine.
const FIRST_EPOCH: Epoch = Epoch(1);

fn log_options(config: &Config, kind: LogKind, log_id: [u8; 16]) -> LogOptions {
    // The index log stays cached: lookups read its windows all the time.
    let (sub, segment_size, keep_cached_bytes) = match kind {
        LogKind::Values => (
            "wal",
            config.wal_segment_bytes,
            (config.wal_cached_bytes != u64::MAX).then_some(config.wal_cached_bytes),
        ),
        LogKind::Index => ("index", config.index_segment_bytes, None),
    };
    LogOptions {
        dir: config.dir.join(sub),
        kind,
        log_id,
        segment_size,
        spare_segments: config.spare_segments as usize,
        sync_interval: Duration::from_millis(config.sync_interval_ms),
        keep_cached_bytes,
        // Index lookups read a few entries of a window at a time: in place
        // through a mapping, not by copying whole windows with `pread`.
        mapped_reads: kind == LogKind::Index,
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

/// Opens or creates the engine described by `config` on `storage`.
pub(crate) fn open(
    config: Config,
    storage: Arc<dyn Storage>,
    host: Option<Host>,
) -> Result<Engine> {
    config.validate()?;
    let Host { pool, memory } = match host {
        Some(host) => host,
        None => Host {
            pool: WorkerPool::private(config.flusher_threads as usize)?,
            memory: MemoryBudget::new(config.index_memory_bytes, config.value_cache_bytes),
        },
    };
    for dir in [
        config.dir.clone(),
        config.dir.join("wal"),
        config.dir.join("index"),
    ] {
        storage.create_dir_all(&dir).map_err(io(&dir))?;
    }
    // Held until the engine is closed, shut down or dropped: two engines
    // writing one directory would delete and overwrite each other's files.
    let dir_lock = storage.lock(&config.dir).map_err(|e| {
        if e.kind() == std::io::ErrorKind::WouldBlock {
            Error::Locked(e.to_string())
        } else {
            Error::io(&config.dir, e)
        }
    })?;
    let control_path = config.dir.join(CONTROL_FILE);
    let control = match read_whole_file(&*storage, &control_path).map_err(io(&control_path))? {
        Some(bytes) => ControlData::decode(&bytes).map_err(|detail| Error::Corrupt {
            file: control_path.clone(),
            position: WalPosition(0),
            detail,
        })?,
        None => create_fresh(&config, &*storage)?,
    };
    check_compatible(&config, &control)?;
    let health = Arc::new(Health::default());
    let table = LargeTable::new(&config.key_spaces, memory.clone());
    let replay_positions = restore_cells(&table, &control);
    let index = open_index_log(&config, &storage, &health, &control, &pool)?;
    let mut recovered = Recovered::default();
    let values = recover_values(
        &config,
        &storage,
        &health,
        &control,
        &pool,
        |position, view| {
            replay_record(
                &table,
                &replay_positions,
                control.replay_from.0,
                position,
                view,
                &mut recovered,
            )
        },
    )?;
    let opened_at = values.processed().0;
    let cache = EngineCache::new(memory.cache().clone());
    let replay_hold = if config.hold_replay_until_released {
        control.replay_from.0
    } else {
        u64::MAX
    };
    let inner = Arc::new(Inner {
        storage,
        health,
        log_id: control.log_id,
        values,
        replay_hold: std::sync::atomic::AtomicU64::new(replay_hold),
        opened_at,
        index: IndexStore {
            log: index,
            bits_per_key: config.bloom_bits_per_key,
            window: config.lookup_window_entries as usize,
        },
        table,
        cache,
        metrics: Metrics::default(),
        app_state: Mutex::new(crate::replication::AppState::Bytes(
            control.app_state.clone(),
        )),
        last_snapshot: Mutex::new(Some(control)),
        index_gc: Default::default(),
        flush_queue: crate::flush::FlushQueue::new(),
        shutdown: AtomicBool::new(false),
        relocation: crate::relocation::RelocationState::new(config.retain_log_until_set),
        dir_lock: Mutex::new(Some(dir_lock)),
        config,
    });
    apply_touches(&inner, &recovered.touches)?;
    inner.table.account(recovered.memory_bytes as isize);
    let tasks = spawn_tasks(&inner, &pool);
    Ok(Engine {
        inner,
        tasks: Mutex::new(tasks),
    })
}

/// Writes the control region of a new, empty engine. The directory must not
/// hold log segments already (that would be data without its control file).
fn create_fresh(config: &Config, storage: &dyn Storage) -> Result<ControlData> {
    for sub in ["wal", "index"] {
        let dir = config.dir.join(sub);
        let names = storage.list(&dir).map_err(io(&dir))?;
        if !names.is_empty() {
            return Err(Error::Incompatible(format!(
                "{} holds {} files but there is no control file",
                dir.display(),
                names.len()
            )));
        }
    }
    let control = ControlData {
        log_id: rand::random(),
        wal_segment_bytes: config.wal_segment_bytes,
        index_segment_bytes: config.index_segment_bytes,
        epoch: FIRST_EPOCH,
        replay_from: WalPosition(0),
        synced: WalPosition(0),
        app_state: Vec::new(),
        spaces: Vec::new(),
    };
    let path = config.dir.join(CONTROL_FILE);
    write_file_atomically(storage, &path, &control.encode()).map_err(io(&path))?;
    Ok(control)
}

/// The stored data must match the configuration: same segment sizes, and
/// the stored key spaces first, unchanged, in order.
fn check_compatible(config: &Config, control: &ControlData) -> Result<()> {
    if control.wal_segment_bytes != config.wal_segment_bytes
        || control.index_segment_bytes != config.index_segment_bytes
    {
        return Err(Error::Incompatible(format!(
            "segment sizes are {}/{} bytes on disk but {}/{} in the configuration",
            control.wal_segment_bytes,
            control.index_segment_bytes,
            config.wal_segment_bytes,
            config.index_segment_bytes
        )));
    }
    for (i, stored) in control.spaces.iter().enumerate() {
        match config.key_spaces.get(i) {
            Some(configured) if *configured == stored.config => {}
            _ => {
                return Err(Error::Incompatible(format!(
                    "key space #{i} is {:?} on disk; key spaces cannot be removed, reordered or changed",
                    stored.config
                )));
            }
        }
    }
    Ok(())
}

/// Installs every stored cell (Unloaded, or Empty) and returns each cell's
/// replay position.
fn restore_cells(table: &LargeTable, control: &ControlData) -> HashMap<(usize, CellId), u64> {
    let mut positions = HashMap::new();
    for (space_index, space) in control.spaces.iter().enumerate() {
        let table_space = &table.spaces[space_index];
        for cell in &space.cells {
            table_space.with_cell_or_create(&cell.id, |c| {
                *c = Cell::restored(&cell.layers, usize::from(cell.base_blobs))
            });
            positions.insert((space_index, cell.id), cell.replay_from);
        }
    }
    positions
}

/// Opens the index log: every referenced blob must be in a readable
/// segment; unreadable files (unused spares) are removed by `Log::start`.
fn open_index_log(
    config: &Config,
    storage: &Arc<dyn Storage>,
    health: &Arc<Health>,
    control: &ControlData,
    pool: &WorkerPool,
) -> Result<Log> {
    let opts = log_options(config, LogKind::Index, control.log_id);
    let segments = replay::open_segments(&**storage, &opts)?;
    for (space, cell) in control
        .spaces
        .iter()
        .flat_map(|s| s.cells.iter().map(move |c| (s, c)))
    {
        if let Some(disk) = cell.layers.iter().find(|disk| {
            !segments
                .valid
                .contains_key(&SegmentId(disk.position.0 / opts.segment_size))
        }) {
            return Err(Error::Corrupt {
                file: opts.dir.clone(),
                position: disk.position,
                detail: format!(
                    "index of a cell of key space {:?} is in a missing segment",
                    space.config.name
                ),
            });
        }
    }
    let mut valid = segments.valid;
    // Writing resumes after the last segment the control file references:
    // later ones hold only blobs no snapshot uses (written after the last
    // one, or a previous open's fresh segment), which garbage collection
    // deletes anyway, and `Log::start` deletes them now. Before, every
    // open began a new segment after the last file: a process failing
    // soon after opening (a crash loop) added one per start, each with
    // its reserved blocks, until the disk filled.
    let next = control
        .index_segments()
        .last()
        .map_or(SegmentId(0), |id| SegmentId(id.0 + 1));
    // Unreadable index segments below `next` are garbage no snapshot uses.
    for (id, _) in &segments.unreadable {
        if *id < next {
            let path = crate::wal::segment::segment_path(&opts.dir, LogKind::Index, *id);
            storage.remove(&path).map_err(io(&path))?;
        }
    }
    valid.retain(|id, _| *id < next);
    Log::start(
        opts,
        storage.clone(),
        health.clone(),
        FIRST_EPOCH,
        next,
        valid,
        pool,
    )
}

/// Replays the value WAL from the control region's `replay_from`, cuts it at
/// the first invalid record, and starts writing after it.
fn recover_values(
    config: &Config,
    storage: &Arc<dyn Storage>,
    health: &Arc<Health>,
    control: &ControlData,
    pool: &WorkerPool,
    visit: impl FnMut(WalPosition, &RecordView<'_>) -> Result<()>,
) -> Result<Log> {
    let opts = log_options(config, LogKind::Values, control.log_id);
    let segments = replay::open_segments(&**storage, &opts)?;
    // A segment that starts below the replay position held data the index
    // points at (or that replay needs): unreadable, it is damage.
    let starts_below = |id: &SegmentId| id.0 * opts.segment_size < control.replay_from.0;
    if let Some((id, reason)) = segments.unreadable.iter().find(|(id, _)| starts_below(id)) {
        return Err(Error::Corrupt {
            file: opts.dir.clone(),
            position: WalPosition(id.0 * opts.segment_size),
            detail: format!("segment {id} is unreadable: {reason}"),
        });
    }
    let end = replay::replay(&opts, &segments.valid, control.replay_from, visit)?;
    // Damage to synced data must not pass for a torn tail: the snapshot's
    // watermark may be old, so also look for sync marks past the end.
    // Marks in a segment whose header is damaged count too: its records
    // are not a torn tail if a mark says they were durable.
    let mut scanned = segments.valid.clone();
    scanned.extend(
        segments
            .damaged
            .iter()
            .map(|(id, segment)| (*id, segment.clone())),
    );
    let marked = replay::scan_sync_marks(&opts, &scanned, end.end)?;
    let durable = control.synced.max(WalPosition(marked));
    if end.end < durable && config.recovery == RecoveryMode::Strict {
        let detail = match end.stop {
            Stop::Bad { detail } => detail,
            Stop::End => "the log ends early".to_string(),
        };
        return Err(Error::Corrupt {
            file: opts.dir.clone(),
            position: end.end,
            detail: format!("{detail}; the log was durable up to {durable}"),
        });
    }
    let next = replay::seal_tail(
        &**storage,
        &opts,
        &segments.valid,
        control.replay_from,
        end.end,
    )?;
    let existing: BTreeMap<_, _> = segments
        .valid
        .into_iter()
        .filter(|(id, _)| *id < next)
        .collect();
    let epoch = existing
        .values()
        .map(|s| s.epoch)
        .max()
        .unwrap_or(FIRST_EPOCH)
        .max(control.epoch);
    Log::start(
        opts,
        storage.clone(),
        health.clone(),
        epoch,
        next,
        existing,
        pool,
    )
}

/// What replay rebuilt.
#[derive(Debug, Default)]
struct Recovered {
    memory_bytes: usize,
    /// Touches found, in log order, applied once the engine is built.
    touches: Vec<Touch>,
}

/// A replayed touch: move the entry of `version` to `epoch`.
#[derive(Debug)]
struct Touch {
    space: u8,
    key: crate::index::entry::Key,
    version: u64,
    epoch: crate::types::Epoch,
    record: u64,
}

/// Applies replayed touches in log order, each only if the entry it named
/// is still the key's current one (a later write or delete wins). Applying
/// them after the rest of the replay gives the same result as in order:
/// every write after a touch supersedes the touched version either way.
fn apply_touches(inner: &Inner, touches: &[Touch]) -> Result<()> {
    for touch in touches {
        inner.update_entry(
            touch.space,
            &touch.key,
            touch.record,
            crate::entry_update::DiskAccess::Read,
            |now| {
                (now.version == touch.version && !now.tombstone()).then_some(Entry {
                    epoch: touch.epoch,
                    ..*now
                })
            },
        )?;
    }
    Ok(())
}

/// Applies one replayed record's items to the table: only records the
/// engine applied when writing them (not relocated copies, not records the
/// application applies itself), and only items at or after their cell's
/// replay position.
fn replay_record(
    table: &LargeTable,
    positions: &HashMap<(usize, CellId), u64>,
    default_position: u64,
    position: WalPosition,
    view: &RecordView<'_>,
    recovered: &mut Recovered,
) -> Result<()> {
    let flags = view.header.flags;
    if view.header.kind != Kind::Entry || flags & FLAG_APPLIED == 0 || flags & FLAG_RELOCATED != 0 {
        return Ok(());
    }
    for (offset, item) in view.items() {
        let location = position.0 + offset as u64;
        let corrupt = |detail: &str| Error::Corrupt {
            file: "value WAL".into(),
            position: WalPosition(location),
            detail: detail.to_string(),
        };
        let space_index = usize::from(item.key_space);
        let space = table
            .spaces
            .get(space_index)
            .ok_or_else(|| corrupt("item of an unknown key space"))?;
        if item.key.len() != space.key_len() {
            return Err(corrupt("item key of the wrong length for its key space"));
        }
        let key = key_array(item.key);
        let id = space.cell_of(&key);
        if position.0
            < *positions
                .get(&(space_index, id))
                .unwrap_or(&default_position)
        {
            continue;
        }
        if item.op == Op::Touch {
            recovered.touches.push(Touch {
                space: item.key_space,
                key,
                version: item.version,
                epoch: item.epoch,
                record: position.0,
            });
            continue;
        }
        let entry = Entry::of_item(location, &item);
        space.with_cell_or_create(&id, |cell| {
            recovered.memory_bytes += cell.apply(key, entry, position.0).unwrap_or(0);
        });
    }
    Ok(())
}

/// Registers the engine's background tasks with `pool`: maintenance,
/// relocation (on the pool's low-priority lane) and `flusher_threads`
/// flushers. A flusher is woken when a cell is queued for flushing.
fn spawn_tasks(inner: &Arc<Inner>, pool: &WorkerPool) -> Vec<Task> {
    let task = |lane, first, what, body: fn(&Inner) -> Next| {
        let inner = inner.clone();
        let health = inner.health.clone();
        pool.spawn(lane, first, guarded(health, what, move || body(&inner)))
    };
    let interval = Duration::from_millis(inner.config.snapshot_interval_ms);
    let mut tasks = vec![task(
        Lane::Normal,
        interval,
        "maintenance",
        crate::flush::run_maintenance,
    )];
    if inner.config.relocation_enabled {
        let interval = Duration::from_millis(inner.config.relocation_interval_ms);
        let mut state = crate::relocation::Relocator::new();
        let inner = inner.clone();
        let health = inner.health.clone();
        tasks.push(pool.spawn(
            Lane::Low,
            interval,
            guarded(health, "relocation", move || state.run(&inner)),
        ));
    }
    let mut wakers = Vec::new();
    for _ in 0..inner.config.flusher_threads {
        let flusher = task(
            Lane::Normal,
            crate::flush::FLUSHER_LOOK,
            "flusher",
            crate::flush::run_flusher,
        );
        wakers.push(flusher.waker());
        tasks.push(flusher);
    }
    inner.flush_queue.set_flushers(wakers);
    tasks
}
