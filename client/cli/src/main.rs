//! `tidectl`: the Tidepool command-line tool, built on the client SDK.
//!
//! Exit codes scripts can rely on: 0 success; 1 the cluster refused or
//! failed the operation; 2 bad usage or input (missing file, bad digest,
//! unknown command); 3 not found (key, namespace, node), or for `exists`,
//! some keys missing; 4 the cluster could not be reached in time; 5 the
//! credential was refused (`UNAUTHENTICATED`, `PERMISSION_DENIED`).

mod bench;
mod load;

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use serde_json::json;
use tidepool_client::proto::v1::{
    ClusterStatus, MoveStep, Namespace, NodeState, NodeStatus, ReplicaStatus, RestoreMapResponse,
    ShardInfo, TokenGrant, retention,
};
use tidepool_client::{
    Client, ClientConfig, Durability, ErrorCode, ListOptions, RetentionPolicy, TlsFiles, hex,
    read_token_file, role_name, role_of,
};

/// Command-line interface to a Tidepool cluster.
#[derive(Debug, Parser)]
#[command(name = "tidectl", version, about)]
struct Cli {
    /// Coordinator address(es), comma-separated.
    #[arg(
        long,
        env = "TIDEPOOL_COORDINATOR",
        default_value = "http://127.0.0.1:7400",
        value_delimiter = ',',
        global = true
    )]
    coordinator: Vec<String>,
    /// Print machine-readable JSON.
    #[arg(long, global = true)]
    json: bool,
    /// Deadline of each operation, seconds.
    #[arg(long, default_value_t = 60, global = true)]
    timeout: u64,
    /// Directory with `ca.pem`, `client.pem` and `client-key.pem` (what
    /// `tidepool certs` and dev mode make). Default: `<dev dir>/tls` when
    /// it exists.
    #[arg(long, env = "TIDEPOOL_TLS_DIR", global = true)]
    tls_dir: Option<PathBuf>,
    /// Bearer token.
    #[arg(long, env = "TIDEPOOL_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// File holding the bearer token. Default: `<dev dir>/admin.token` when
    /// it exists.
    #[arg(long, env = "TIDEPOOL_TOKEN_FILE", global = true)]
    token_file: Option<PathBuf>,
    /// Plaintext, no TLS material looked for.
    #[arg(long, global = true)]
    insecure: bool,
    /// The dev cluster's data directory, searched for TLS material and the
    /// admin token when none is given.
    #[arg(
        long,
        env = "TIDEPOOL_DEV_DIR",
        default_value = "tidepool-dev",
        global = true
    )]
    dev_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write blobs continuously, as a load while the cluster restarts,
    /// scales or upgrades: each acknowledged key is appended to
    /// `--record`; prints the failures and the longest gap between
    /// acknowledgements (exit 1 if any put failed).
    Load {
        /// Namespace.
        namespace: String,
        /// Stop after this many seconds (0: only at `--stop-file`).
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Bytes per blob.
        #[arg(long, default_value_t = 4096)]
        size: usize,
        /// Writers at once.
        #[arg(long, default_value_t = 4)]
        writers: usize,
        /// Key prefix (default: `load-<unix seconds>`).
        #[arg(long)]
        prefix: Option<String>,
        /// Append each acknowledged key (and size) to this file.
        #[arg(long)]
        record: Option<PathBuf>,
        /// Stop when this file exists.
        #[arg(long)]
        stop_file: Option<PathBuf>,
    },
    /// A load generator: `--concurrency` workers running a mix of puts,
    /// gets, exists and deletes for `--seconds` (or `--count` operations);
    /// prints per operation ops/s, MiB/s, latency percentiles and errors by
    /// code (exit 1 if any failed with a code other than NOT_FOUND).
    Bench {
        /// Namespace.
        namespace: String,
        /// Workers at once.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// Bytes per value.
        #[arg(long, default_value_t = 1024)]
        size: usize,
        /// Seconds to run (0: until `--count`).
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Stop after this many operations in all.
        #[arg(long)]
        count: Option<u64>,
        /// Operation weights, e.g. `put=1,get=3,exists=1,delete=0`.
        #[arg(long, default_value = "put=1")]
        mix: bench::Mix,
        /// Keys the operations pick from (`<prefix>-0` ...).
        #[arg(long, default_value_t = 10_000)]
        keys: u64,
        /// Key distribution: `uniform`, `sequential` (each key in turn) or
        /// `zipf` / `zipf:S`.
        #[arg(long, default_value = "uniform")]
        distribution: bench::Distribution,
        /// Key prefix (default: `bench-<size>`).
        #[arg(long)]
        prefix: Option<String>,
        /// Do not write every key first when the mix reads.
        #[arg(long)]
        no_prefill: bool,
        /// Seed of the operation and key choices (printed when not given).
        #[arg(long)]
        seed: Option<u64>,
        /// What puts and deletes wait for: `default` (the cluster's
        /// setting), `buffered` or `synced`.
        #[arg(long, default_value = "default", value_parser = parse_durability)]
        durability: Durability,
    },
    /// Read back every blob of a `load --record` file and check its
    /// content (exit 1 if any is missing or wrong).
    Verify {
        /// Namespace.
        namespace: String,
        /// The record file.
        record: PathBuf,
    },
    /// Store a file (or stdin with `-`) under a key. In a content-addressed
    /// namespace give `--content` instead of a key: the key is the SHA-256.
    Put {
        /// Namespace.
        namespace: String,
        /// Key (text; 64 hex digits in a content-addressed namespace), or
        /// the file when `--content` is given.
        key: String,
        /// File to store; `-` for stdin.
        file: Option<PathBuf>,
        /// Store under the content's SHA-256 (printed).
        #[arg(long)]
        content: bool,
    },
    /// Fetch a blob to stdout or a file.
    Get {
        /// Namespace.
        namespace: String,
        /// Key.
        key: String,
        /// Write here instead of stdout.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Size, SHA-256 and epoch of a blob.
    Head {
        /// Namespace.
        namespace: String,
        /// Key.
        key: String,
    },
    /// List a namespace's keys in key order (streamed; `--json`: one
    /// object per line). Keys of content-addressed namespaces, and prefixes
    /// given for them, are hex.
    Ls {
        /// Namespace.
        namespace: String,
        /// Only keys starting with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// Only keys after this one (the last key of an earlier listing).
        #[arg(long)]
        start_after: Option<String>,
        /// Stop after this many keys.
        #[arg(long)]
        limit: Option<u64>,
        /// Also size, epoch and SHA-256.
        #[arg(short, long)]
        long: bool,
    },
    /// Delete a blob.
    Rm {
        /// Namespace.
        namespace: String,
        /// Key.
        key: String,
    },
    /// Which of the keys on stdin (one per line) exist; prints the missing
    /// ones (exit 3 if any).
    Exists {
        /// Namespace.
        namespace: String,
    },
    /// The cluster.
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Namespaces.
    Namespace {
        #[command(subcommand)]
        command: NamespaceCommand,
    },
    /// Epochs.
    Epoch {
        #[command(subcommand)]
        command: EpochCommand,
    },
    /// Nodes.
    Node {
        #[command(subcommand)]
        command: NodeCommand,
    },
    /// Shards.
    Shard {
        #[command(subcommand)]
        command: ShardCommand,
    },
    /// Client tokens (admin).
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Create a token; prints its secret (shown once).
    Create {
        /// Unique name.
        name: String,
        /// Cluster admin.
        #[arg(long)]
        admin: bool,
        /// `NAMESPACE=ROLE[,ROLE...]` with roles read, write, append-only,
        /// delete; namespace `*` for all (repeat).
        #[arg(long = "grant", value_name = "NAMESPACE=ROLES")]
        grants: Vec<String>,
    },
    /// Every token's name and roles.
    List,
    /// Revoke a token: every node refuses it within seconds.
    Revoke {
        /// Name.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Nodes, shards, leaders, epochs and moves in progress.
    Status,
    /// Put the newest map the nodes hold back into the coordinator's
    /// store, after the store was emptied (the coordinator founded a new
    /// cluster the nodes refuse) or restored from an older snapshot (the
    /// coordinator changes nothing meanwhile). The coordinator asks the
    /// node named and every node its map lists.
    RestoreMap {
        /// A node's address, e.g. `https://node-0:7401`.
        #[arg(long)]
        from_node: String,
        /// Restore though some nodes of the map do not answer (one of them
        /// may hold a newer map).
        #[arg(long)]
        allow_unanswered: bool,
    },
}

#[derive(Debug, Subcommand)]
enum NamespaceCommand {
    /// Create a namespace.
    Create {
        /// Name.
        name: String,
        /// Drop blobs this many epochs after their last write or touch
        /// (default: durable).
        #[arg(long)]
        retain: Option<u32>,
        /// Keys are SHA-256 digests of the content, verified on write.
        #[arg(long)]
        content_addressed: bool,
    },
    /// Change a namespace's retention (answered once every shard holds it).
    SetRetention {
        /// Name.
        name: String,
        /// Drop blobs this many epochs after their last write or touch.
        #[arg(long, conflicts_with = "durable", required_unless_present = "durable")]
        retain: Option<u32>,
        /// Never drop blobs (a durable namespace never becomes expiring).
        #[arg(long)]
        durable: bool,
    },
    /// List namespaces.
    List,
}

#[derive(Debug, Subcommand)]
enum EpochCommand {
    /// Start the next epoch.
    Advance {
        /// Only if the current epoch is this.
        #[arg(long)]
        expect: Option<u64>,
    },
}

#[derive(Debug, Subcommand)]
enum NodeCommand {
    /// Move every replica off a node.
    Drain {
        /// Node id.
        id: u64,
    },
}

#[derive(Debug, Subcommand)]
enum ShardCommand {
    /// Split a shard's hash range in two: a new shard takes the upper part
    /// (see `tidectl cluster status` for when it is published).
    Split {
        /// Shard id.
        id: u32,
        /// First hash position of the new shard (decimal or 0x hex;
        /// default: the middle of the shard's range).
        #[arg(long, value_parser = parse_position)]
        at: Option<u64>,
    },
}

/// A hash position: decimal, or hexadecimal after `0x`.
fn parse_durability(text: &str) -> Result<Durability, String> {
    match text {
        "default" => Ok(Durability::Default),
        "buffered" => Ok(Durability::Buffered),
        "synced" => Ok(Durability::Synced),
        other => Err(format!(
            "{other:?}: the durability is `default`, `buffered` or `synced`"
        )),
    }
}

fn parse_position(text: &str) -> Result<u64, String> {
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.map_err(|e| format!("{text:?} is not a hash position: {e}"))
}

/// A failure with its exit code.
struct Failure {
    code: u8,
    message: String,
}

impl From<tidepool_client::Error> for Failure {
    fn from(error: tidepool_client::Error) -> Self {
        let code = match error.code() {
            ErrorCode::NotFound | ErrorCode::NamespaceNotFound | ErrorCode::NodeNotFound => 3,
            ErrorCode::InvalidArgument
            | ErrorCode::DigestMismatch
            | ErrorCode::ValueTooLarge
            | ErrorCode::NamespaceExists => 2,
            ErrorCode::Timeout | ErrorCode::NoQuorum => 4,
            ErrorCode::Unauthenticated | ErrorCode::PermissionDenied => 5,
            _ => 1,
        };
        Failure {
            code,
            message: error.to_string(),
        }
    }
}

fn usage(message: impl Into<String>) -> Failure {
    Failure {
        code: 2,
        message: message.into(),
    }
}

type Outcome = Result<(), Failure>;

/// Parses a key: 64 hex digits in a content-addressed namespace, else the
/// text's bytes.
fn parse_key(client: &Client, namespace: &str, key: &str) -> Result<Vec<u8>, Failure> {
    let map = client.map();
    let ns = map
        .namespaces
        .iter()
        .find(|n| n.name == namespace)
        .ok_or_else(|| Failure {
            code: 3,
            message: format!("no namespace {namespace:?} (see `tidectl namespace list`)"),
        })?;
    if !ns.content_addressed {
        return Ok(key.as_bytes().to_vec());
    }
    parse_digest(key).ok_or_else(|| {
        usage(format!(
            "namespace {namespace:?} is content-addressed: keys are SHA-256 digests (64 hex digits), not {key:?}"
        ))
    })
}

fn is_content_addressed(client: &Client, namespace: &str) -> bool {
    client
        .map()
        .namespaces
        .iter()
        .any(|n| n.name == namespace && n.content_addressed)
}

/// Bytes from hex digits (an even number of them).
fn parse_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A key as text: itself when it is printable UTF-8 without a backslash,
/// else with escapes (a backslash escaped too, so no two keys print alike:
/// the text `a\x01` and the bytes `a`, 0x01 did).
fn display_key(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(text) if !text.chars().any(|c| c.is_control() || c == '\\') => text.to_string(),
        _ => key.escape_ascii().to_string(),
    }
}

fn parse_digest(text: &str) -> Option<Vec<u8>> {
    let text = text.trim();
    if text.len() != 64 {
        return None;
    }
    (0..32)
        .map(|i| u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

fn progress_bar(total: Option<u64>) -> Option<indicatif::ProgressBar> {
    const LARGE: u64 = 8 << 20;
    if !std::io::stderr().is_terminal() || total.is_some_and(|t| t < LARGE) {
        return None;
    }
    let bar = match total {
        Some(total) => indicatif::ProgressBar::new(total),
        None => indicatif::ProgressBar::no_length(),
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Some(bar)
}

fn print(json: bool, value: serde_json::Value, text: String) {
    if json {
        println!("{value}");
    } else if !text.is_empty() {
        println!("{text}");
    }
}

async fn put(
    cli: &Cli,
    client: &Client,
    namespace: &str,
    key: &str,
    file: Option<&PathBuf>,
    content: bool,
) -> Outcome {
    let (key_bytes, path) = if content {
        if file.is_some() {
            return Err(usage("with --content give only NAMESPACE and FILE"));
        }
        // Elsewhere the key would be the 32 raw digest bytes, which no
        // command taking keys as text can name again (stored for good in
        // a durable namespace).
        if !is_content_addressed(client, namespace) {
            return Err(usage(format!(
                "--content stores under the content's digest: namespace {namespace:?} is not content-addressed (give a KEY instead)"
            )));
        }
        (None, PathBuf::from(key))
    } else {
        let path = file
            .cloned()
            .ok_or_else(|| usage("give NAMESPACE KEY FILE (or - for stdin)"))?;
        (Some(parse_key(client, namespace, key)?), path)
    };
    let outcome = if path.as_os_str() == "-" {
        if content {
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes)
                .map_err(|e| usage(format!("stdin: {e}")))?;
            let digest = tidepool_client::sha256(&bytes);
            client.put(namespace, &digest, &bytes).await?
        } else {
            let key = key_bytes.expect("set without --content");
            client
                .put_stream(namespace, &key, tokio::io::stdin())
                .await?
        }
    } else {
        let file = tokio::fs::File::open(&path)
            .await
            .map_err(|e| usage(format!("cannot read {}: {e}", path.display())))?;
        let size = file.metadata().await.map(|m| m.len()).ok();
        let key = match key_bytes {
            Some(key) => key,
            None => {
                // The key is the digest: hash the file first, a block at a
                // time (it was read whole into memory: a file larger than
                // memory could not be stored).
                file_sha256(&path)
                    .await
                    .map_err(|e| usage(format!("cannot read {}: {e}", path.display())))?
                    .to_vec()
            }
        };
        let bar = progress_bar(size);
        let result = client
            .put_stream_progress(namespace, &key, file, |done| {
                if let Some(bar) = &bar {
                    bar.set_position(done);
                }
            })
            .await;
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        result?
    };
    let digest = hex(&outcome.sha256);
    print(
        cli.json,
        json!({"size": outcome.size, "sha256": digest, "epoch": outcome.epoch, "already_present": outcome.already_present}),
        if content {
            digest
        } else {
            format!("stored {} bytes, sha256 {digest}", outcome.size)
        },
    );
    Ok(())
}

/// The SHA-256 of the file at `path`, read a mebibyte at a time.
async fn file_sha256(path: &std::path::Path) -> std::io::Result<[u8; 32]> {
    use tokio::io::AsyncReadExt;
    let mut file = tokio::fs::File::open(path).await?;
    use sha2::Digest as _;
    let mut hasher = sha2::Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer).await?;
        if n == 0 {
            return Ok(hasher.finalize().into());
        }
        hasher.update(&buffer[..n]);
    }
}

/// A temporary name beside `path`, unique to this process and call:
/// `.NAME.PID-RANDOM.tidectl-partial`.
fn partial_path(path: &std::path::Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "output".into(), |n| n.to_string_lossy().into_owned());
    let unique = format!(
        ".{name}.{}-{:016x}.tidectl-partial",
        std::process::id(),
        rand::random::<u64>()
    );
    path.with_file_name(unique)
}

async fn get(client: &Client, namespace: &str, key: &str, output: Option<&PathBuf>) -> Outcome {
    let key = parse_key(client, namespace, key)?;
    match output {
        Some(path) => {
            // Into a temporary file renamed on success: a failed or
            // unverifiable read leaves no partial output behind. A name of
            // its own, made exclusively (before, `out.1` and `out.2` shared
            // `out.tidectl-partial`: two downloads at once wrote into one
            // file, and one exited 0 with the other's bytes in it). A
            // device or pipe (`-o /dev/null`) is written directly.
            if path.exists() && !path.is_file() {
                let file = tokio::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .await
                    .map_err(|e| usage(format!("cannot write {}: {e}", path.display())))?;
                client.get_stream(namespace, &key, file).await?;
                return Ok(());
            }
            let tmp = partial_path(path);
            let file = tokio::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .await
                .map_err(|e| usage(format!("cannot write {}: {e}", tmp.display())))?;
            let bar = progress_bar(None);
            let result = client
                .get_stream_progress(namespace, &key, file, |done, total| {
                    if let Some(bar) = &bar {
                        bar.set_length(total);
                        bar.set_position(done);
                    }
                })
                .await;
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            if let Err(e) = result {
                let _ = std::fs::remove_file(&tmp);
                return Err(e.into());
            }
            if let Err(e) = std::fs::rename(&tmp, path) {
                let _ = std::fs::remove_file(&tmp);
                return Err(usage(format!("cannot write {}: {e}", path.display())));
            }
        }
        None => {
            // Streamed: each chunk is verified before it is printed, the
            // whole blob's digest at the end (a mismatch then exits 1
            // after the bytes went out). Before, the whole blob was held
            // in memory first: a blob larger than memory could not be
            // read to stdout at all.
            match client
                .get_stream(namespace, &key, tokio::io::stdout())
                .await
            {
                Ok(_) => {}
                Err(tidepool_client::Error::Io(e)) => {
                    return Err(Failure {
                        code: 1,
                        message: format!("stdout: {e}"),
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

fn state_name(state: i32) -> String {
    NodeState::try_from(state)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("NODE_STATE_")
                .to_lowercase()
        })
        .unwrap_or_else(|_| "unknown".into())
}

fn retention_text(ns: &Namespace) -> String {
    match ns.retention.as_ref().and_then(|r| r.policy.as_ref()) {
        Some(retention::Policy::Retain(r)) => format!("retain {} epochs", r.epochs),
        _ => "durable".into(),
    }
}

/// What a node's writes wait for, from its last report: `synced`,
/// `buffered` (acknowledged before they are on disk), or `unknown` (no
/// report yet, or a version that does not say).
fn writes_name(report: Option<&NodeStatus>) -> &'static str {
    match report.map(|r| r.durability()) {
        Some(Durability::Synced) => "synced",
        Some(Durability::Buffered) => "buffered",
        _ => "unknown",
    }
}

fn restored_text(restored: &RestoreMapResponse) -> String {
    let map = restored.map.clone().unwrap_or_default();
    let mut out = format!(
        "restored cluster {} map v{} ({} nodes, {} shards), the newest the nodes hold, from {}; the store held cluster {} v{}",
        map.cluster_id,
        map.version,
        map.nodes.len(),
        map.shards.len(),
        restored.from_node_address,
        restored.previous_cluster_id,
        restored.previous_version
    );
    if !restored.unanswered_nodes.is_empty() {
        out.push_str(&format!(
            "\nnot asked (no answer): {}; each takes the restored map when it reports again",
            restored.unanswered_nodes.join(", ")
        ));
    }
    if restored.skipped_ids > 0 {
        out.push_str(&format!(
            "\nnamespace and shard ids skip {} ahead: a newer map than the one restored may have handed some out; the map's version skips past any such map's, so its holder takes this one when it is back (what only it held is left out)",
            restored.skipped_ids
        ));
    }
    out
}

fn restored_json(restored: &RestoreMapResponse) -> serde_json::Value {
    let map = restored.map.clone().unwrap_or_default();
    json!({
        "cluster_id": map.cluster_id, "map_version": map.version,
        "nodes": map.nodes.len(), "shards": map.shards.len(),
        "from_node": restored.from_node_address,
        "unanswered_nodes": restored.unanswered_nodes,
        "previous_cluster_id": restored.previous_cluster_id,
        "previous_version": restored.previous_version,
        "skipped_ids": restored.skipped_ids,
    })
}

fn status_text(status: &ClusterStatus) -> String {
    let map = status.map.clone().unwrap_or_default();
    let mut out = String::new();
    if status.newer_map_on_node != 0 {
        out += &format!(
            "WARNING: node {} holds map v{}, newer than the coordinator's store (v{}): the store was restored from an older snapshot, and nothing is changed until `tidectl cluster restore-map --from-node ADDRESS`\n\n",
            status.newer_map_on_node, status.newer_map_version, map.version
        );
    }
    for refused in &status.refused_nodes {
        out += &format!(
            "WARNING: node {} ({}) holds data of cluster {}, not of this coordinator's cluster {}, and is refused ({} s ago): if the coordinator's store (etcd, its key prefix) lost that cluster, `tidectl cluster restore-map --from-node {}` puts its map back from the nodes\n\n",
            refused.node_id,
            refused.address,
            refused.cluster_id,
            map.cluster_id,
            refused.seconds_ago,
            if refused.address.is_empty() {
                "ADDRESS"
            } else {
                &refused.address
            },
        );
    }
    for (node, replica) in unlisted_replicas(status) {
        let range = replica.range.unwrap_or_default();
        out += &format!(
            "WARNING: node {node} hosts a replica of shard {} ([{:#018x}, {:#018x}]{}), which the map does not list: no request reaches it. A split whose publication the map lost (restored from an older map?) leaves its new shard so until the coordinator puts it back (once its group and the parent's have leaders whose ranges cover the parent's); its data stays on the node\n\n",
            replica.shard_id,
            range.start,
            range.end,
            if replica.is_leader { ", leading" } else { "" },
        );
    }
    out += &format!(
        "cluster {} map v{} epoch {} replication {} (answered by {}{})\n\nnodes:\n",
        map.cluster_id,
        map.version,
        map.epoch,
        map.replication_factor,
        status.coordinator_id,
        if status.is_leader { ", the leader" } else { "" }
    );
    for node in &map.nodes {
        let report = status.nodes.iter().find(|n| n.node_id == node.node_id);
        out += &format!(
            "  {:>3} {:<9} {} zone={:?} writes={} replicas={} data={} MiB\n",
            node.node_id,
            state_name(node.state),
            node.address,
            node.zone,
            writes_name(report),
            report.map_or(0, |r| r.replicas.len()),
            report.map_or(0, |r| r
                .replicas
                .iter()
                .map(|x| x.disk_used_bytes)
                .sum::<u64>()
                >> 20)
        );
    }
    out += "\nshards:\n";
    for shard in &map.shards {
        let replicas: Vec<String> = shard
            .replicas
            .iter()
            .map(|r| r.node_id.to_string())
            .collect();
        out += &format!(
            "  {:>3} [{:#018x}, {:#018x}] leader {} replicas {}",
            shard.shard_id,
            shard.hash_start,
            shard.hash_end,
            shard.leader_hint,
            replicas.join(",")
        );
        if let Some(leader) = leader_report(status, shard) {
            if let Some(bytes) = leader.data_bytes {
                out += &format!(" data {} MiB", bytes >> 20);
            }
            out += &format!(" {:.0} req/s", leader.requests_per_second);
        }
        if let Some(split) = &shard.split {
            out += &format!(
                " splitting at {:#018x} into shard {}",
                split.at, split.child_shard_id
            );
        }
        let missing = files_missing(status, shard.shard_id);
        if !missing.is_empty() {
            let nodes: Vec<String> = missing.iter().map(u64::to_string).collect();
            out += &format!(" files missing on node {} (rebuilding)", nodes.join(","));
        }
        let failed = replicas_where(status, shard.shard_id, |r| r.failed);
        if !failed.is_empty() {
            let nodes: Vec<String> = failed.iter().map(u64::to_string).collect();
            out += &format!(
                " engine failed on node {} (down; replaced after the down grace period)",
                nodes.join(",")
            );
        }
        let holding = votes_held(status, shard.shard_id);
        if !holding.is_empty() {
            let nodes: Vec<String> = holding.iter().map(u64::to_string).collect();
            out += &format!(
                " votes held on node {} (founded on an empty disk, catching up)",
                nodes.join(",")
            );
        }
        out += "\n";
    }
    out += &format!("\nmoves in progress: {}\n", status.moves.len());
    for m in &status.moves {
        let step = MoveStep::try_from(m.step)
            .map(|s| {
                s.as_str_name()
                    .trim_start_matches("MOVE_STEP_")
                    .to_lowercase()
            })
            .unwrap_or_default();
        out += &format!(
            "  shard {} {} -> {} ({step})\n",
            m.shard_id, m.from_node, m.to_node
        );
    }
    if let Some(epochs) = &status.epochs {
        out += &format!("\nepoch drops (current epoch {}):\n", epochs.current_epoch);
        for ns in &epochs.namespaces {
            out += &format!(
                "  {}: below {} on {}/{} shards\n",
                ns.namespace, ns.drop_below, ns.shards_done, ns.shards_total
            );
        }
    }
    out
}

/// Nodes whose replica of `shard_id` reports `what` of itself (its files
/// missing: down, and being rebuilt by the coordinator; its votes held:
/// founded on an empty disk and not caught up yet).
fn replicas_where(
    status: &ClusterStatus,
    shard_id: u32,
    what: fn(&ReplicaStatus) -> bool,
) -> Vec<u64> {
    status
        .nodes
        .iter()
        .filter(|n| n.replicas.iter().any(|r| r.shard_id == shard_id && what(r)))
        .map(|n| n.node_id)
        .collect()
}

fn files_missing(status: &ClusterStatus, shard_id: u32) -> Vec<u64> {
    replicas_where(status, shard_id, |r| r.files_missing)
}

fn votes_held(status: &ClusterStatus, shard_id: u32) -> Vec<u64> {
    replicas_where(status, shard_id, |r| r.votes_held)
}

/// Replicas the nodes report of shards the map neither lists nor is
/// splitting into, by node: groups the map lost (shard ids are never
/// reused, and shards never merge).
fn unlisted_replicas(status: &ClusterStatus) -> Vec<(u64, &ReplicaStatus)> {
    let Some(map) = status.map.as_ref() else {
        return Vec::new();
    };
    let listed = |shard_id: u32| {
        map.shards.iter().any(|s| {
            s.shard_id == shard_id || s.split.is_some_and(|p| p.child_shard_id == shard_id)
        })
    };
    status
        .nodes
        .iter()
        .flat_map(|n| n.replicas.iter().map(move |r| (n.node_id, r)))
        .filter(|(_, r)| !listed(r.shard_id))
        .collect()
}

/// The shard's leader's own report of it, if its node reported one.
fn leader_report<'a>(status: &'a ClusterStatus, shard: &ShardInfo) -> Option<&'a ReplicaStatus> {
    status
        .nodes
        .iter()
        .flat_map(|n| n.replicas.iter())
        .find(|r| r.shard_id == shard.shard_id && r.is_leader)
}

fn status_json(status: &ClusterStatus) -> serde_json::Value {
    let map = status.map.clone().unwrap_or_default();
    json!({
        "cluster_id": map.cluster_id,
        "map_version": map.version,
        "epoch": map.epoch,
        "replication_factor": map.replication_factor,
        "coordinator": status.coordinator_id,
        "is_leader": status.is_leader,
        "newer_map_on_node": status.newer_map_on_node,
        "newer_map_version": status.newer_map_version,
        "refused_nodes": status.refused_nodes.iter().map(|r| json!({
            "id": r.node_id, "address": r.address, "cluster_id": r.cluster_id,
            "seconds_ago": r.seconds_ago,
        })).collect::<Vec<_>>(),
        "unlisted_replicas": unlisted_replicas(status).into_iter().map(|(node, r)| json!({
            "node": node, "shard": r.shard_id, "is_leader": r.is_leader,
            "hash_start": r.range.unwrap_or_default().start,
            "hash_end": r.range.unwrap_or_default().end,
        })).collect::<Vec<_>>(),
        "nodes": map.nodes.iter().map(|n| json!({
            "id": n.node_id, "address": n.address, "zone": n.zone, "state": state_name(n.state),
            "writes": writes_name(status.nodes.iter().find(|r| r.node_id == n.node_id)),
        })).collect::<Vec<_>>(),
        "shards": map.shards.iter().map(|s| json!({
            "id": s.shard_id, "hash_start": s.hash_start, "hash_end": s.hash_end,
            "leader": s.leader_hint,
            "replicas": s.replicas.iter().map(|r| r.node_id).collect::<Vec<_>>(),
            "split": s.split.as_ref().map(|p| json!({"child": p.child_shard_id, "at": p.at})),
            "data_bytes": leader_report(status, s).and_then(|r| r.data_bytes),
            "requests_per_second": leader_report(status, s).map(|r| r.requests_per_second),
            "files_missing_on": files_missing(status, s.shard_id),
            "failed_on": replicas_where(status, s.shard_id, |r| r.failed),
            "votes_held_on": votes_held(status, s.shard_id),
        })).collect::<Vec<_>>(),
        "moves": status.moves.iter().map(|m| json!({
            "shard": m.shard_id, "from": m.from_node, "to": m.to_node, "step": m.step,
        })).collect::<Vec<_>>(),
        "epoch_drops": status.epochs.as_ref().map(|e| e.namespaces.iter().map(|n| json!({
            "namespace": n.namespace, "drop_below": n.drop_below,
            "shards_done": n.shards_done, "shards_total": n.shards_total,
        })).collect::<Vec<_>>()),
    })
}

/// TLS material and token: from the flags, else from the dev directory
/// when it holds them.
fn credentials(cli: &Cli, config: &mut ClientConfig) -> Outcome {
    // The dev cluster's material only for a cluster on this machine: its
    // admin token was sent to whatever `--coordinator` named (a plaintext
    // one elsewhere included) when run from a directory holding it.
    let dev = !cli.insecure && cli.coordinator.iter().all(|a| is_loopback(a));
    if cli.token.is_some() && cli.token_file.is_some() {
        // Which one was meant cannot be told (the environment fills
        // either): before, TIDEPOOL_TOKEN silently won over --token-file.
        return Err(Failure {
            code: 2,
            message: "both a token (--token or TIDEPOOL_TOKEN) and a token file (--token-file or TIDEPOOL_TOKEN_FILE) are given: give one".into(),
        });
    }
    if !cli.insecure {
        let dir = cli.tls_dir.clone().or_else(|| {
            let dev_tls = cli.dev_dir.join("tls");
            (dev && dev_tls.join("ca.pem").exists()).then_some(dev_tls)
        });
        if let Some(dir) = dir {
            config.tls = Some(TlsFiles {
                cert: dir.join("client.pem"),
                key: dir.join("client-key.pem"),
                ca: dir.join("ca.pem"),
            });
        }
    }
    let token_file = cli.token_file.clone().or_else(|| {
        let dev_token = cli.dev_dir.join("admin.token");
        (dev && dev_token.exists()).then_some(dev_token)
    });
    config.token = match (&cli.token, token_file) {
        (Some(token), _) => Some(token.clone()),
        (None, Some(path)) => Some(read_token_file(&path).map_err(|e| Failure {
            code: 2,
            message: format!("token file: {e}"),
        })?),
        (None, None) => None,
    };
    Ok(())
}

/// Whether a coordinator address names this machine (`127.0.0.0/8`,
/// `::1`, `localhost`).
fn is_loopback(address: &str) -> bool {
    let rest = address.split_once("://").map_or(address, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = if let Some(bracketed) = authority.strip_prefix('[') {
        bracketed.split(']').next().unwrap_or("")
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn parse_grant(text: &str) -> Result<TokenGrant, Failure> {
    let usage = || Failure {
        code: 2,
        message: format!(
            "--grant {text:?}: give NAMESPACE=ROLE[,ROLE...] with roles read, write, append-only, delete"
        ),
    };
    let (namespace, roles) = text.split_once('=').ok_or_else(usage)?;
    let roles = roles
        .split(',')
        .map(|r| role_of(r.trim()).map(|r| r as i32).ok_or_else(usage))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(TokenGrant {
        namespace: namespace.to_string(),
        roles,
    })
}

fn role_names(grant: &TokenGrant) -> String {
    grant.roles().map(role_name).collect::<Vec<_>>().join(",")
}

async fn token_command(cli: &Cli, client: &Client, command: &TokenCommand) -> Outcome {
    match command {
        TokenCommand::Create {
            name,
            admin,
            grants,
        } => {
            let grants = grants
                .iter()
                .map(|g| parse_grant(g))
                .collect::<Result<Vec<_>, _>>()?;
            let (secret, _) = client.create_token(name, *admin, grants).await?;
            print(
                cli.json,
                json!({"name": name, "secret": secret}),
                secret.clone(),
            );
        }
        TokenCommand::List => {
            let tokens = client.list_tokens().await?;
            let rows: Vec<String> = tokens
                .iter()
                .map(|t| {
                    let grants: Vec<String> = t
                        .grants
                        .iter()
                        .map(|g| format!("{}={}", g.namespace, role_names(g)))
                        .collect();
                    format!(
                        "{}{} {}",
                        t.name,
                        if t.admin { " admin" } else { "" },
                        grants.join(" ")
                    )
                })
                .collect();
            let value = json!(tokens.iter().map(|t| json!({
                "name": t.name, "admin": t.admin, "created_ms": t.created_ms,
                "grants": t.grants.iter().map(|g| json!({"namespace": g.namespace, "roles": role_names(g)})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>());
            print(cli.json, value, rows.join("\n"));
        }
        TokenCommand::Revoke { name } => {
            let answer = client.revoke_token_answer(name).await?;
            if !answer.existed {
                return Err(Failure {
                    code: 3,
                    message: format!("no token {name:?}"),
                });
            }
            if !answer.behind_nodes.is_empty() {
                eprintln!(
                    "warning: live nodes {:?} had not taken the map without the token yet; they may take it until they do",
                    answer.behind_nodes
                );
            }
            print(
                cli.json,
                json!({"revoked": name, "behind_nodes": answer.behind_nodes}),
                String::new(),
            );
        }
    }
    Ok(())
}

async fn run(cli: &Cli) -> Outcome {
    let mut config = ClientConfig::new(&cli.coordinator);
    config.timeout = Duration::from_secs(cli.timeout);
    // One-shot commands need no map watch; a load runs long enough to.
    config.watch = matches!(cli.command, Command::Load { .. } | Command::Bench { .. });
    credentials(cli, &mut config)?;
    let client = Client::with_config(config).await.map_err(|e| Failure {
        // A refused credential keeps its own exit code, and so does bad
        // local input (a missing TLS file, a malformed address): retrying
        // it will not help.
        code: match e.code() {
            ErrorCode::Unauthenticated | ErrorCode::PermissionDenied => 5,
            ErrorCode::InvalidArgument => 2,
            _ => 4,
        },
        message: format!(
            "cannot reach the cluster at {}: {e}",
            cli.coordinator.join(", ")
        ),
    })?;
    match &cli.command {
        Command::Load {
            namespace,
            seconds,
            size,
            writers,
            prefix,
            record,
            stop_file,
        } => {
            let prefix = prefix.clone().unwrap_or_else(|| {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                format!("load-{}", now.as_secs())
            });
            let settings = load::Load {
                namespace: namespace.clone(),
                seconds: *seconds,
                size: *size,
                writers: *writers,
                prefix,
                record: record.clone(),
                stop_file: stop_file.clone(),
            };
            load::load(cli.json, &client, settings).await
        }
        Command::Bench {
            namespace,
            concurrency,
            size,
            seconds,
            count,
            mix,
            keys,
            distribution,
            prefix,
            no_prefill,
            seed,
            durability,
        } => {
            let seed = seed.unwrap_or_else(|| {
                let seed = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos() as u64;
                eprintln!("bench: --seed {seed}");
                seed
            });
            let settings = bench::Bench {
                namespace: namespace.clone(),
                concurrency: (*concurrency).max(1),
                size: *size,
                seconds: *seconds,
                count: *count,
                mix: *mix,
                keys: *keys,
                distribution: *distribution,
                prefix: prefix.clone().unwrap_or_else(|| format!("bench-{size}")),
                prefill: !no_prefill,
                seed,
            };
            bench::bench(cli.json, &client.with_durability(*durability), settings).await
        }
        Command::Verify { namespace, record } => {
            load::verify(cli.json, &client, namespace, record).await
        }
        Command::Put {
            namespace,
            key,
            file,
            content,
        } => put(cli, &client, namespace, key, file.as_ref(), *content).await,
        Command::Get {
            namespace,
            key,
            output,
        } => get(&client, namespace, key, output.as_ref()).await,
        Command::Head { namespace, key } => {
            let key = parse_key(&client, namespace, key)?;
            let meta = client.head(namespace, &key).await?;
            let digest = hex(&meta.sha256);
            print(
                cli.json,
                json!({"size": meta.size, "sha256": digest, "epoch": meta.epoch, "chunked": meta.chunked}),
                format!(
                    "size {} sha256 {digest} epoch {}{}",
                    meta.size,
                    meta.epoch,
                    if meta.chunked { " (chunked)" } else { "" }
                ),
            );
            Ok(())
        }
        Command::Ls {
            namespace,
            prefix,
            start_after,
            limit,
            long,
        } => {
            let content_addressed = is_content_addressed(&client, namespace);
            let bytes_of = |text: &str| -> Result<Vec<u8>, Failure> {
                if content_addressed {
                    parse_hex(text).ok_or_else(|| {
                        usage(format!(
                            "namespace {namespace:?} is content-addressed: give keys and prefixes in hex, not {text:?}"
                        ))
                    })
                } else {
                    Ok(text.as_bytes().to_vec())
                }
            };
            let options = ListOptions {
                prefix: bytes_of(prefix)?,
                start_after: start_after.as_deref().map(bytes_of).transpose()?,
                page_size: 0,
            };
            let mut lister = client.list(namespace, options);
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            let mut count = 0u64;
            while limit.is_none_or(|limit| count < limit) {
                let Some(entry) = lister.next().await? else {
                    break;
                };
                count += 1;
                let key = if content_addressed {
                    hex(&entry.key)
                } else {
                    display_key(&entry.key)
                };
                let line = if cli.json {
                    json!({
                        "key": key,
                        "key_hex": hex(&entry.key),
                        "size": entry.size,
                        "sha256": hex(&entry.sha256),
                        "epoch": entry.epoch,
                        "chunked": entry.chunked,
                    })
                    .to_string()
                } else if *long {
                    format!(
                        "{:>12} {:>6} {} {key}",
                        entry.size,
                        entry.epoch,
                        hex(&entry.sha256)
                    )
                } else {
                    key
                };
                writeln!(out, "{line}").map_err(|e| usage(format!("stdout: {e}")))?;
            }
            out.flush().map_err(|e| usage(format!("stdout: {e}")))?;
            if lister.incomplete() {
                eprintln!(
                    "note: some shards hold blobs written before keys were indexed; those are not listed (docs/design/listing.md)"
                );
            }
            Ok(())
        }
        Command::Rm { namespace, key } => {
            let key_bytes = parse_key(&client, namespace, key)?;
            if client.delete(namespace, &key_bytes).await? {
                print(cli.json, json!({"deleted": true}), String::new());
                Ok(())
            } else {
                print(cli.json, json!({"deleted": false}), String::new());
                Err(Failure {
                    code: 3,
                    message: format!("no blob {key:?} in {namespace:?}"),
                })
            }
        }
        Command::Exists { namespace } => {
            let mut texts = Vec::new();
            let mut keys = Vec::new();
            for line in std::io::stdin().lock().lines() {
                let line = line.map_err(|e| usage(format!("stdin: {e}")))?;
                let line = line.trim();
                if line.is_empty() {
                    continue;
                }
                keys.push(parse_key(&client, namespace, line)?);
                texts.push(line.to_string());
            }
            let present = client.batch_exists(namespace, &keys).await?;
            let missing: Vec<&String> = texts
                .iter()
                .zip(&present)
                .filter(|(_, p)| !**p)
                .map(|(t, _)| t)
                .collect();
            print(
                cli.json,
                json!({"present": present.iter().filter(|p| **p).count(), "missing": missing}),
                missing
                    .iter()
                    .map(|m| m.as_str())
                    .collect::<Vec<_>>()
                    .join("\n"),
            );
            if missing.is_empty() {
                Ok(())
            } else {
                Err(Failure {
                    code: 3,
                    message: format!("{} of {} keys are missing", missing.len(), keys.len()),
                })
            }
        }
        Command::Cluster {
            command: ClusterCommand::Status,
        } => {
            let status = client.cluster_status().await?;
            print(cli.json, status_json(&status), status_text(&status));
            Ok(())
        }
        Command::Cluster {
            command:
                ClusterCommand::RestoreMap {
                    from_node,
                    allow_unanswered,
                },
        } => {
            let restored = client.restore_map(from_node, *allow_unanswered).await?;
            print(cli.json, restored_json(&restored), restored_text(&restored));
            Ok(())
        }
        Command::Namespace {
            command:
                NamespaceCommand::Create {
                    name,
                    retain,
                    content_addressed,
                },
        } => {
            let retention = match retain {
                Some(0) => return Err(usage("--retain must be at least 1")),
                Some(n) => RetentionPolicy::Epochs(*n),
                None => RetentionPolicy::Durable,
            };
            let ns = client
                .create_namespace(name, *content_addressed, retention)
                .await?;
            print(
                cli.json,
                json!({"name": ns.name, "id": ns.id, "content_addressed": ns.content_addressed, "retention": retention_text(&ns)}),
                format!(
                    "created namespace {} (id {}, {})",
                    ns.name,
                    ns.id,
                    retention_text(&ns)
                ),
            );
            Ok(())
        }
        Command::Namespace {
            command:
                NamespaceCommand::SetRetention {
                    name,
                    retain,
                    durable: _,
                },
        } => {
            let retention = match retain {
                Some(0) => return Err(usage("--retain must be at least 1")),
                Some(n) => RetentionPolicy::Epochs(*n),
                None => RetentionPolicy::Durable,
            };
            let ns = client.set_retention(name, retention).await?;
            print(
                cli.json,
                json!({"name": ns.name, "id": ns.id, "retention": retention_text(&ns)}),
                format!("namespace {}: {}", ns.name, retention_text(&ns)),
            );
            Ok(())
        }
        Command::Namespace {
            command: NamespaceCommand::List,
        } => {
            let list = client.list_namespaces().await?;
            let text = list
                .iter()
                .map(|ns| {
                    format!(
                        "{:<24} id {:<4} {}{}",
                        ns.name,
                        ns.id,
                        retention_text(ns),
                        if ns.content_addressed {
                            ", content-addressed"
                        } else {
                            ""
                        }
                    )
                })
                .collect::<Vec<_>>()
                .join("\n");
            let value = json!(
                list.iter()
                    .map(|ns| json!({
                        "name": ns.name, "id": ns.id, "content_addressed": ns.content_addressed,
                        "retention": retention_text(ns), "created_epoch": ns.created_epoch,
                    }))
                    .collect::<Vec<_>>()
            );
            print(cli.json, value, text);
            Ok(())
        }
        Command::Epoch {
            command: EpochCommand::Advance { expect },
        } => {
            let answer = client.advance_epoch_answer(*expect).await?;
            let epoch = answer.epoch;
            if !answer.behind_nodes.is_empty() {
                eprintln!(
                    "warning: live nodes {:?} had not taken the new epoch's map yet; writes they take until they do carry epoch {}",
                    answer.behind_nodes,
                    epoch - 1
                );
            }
            print(
                cli.json,
                json!({"epoch": epoch, "behind_nodes": answer.behind_nodes}),
                format!("epoch {epoch}"),
            );
            Ok(())
        }
        Command::Token { command } => token_command(cli, &client, command).await,
        Command::Node {
            command: NodeCommand::Drain { id },
        } => {
            let replicas = client.drain_node(*id).await?;
            print(
                cli.json,
                json!({"node": id, "replicas_to_move": replicas}),
                format!(
                    "draining node {id}: {replicas} replicas to move (see `tidectl cluster status`)"
                ),
            );
            Ok(())
        }
        Command::Shard {
            command: ShardCommand::Split { id, at },
        } => {
            // 0 asks the shard to choose (its middle): given by hand it is
            // no point inside a shard, and a split cannot be undone.
            if *at == Some(0) {
                return Err(usage(
                    "--at 0 is no point inside a shard: leave --at out to split at the middle",
                ));
            }
            let (child, at) = client.split_shard(*id, at.unwrap_or(0)).await?;
            print(
                cli.json,
                json!({"shard": id, "child": child, "at": at}),
                format!(
                    "splitting shard {id} at {at:#018x}: shard {child} takes the upper part (see `tidectl cluster status`)"
                ),
            );
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tidectl: cannot start: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(&cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            if cli.json {
                println!(
                    "{}",
                    json!({"error": failure.message, "exit_code": failure.code})
                );
            }
            eprintln!("tidectl: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No two keys are displayed alike.
    #[test]
    fn keys_display_unambiguously() {
        assert_eq!(display_key(b"reports/q3.pdf"), "reports/q3.pdf");
        assert_eq!(display_key("été".as_bytes()), "été");
        // The byte 0x01, and the text backslash-x-0-1.
        assert_eq!(display_key(b"a\x01"), "a\\x01");
        assert_eq!(display_key(b"a\\x01"), "a\\\\x01");
        assert_ne!(display_key(b"a\x01"), display_key(b"a\\x01"));
    }

    /// The dev directory's token and TLS material go only to a cluster on
    /// this machine.
    #[test]
    fn only_loopback_coordinators_get_the_dev_credentials() {
        for local in [
            "http://127.0.0.1:7400",
            "https://localhost:7400",
            "http://[::1]:7400",
            "127.0.0.2:7400",
        ] {
            assert!(is_loopback(local), "{local}");
        }
        for remote in [
            "http://10.0.0.7:7400",
            "https://coordinator.example:7400",
            "http://[2001:db8::1]:7400",
            "http://localhost.example:7400",
        ] {
            assert!(!is_loopback(remote), "{remote}");
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("admin.token"), "dev-secret\n").unwrap();
        let dev_dir = dir.path().display().to_string();
        for (coordinator, expected) in [
            ("http://127.0.0.1:7400", Some("dev-secret")),
            ("http://10.0.0.7:7400", None),
        ] {
            let cli = Cli::try_parse_from([
                "tidectl",
                "--coordinator",
                coordinator,
                "--dev-dir",
                &dev_dir,
                "cluster",
                "status",
            ])
            .unwrap();
            let mut config = ClientConfig::new(&cli.coordinator);
            assert!(credentials(&cli, &mut config).is_ok());
            assert_eq!(config.token.as_deref(), expected, "{coordinator}");
        }
    }

    /// A replica down for its files missing shows on its shard's line and
    /// in the JSON.
    #[test]
    fn status_names_replicas_whose_files_are_missing() {
        let shard = ShardInfo {
            shard_id: 7,
            ..ShardInfo::default()
        };
        let report = |node_id, files_missing| NodeStatus {
            node_id,
            replicas: vec![ReplicaStatus {
                shard_id: 7,
                files_missing,
                ..ReplicaStatus::default()
            }],
            ..NodeStatus::default()
        };
        let status = ClusterStatus {
            map: Some(tidepool_client::proto::v1::ClusterMap {
                shards: vec![shard],
                ..Default::default()
            }),
            nodes: vec![report(1, false), report(3, true)],
            ..ClusterStatus::default()
        };
        let text = status_text(&status);
        assert!(
            text.contains("files missing on node 3 (rebuilding)"),
            "{text}"
        );
        assert_eq!(
            status_json(&status)["shards"][0]["files_missing_on"],
            json!([3])
        );
        let healthy = ClusterStatus {
            nodes: vec![report(1, false)],
            ..status
        };
        assert!(!status_text(&healthy).contains("files missing"));
    }

    /// A coordinator whose store is behind a node's map says so first.
    #[test]
    fn status_warns_of_a_store_behind_the_nodes() {
        let status = ClusterStatus {
            map: Some(tidepool_client::proto::v1::ClusterMap {
                version: 7,
                ..Default::default()
            }),
            newer_map_on_node: 3,
            newer_map_version: 9,
            ..ClusterStatus::default()
        };
        let text = status_text(&status);
        assert!(
            text.starts_with(
                "WARNING: node 3 holds map v9, newer than the coordinator's store (v7)"
            ),
            "{text}"
        );
        assert!(text.contains("tidectl cluster restore-map"), "{text}");
        assert_eq!(status_json(&status)["newer_map_version"], json!(9));
        let current = ClusterStatus {
            newer_map_on_node: 0,
            newer_map_version: 0,
            ..status
        };
        assert!(!status_text(&current).contains("WARNING"));
    }

    /// A coordinator that refused nodes of another cluster names them and
    /// the restore that would bring their cluster back.
    #[test]
    fn status_warns_of_nodes_of_another_cluster() {
        let status = ClusterStatus {
            map: Some(tidepool_client::proto::v1::ClusterMap {
                cluster_id: "new".into(),
                version: 2,
                ..Default::default()
            }),
            refused_nodes: vec![tidepool_client::proto::v1::RefusedNode {
                node_id: 2,
                address: "https://node-1:7401".into(),
                cluster_id: "old".into(),
                seconds_ago: 4,
            }],
            ..ClusterStatus::default()
        };
        let text = status_text(&status);
        assert!(
            text.starts_with(
                "WARNING: node 2 (https://node-1:7401) holds data of cluster old, not of this coordinator's cluster new"
            ),
            "{text}"
        );
        assert!(
            text.contains("tidectl cluster restore-map --from-node https://node-1:7401`"),
            "{text}"
        );
        let json = status_json(&status);
        assert_eq!(json["refused_nodes"][0]["cluster_id"], json!("old"));
        assert_eq!(
            json["refused_nodes"][0]["address"],
            json!("https://node-1:7401")
        );
        let none = ClusterStatus {
            refused_nodes: Vec::new(),
            ..status
        };
        assert!(!status_text(&none).contains("WARNING"));
        assert_eq!(status_json(&none)["refused_nodes"], json!([]));
    }

    /// A restore names the node whose map it stored and those that did
    /// not answer.
    #[test]
    fn a_restore_says_where_the_map_came_from() {
        let restored = RestoreMapResponse {
            map: Some(tidepool_client::proto::v1::ClusterMap {
                cluster_id: "c1".into(),
                version: 12,
                ..Default::default()
            }),
            previous_cluster_id: "c1".into(),
            previous_version: 5,
            from_node_address: "http://b:7401".into(),
            unanswered_nodes: vec!["http://c:7401".into()],
            skipped_ids: 1_024,
        };
        let text = restored_text(&restored);
        assert!(
            text.starts_with("restored cluster c1 map v12 (0 nodes, 0 shards), the newest the nodes hold, from http://b:7401; the store held cluster c1 v5"),
            "{text}"
        );
        assert!(
            text.contains("not asked (no answer): http://c:7401"),
            "{text}"
        );
        let json = restored_json(&restored);
        assert_eq!(json["from_node"], json!("http://b:7401"));
        assert_eq!(json["unanswered_nodes"], json!(["http://c:7401"]));
        assert!(text.contains("ids skip 1024 ahead"), "{text}");
        assert_eq!(json["skipped_ids"], json!(1_024));
        let all = RestoreMapResponse {
            unanswered_nodes: Vec::new(),
            skipped_ids: 0,
            ..restored
        };
        assert!(!restored_text(&all).contains("no answer"));
        assert!(!restored_text(&all).contains("skip"));
    }

    /// A replica holding its votes (founded again on an empty disk, not
    /// caught up) shows on its shard's line and in the JSON.
    #[test]
    fn status_names_replicas_holding_their_votes() {
        let report = |node_id, votes_held| NodeStatus {
            node_id,
            replicas: vec![ReplicaStatus {
                shard_id: 4,
                votes_held,
                ..ReplicaStatus::default()
            }],
            ..NodeStatus::default()
        };
        let status = ClusterStatus {
            map: Some(tidepool_client::proto::v1::ClusterMap {
                shards: vec![ShardInfo {
                    shard_id: 4,
                    ..ShardInfo::default()
                }],
                ..Default::default()
            }),
            nodes: vec![report(2, true), report(5, false)],
            ..ClusterStatus::default()
        };
        let text = status_text(&status);
        assert!(text.contains("votes held on node 2 ("), "{text}");
        assert_eq!(
            status_json(&status)["shards"][0]["votes_held_on"],
            json!([2])
        );
        let caught_up = ClusterStatus {
            nodes: vec![report(2, false), report(5, false)],
            ..status
        };
        assert!(!status_text(&caught_up).contains("votes held"));
        assert_eq!(
            status_json(&caught_up)["shards"][0]["votes_held_on"],
            json!([])
        );
    }

    /// A replica of a shard the map does not list (a split whose
    /// publication the map lost) is a warning; the new shard of a split
    /// under way is not.
    #[test]
    fn status_warns_of_replicas_of_shards_the_map_lacks() {
        let replica = |shard_id, is_leader| ReplicaStatus {
            shard_id,
            is_leader,
            range: Some(tidepool_client::proto::v1::HashRange {
                start: 0x8000_0000_0000_0000,
                end: u64::MAX,
            }),
            ..ReplicaStatus::default()
        };
        let status = ClusterStatus {
            map: Some(tidepool_client::proto::v1::ClusterMap {
                shards: vec![ShardInfo {
                    shard_id: 1,
                    split: Some(tidepool_client::proto::v1::SplitIntent {
                        child_shard_id: 3,
                        at: 0x8000_0000_0000_0000,
                    }),
                    ..ShardInfo::default()
                }],
                ..Default::default()
            }),
            nodes: vec![
                NodeStatus {
                    node_id: 2,
                    replicas: vec![replica(1, true), replica(3, false), replica(9, true)],
                    ..NodeStatus::default()
                },
                NodeStatus {
                    node_id: 5,
                    replicas: vec![replica(9, false)],
                    ..NodeStatus::default()
                },
            ],
            ..ClusterStatus::default()
        };
        let text = status_text(&status);
        assert!(
            text.contains("WARNING: node 2 hosts a replica of shard 9 ([0x8000000000000000, 0xffffffffffffffff], leading), which the map does not list"),
            "{text}"
        );
        assert!(
            text.contains("WARNING: node 5 hosts a replica of shard 9 ([0x8000000000000000, 0xffffffffffffffff]), which"),
            "{text}"
        );
        assert!(!text.contains("shard 3 ("), "{text}");
        assert!(!text.contains("shard 1 ("), "{text}");
        let json = status_json(&status);
        assert_eq!(json["unlisted_replicas"].as_array().unwrap().len(), 2);
        assert_eq!(json["unlisted_replicas"][0]["shard"], json!(9));
        assert_eq!(json["unlisted_replicas"][0]["node"], json!(2));
        let published = ClusterStatus {
            nodes: vec![NodeStatus {
                node_id: 2,
                replicas: vec![replica(1, true), replica(3, false)],
                ..NodeStatus::default()
            }],
            ..status
        };
        assert!(!status_text(&published).contains("WARNING"));
    }
}
