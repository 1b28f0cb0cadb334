//! The node's error type.

/// Everything a node operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The storage engine failed.
    #[error(transparent)]
    Engine(#[from] tidepool_engine::Error),
    /// raft-rs refused an operation.
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    /// Bytes from disk or the network did not decode.
    #[error("malformed data: {0}")]
    Malformed(String),
    /// The replica failed earlier (its engine failed, or raft-rs gave up on
    /// it) and must be reopened.
    #[error("the replica failed and must be reopened: {0}")]
    Failed(String),
    /// A replica's files are gone (its directory deleted, or a volume no
    /// longer mounted under it): it is not opened empty in their place,
    /// since an empty replica would vote with a forgotten log.
    #[error("replica files missing: {0}")]
    FilesMissing(String),
    /// The configuration is invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// A network or server error.
    #[error("network: {0}")]
    Network(String),
}

/// The node's result type.
pub type Result<T, E = NodeError> = std::result::Result<T, E>;
