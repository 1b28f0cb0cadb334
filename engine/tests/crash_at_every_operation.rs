//! Crash consistency: run a workload on the fault-injecting storage, make
//! the N-th storage operation (create, write, sync, rename, remove) fail —
//! the machine "crashes" there — for every N the workload reaches, then
//! reboot with torn unsynced sectors and reopen. The recovered store must
//! equal the model after some prefix of the workload that includes every
//! write acknowledged as `Synced` (after a power loss) or every acknowledged
//! write (after a process crash): batches all-or-nothing, every key its old
//! or new value, nothing corrupt. A crash during recovery itself must not
//! change that.
//!
//! Prints its seed; replay with `CRASH_SEED=<seed>`.

mod support;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::open;
use support::workload::{Op, assert_prefix, read_state, run, workload};
use tidepool_engine::storage::FaultStorage;
use tidepool_engine::{Config, Durability};

/// What the workload achieved before the crash.
struct Outcome {
    /// Operations that returned `Ok`.
    acked: usize,
    /// Index of the last operation acknowledged as `Synced`, plus one.
    synced_prefix: usize,
    /// Operations started (the failing one may or may not be stored).
    attempted: usize,
}

fn run_until_crash(
    storage: &FaultStorage,
    config: &Config,
    ops: &[(Op, Durability)],
    crash_at: u64,
) -> Outcome {
    let engine = open(storage, config).expect("open before the crash");
    storage.crash_at_op(storage.ops() + crash_at);
    let mut outcome = Outcome {
        acked: 0,
        synced_prefix: 0,
        attempted: 0,
    };
    for (i, (op, durability)) in ops.iter().enumerate() {
        outcome.attempted = i + 1;
        if run(&engine, op, *durability).is_err() {
            break;
        }
        outcome.acked = i + 1;
        if *durability == Durability::Synced {
            outcome.synced_prefix = i + 1;
        }
    }
    drop(engine);
    outcome
}

#[test]
fn every_crash_point_recovers_a_prefix_with_all_acknowledged_writes() {
    let seed = tidepool_testkit::seed_from_env("CRASH_SEED");
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut config = Config::for_tests("/db");
    // Keep background timers slow so most storage operations come from the
    // workload itself and each crash point hits a different place.
    config.snapshot_interval_ms = 20;
    config.sync_interval_ms = 2;
    let ops = workload(&mut rng, 200);

    // How many storage operations a whole run takes.
    let probe = FaultStorage::default();
    let full = run_until_crash(&probe, &config, &ops, u64::MAX / 2);
    assert_eq!(full.acked, ops.len());
    let total_ops = probe.ops();
    let mut crash_points = 0;
    for crash_at in 1..=total_ops {
        let storage = FaultStorage::default();
        let outcome = run_until_crash(&storage, &config, &ops, crash_at);
        crash_points += 1;
        let context = format!("seed {seed}, crash at op {crash_at}");

        let after_kill = storage.restart_process();
        let engine = open(&after_kill, &config)
            .unwrap_or_else(|e| panic!("{context}: reopen after kill: {e}"));
        let state = read_state(&engine, &context);
        assert_prefix(
            &ops,
            &state,
            outcome.acked,
            outcome.attempted,
            &format!("{context} (process crash)"),
        );
        drop(engine);

        let reboot_seed = rng.random::<u64>();
        let rebooted = storage.reboot(reboot_seed);
        // Half the time, crash recovery itself too, then reboot again.
        let rebooted = if rng.random_bool(0.5) {
            rebooted.crash_at_op(rng.random_range(1..12));
            drop(open(&rebooted, &config));
            rebooted.reboot(reboot_seed ^ 1)
        } else {
            rebooted
        };
        let context = format!("{context}, reboot seed {reboot_seed}");
        let engine = open(&rebooted, &config)
            .unwrap_or_else(|e| panic!("{context}: reopen after power loss: {e}"));
        let state = read_state(&engine, &context);
        assert_prefix(
            &ops,
            &state,
            outcome.synced_prefix,
            outcome.attempted,
            &format!("{context} (power loss)"),
        );
        engine.close().unwrap();
    }
    println!(
        "seed {seed}: {crash_points} crash points over {} operations",
        ops.len()
    );
    assert!(
        crash_points > 50,
        "the workload must reach many storage operations"
    );
}
