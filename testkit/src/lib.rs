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

#[cfg(feature = "cluster")]
pub mod cluster;
pub mod depcheck;
mod etcd;
#[cfg(feature = "grpc")]
pub mod grpc;
mod io;
mod process;
mod seed;

pub use etcd::EtcdServer;
pub use io::{on_block_device, process_read_bytes, process_write_bytes};
pub use process::TestProcess;
pub use seed::seed_from_env;

/// A free local TCP port (bound and released; another process could take
/// it before the caller binds it, which is unlikely).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}
