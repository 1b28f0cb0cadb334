//! Tidepool's wire contract: the versioned gRPC API (protobuf package
//! `tidepool.v1`) and the few pure helpers every party must compute the same
//! way — the storage key of a blob, its position in the hash space, and the
//! error detail carried by every failed call.
//!
//! What this crate is **not**: it holds no server logic, no client retry
//! policy and no storage; it is the contract between the `client`, `node`
//! and `coordinator` crates, and depends on nothing of theirs.
//!
//! # Code generation
//!
//! The `.proto` files live in `proto/tidepool/v1/` and are compiled by
//! `tonic-prost-build` with the `protoc` binary from Debian's
//! `protobuf-compiler` package, installed by `make deps`. We chose the
//! packaged compiler over a pure-Rust one because it is the reference
//! implementation of the language (no risk of a second parser accepting a
//! different dialect), it costs nothing to compile on our 2-core builders,
//! and the same binary serves any other-language client we generate later.
//!
//! # Example
//!
//! ```
//! use tidepool_proto::{hash_position, storage_key};
//!
//! let key = storage_key(7, b"reports/2026/q3.pdf");
//! assert_eq!(key.len(), 32);
//! // The shard that owns the blob is the one whose range holds this value.
//! let _position: u64 = hash_position(&key);
//! ```

mod error;
mod keys;

/// What a node's version can apply, reported in `NodeStatus.capabilities`:
/// features whose Raft entries a node without them would refuse, so the
/// coordinator proposes them only when the node of every replica of the
/// shard reports them (a rolling upgrade never makes an old node fail on
/// an entry it cannot read).
pub mod capabilities {
    /// Shard splits: the split entry (command kind 6) and the groups split
    /// off in the replicated state (app state version 5).
    pub const SPLIT: &str = "split";
    /// Retention in the shards: the retain entry (command kind 7) and the
    /// retentions in the replicated state (app state version 6).
    pub const RETAIN: &str = "retain";
    /// Every capability of this version.
    pub const ALL: &[&str] = &[SPLIT, RETAIN];
}

/// Generated types and services of `tidepool.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("tidepool.v1");
}

pub use error::{
    ERROR_DETAIL_TYPE_URL, ErrorInfo, error_detail, legacy_status_with_detail, status_with_detail,
};
pub use keys::{
    KEY_MAX_BYTES, NAMESPACE_NAME_MAX_BYTES, STORAGE_KEY_BYTES, StorageKey, even_shard_ranges,
    hash_position, quoted_namespace, storage_key, validate_namespace_name,
};
