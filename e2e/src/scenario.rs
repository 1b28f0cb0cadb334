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

/// Starts the workload against `cluster`.
pub async fn start(cluster: &Cluster, workload: Workload) -> Run {
    let recorder = Recorder::new();
    let (stop, stop_rx) = watch::channel(false);
    let client = cluster.client().await;
    let seed = workload.seed;
    let task = tokio::spawn(run(client, workload, recorder.clone(), stop_rx));
    Run {
        recorder,
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
        let _ = self.task.await;
        let end = self.recorder.now();
        let history = self.recorder.history();
        let from = self.fault_from.unwrap_or(0);
        Report {
            scenario: scenario.to_string(),
            seed: self.seed,
            operations: history.len(),
            acknowledged: self.recorder.acknowledged(),
            errors: self.recorder.errors(),
            write_gap_s: self.recorder.longest_write_gap(from, end),
            duration_s: end as f64 / 1e9,
            violations: check_all(&history),
            history,
        }
    }
}
