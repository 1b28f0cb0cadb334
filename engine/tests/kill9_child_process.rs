//! `kill -9` with a real process: a child process writes on real files and
//! reports each acknowledged operation on stdout; the parent kills it with
//! SIGKILL at a random moment, reopens the engine and checks that the store
//! equals the workload after a prefix that includes every acknowledged
//! operation (a process crash loses nothing that was acknowledged, even
//! `Buffered`: the page cache outlives the process).
//!
//! Prints its seed; replay with `KILL9_SEED=<seed>`.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::workload::{assert_prefix, read_state, run, workload};
use tidepool_engine::{Config, Engine};

const CHILD_DIR: &str = "TIDEPOOL_KILL9_CHILD_DIR";
const CHILD_SEED: &str = "TIDEPOOL_KILL9_CHILD_SEED";
const OPS: usize = 50_000;

/// The child: runs the workload and prints `ack <n>` after each operation.
fn child(dir: &str, seed: u64) {
    let ops = workload(&mut SmallRng::seed_from_u64(seed), OPS);
    let engine = Engine::open(Config::for_tests(dir)).expect("child opens the engine");
    for (i, (op, durability)) in ops.iter().enumerate() {
        run(&engine, op, *durability).expect("child write");
        println!("ack {}", i + 1);
    }
    // Finished before the kill: wait for it.
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn acknowledged_writes_survive_sigkill() {
    if let (Ok(dir), Ok(seed)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_SEED)) {
        child(&dir, seed.parse().expect("seed"));
        return;
    }
    let seed = tidepool_testkit::seed_from_env("KILL9_SEED");
    let mut rng = SmallRng::seed_from_u64(seed);
    for round in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        let workload_seed: u64 = rng.random();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "acknowledged_writes_survive_sigkill",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, dir.path())
            .env(CHILD_SEED, workload_seed.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let kill_after = Duration::from_millis(rng.random_range(300..1_500));
        let mut acked = 0usize;
        // The kill timer starts at the first acknowledgement, so a slow
        // start (a loaded machine) does not leave nothing to check.
        for line in lines.by_ref() {
            if let Some(n) = line.unwrap().strip_prefix("ack ") {
                acked = n.parse().unwrap();
                break;
            }
        }
        let started = Instant::now();
        // Read acknowledgements until it is time to kill.
        while started.elapsed() < kill_after {
            match lines.next() {
                Some(line) => {
                    if let Some(n) = line.unwrap().strip_prefix("ack ") {
                        acked = n.parse().unwrap();
                    }
                }
                None => break,
            }
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Acknowledgements printed before the kill but not read yet count.
        for line in lines.map_while(Result::ok) {
            if let Some(n) = line.strip_prefix("ack ") {
                acked = n.parse().unwrap();
            }
        }
        assert!(
            acked > 0,
            "round {round}: the child acknowledged nothing before the kill"
        );
        let ops = workload(&mut SmallRng::seed_from_u64(workload_seed), OPS);
        let engine = Engine::open(Config::for_tests(dir.path())).unwrap();
        let context = format!("seed {seed}, round {round}, {acked} acknowledged");
        let state = read_state(&engine, &context);
        assert_prefix(&ops, &state, acked, (acked + 1).min(OPS), &context);
        engine.close().unwrap();
        println!(
            "round {round}: killed after {acked} acknowledged operations; recovered state matches"
        );
    }
}
