//! A Tidepool storage node: hosts shard replicas, each a raft-rs group whose
//! Raft log is the replica's engine WAL, and serves the client `BlobService`,
//! the node-to-node `RaftTransport` and the coordinator's `NodeAdmin` calls.
//!
//! What this crate is **not**: it does not decide placement (the coordinator
//! does, and this crate never depends on it) and it does not implement storage
//! formats (the `tidepool-engine` crate does).
//!
//! Status: the Raft log on the engine WAL (`raftlog`), the replica's Ready
//! loop (`replica`) and a simulated network for tests (`sim`) are built; the
//! transport, services and snapshots are being built (issue 6). [`serve`] reports that
//! and fails.

pub mod command;
mod error;
pub mod raftlog;
pub mod replica;
pub mod shard;
pub mod sim;
pub mod snapshot;
pub mod store;

pub use error::{NodeError, Result};

/// Runs a storage node until shutdown. Not built yet: always fails.
pub fn serve() -> Result<()> {
    Err(NodeError::NotYet)
}
