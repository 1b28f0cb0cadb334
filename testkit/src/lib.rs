//! Test support shared by Tidepool's crates, and the workspace's
//! dependency-direction check.
//!
//! What this crate is **not**: production code. Nothing outside tests,
//! benchmarks and the `depcheck` tool may depend on it.
//!
//! ```
//! let seed = tidepool_testkit::seed_from_env("EXAMPLE_SEED");
//! println!("re-run with EXAMPLE_SEED={seed}");
//! ```

pub mod depcheck;
mod io;
mod seed;

pub use io::{on_block_device, process_read_bytes, process_write_bytes};
pub use seed::seed_from_env;
