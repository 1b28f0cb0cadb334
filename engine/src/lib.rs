//! Tidepool's local storage engine (being built in issue 3).

mod batch;
mod cache;
mod config;
mod control;
mod engine;
mod error;
mod flush;
mod health;
mod index;
mod metrics;
mod recovery;
mod replication;
mod scan;
mod snapshot;
pub mod storage;
mod table;
mod types;
mod wal;

pub use batch::WriteBatch;
pub use config::{CellLayout, Config, KeySpaceConfig, RecoveryMode};
pub use engine::Engine;
pub use error::{Error, Result};
pub use metrics::{CounterSnapshot, LatencySnapshot, MetricsSnapshot};
pub use replication::{Appended, AppendedItem, ItemData, ItemInput, ItemOp, RecordData};
pub use scan::{Direction, Scan};
pub use table::cell::CellState;
pub use types::{Durability, Epoch, KeySpace, MAX_KEY_BYTES, SegmentId, Tag, WalPosition};
