//! Running a workload through a fault: start the clients, mark when the
//! fault begins and ends, stop, check the history, report availability.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::cluster::Cluster;
use crate::history::{Nanos, Violation, check_all};
use crate::workload::{Recorder, Workload, run};

/// A workload in progress.
pub struct Run {
    recorder: Arc<Recorder>,
    /// For the read-back at the end.
    client: tidepool_client::Client,
    workload: Workload,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    seed: u64,
    fault_from: Option<Nanos>,
    fault_to: Option<Nanos>,
}

/// What a scenario measured.
#[derive(Debug)]
pub struct Report {
    /// Scenario name.
    pub scenario: String,
    /// Seed of the workload.
    pub seed: u64,
    /// Operations recorded.
    pub operations: usize,
    /// Operations acknowledged.
    pub acknowledged: usize,
    /// Failed operations by code.
    pub errors: BTreeMap<String, u64>,
    /// Longest stretch without an acknowledged write from the fault's
    /// start to the end of the run, seconds.
    pub write_gap_s: f64,
    /// Length of the run, seconds.
    pub duration_s: f64,
    /// What the checker found.
    pub violations: Vec<Violation>,
    /// The whole history.
    pub history: Vec<crate::history::Event>,
}

impl Report {
    /// The report as one Markdown table row.
    pub fn row(&self) -> String {
        let errors: Vec<String> = self
            .errors
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        format!(
            "| {} | {} | {:.0} | {} | {} | {:.1} | {} | {} |",
            self.scenario,
            self.seed,
            self.duration_s,
            self.operations,
            self.acknowledged,
            self.write_gap_s,
            if errors.is_empty() {
                "none".into()
            } else {
                errors.join(", ")
            },
            self.violations.len()
        )
    }

    /// Prints the report (and appends its row to `$E2E_REPORT` if set);
    /// panics with the seed and the violating history slices if the
    /// checker found anything.
    pub fn assert_clean(&self) {
        eprintln!("{}", self.row());
        if let Ok(path) = std::env::var("E2E_REPORT")
            && let Ok(mut file) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
        {
            let _ = writeln!(file, "{}", self.row());
        }
        // Bytes that failed their checks reached a client: no fault this
        // suite injects may cause that (the SDK verifies what it reads).
        let integrity: Vec<_> = self
            .errors
            .iter()
            .filter(|(code, _)| INTEGRITY_CODES.contains(&code.as_str()))
            .collect();
        assert!(
            integrity.is_empty(),
            "{}: operations failed their integrity checks: {integrity:?} (seed {})",
            self.scenario,
            self.seed
        );
        if !self.violations.is_empty() {
            let shown: Vec<String> = self
                .violations
                .iter()
                .take(5)
                .map(|v| v.to_string())
                .collect();
            panic!(
                "{}: {} violations (seed {}; replay with E2E_SEED={}):\n{}",
                self.scenario,
                self.violations.len(),
                self.seed,
                self.seed,
                shown.join("\n")
            );
        }
    }
}

/// Codes saying stored bytes failed their checks.
const INTEGRITY_CODES: [&str; 3] = ["CORRUPT", "DIGEST_MISMATCH", "SIZE_MISMATCH"];

/// Writes to one shard in a window, as clients saw them.
#[derive(Clone, Debug)]
pub struct ShardWrites {
    /// The shard.
    pub shard: u32,
    /// Writes invoked in the window.
    pub writes: usize,
    /// Of those, acknowledged.
    pub acknowledged: usize,
    /// Seconds from the window's start to the first acknowledged write
    /// invoked in it (a shard whose leader was cut off needs an election).
    pub first_s: Option<f64>,
    /// The longest stretch with no acknowledged write completing, from the
    /// moment every shard had its first write (after the elections the
    /// fault caused: before, clients blocked on a shard electing a leader
    /// starve the others) to the window's end, seconds.
    pub longest_gap_s: f64,
    /// SDK attempts per write: mean and most.
    pub mean_attempts: f64,
    /// Most attempts one write needed.
    pub max_attempts: u32,
}

impl ShardWrites {
    /// The figures as one Markdown table row.
    pub fn row(&self, phase: &str) -> String {
        format!(
            "| {phase} | {} | {} | {} | {} | {:.2} | {:.2} | {} |",
            self.shard,
            self.writes,
            self.acknowledged,
            self.first_s.map_or("never".into(), |s| format!("{s:.2}")),
            self.longest_gap_s,
            self.mean_attempts,
            self.max_attempts
        )
    }
}

/// Per shard, the writes invoked in `[from, to]` (`shard_of` maps a
/// workload key to its shard), gaps counted once every shard wrote again.
pub fn shard_writes(
    history: &[crate::history::Event],
    shard_of: &dyn Fn(u32) -> u32,
    from: Nanos,
    to: Nanos,
) -> Vec<ShardWrites> {
    use crate::history::{Op, Status};
    let mut by_shard: BTreeMap<u32, Vec<&crate::history::Event>> = BTreeMap::new();
    for e in history {
        if matches!(e.op, Op::Put(_) | Op::Delete(_)) && e.invoked >= from && e.invoked <= to {
            by_shard.entry(shard_of(e.key)).or_default().push(e);
        }
    }
    let acked = |writes: &[&crate::history::Event]| -> Vec<Nanos> {
        let mut done: Vec<Nanos> = writes
            .iter()
            .filter(|e| e.status == Status::Ok)
            .map(|e| e.completed)
            .collect();
        done.sort_unstable();
        done
    };
    // Every shard wrote again by then (or never did: the whole window).
    let all_back = by_shard
        .values()
        .map(|w| acked(w).first().copied().unwrap_or(to))
        .max()
        .unwrap_or(from);
    by_shard
        .into_iter()
        .map(|(shard, writes)| {
            let done = acked(&writes);
            let mut last = all_back;
            let mut gap = 0;
            for t in done.iter().copied().filter(|t| *t > all_back && *t <= to) {
                gap = gap.max(t - last);
                last = t;
            }
            gap = gap.max(to.saturating_sub(last));
            let attempts: Vec<u32> = writes.iter().map(|e| e.attempts).collect();
            ShardWrites {
                shard,
                writes: writes.len(),
                acknowledged: done.len(),
                first_s: done.first().map(|t| t.saturating_sub(from) as f64 / 1e9),
                longest_gap_s: gap as f64 / 1e9,
                mean_attempts: attempts.iter().map(|a| f64::from(*a)).sum::<f64>()
                    / attempts.len().max(1) as f64,
                max_attempts: attempts.iter().copied().max().unwrap_or(0),
            }
        })
        .collect()
}

/// Appends lines to `$E2E_REPORT`, if set.
pub fn report_lines(lines: &[String]) {
    if let Ok(path) = std::env::var("E2E_REPORT")
        && let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    {
        for line in lines {
            let _ = writeln!(file, "{line}");
        }
    }
}

/// Starts the workload against `cluster`.
pub async fn start(cluster: &Cluster, workload: Workload) -> Run {
    let recorder = Recorder::new();
    let (stop, stop_rx) = watch::channel(false);
    let client = cluster.client().await;
    let seed = workload.seed;
    let task = tokio::spawn(run(
        client.clone(),
        workload.clone(),
        recorder.clone(),
        stop_rx,
    ));
    Run {
        recorder,
        client,
        workload,
        stop,
        task,
        seed,
        fault_from: None,
        fault_to: None,
    }
}

impl Run {
    /// The fault begins now.
    pub fn fault_begins(&mut self) {
        self.fault_from = Some(self.recorder.now());
    }

    /// The fault is over now.
    pub fn fault_ends(&mut self) {
        self.fault_to = Some(self.recorder.now());
    }

    /// When the fault began and ended (nanoseconds into the run).
    pub fn fault_window(&self) -> (Nanos, Nanos) {
        (
            self.fault_from.unwrap_or(0),
            self.fault_to.unwrap_or(u64::MAX),
        )
    }

    /// Nanoseconds since the run started.
    pub fn now(&self) -> Nanos {
        self.recorder.now()
    }

    /// The history so far.
    pub fn history(&self) -> Vec<crate::history::Event> {
        self.recorder.history()
    }

    /// Acknowledged operations so far.
    pub fn acknowledged(&self) -> usize {
        self.recorder.acknowledged()
    }

    /// Lets the workload run on for `time`.
    pub async fn run_for(&self, time: Duration) {
        tokio::time::sleep(time).await;
    }

    /// Stops the clients, checks the history and measures.
    pub async fn finish(self, scenario: &str) -> Report {
        self.stop.send_replace(true);
        self.task.await.expect("the workload panicked");
        let end = self.recorder.now();
        let unread = crate::workload::read_back(&self.client, &self.workload, &self.recorder).await;
        let history = self.recorder.history();
        let mut violations = check_all(&history);
        violations.extend(unread.into_iter().map(|key| crate::history::Violation {
            key,
            what: "the read-back after the run never answered: an acknowledged write there goes unchecked".into(),
            slice: history
                .iter()
                .filter(|e| e.key == key && e.client == self.workload.clients)
                .cloned()
                .collect(),
        }));
        let from = self.fault_from.unwrap_or(0);
        Report {
            scenario: scenario.to_string(),
            seed: self.seed,
            operations: history.len(),
            acknowledged: self.recorder.acknowledged(),
            errors: self.recorder.errors(),
            write_gap_s: self.recorder.longest_write_gap(from, end),
            duration_s: end as f64 / 1e9,
            violations,
            history,
        }
    }
}

/// Checks that a listing of namespace `default` names exactly the workload
/// keys that hold a value, each with its value's size and SHA-256: the
/// name index (kept beside the blobs, `docs/design/listing.md`) agrees with
/// the blobs after whatever the cluster went through. Run it once the
/// workload has stopped; a linearizable get of each key is the truth.
pub async fn check_listing(cluster: &Cluster, keys: u32) -> Result<(), String> {
    let client = cluster.client().await;
    let mut stored = BTreeMap::new();
    for key in 0..keys {
        let name = crate::workload::key_name(key);
        match client.get("default", &name).await {
            Ok(value) => {
                let sha = tidepool_client::sha256(&value);
                stored.insert(name, (value.len() as u64, sha));
            }
            Err(e) if e.code() == tidepool_client::ErrorCode::NotFound => {}
            Err(e) => return Err(format!("get of key {key}: {e}")),
        }
    }
    let mut lister = client.list(
        "default",
        tidepool_client::ListOptions {
            prefix: b"e2e-key-".to_vec(),
            ..Default::default()
        },
    );
    let mut listed = BTreeMap::new();
    while let Some(entry) = lister.next().await.map_err(|e| format!("listing: {e}"))? {
        if listed
            .insert(entry.key.clone(), (entry.size, entry.sha256))
            .is_some()
        {
            return Err(format!(
                "listing names {} twice",
                String::from_utf8_lossy(&entry.key)
            ));
        }
    }
    if listed == stored {
        eprintln!(
            "listing: the {} keys holding values, and no other",
            listed.len()
        );
        return Ok(());
    }
    let show = |m: &BTreeMap<Vec<u8>, (u64, [u8; 32])>| {
        m.iter()
            .map(|(k, (size, sha))| {
                format!(
                    "{} {size} {:02x}{:02x}..",
                    String::from_utf8_lossy(k),
                    sha[0],
                    sha[1]
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    Err(format!(
        "the listing disagrees with the blobs:\n listed: {}\n stored: {}",
        show(&listed),
        show(&stored)
    ))
}

/// Runs the workload until the map publishes the split of `parent` into
/// `child` at `at`: both in the map, the parent ending before the cut and
/// the child starting at it, the split intent cleared.
pub async fn wait_split_published(cluster: &Cluster, run: &Run, parent: u32, child: u32, at: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(map) = cluster.status().await.and_then(|s| s.map) {
            let p = map.shards.iter().find(|s| s.shard_id == parent);
            let c = map.shards.iter().find(|s| s.shard_id == child);
            if let (Some(p), Some(c)) = (p, c)
                && p.split.is_none()
            {
                assert_eq!(p.hash_end, at - 1, "the parent ends before the cut");
                assert_eq!(c.hash_start, at, "the child starts at the cut");
                return;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the split of shard {parent} into {child} was not published; map {:?}\n{}",
            cluster.status().await.and_then(|s| s.map),
            cluster.log_tails()
        );
        run.run_for(Duration::from_millis(300)).await;
    }
}
