//! `gateway-bench`: the build-cache gateway against a real dev cluster
//! (`tidepool dev --insecure`, a separate process: a coordinator, three
//! nodes with every shard replicated three times, and the gateway).
//!
//! The gateway measured runs as a process of its own (`tidepool gateway
//! --insecure --anonymous`), so the CPU it costs is told apart from the
//! cluster's and the clients'.
//!
//! 1. Fill: `--blobs` content-addressed blobs of 100 bytes in the cache's
//!    CAS (through the SDK, 64 concurrent puts).
//! 2. `FindMissingBlobs` of 10,000 digests, half of them stored (drawn at
//!    random from the fill), half not, one request at a time: p50/p99.
//! 3. Throughput at 1 KiB and 1 MiB, `--seconds` per phase, `--clients`
//!    concurrent: ByteStream `Write` of new blobs and ByteStream `Read` of
//!    the blobs just written, through the gateway — and next to it, in the
//!    same run, the SDK's own `put`/`get` of the same sizes against the
//!    same cluster: the gateway's overhead is the ratio.
//!
//! Usage: `cargo run --release -p tidepool-benchmarks --bin gateway-bench
//! -- [--blobs 1000000] [--seconds 10] [--clients 16] [--tidepool
//! target/release/tidepool] [--dir target/bench-gateway]`

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bazel_remote_apis::build::bazel::remote::execution::v2 as re;
use bazel_remote_apis::google::bytestream::byte_stream_client::ByteStreamClient;
use bazel_remote_apis::google::bytestream::{ReadRequest, WriteRequest};
use clap::Parser;
use rand::{Rng, SeedableRng as _};
use re::content_addressable_storage_client::ContentAddressableStorageClient;
use tidepool_benchmarks::{Latencies, cpu_seconds, human};
use tidepool_client::{Client, hex, sha256};
use tonic::transport::Channel;

#[derive(Debug, Parser)]
struct Args {
    /// Blobs stored before FindMissingBlobs is measured.
    #[arg(long, default_value_t = 1_000_000)]
    blobs: u64,
    /// FindMissingBlobs requests measured.
    #[arg(long, default_value_t = 100)]
    queries: usize,
    /// Seconds per throughput phase.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Concurrent clients in the throughput phases.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// The server binary.
    #[arg(long, default_value = "target/release/tidepool")]
    tidepool: PathBuf,
    /// Scratch directory (emptied first).
    #[arg(long, default_value = "target/bench-gateway")]
    dir: PathBuf,
    /// Random seed (printed).
    #[arg(long)]
    seed: Option<u64>,
}

struct Dev {
    child: Child,
    /// The gateway measured: a `tidepool gateway` process of its own (so
    /// its CPU is told apart from the cluster's).
    gateway: Child,
    coordinator: String,
    grpc: String,
}

impl Drop for Dev {
    fn drop(&mut self) {
        for child in [&mut self.gateway, &mut self.child] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `tidepool gateway` for `coordinator`; returns it and its gRPC
/// URL (from the line it prints once serving).
fn start_gateway(args: &Args, coordinator: &str) -> anyhow::Result<(Child, String)> {
    let mut child = Command::new(&args.tidepool)
        .args([
            "gateway",
            "--insecure",
            "--anonymous",
            "--coordinator",
            coordinator,
        ])
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .stderr(Stdio::piped())
        .spawn()?;
    let stderr = child.stderr.take().context("no stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = Vec::new();
    let url = loop {
        let Some(line) = lines.next() else {
            bail!("the gateway exited:\n{}", seen.join("\n"));
        };
        let line = line?;
        if let Some(address) = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("grpc://"))
        {
            break format!("http://{}", address.trim_end_matches(','));
        }
        seen.push(line);
    };
    // Keep draining its log so that it never blocks on a full pipe.
    let log = args.dir.join("gateway.log");
    std::thread::spawn(move || {
        use std::io::Write as _;
        if let Ok(mut file) = std::fs::File::create(log) {
            for line in lines.map_while(Result::ok) {
                let _ = writeln!(file, "{line}");
            }
        }
    });
    Ok((child, url))
}

fn start_dev(args: &Args) -> anyhow::Result<Dev> {
    let _ = std::fs::remove_dir_all(&args.dir);
    std::fs::create_dir_all(&args.dir)?;
    let mut child = Command::new(&args.tidepool)
        .args(["dev", "--insecure", "--port", "0", "--data-dir"])
        .arg(args.dir.join("data"))
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(args.dir.join("dev.log"))?)
        .spawn()
        .with_context(|| format!("cannot run {}", args.tidepool.display()))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut banner = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let last = line.starts_with("Ctrl-C");
        banner.push(line);
        if last {
            break;
        }
    }
    let words: Vec<&str> = banner.iter().flat_map(|l| l.split_whitespace()).collect();
    let coordinator = words
        .iter()
        .find(|w| w.starts_with("http://"))
        .map(|w| w.trim_end_matches(',').to_string());
    let Some(coordinator) = coordinator else {
        bail!("unexpected banner:\n{}", banner.join("\n"));
    };
    let (gateway, grpc) = start_gateway(args, &coordinator)?;
    Ok(Dev {
        child,
        gateway,
        coordinator,
        grpc,
    })
}

/// Unique content for blob `i` of a phase.
fn content(phase: u64, i: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut state = (phase << 40) ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555;
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn digest(bytes: &[u8]) -> re::Digest {
    re::Digest {
        hash: hex(&sha256(bytes)),
        size_bytes: bytes.len() as i64,
    }
}

async fn fill(client: &Client, blobs: u64) -> anyhow::Result<Vec<[u8; 32]>> {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let (client, next) = (client.clone(), next.clone());
        tasks.spawn(async move {
            let mut keys = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= blobs {
                    return Ok::<_, tidepool_client::Error>(keys);
                }
                let bytes = content(0, i, 100);
                keys.push(client.put_content("cache", &bytes).await?);
                if i > 0 && i % 100_000 == 0 {
                    eprintln!("  filled {i} blobs");
                }
            }
        });
    }
    let mut keys = Vec::new();
    while let Some(done) = tasks.join_next().await {
        keys.extend(done??);
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "fill: {blobs} blobs of 100 B in {secs:.1} s ({:.0} puts/s)",
        blobs as f64 / secs
    );
    Ok(keys)
}

async fn find_missing(
    channel: &Channel,
    keys: &[[u8; 32]],
    queries: usize,
    rng: &mut rand::rngs::SmallRng,
) -> anyhow::Result<Latencies> {
    let mut cas = ContentAddressableStorageClient::new(channel.clone());
    let mut latencies = Latencies::default();
    for q in 0..queries {
        let mut digests = Vec::with_capacity(10_000);
        for _ in 0..5_000 {
            let key = keys[rng.random_range(0..keys.len())];
            digests.push(re::Digest {
                hash: hex(&key),
                size_bytes: 100,
            });
        }
        for i in 0..5_000u64 {
            digests.push(digest(&content(1_000 + q as u64, i, 100)));
        }
        let started = Instant::now();
        let missing = cas
            .find_missing_blobs(re::FindMissingBlobsRequest {
                instance_name: String::new(),
                blob_digests: digests,
                digest_function: 0,
            })
            .await?
            .into_inner()
            .missing_blob_digests;
        latencies.record(started.elapsed());
        if missing.len() != 5_000 {
            bail!("FindMissingBlobs said {} missing, not 5000", missing.len());
        }
    }
    Ok(latencies)
}

/// One phase's result.
struct Phase {
    ops: u64,
    bytes: u64,
    secs: f64,
    latencies: Latencies,
    /// CPU seconds used during the phase by the cluster process (nodes,
    /// coordinator), the gateway process and this one (the clients).
    cpu: [f64; 3],
}

/// CPU seconds so far of the cluster, the gateway and this process.
fn cpu_now(pids: [u32; 2]) -> [f64; 3] {
    [
        cpu_seconds(pids[0]),
        cpu_seconds(pids[1]),
        cpu_seconds(std::process::id()),
    ]
}

fn cpu_since(pids: [u32; 2], then: [f64; 3]) -> [f64; 3] {
    let now = cpu_now(pids);
    [now[0] - then[0], now[1] - then[1], now[2] - then[2]]
}

impl Phase {
    fn mib_s(&self) -> f64 {
        self.bytes as f64 / self.secs / (1 << 20) as f64
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Gateway,
    Sdk,
}

/// What every phase runs against.
struct Setup {
    /// The cluster's and the gateway's process ids.
    dev: [u32; 2],
    client: Client,
    channel: Channel,
    seconds: u64,
    clients: usize,
}

impl Setup {
    fn parts(&self) -> ([u32; 2], &Client, &Channel, u64, usize) {
        (
            self.dev,
            &self.client,
            &self.channel,
            self.seconds,
            self.clients,
        )
    }
}

/// Writes new blobs of `size` for `seconds` with `clients` tasks; returns
/// the phase and the blobs written (for the read phase).
async fn write_phase(
    setup: &Setup,
    path: Path,
    phase_id: u64,
    size: usize,
) -> anyhow::Result<(Phase, Vec<Vec<u8>>)> {
    let (dev, client, channel, seconds, clients) = setup.parts();
    let next = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let cpu = cpu_now(dev);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (client, next) = (client.clone(), next.clone());
        let mut bytestream = ByteStreamClient::new(channel.clone());
        tasks.spawn(async move {
            let mut latencies = Latencies::default();
            let mut written = Vec::new();
            while Instant::now() < deadline {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let bytes = content(phase_id, i, size);
                let t = Instant::now();
                match path {
                    Path::Sdk => {
                        client.put_content("cache", &bytes).await?;
                    }
                    Path::Gateway => {
                        let d = digest(&bytes);
                        let name =
                            format!("uploads/{phase_id}-{i}/blobs/{}/{}", d.hash, d.size_bytes);
                        let requests: Vec<WriteRequest> = bytes
                            .chunks(1 << 20)
                            .enumerate()
                            .map(|(n, piece)| WriteRequest {
                                resource_name: if n == 0 { name.clone() } else { String::new() },
                                write_offset: (n << 20) as i64,
                                finish_write: (n + 1) << 20 >= bytes.len(),
                                data: piece.to_vec(),
                            })
                            .collect();
                        bytestream.write(tokio_stream::iter(requests)).await?;
                    }
                }
                latencies.record(t.elapsed());
                written.push(bytes);
            }
            Ok::<_, anyhow::Error>((latencies, written))
        });
    }
    let mut latencies = Latencies::default();
    let mut blobs = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (l, w) = done??;
        latencies.merge(l);
        blobs.extend(w);
    }
    let secs = started.elapsed().as_secs_f64();
    let ops = latencies.count();
    Ok((
        Phase {
            ops,
            bytes: ops * size as u64,
            secs,
            latencies,
            cpu: cpu_since(dev, cpu),
        },
        blobs,
    ))
}

async fn read_phase(setup: &Setup, path: Path, blobs: Arc<Vec<Vec<u8>>>) -> anyhow::Result<Phase> {
    let (dev, client, channel, seconds, clients) = setup.parts();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let cpu = cpu_now(dev);
    let total = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        let (client, blobs, total) = (client.clone(), blobs.clone(), total.clone());
        let mut bytestream =
            ByteStreamClient::new(channel.clone()).max_decoding_message_size(8 << 20);
        tasks.spawn(async move {
            let mut latencies = Latencies::default();
            let mut i = c;
            while Instant::now() < deadline {
                let bytes = &blobs[i % blobs.len()];
                i += clients;
                let key = sha256(bytes);
                let t = Instant::now();
                let got = match path {
                    Path::Sdk => client.get("cache", &key).await?,
                    Path::Gateway => {
                        let mut stream = bytestream
                            .read(ReadRequest {
                                resource_name: format!("blobs/{}/{}", hex(&key), bytes.len()),
                                read_offset: 0,
                                read_limit: 0,
                            })
                            .await?
                            .into_inner();
                        let mut got = Vec::with_capacity(bytes.len());
                        while let Some(m) = stream.message().await? {
                            got.extend_from_slice(&m.data);
                        }
                        got
                    }
                };
                latencies.record(t.elapsed());
                if got.len() != bytes.len() {
                    bail!("read {} bytes, not {}", got.len(), bytes.len());
                }
                total.fetch_add(got.len() as u64, Ordering::Relaxed);
            }
            Ok::<_, anyhow::Error>(latencies)
        });
    }
    let mut latencies = Latencies::default();
    while let Some(done) = tasks.join_next().await {
        latencies.merge(done??);
    }
    Ok(Phase {
        ops: latencies.count(),
        bytes: total.load(Ordering::Relaxed),
        secs: started.elapsed().as_secs_f64(),
        latencies,
        cpu: cpu_since(dev, cpu),
    })
}

fn row(what: &str, size: usize, gateway: &mut Phase, sdk: &mut Phase) {
    // CPU per operation, µs: cluster, gateway, clients.
    let per_op = |p: &Phase| p.cpu.map(|c| c * 1e6 / p.ops.max(1) as f64);
    let total = |c: [f64; 3]| c.iter().sum::<f64>();
    let (g, d) = (per_op(gateway), per_op(sdk));
    println!(
        "| {what} | {} | {:.0} ops/s, {:.1} MiB/s, p50 {}, p99 {}; CPU/op µs: cluster {:.0}, gateway {:.0}, clients {:.0} | {:.0} ops/s, {:.1} MiB/s, p50 {}, p99 {}; CPU/op µs: cluster {:.0}, clients {:.0} | {:.2} | {:.2} |",
        if size >= 1 << 20 {
            format!("{} MiB", size >> 20)
        } else {
            format!("{} KiB", size >> 10)
        },
        gateway.ops as f64 / gateway.secs,
        gateway.mib_s(),
        human(gateway.latencies.quantile(0.5)),
        human(gateway.latencies.quantile(0.99)),
        g[0],
        g[1],
        g[2],
        sdk.ops as f64 / sdk.secs,
        sdk.mib_s(),
        human(sdk.latencies.quantile(0.5)),
        human(sdk.latencies.quantile(0.99)),
        d[0],
        d[2],
        gateway.mib_s() / sdk.mib_s(),
        total(g) / total(d),
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(rand::random);
    println!("gateway-bench seed {seed}: {args:?}");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let dev = start_dev(&args)?;
    let pid = [dev.child.id(), dev.gateway.id()];
    let client = Client::connect(std::slice::from_ref(&dev.coordinator)).await?;
    let channel = Channel::from_shared(dev.grpc.clone())?.connect().await?;

    let keys = fill(&client, args.blobs).await?;
    let mut latencies = find_missing(&channel, &keys, args.queries, &mut rng).await?;
    println!(
        "FindMissingBlobs of 10,000 digests (5,000 stored among {} blobs), {} requests one at a time: p50 {}, p99 {}, max {}",
        args.blobs,
        latencies.count(),
        human(latencies.quantile(0.5)),
        human(latencies.quantile(0.99)),
        human(latencies.quantile(1.0)),
    );

    println!(
        "\n| phase | size | gateway (ByteStream) | SDK | throughput gateway / SDK | CPU per op gateway / SDK |\n|---|---|---|---|---|---|"
    );
    let setup = Setup {
        dev: pid,
        client: client.clone(),
        channel: channel.clone(),
        seconds: args.seconds,
        clients: args.clients,
    };
    let mut phase_id = 10;
    for size in [1 << 10, 1 << 20] {
        phase_id += 1;
        let (mut gw_write, gw_blobs) = write_phase(&setup, Path::Gateway, phase_id, size).await?;
        phase_id += 1;
        let (mut sdk_write, sdk_blobs) = write_phase(&setup, Path::Sdk, phase_id, size).await?;
        row("write", size, &mut gw_write, &mut sdk_write);
        // Each path reads the blobs it wrote (just written: in the page
        // cache).
        let mut gw_read = read_phase(&setup, Path::Gateway, Arc::new(gw_blobs)).await?;
        let mut sdk_read = read_phase(&setup, Path::Sdk, Arc::new(sdk_blobs)).await?;
        row("read", size, &mut gw_read, &mut sdk_read);
    }
    drop(dev);
    Ok(())
}
