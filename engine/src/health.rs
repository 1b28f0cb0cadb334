//! Poisoning: after one failed write or `fsync`, or a dead background task,
//! the engine refuses all further I/O until it is reopened — continuing could
//! acknowledge writes that will never be durable.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Shared poison flag of one engine.
#[derive(Debug, Default)]
pub(crate) struct Health {
    poisoned: AtomicBool,
    reason: Mutex<Option<String>>,
    closed: AtomicBool,
}

impl Health {
    /// Ok while healthy and open.
    pub fn check(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Acquire) {
            let reason = self.reason.lock().clone().unwrap_or_default();
            return Err(Error::Poisoned(reason));
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// Whether the engine is poisoned.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// Poisons the engine; the first reason is kept.
    pub fn poison(&self, reason: impl Into<String>) {
        let mut slot = self.reason.lock();
        if slot.is_none() {
            *slot = Some(reason.into());
        }
        self.poisoned.store(true, Ordering::Release);
    }

    /// Poisons with `error` as the reason and returns it — unless the error
    /// is a full disk, which only means nothing could be written (a file
    /// could not be created): nothing on disk is in doubt.
    pub fn poison_unless_full(&self, error: Error) -> Error {
        if matches!(error, Error::DiskFull(_)) {
            return error;
        }
        self.poison_with(error)
    }

    /// Poisons with `error` as the reason and returns it.
    pub fn poison_with(&self, error: Error) -> Error {
        self.poison(error.to_string());
        error
    }

    /// Marks the engine closed.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}
