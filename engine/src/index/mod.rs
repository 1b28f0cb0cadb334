//! The on-disk index: fixed-size entries, per-cell blobs (a base and the
//! deltas over it) with bloom filters, and the optimistic lookup that
//! reads them.

pub(crate) mod blob;
pub(crate) mod bloom;
pub(crate) mod entry;
pub(crate) mod layers;
pub(crate) mod lookup;
pub(crate) mod store;
