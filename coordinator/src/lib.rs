//! The Tidepool coordinator: owns the cluster map (in etcd, or an embedded
//! store in dev mode), places shard replicas on nodes, keeps them placed as
//! nodes come and go, and drives epochs across the cluster.
//!
//! What this crate is **not**: it never stores or reads blobs and has no
//! dependency on the engine or the node; it talks to nodes over gRPC only.
//!
//! Status: being built (issue 7). Built: the metadata store ([`meta`]:
//! etcd and embedded, one conformance suite) and placement ([`placement`]).
//! Not yet: node registration, the reconciler, leadership, cluster-wide
//! epochs; [`serve`] reports that and fails.

pub mod meta;
pub mod placement;

/// Errors of the coordinator.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// The capability is not built yet.
    #[error("the coordinator is not implemented yet")]
    NotYet,
}

/// Runs a coordinator until shutdown. Not built yet: always fails.
pub fn serve() -> Result<(), CoordinatorError> {
    Err(CoordinatorError::NotYet)
}
