//! Tidepool's local storage engine (being built in issue 3).

mod error;
mod health;
pub mod storage;
mod types;
mod wal;

pub use error::{Error, Result};
pub use types::{Durability, Epoch, KeySpace, MAX_KEY_BYTES, SegmentId, Tag, WalPosition};
