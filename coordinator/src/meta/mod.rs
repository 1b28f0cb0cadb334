//! Metadata storage behind one trait, [`MetaStore`]: etcd in production
//! ([`EtcdStore`]), an embedded store for the single-process dev mode
//! ([`EmbeddedStore`]). Both pass the same conformance suite
//! (`coordinator/tests/metastore_conformance.rs`).
//!
//! The model is etcd's, reduced to what the coordinator needs: string keys
//! with byte values; one store-wide revision bumped by every change, each
//! key remembering the revision that last modified it; transactions that
//! apply a list of puts and deletes only if every comparison holds (the
//! compare-and-swap every cluster-map change goes through); leases whose
//! expiry deletes the keys attached to them (node liveness, leader
//! election); and watches that deliver every change under a prefix from a
//! revision on, in order.

mod embedded;
mod etcd;

use std::time::Duration;

pub use embedded::EmbeddedStore;
pub use etcd::EtcdStore;
use tokio::sync::mpsc;

/// Errors of a metadata store.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// The store could not be reached or failed the request.
    #[error("metadata store unavailable: {0}")]
    Unavailable(String),
    /// A watch asked for history that is no longer kept.
    #[error("revision {requested} is compacted (history starts at {oldest})")]
    Compacted {
        /// The revision asked for.
        requested: u64,
        /// The oldest revision still available.
        oldest: u64,
    },
    /// The embedded store's file could not be read or written.
    #[error("metadata file {path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
}

/// Result of metadata operations.
pub type MetaResult<T> = std::result::Result<T, MetaError>;

/// A lease: keys attached to it are deleted when it expires.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

/// A stored key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: String,
    /// Its value.
    pub value: Vec<u8>,
    /// Revision of the change that created it (since its last deletion).
    pub create_revision: u64,
    /// Revision of the change that last modified it.
    pub mod_revision: u64,
    /// The lease it is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// A condition of a transaction.
#[derive(Clone, Debug)]
pub enum Compare {
    /// The key does not exist.
    Absent(String),
    /// The key exists and was last modified at this revision.
    ModRevision(String, u64),
    /// The key exists with this value.
    Value(String, Vec<u8>),
}

/// A change in a transaction.
#[derive(Clone, Debug)]
pub enum Op {
    /// Create or replace a key, optionally attached to a lease.
    Put {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
        /// The lease, if any.
        lease: Option<LeaseId>,
    },
    /// Delete a key (nothing if absent).
    Delete {
        /// The key.
        key: String,
    },
}

/// What a transaction did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnOutcome {
    /// Whether every comparison held (and the ops were applied).
    pub succeeded: bool,
    /// The store's revision after the transaction.
    pub revision: u64,
}

/// One change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was created or replaced.
    Put(KeyValue),
    /// A key was deleted (explicitly or by lease expiry).
    Delete {
        /// The key.
        key: String,
        /// Revision of the deletion.
        mod_revision: u64,
    },
}

impl WatchEvent {
    /// Revision of the change.
    pub fn revision(&self) -> u64 {
        match self {
            WatchEvent::Put(kv) => kv.mod_revision,
            WatchEvent::Delete { mod_revision, .. } => *mod_revision,
        }
    }

    /// The key changed.
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }
}

/// Where cluster metadata lives.
#[tonic::async_trait]
pub trait MetaStore: Send + Sync + 'static {
    /// One key.
    async fn get(&self, key: &str) -> MetaResult<Option<KeyValue>>;

    /// Every key starting with `prefix`, in key order.
    async fn list(&self, prefix: &str) -> MetaResult<Vec<KeyValue>>;

    /// Applies `ops` atomically if every comparison holds.
    async fn txn(&self, compares: Vec<Compare>, ops: Vec<Op>) -> MetaResult<TxnOutcome>;

    /// A new lease that expires `ttl` after its last keep-alive.
    async fn grant_lease(&self, ttl: Duration) -> MetaResult<LeaseId>;

    /// Renews a lease; `false` if it has expired or never existed.
    async fn keep_alive(&self, lease: LeaseId) -> MetaResult<bool>;

    /// Ends a lease now, deleting its keys.
    async fn revoke(&self, lease: LeaseId) -> MetaResult<()>;

    /// Every change under `prefix` with a revision of at least
    /// `from_revision` (0: from now), in revision order. The channel closes
    /// if the watch breaks (the caller re-watches from the revision after
    /// the last event it saw).
    async fn watch(
        &self,
        prefix: &str,
        from_revision: u64,
    ) -> MetaResult<mpsc::Receiver<WatchEvent>>;

    /// Puts one key unconditionally; returns the new revision.
    async fn put(&self, key: &str, value: Vec<u8>) -> MetaResult<u64> {
        let op = Op::Put {
            key: key.to_string(),
            value,
            lease: None,
        };
        Ok(self.txn(Vec::new(), vec![op]).await?.revision)
    }

    /// Deletes one key; returns the new revision.
    async fn delete(&self, key: &str) -> MetaResult<u64> {
        let op = Op::Delete {
            key: key.to_string(),
        };
        Ok(self.txn(Vec::new(), vec![op]).await?.revision)
    }
}
