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
pub mod fuzz;
#[cfg(feature = "grpc")]
pub mod grpc;
mod io;
mod process;
#[cfg(feature = "grpc")]
pub mod proxy;
mod seed;

pub use etcd::EtcdServer;
pub use io::{on_block_device, process_read_bytes, process_write_bytes};
pub use process::TestProcess;
pub use seed::seed_from_env;

/// A free loopback TCP port for a test process to listen on.
///
/// Chosen below the kernel's ephemeral range (`ip_local_port_range`), so a
/// socket bound to port 0 meanwhile — an outgoing connection, a proxy, an
/// etcd client — cannot take it before the caller binds it (a port handed
/// out by binding port 0 and releasing it could, and did). Ports are handed
/// out in order from a per-process offset, each checked bindable, so calls
/// in one process never repeat and concurrent test processes rarely meet.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let high = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768)
        .clamp(LOW + 1_000, 65_535);
    let span = high - LOW;
    let offset = (std::process::id().wrapping_mul(7_919)) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOW + (offset + n) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {LOW}..{high}");
}
