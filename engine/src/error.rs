//! The engine's error type.

use std::path::PathBuf;

use crate::types::WalPosition;

/// Everything an engine call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A key of the wrong length for its key space.
    #[error("key is {got} bytes; key space {key_space:?} takes {expected}")]
    WrongKeyLength {
        /// The key space's name.
        key_space: String,
        /// The configured key length.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A value or record larger than the configured maximum.
    #[error("{what} of {got} bytes exceeds the maximum of {max} bytes")]
    TooLarge {
        /// What was too large ("value", "batch", "record").
        what: &'static str,
        /// Its size.
        got: u64,
        /// The limit.
        max: u64,
    },
    /// No key space of that name.
    #[error("no key space named {0:?}")]
    UnknownKeySpace(String),
    /// The configuration is invalid; the message says which setting.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The disk (or the injected quota) is full. Nothing was written.
    #[error("disk full: {0}")]
    DiskFull(String),
    /// An earlier write or `fsync` failed, or a background task died; the
    /// engine refuses all further I/O until it is reopened.
    #[error("engine is poisoned after an earlier failure: {0}")]
    Poisoned(String),
    /// The engine was closed.
    #[error("engine is closed")]
    Closed,
    /// Another open engine (in this process or another) holds the
    /// directory.
    #[error("engine directory in use: {0}")]
    Locked(String),
    /// Stored bytes failed their checksum or are malformed.
    #[error("corrupt data in {file} at {position}: {detail}")]
    Corrupt {
        /// File that holds the bad bytes.
        file: PathBuf,
        /// Where in the log (or file) the bad bytes start.
        position: WalPosition,
        /// What was wrong.
        detail: String,
    },
    /// The on-disk data does not match the configuration (different segment
    /// size, key spaces removed or changed).
    #[error("stored data does not match the configuration: {0}")]
    Incompatible(String),
    /// A position that holds no record (deleted segment, out of range).
    #[error("no record at {0}")]
    NoRecord(WalPosition),
    /// An I/O failure.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an I/O error, turning "no space left" into [`Error::DiskFull`].
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        let path = path.into();
        if is_disk_full(&source) {
            return Error::DiskFull(format!("{}: {source}", path.display()));
        }
        Error::Io { path, source }
    }
}

/// Whether an I/O error means the disk is full.
pub(crate) fn is_disk_full(error: &std::io::Error) -> bool {
    error.kind() == std::io::ErrorKind::StorageFull || error.raw_os_error() == Some(28)
}
