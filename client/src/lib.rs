//! The Tidepool Rust SDK: connects to a cluster, routes each key by hash to
//! its shard leader, retries across leader changes and stale maps, streams
//! large blobs in chunks and verifies content-addressed reads.
//!
//! What this crate is **not**: it embeds no storage and depends on neither the
//! engine nor the node; it speaks only the `tidepool.v1` wire contract.
//!
//! Status: not yet built (issue 8). [`Client::connect`] reports that.

pub use tidepool_proto as proto;

/// Errors of the SDK.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The capability is not built yet.
    #[error("the client SDK is not implemented yet")]
    NotYet,
}

/// A connection to a Tidepool cluster.
#[derive(Debug)]
pub struct Client {
    _private: (),
}

impl Client {
    /// Connects to the cluster through the given seed addresses. Not built
    /// yet: always fails.
    pub fn connect(_seeds: &[&str]) -> Result<Client, ClientError> {
        Err(ClientError::NotYet)
    }
}
