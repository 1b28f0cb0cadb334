//! Helpers shared by the engine's integration tests.

#![allow(dead_code)]

pub mod shadow;
pub mod workload;

use std::sync::Arc;

use tidepool_engine::storage::{FaultStorage, Storage};
use tidepool_engine::{Config, Engine};

/// A 32-byte key spread over the hash space, unique per `i`.
pub fn key(i: u64) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    k[8..16].copy_from_slice(&i.to_le_bytes());
    k
}

/// A 16-byte key of the test config's prefixed key space: a 4-byte prefix
/// from a small set, then hash-like bytes.
pub fn prefixed_key(prefix: u32, i: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..4].copy_from_slice(&prefix.to_be_bytes());
    k[4..12].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    k[12..].copy_from_slice(&(i as u32).to_le_bytes());
    k
}

/// A value that names its key and version, of a length that varies.
pub fn value(key: u64, version: u64, len: usize) -> Vec<u8> {
    let mut v = format!("k{key}v{version}:").into_bytes();
    v.resize(len.max(v.len()), (key ^ version) as u8);
    v
}

/// Parses the version out of [`value`]'s output.
pub fn version_of(value: &[u8]) -> u64 {
    let text =
        std::str::from_utf8(&value[..value.iter().position(|&b| b == b':').expect("marker")])
            .expect("ascii");
    text.split('v')
        .nth(1)
        .expect("version")
        .parse()
        .expect("number")
}

/// The in-memory storage used by the model and crash tests, with its
/// engine directory.
pub fn fault_storage() -> (FaultStorage, Config) {
    (FaultStorage::default(), Config::for_tests("/db"))
}

/// Opens an engine on a fault storage.
pub fn open(storage: &FaultStorage, config: &Config) -> tidepool_engine::Result<Engine> {
    let storage: Arc<dyn Storage> = Arc::new(storage.clone());
    Engine::open_with_storage(config.clone(), storage)
}

#[allow(unused_imports)]
pub use tidepool_testkit::{on_block_device, process_read_bytes};
