//! End-to-end tests of Tidepool: real `tidepool` processes (coordinators
//! and nodes) on a real etcd, faults injected from outside — kill -9,
//! SIGSTOP, cut network paths, a full disk — under a concurrent workload
//! whose history is checked (`history::check_all`: per-key conditions and
//! a strict linearizability search).
//!
//! - [`cluster`]: the harness (processes, proxies, tmpfs disks, logs);
//! - [`proxy`]: the TCP proxy on every node-to-peer path;
//! - [`workload`]: the clients and their recorded history;
//! - [`history`]: the history and its fast per-key checks;
//! - [`linearizable`]: the strict checker (one linearization point per
//!   operation, Wing–Gong search with memoisation);
//! - [`scenario`]: run a workload through a fault and report;
//! - [`churn`]: a writer overwriting larger blobs (relocation);
//! - [`expiring`]: a writer into a namespace that keeps one epoch, and
//!   advancing the epoch until its drop is applied everywhere;
//! - [`gateway`]: a `tidepool gateway` process and an HTTP cache load
//!   whose every acknowledged blob is checked, byte for byte.
//!
//! The scenarios are `e2e/tests/scenarios.rs`; figures in `e2e/RESULTS.md`.

pub mod churn;
pub mod cluster;
pub mod expiring;
pub mod gateway;
pub mod history;
pub mod linearizable;
pub use tidepool_testkit::proxy;
pub mod scenario;
pub mod workload;
