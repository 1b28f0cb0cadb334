//! Benchmarks of Tidepool against its peers (RocksDB, BlobDB), run side by
//! side in one process on the same data. Heavy peers will sit behind a
//! feature so `make ci` never builds them; `make bench` does.
//!
//! What this crate is **not**: a place for timing assertions. Results are
//! recorded, with the command that produced them, in `benchmarks/RESULTS.md`.
//!
//! Binaries:
//! - `engine-put`: engine put throughput with 1 and 2 threads next to the
//!   `memcpy`-into-mmap limit of the same machine.
