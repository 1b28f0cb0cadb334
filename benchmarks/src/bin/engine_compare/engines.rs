//! The engines `engine-compare` drives, behind one trait: Tidepool's
//! engine, and RocksDB (leveled) or BlobDB through the `rocksdb` crate,
//! each opened with its settings described for the results.

use std::path::{Path, PathBuf};

use anyhow::Context;
use tidepool_engine::{CellLayout, Config, Durability, Engine, KeySpace, KeySpaceConfig, Strategy};

/// What the benchmark needs of an engine.
pub trait KvEngine: Send + Sync {
    fn put(&self, key: &[u8; 32], value: &[u8]);
    fn delete(&self, key: &[u8; 32]);
    fn get(&self, key: &[u8; 32]) -> Option<usize>;
    fn exists(&self, key: &[u8; 32]) -> bool;
    /// The largest key smaller than `key`, and its value's length.
    fn last_before(&self, key: &[u8; 32]) -> Option<([u8; 32], usize)>;
    /// Makes what was written reach the engine's files (index flushed,
    /// memtables flushed).
    fn finish(&self);
    /// Reclaims the space of deleted entries.
    fn reclaim(&self);
    /// Engine counters worth printing with a phase, as a string.
    fn detail(&self) -> String {
        String::new()
    }
    /// Bytes the engine itself has written since it opened, where it
    /// counts them: (value log, index). Splits a phase's write
    /// amplification into its parts.
    fn written(&self) -> Option<(u64, u64)> {
        None
    }
}

struct Tidepool {
    engine: Engine,
    space: KeySpace,
    dir: PathBuf,
}

impl KvEngine for Tidepool {
    fn put(&self, key: &[u8; 32], value: &[u8]) {
        self.engine
            .put(self.space, key, value, Durability::Buffered)
            .expect("tidepool put");
    }
    fn delete(&self, key: &[u8; 32]) {
        self.engine
            .delete(self.space, key, Durability::Buffered)
            .expect("tidepool delete");
    }
    fn get(&self, key: &[u8; 32]) -> Option<usize> {
        self.engine
            .get(self.space, key)
            .expect("tidepool get")
            .map(|v| v.len())
    }
    fn exists(&self, key: &[u8; 32]) -> bool {
        self.engine
            .exists(self.space, key)
            .expect("tidepool exists")
    }
    fn last_before(&self, key: &[u8; 32]) -> Option<([u8; 32], usize)> {
        self.engine
            .last_before(self.space, key)
            .expect("tidepool last_before")
            .map(|(k, v)| (k.try_into().expect("32-byte key"), v.len()))
    }
    fn finish(&self) {
        self.engine.flush().expect("tidepool flush");
    }
    fn reclaim(&self) {
        let below = self.engine.processed_position();
        self.engine
            .relocate(Strategy::Index { below })
            .expect("tidepool relocate");
    }
    fn written(&self) -> Option<(u64, u64)> {
        let c = self.engine.metrics().counters;
        Some((c.wal_bytes_written, c.index_bytes_written))
    }
    fn detail(&self) -> String {
        let c = self.engine.metrics().counters;
        format!(
            "written: wal {} MiB, index {} MiB ({} flushes, {} deltas, {} blobs moved by cleaning); files: wal {} MiB, index {} MiB; cache hits {} misses {}, disk lookups {} ({} blobs, {} reads), bloom negatives {}, cell loads {} unloads {}",
            c.wal_bytes_written >> 20,
            c.index_bytes_written >> 20,
            c.flushes,
            c.delta_flushes,
            c.index_blobs_moved,
            crate::dir_bytes(&self.dir.join("wal")) >> 20,
            crate::dir_bytes(&self.dir.join("index")) >> 20,
            c.cache_hits,
            c.cache_misses,
            c.disk_lookups,
            c.disk_lookup_blobs,
            c.disk_lookup_reads,
            c.bloom_negatives,
            c.cell_loads,
            c.cell_unloads
        )
    }
}

struct Rocks {
    db: rocksdb::DB,
    write: rocksdb::WriteOptions,
    blob: bool,
}

impl KvEngine for Rocks {
    fn put(&self, key: &[u8; 32], value: &[u8]) {
        self.db
            .put_opt(key, value, &self.write)
            .expect("rocksdb put");
    }
    fn delete(&self, key: &[u8; 32]) {
        self.db
            .delete_opt(key, &self.write)
            .expect("rocksdb delete");
    }
    fn get(&self, key: &[u8; 32]) -> Option<usize> {
        self.db
            .get_pinned(key)
            .expect("rocksdb get")
            .map(|v| v.len())
    }
    fn exists(&self, key: &[u8; 32]) -> bool {
        // What a blob store's "exists" must be: exact (a bloom filter's
        // "maybe" is checked by a read).
        self.db.get_pinned(key).expect("rocksdb get").is_some()
    }
    fn last_before(&self, key: &[u8; 32]) -> Option<([u8; 32], usize)> {
        let mut iter = self.db.raw_iterator();
        iter.seek_for_prev(key);
        if iter.valid() && iter.key() == Some(&key[..]) {
            iter.prev();
        }
        if !iter.valid() {
            iter.status().expect("rocksdb iterator");
            return None;
        }
        let found = iter.key()?.try_into().expect("32-byte key");
        Some((found, iter.value()?.len()))
    }
    fn finish(&self) {
        self.db.flush().expect("rocksdb flush");
    }
    fn reclaim(&self) {
        if self.blob {
            // Every blob file is eligible for garbage collection during
            // this compaction.
            self.db
                .set_options(&[("blob_garbage_collection_age_cutoff", "1.0")])
                .expect("rocksdb set_options");
        }
        let mut options = rocksdb::CompactOptions::default();
        options.set_bottommost_level_compaction(rocksdb::BottommostLevelCompaction::Force);
        self.db
            .compact_range_opt(None::<&[u8]>, None::<&[u8]>, &options);
    }
}

pub fn open(
    name: &str,
    dir: &Path,
    memory: u64,
    value_bytes: usize,
) -> anyhow::Result<(Box<dyn KvEngine>, String)> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    match name {
        "tidepool" => {
            let mut config = Config::new(dir);
            config.wal_segment_bytes = 256 << 20;
            config.index_memory_bytes = memory * 3 / 4;
            config.value_cache_bytes = memory / 4;
            config.max_value_bytes = (value_bytes as u64).max(1 << 20);
            config.relocation_enabled = false;
            config.key_spaces = vec![KeySpaceConfig {
                name: "default".into(),
                key_bytes: 32,
                layout: CellLayout::Uniform { cells: 16_384 },
            }];
            let settings = format!(
                "WAL segments 256 MiB, index memory {} MiB, value cache {} MiB, 16384 cells, writes buffered (no fsync per write), background relocation off",
                config.index_memory_bytes >> 20,
                config.value_cache_bytes >> 20
            );
            let engine = Engine::open(config).context("open tidepool")?;
            let space = engine.key_space("default")?;
            Ok((
                Box::new(Tidepool {
                    engine,
                    space,
                    dir: dir.to_path_buf(),
                }),
                settings,
            ))
        }
        "rocksdb" | "blobdb" => {
            let mut options = rocksdb::Options::default();
            options.create_if_missing(true);
            options.increase_parallelism(2);
            let mut table = rocksdb::BlockBasedOptions::default();
            let cache = rocksdb::Cache::new_lru_cache((memory / 2) as usize);
            table.set_block_cache(&cache);
            table.set_bloom_filter(10.0, false);
            table.set_cache_index_and_filter_blocks(true);
            options.set_block_based_table_factory(&table);
            options.set_write_buffer_size((memory / 4) as usize);
            options.set_max_write_buffer_number(2);
            let blob = name == "blobdb";
            if blob {
                options.set_enable_blob_files(true);
                options.set_min_blob_size(512);
                options.set_enable_blob_gc(true);
            }
            let mut write = rocksdb::WriteOptions::default();
            write.set_sync(false);
            write.disable_wal(false);
            let settings = format!(
                "leveled, WAL on, no sync per write, bloom 10 bits/key, block cache {} MiB, 2 memtables of {} MiB, no compression{}",
                (memory / 2) >> 20,
                (memory / 4) >> 20,
                if blob {
                    ", blob files for values >= 512 B, blob GC on (age cutoff 0.25; 1.0 for the reclaim pass)"
                } else {
                    ""
                }
            );
            let db = rocksdb::DB::open(&options, dir).context("open rocksdb")?;
            Ok((Box::new(Rocks { db, write, blob }), settings))
        }
        other => anyhow::bail!("unknown engine {other:?} (tidepool, rocksdb, blobdb)"),
    }
}
