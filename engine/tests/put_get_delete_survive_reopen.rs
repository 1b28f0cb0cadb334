//! Puts, deletes and gets, on real files, across close/reopen and across a
//! drop without close (recovery replays the WAL).

use tidepool_engine::{Config, Durability, Engine};

fn key(i: u32) -> [u8; 32] {
    let mut k = [0u8; 32];
    // Spread keys over the whole hash space like real storage keys.
    k[..8].copy_from_slice(&(u64::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_be_bytes());
    k[8..12].copy_from_slice(&i.to_le_bytes());
    k
}

fn value(i: u32, round: u32) -> Vec<u8> {
    format!("value {i} round {round}")
        .into_bytes()
        .repeat(1 + (i as usize % 5))
}

#[test]
fn values_survive_close_and_crash_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::for_tests(dir.path());
    let engine = Engine::open(config.clone()).unwrap();
    let ks = engine.key_space("default").unwrap();
    for i in 0..2_000 {
        engine
            .put(ks, &key(i), &value(i, 0), Durability::Buffered)
            .unwrap();
    }
    for i in (0..2_000).step_by(3) {
        engine.delete(ks, &key(i), Durability::Buffered).unwrap();
    }
    let check = |engine: &Engine| {
        for i in 0..2_000 {
            let got = engine.get(ks, &key(i)).unwrap();
            if i % 3 == 0 {
                assert_eq!(got, None, "key {i} was deleted");
                assert!(!engine.exists(ks, &key(i)).unwrap());
            } else {
                assert_eq!(got.as_deref(), Some(&value(i, 0)[..]), "key {i}");
                assert!(engine.exists(ks, &key(i)).unwrap());
            }
        }
    };
    check(&engine);
    engine.close().unwrap();

    let engine = Engine::open(config.clone()).unwrap();
    check(&engine);
    for i in 0..500 {
        engine
            .put(ks, &key(i), &value(i, 1), Durability::Synced)
            .unwrap();
    }
    drop(engine); // no close: the next open replays

    let engine = Engine::open(config).unwrap();
    for i in 0..500 {
        assert_eq!(
            engine.get(ks, &key(i)).unwrap().as_deref(),
            Some(&value(i, 1)[..])
        );
    }
    let metrics = engine.metrics();
    assert!(metrics.counters.gets >= 500);
    engine.close().unwrap();
}

/// A read asked to admit its bytes first is told the value's stored length
/// before anything is read, and reads nothing when refused (a node takes
/// its in-flight budget so: refused reads allocate no value).
#[test]
fn an_admitted_read_asks_before_reading() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::for_tests(dir.path());
    config.value_cache_bytes = 0;
    let engine = Engine::open(config).unwrap();
    let ks = engine.key_space("default").unwrap();
    let big = vec![7u8; 10_000];
    engine.put(ks, &key(1), &big, Durability::Buffered).unwrap();
    let reads = |engine: &Engine| {
        let c = engine.metrics().counters;
        c.cache_hits + c.cache_misses
    };
    for now in [false, true] {
        let before = reads(&engine);
        let mut asked = Vec::new();
        let mut refuse = |len: u64| {
            asked.push(len);
            false
        };
        let got = if now {
            engine
                .get_stored_admitted_now(ks, &key(1), &mut refuse)
                .unwrap()
                .expect("in memory")
        } else {
            engine
                .get_stored_admitted(ks, &key(1), &mut refuse)
                .unwrap()
        };
        assert_eq!(got, None, "refused (now: {now})");
        assert_eq!(asked.len(), 1);
        assert!(asked[0] >= big.len() as u64, "{asked:?}");
        assert_eq!(reads(&engine), before, "nothing read when refused");
        let mut admit = |_: u64| true;
        let got = if now {
            engine
                .get_stored_admitted_now(ks, &key(1), &mut admit)
                .unwrap()
                .expect("in memory")
        } else {
            engine.get_stored_admitted(ks, &key(1), &mut admit).unwrap()
        };
        assert_eq!(got.expect("admitted").value, big);
        // Absent: not asked.
        let mut never = |_: u64| -> bool { panic!("asked for an absent key") };
        assert_eq!(
            engine.get_stored_admitted(ks, &key(2), &mut never).unwrap(),
            None
        );
    }
}
