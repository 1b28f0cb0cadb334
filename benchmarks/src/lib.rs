//! Benchmarks of Tidepool against its peers (RocksDB, BlobDB), run side by
//! side in one process on the same data. Heavy peers are behind the
//! `peers` feature so `make ci` never builds them; `make bench` does.
//!
//! What this crate is **not**: a place for timing assertions. Results are
//! recorded, with the command that produced them, in `benchmarks/RESULTS.md`.
//!
//! Status: not yet built (issues 3 and 5).
