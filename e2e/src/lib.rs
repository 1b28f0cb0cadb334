//! End-to-end tests of Tidepool: real `tidepool` processes, a real `etcd`,
//! injected faults (kill -9, freezes, partitions, full disks) and a
//! linearizability checker over recorded histories.
//!
//! What this crate is **not**: a unit-test home or a library for production
//! code. Status: not yet built (issue 9).
