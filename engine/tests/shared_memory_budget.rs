//! Engines of one node share one memory budget (`MemoryBudget`): their
//! in-memory indexes together stay within its index limit; the cells an
//! engine keeps reading stay loaded while another engine's idle cells are
//! unloaded; and unflushed changes beyond the limit are flushed even when
//! no other rule would flush them yet.

use std::time::{Duration, Instant};

use tidepool_engine::storage::FileStorage;
use tidepool_engine::{Config, Durability, Engine, Host, MemoryBudget, WorkerPool};

const KEYS: u32 = 2_000;

fn key(engine: u8, i: u32) -> [u8; 32] {
    let mut key = [0u8; 32];
    // Spread over the cells: the first bytes pick a key's cell.
    key[..4].copy_from_slice(&i.wrapping_mul(0x9e37_79b9).to_be_bytes());
    key[4] = engine;
    key[5..9].copy_from_slice(&i.to_be_bytes());
    key
}

fn open(dir: &std::path::Path, host: &Host, configure: impl FnOnce(&mut Config)) -> Engine {
    let mut config = Config::for_tests(dir);
    // Ignored: the host's budget counts.
    config.index_memory_bytes = u64::MAX;
    configure(&mut config);
    Engine::open_in(config, std::sync::Arc::new(FileStorage::new()), host).unwrap()
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_hot_engine_keeps_its_cells_and_the_node_stays_within_its_index_limit() {
    let dir = tempfile::tempdir().unwrap();
    // One engine's loaded cells (about 130 KiB) and a little more.
    let limit = 160 << 10;
    let host = Host {
        pool: WorkerPool::new("budget-test", 4, 1).unwrap(),
        memory: MemoryBudget::new(limit, 0),
    };
    let hot = open(&dir.path().join("hot"), &host, |_| {});
    let cold = open(&dir.path().join("cold"), &host, |_| {});
    let space = hot.key_space("default").unwrap();
    for (n, engine) in [(0u8, &hot), (1, &cold)] {
        for i in 0..KEYS {
            engine
                .put(space, &key(n, i), &i.to_le_bytes(), Durability::Buffered)
                .unwrap();
        }
        engine.flush().unwrap();
    }
    // Both read in full, the cold one first: it loads all its cells, the
    // hot one what is left.
    for (n, engine) in [(1u8, &cold), (0, &hot)] {
        for i in 0..KEYS {
            assert_eq!(
                engine.get(space, &key(n, i)).unwrap().unwrap(),
                &i.to_le_bytes()[..]
            );
        }
    }
    // Then only the hot engine is read, round after maintenance round,
    // until all its cells are loaded.
    let all_loaded = |engine: &Engine| {
        let [empty, loaded, ..] = engine.metrics().cell_states;
        loaded == 64 - empty
    };
    let started = Instant::now();
    while !all_loaded(&hot) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the hot engine's cells stay unloaded: {:?}",
            hot.metrics().cell_states
        );
        for i in 0..KEYS {
            assert!(hot.get(space, &key(0, i)).unwrap().is_some());
        }
    }
    println!(
        "all the hot engine's cells loaded after {:?}",
        started.elapsed()
    );
    // Idle for a few rounds: whatever is over the limit goes.
    wait_until(
        "the node's indexes within the limit",
        Duration::from_secs(5),
        || host.memory.index_bytes() <= limit,
    );
    let (hot_bytes, cold_bytes) = (
        hot.metrics().index_memory_bytes,
        cold.metrics().index_memory_bytes,
    );
    println!(
        "limit {limit}: hot engine {hot_bytes} bytes, cold engine {cold_bytes} bytes, node {}",
        host.memory.index_bytes()
    );
    assert_eq!(host.memory.index_bytes(), hot_bytes + cold_bytes);
    // Every cell of the hot engine is loaded (the cold one keeps what
    // still fits beside them): room moved from the cold engine's idle
    // cells, which were loaded first, to the hot engine's.
    let [empty, loaded, dirty_loaded, unloaded, dirty_unloaded] = hot.metrics().cell_states;
    assert_eq!(
        (loaded, dirty_loaded, unloaded, dirty_unloaded),
        (64 - empty, 0, 0, 0),
        "the hot engine's cells"
    );
    assert!(
        hot_bytes > cold_bytes,
        "the hot engine should hold most of the budget: {hot_bytes} vs {cold_bytes}"
    );
    assert!(cold.metrics().counters.cell_unloads > 0);
    // Closing an engine gives its share back.
    drop(cold);
    assert_eq!(host.memory.index_bytes(), hot.metrics().index_memory_bytes);
}

#[test]
fn unflushed_changes_over_the_limit_are_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let limit = 64 << 10;
    let host = Host {
        pool: WorkerPool::new("budget-test", 4, 1).unwrap(),
        memory: MemoryBudget::new(limit, 0),
    };
    // Nothing else would flush: no change threshold, no replay bound.
    let configure = |config: &mut Config| {
        config.flush_dirty_entries = u32::MAX;
        config.max_replay_bytes = 1 << 40;
        config.wal_segment_bytes = 4 << 20;
    };
    let engines = [
        open(&dir.path().join("a"), &host, configure),
        open(&dir.path().join("b"), &host, configure),
    ];
    let space = engines[0].key_space("default").unwrap();
    for i in 0..KEYS {
        for (n, engine) in engines.iter().enumerate() {
            engine
                .put(space, &key(n as u8, i), b"v", Durability::Buffered)
                .unwrap();
        }
    }
    // Two engines of changes: several times the limit when written.
    wait_until(
        "the changes flushed down to the limit",
        Duration::from_secs(10),
        || host.memory.index_bytes() <= limit,
    );
    for (n, engine) in engines.iter().enumerate() {
        assert!(engine.metrics().counters.flushes > 0);
        for i in (0..KEYS).step_by(97) {
            assert_eq!(
                engine.get(space, &key(n as u8, i)).unwrap().unwrap(),
                &b"v"[..]
            );
        }
    }
}
