//! Tidepool's local storage engine: a WAL-as-store for fixed-size keys,
//! after the TideHunter design.
//!
//! Values are written once, into pre-allocated memory-mapped segments of a
//! write-ahead log that *is* the permanent store. A Large Table of cells
//! maps keys to WAL positions; dirty cells are flushed lazily into an
//! append-only index log; a control region snapshot says where every cell's
//! index is and where recovery replays from. Reads cost one small `pread`
//! (the index is in memory, or a few entries of its mapped log are read). See
//! `ARCHITECTURE.md` and `docs/design/` for the formats, the cell states, the
//! flush and recovery sequences, and why nothing acknowledged is lost.
//!
//! What this crate is **not**: it is not replicated, not networked and not
//! asynchronous. It runs on std threads, depends on no async runtime, RPC or
//! Raft crate, and keeps every `unsafe` block in [`storage`], the one I/O
//! seam (which has a fault-injecting twin for crash tests).
//!
//! # Example
//!
//! ```
//! use tidepool_engine::{Config, Durability, Engine};
//!
//! # fn main() -> Result<(), tidepool_engine::Error> {
//! let dir = tempfile::tempdir().expect("temp dir");
//! let engine = Engine::open(Config::for_tests(dir.path()))?;
//! let blobs = engine.key_space("default")?;
//! let key = [7u8; 32];
//! engine.put(blobs, &key, b"hello", Durability::Synced)?;
//! assert_eq!(engine.get(blobs, &key)?.as_deref(), Some(&b"hello"[..]));
//! assert!(engine.exists(blobs, &key)?);
//! engine.delete(blobs, &key, Durability::Buffered)?;
//! assert_eq!(engine.get(blobs, &key)?, None);
//! engine.close()?;
//! # Ok(())
//! # }
//! ```
//!
//! # Durability
//!
//! Every write names its [`Durability`]: `Buffered` returns once the record
//! (and every record before it) is copied into the mapped WAL — it survives
//! a crash of the process; `Synced` returns once it is `fsync`ed — it survives
//! power loss. [`Engine::wait_synced`] waits for any position. After a
//! failed write or `fsync` the engine is poisoned and refuses further I/O
//! until reopened.
//!
//! One engine at a time holds a directory (an `flock` on its `LOCK` file,
//! so also across processes): a second open gets [`Error::Locked`] until
//! the first is closed, dropped, or stopped with [`Engine::shutdown`]
//! (no final flush or snapshot — what a killed process leaves).
//!
//! # Reclaiming space
//!
//! [`Engine::relocate`] (and a background task, by policy) copies live
//! entries out of old segments and deletes the segments whole; a
//! [`RelocationFilter`] may drop entries on the way. Every segment belongs to
//! an [`Epoch`]; [`Engine::drop_epochs_below`] expires whole epochs by
//! deleting their files, keeping what the filter says and what was
//! [`Engine::touch`]ed since.
//!
//! # Replication
//!
//! [`Engine::append`], [`Engine::apply`] and [`Engine::read_record`] let a
//! Raft layer use the WAL as its log, so a replicated value reaches each
//! replica's disk once (see the `replication` module docs).

mod batch;
mod buffers;
mod cache;
mod checkpoint;
mod config;
mod control;
mod engine;
mod entry_update;
mod epochs;
mod error;
mod flush;
#[doc(hidden)]
pub mod fuzzing;
mod health;
mod index;
mod index_cleaning;
mod memory;
mod metrics;
pub mod pool;
mod recovery;
mod relocation;
mod replication;
mod scan;
mod snapshot;
pub mod storage;
mod striped;
mod table;
mod types;
mod wal;

pub use batch::WriteBatch;
pub use checkpoint::{
    Checkpoint, CheckpointFile, engine_exists, is_engine_file, remove_engine_files,
};
pub use config::{
    CellLayout, Config, DEFAULT_APPEND_PWRITE_MIN_BYTES, KeySpaceConfig, RecoveryMode,
};
pub use control::CONTROL_FILE;
pub use engine::{Engine, Stored, StoredHead};
pub use error::{Error, Result};
pub use memory::{Host, MemoryBudget};
pub use metrics::{CounterSnapshot, LatencySnapshot, MetricsSnapshot};
pub use pool::WorkerPool;
pub use relocation::{
    Decision, EntryInfo, KeepAll, RelocationFilter, RelocationReport, SegmentUsage, Strategy,
};
pub use replication::{
    AppStateSource, Appended, AppendedItem, ItemData, ItemInput, ItemOp, RecordData,
};
pub use scan::{Direction, Scan};
pub use table::cell::CellState;
pub use types::{Durability, Epoch, KeySpace, MAX_KEY_BYTES, SegmentId, Tag, WalPosition};
