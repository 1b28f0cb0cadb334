//! A Tidepool storage node: hosts shard replicas, each a raft-rs group whose
//! Raft log is the replica's engine WAL, and serves the client `BlobService`,
//! the node-to-node `RaftTransport` and the coordinator's `NodeAdmin` calls.
//!
//! What this crate is **not**: it does not decide placement (the coordinator
//! does, and this crate never depends on it) and it does not implement storage
//! formats (the `tidepool-engine` crate does).
//!
//! The map, bottom up: [`raftlog`] (the Raft log on the engine WAL),
//! [`replica`] (one raft-rs `RawNode` and the Ready checklist), [`snapshot`]
//! and [`store`] (snapshots as files, the replica's two engine slots),
//! [`session`] (client write sessions: exactly-once application),
//! [`shard`] (the owner task: group commit, ReadIndex batching), [`load`]
//! (a replica's requests a second, for splits by load),
//! [`server`] (the node: gRPC services, transport, metrics), [`sim`] (a
//! simulated network for tests). See `docs/design/replication.md`.
//!
//! ```no_run
//! # async fn run() -> tidepool_node::Result<()> {
//! let config = tidepool_node::config::NodeConfig::from_file("node.toml".as_ref())?;
//! let running = tidepool_node::server::start(config).await?;
//! println!("serving on {}", running.address);
//! running.stop().await
//! # }
//! ```

pub mod blob;
pub mod command;
pub mod config;
pub mod entry_context;
mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod load;
pub mod names;
pub mod raftlog;
pub mod replica;
pub mod server;
pub mod session;
pub mod shard;
pub mod sim;
pub mod snapshot;
pub mod store;
mod tracing_context;

pub use error::{NodeError, Result};
