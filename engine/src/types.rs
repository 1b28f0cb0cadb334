//! Newtypes for positions, ids and epochs, and the durability parameter.

use std::fmt;

/// Largest key the engine accepts, in bytes. Each key space fixes its own
/// key length at or below this.
pub const MAX_KEY_BYTES: usize = 32;

/// A byte offset in a write-ahead log (value WAL or index log), counted
/// across segments: segment `n` holds positions `[n * S, (n + 1) * S)` for
/// segment size `S`. Positions only grow, so a larger position is a later
/// write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct WalPosition(pub u64);

impl WalPosition {
    /// The position `bytes` further on.
    pub fn plus(self, bytes: u64) -> WalPosition {
        WalPosition(self.0 + bytes)
    }
}

impl fmt::Display for WalPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "@{}", self.0)
    }
}

/// The number of a WAL segment file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentId(pub u64);

impl fmt::Display for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "segment {:016x}", self.0)
    }
}

/// A retention epoch. Every WAL segment belongs to the epoch that was
/// current when it was started, and every stored entry carries the epoch of
/// its last write or touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Epoch(pub u32);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "epoch {}", self.0)
    }
}

/// An application-defined label stored with every entry (the node stores
/// the namespace id here). Epoch drops apply per tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Tag(pub u32);

/// Handle of a key space, obtained from [`crate::Engine::key_space`]. The
/// default is the first configured key space.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KeySpace(pub(crate) u8);

impl KeySpace {
    /// The key space's index in the configuration.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

/// How durable a write must be before the call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Copied into the memory-mapped WAL and every earlier write too: survives
    /// a crash of the process, not of the kernel or the machine.
    Buffered,
    /// Also `fsync`ed: survives power loss.
    Synced,
}
