//! The engine's configuration: one struct, serde defaults, documented units,
//! checked by [`Config::validate`] at open.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::types::MAX_KEY_BYTES;

/// Most deltas a cell's base may have (the control file stores a cell's
/// layer count in one byte).
pub const MAX_INDEX_DELTAS: u32 = 64;

/// How a key space splits keys into cells.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum CellLayout {
    /// Keys are uniformly distributed (hashes): a fixed array of `cells`
    /// cells, each a contiguous range of the key's first 8 bytes.
    Uniform {
        /// Number of cells.
        cells: u32,
    },
    /// Keys start with a prefix of `prefix_bytes` bytes; each distinct
    /// prefix is one cell, cells are kept in a B-tree (ordered scans within
    /// and across prefixes), and the bytes after the prefix should be
    /// uniformly distributed for one-read lookups.
    Prefixed {
        /// Bytes of the prefix.
        prefix_bytes: u32,
    },
}

/// One key space: a separate index over keys of one fixed length. All key
/// spaces share the WAL.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySpaceConfig {
    /// Name, unique in the engine.
    pub name: String,
    /// Length of every key, 1 to 32 bytes.
    pub key_bytes: u32,
    /// How keys map to cells.
    pub layout: CellLayout,
}

/// What recovery does with a record that fails its checksum below the last
/// recorded durable position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryMode {
    /// Refuse to open with [`Error::Corrupt`]: the damage is in data that
    /// was acknowledged as durable, and an operator should decide.
    #[default]
    Strict,
    /// Cut the log at the damaged record and open (losing what follows).
    TruncateCorrupt,
}

/// Engine configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Directory that holds the engine's files.
    pub dir: PathBuf,
    /// Size of a value WAL segment file, bytes. Also bounds the largest
    /// record (a value or an atomic batch) to this minus 72 bytes.
    pub wal_segment_bytes: u64,
    /// Size of an index log segment file, bytes.
    pub index_segment_bytes: u64,
    /// Largest value accepted, bytes.
    pub max_value_bytes: u64,
    /// Segments each log keeps created and mapped ahead of need.
    pub spare_segments: u32,
    /// How often the syncer makes processed bytes durable without being
    /// asked, milliseconds.
    pub sync_interval_ms: u64,
    /// How often a control-region snapshot is written, milliseconds.
    pub snapshot_interval_ms: u64,
    /// Flusher tasks (index flushes that may run at once).
    pub flusher_threads: u32,
    /// A cell is queued for flushing once it holds this many unflushed
    /// changes.
    pub flush_dirty_entries: u32,
    /// Cells whose oldest unflushed change is more than this many bytes
    /// behind the WAL's end are flushed at the next snapshot, bounding how
    /// much recovery replays.
    pub max_replay_bytes: u64,
    /// Most delta blobs over a cell's base blob: a flush writes the cell's
    /// changes alone as a delta, unless the cell already has this many
    /// deltas or its deltas would hold `index_merge_ratio` times as many
    /// entries as its base — then it merges everything into a new base.
    /// 0 merges on every flush. A lookup of a cell not in memory checks up
    /// to this many bloom filters before the base's.
    pub index_max_deltas: u32,
    /// A flush merges once the deltas and the changes would hold this many
    /// times the base's entries (at least 1), each delete among the changes
    /// counting this many times. Each delta entry is written
    /// about `2 + 1/ratio` times over its life while the delta limit does
    /// not bind (docs/design/index-flush.md).
    pub index_merge_ratio: u32,
    /// Memory for the in-memory index (loaded cells, unflushed changes,
    /// bloom filters), bytes. Beyond it cells are unloaded and looked up on
    /// disk. An engine opened as one of a node's ([`crate::Engine::open_in`])
    /// uses the node's [`crate::MemoryBudget`] instead.
    pub index_memory_bytes: u64,
    /// Memory for the value cache, bytes (0 disables it); likewise replaced
    /// by the node's budget.
    pub value_cache_bytes: u64,
    /// Bytes of the most recently synced value WAL left to the kernel's
    /// page cache; `u64::MAX` (the default) leaves all of it to the kernel.
    /// Otherwise, once a sealed segment is synced and lies this far behind
    /// the synced watermark, the engine asks the kernel to drop its pages
    /// (`POSIX_FADV_DONTNEED`): new writes then reuse that memory instead
    /// of memory never touched before, which on virtual machines that back
    /// guest memory lazily costs several times the copy — but reads of
    /// older values go to the disk unless the value cache holds them. For
    /// hosts whose data is far larger than memory; see
    /// `docs/design/wal-format.md` for the measured trade-off.
    pub wal_cached_bytes: u64,
    /// Most entries read per optimistic index lookup (a lookup reads
    /// `3·sqrt(count) + 16` of a cell's `count`, up to this).
    pub lookup_window_entries: u32,
    /// Bloom filter bits per key.
    pub bloom_bits_per_key: u32,
    /// Recovery's answer to damaged acknowledged data.
    pub recovery: RecoveryMode,
    /// Whether the background relocation task runs.
    pub relocation_enabled: bool,
    /// How often background relocation takes a census and looks for
    /// segments to reclaim, milliseconds.
    pub relocation_interval_ms: u64,
    /// Background relocation reclaims a sealed segment once this fraction
    /// of it is garbage (0 to 1).
    pub relocation_garbage_ratio: f64,
    /// When the volume has fewer free bytes than this, relocation works
    /// harder: it uses `relocation_pressure_garbage_ratio` instead.
    pub relocation_pressure_free_bytes: u64,
    /// The garbage ratio used under disk pressure.
    pub relocation_pressure_garbage_ratio: f64,
    /// Bytes per second background relocation copies at most (0: no limit).
    pub relocation_bytes_per_sec: u64,
    /// Segments one background pass processes at most.
    pub relocation_segments_per_pass: u32,
    /// Keep every WAL segment from the moment the engine opens until the
    /// application first calls [`Engine::set_log_retention`](crate::Engine::set_log_retention).
    /// For a replication layer whose log is records appended and not yet
    /// applied ([`Engine::append`](crate::Engine::append)): until it has
    /// read its log back, nothing in the index refers to those records,
    /// so relocation would count their segments as garbage and delete
    /// them. Without it (the default) an engine keeps nothing extra.
    pub retain_log_until_set: bool,
    /// Snapshots keep the replay position the engine opened with until the
    /// application calls [`Engine::release_replay_hold`](crate::Engine::release_replay_hold).
    /// For a replication layer that applies committed records again after
    /// a restart from [`Engine::recovered_replay_from`](crate::Engine::recovered_replay_from):
    /// a snapshot written before it has (the engine's background one, a
    /// few seconds after opening) found no unflushed change, moved the
    /// replay position to the WAL's end with the old application state,
    /// and a crash then left those records' index changes out for good.
    pub hold_replay_until_released: bool,
    /// Records of [`Engine::append`](crate::Engine::append) at least this
    /// long are written to their segment with one `pwritev` instead of
    /// being copied into its mapping (0: never). A copy into a mapping
    /// makes the kernel zero-fill every fresh page before the copy
    /// overwrites it, and takes a fault per page; a write of whole pages
    /// through the file does neither (`docs/design/wal-format.md`,
    /// "Large records through the file").
    pub append_pwrite_min_bytes: u64,
    /// The key spaces, in a fixed order: never remove or reorder one (new
    /// ones may be appended).
    pub key_spaces: Vec<KeySpaceConfig>,
}

/// Default of [`Config::append_pwrite_min_bytes`].
pub const DEFAULT_APPEND_PWRITE_MIN_BYTES: u64 = 32 << 10;

impl Default for Config {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("tidepool-data"),
            wal_segment_bytes: 256 << 20,
            index_segment_bytes: 64 << 20,
            max_value_bytes: 16 << 20,
            spare_segments: 2,
            sync_interval_ms: 100,
            snapshot_interval_ms: 5_000,
            flusher_threads: 1,
            flush_dirty_entries: 4_096,
            max_replay_bytes: 1 << 30,
            index_max_deltas: 32,
            index_merge_ratio: 2,
            index_memory_bytes: 1 << 30,
            value_cache_bytes: 256 << 20,
            wal_cached_bytes: u64::MAX,
            lookup_window_entries: 800,
            bloom_bits_per_key: 10,
            recovery: RecoveryMode::Strict,
            relocation_enabled: true,
            relocation_interval_ms: 30_000,
            relocation_garbage_ratio: 0.5,
            relocation_pressure_free_bytes: 10 << 30,
            relocation_pressure_garbage_ratio: 0.1,
            relocation_bytes_per_sec: 64 << 20,
            relocation_segments_per_pass: 8,
            retain_log_until_set: false,
            hold_replay_until_released: false,
            append_pwrite_min_bytes: DEFAULT_APPEND_PWRITE_MIN_BYTES,
            key_spaces: vec![KeySpaceConfig {
                name: "default".into(),
                key_bytes: 32,
                layout: CellLayout::Uniform { cells: 4_096 },
            }],
        }
    }
}

impl Config {
    /// The defaults, stored in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            ..Self::default()
        }
    }

    /// Small sizes that make tests cross segment, flush and unload
    /// boundaries quickly.
    pub fn for_tests(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            wal_segment_bytes: 64 << 10,
            index_segment_bytes: 64 << 10,
            max_value_bytes: 16 << 10,
            spare_segments: 1,
            sync_interval_ms: 5,
            snapshot_interval_ms: 50,
            flusher_threads: 2,
            flush_dirty_entries: 16,
            max_replay_bytes: 256 << 10,
            index_max_deltas: 3,
            index_merge_ratio: 1,
            index_memory_bytes: 256 << 10,
            value_cache_bytes: 64 << 10,
            wal_cached_bytes: 128 << 10,
            lookup_window_entries: 16,
            bloom_bits_per_key: 10,
            recovery: RecoveryMode::Strict,
            relocation_enabled: true,
            relocation_interval_ms: 100,
            relocation_garbage_ratio: 0.5,
            relocation_pressure_free_bytes: 0,
            relocation_pressure_garbage_ratio: 0.1,
            relocation_bytes_per_sec: 64 << 20,
            relocation_segments_per_pass: 8,
            retain_log_until_set: false,
            hold_replay_until_released: false,
            append_pwrite_min_bytes: DEFAULT_APPEND_PWRITE_MIN_BYTES,
            key_spaces: vec![
                KeySpaceConfig {
                    name: "default".into(),
                    key_bytes: 32,
                    layout: CellLayout::Uniform { cells: 64 },
                },
                KeySpaceConfig {
                    name: "prefixed".into(),
                    key_bytes: 16,
                    layout: CellLayout::Prefixed { prefix_bytes: 4 },
                },
            ],
        }
    }

    /// Checks every setting; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let fail = |message: String| Err(Error::Config(message));
        for (name, bytes) in [
            ("wal_segment_bytes", self.wal_segment_bytes),
            ("index_segment_bytes", self.index_segment_bytes),
        ] {
            if bytes < 4096 || bytes % 4096 != 0 {
                return fail(format!(
                    "{name} must be a multiple of 4096, at least 4096 (got {bytes})"
                ));
            }
        }
        if self.max_value_bytes == 0 || self.max_value_bytes + 4096 > self.wal_segment_bytes {
            return fail(format!(
                "max_value_bytes ({}) must be positive and at least 4096 below wal_segment_bytes ({})",
                self.max_value_bytes, self.wal_segment_bytes
            ));
        }
        if self.spare_segments == 0 || self.flusher_threads == 0 {
            return fail("spare_segments and flusher_threads must be at least 1".into());
        }
        if self.sync_interval_ms == 0 || self.snapshot_interval_ms == 0 {
            return fail("sync_interval_ms and snapshot_interval_ms must be at least 1".into());
        }
        if self.relocation_interval_ms == 0 || self.relocation_segments_per_pass == 0 {
            return fail(
                "relocation_interval_ms and relocation_segments_per_pass must be at least 1".into(),
            );
        }
        let ratios = [
            self.relocation_garbage_ratio,
            self.relocation_pressure_garbage_ratio,
        ];
        if ratios.iter().any(|r| !(0.0..=1.0).contains(r)) {
            return fail("relocation garbage ratios must be between 0 and 1".into());
        }
        if self.lookup_window_entries < 2
            || self.flush_dirty_entries == 0
            || self.bloom_bits_per_key == 0
            || self.index_merge_ratio == 0
        {
            return fail("lookup_window_entries must be at least 2; flush_dirty_entries, bloom_bits_per_key and index_merge_ratio at least 1".into());
        }
        if self.index_max_deltas > MAX_INDEX_DELTAS {
            return fail(format!(
                "index_max_deltas must be at most {MAX_INDEX_DELTAS} (got {})",
                self.index_max_deltas
            ));
        }
        self.validate_key_spaces()
    }

    fn validate_key_spaces(&self) -> Result<()> {
        let fail = |message: String| Err(Error::Config(message));
        if self.key_spaces.is_empty() || self.key_spaces.len() > 255 {
            return fail(format!(
                "between 1 and 255 key spaces are required, got {}",
                self.key_spaces.len()
            ));
        }
        for (i, space) in self.key_spaces.iter().enumerate() {
            if space.name.is_empty() || self.key_spaces[..i].iter().any(|s| s.name == space.name) {
                return fail(format!(
                    "key space names must be non-empty and unique: {:?}",
                    space.name
                ));
            }
            if space.key_bytes == 0 || space.key_bytes as usize > MAX_KEY_BYTES {
                return fail(format!(
                    "key space {:?}: key_bytes must be 1 to {MAX_KEY_BYTES}",
                    space.name
                ));
            }
            match space.layout {
                CellLayout::Uniform { cells } if cells == 0 || cells > 1 << 24 => {
                    return fail(format!(
                        "key space {:?}: cells must be 1 to 2^24",
                        space.name
                    ));
                }
                CellLayout::Prefixed { prefix_bytes }
                    if prefix_bytes == 0 || prefix_bytes >= space.key_bytes =>
                {
                    return fail(format!(
                        "key space {:?}: prefix_bytes must be 1 to key_bytes - 1",
                        space.name
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_test_settings_are_valid() {
        Config::default().validate().unwrap();
        Config::for_tests("/tmp/x").validate().unwrap();
    }

    #[test]
    fn bad_settings_name_themselves() {
        let mut c = Config::for_tests("/x");
        c.wal_segment_bytes = 1000;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("wal_segment_bytes")
        );
        let mut c = Config::for_tests("/x");
        c.key_spaces[1].name = "default".into();
        assert!(c.validate().unwrap_err().to_string().contains("unique"));
        let mut c = Config::for_tests("/x");
        c.key_spaces[0].key_bytes = 33;
        assert!(c.validate().unwrap_err().to_string().contains("key_bytes"));
        let rejects = |change: fn(&mut Config), field: &str| {
            let mut c = Config::for_tests("/x");
            change(&mut c);
            assert!(
                c.validate().unwrap_err().to_string().contains(field),
                "{field}"
            );
        };
        rejects(
            |c| c.index_max_deltas = MAX_INDEX_DELTAS + 1,
            "index_max_deltas",
        );
        rejects(|c| c.index_merge_ratio = 0, "index_merge_ratio");
    }

    #[test]
    fn the_example_config_parses_and_is_valid() {
        let text = include_str!("../engine.example.json");
        let config: Config = serde_json::from_str(text).expect("example parses");
        config.validate().expect("example is valid");
    }
}
