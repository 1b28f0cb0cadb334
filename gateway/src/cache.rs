//! The cache operations both protocols share, on the SDK, with the
//! caller's rights: exact presence (touching what is found), verified
//! reads and writes, action results that are only returned whole, trees.
//!
//! Retention: a read of a blob whose epoch is older than the cluster's
//! (and every `FindMissingBlobs`/`GetActionResult` hit) moves the blob —
//! and a chunked blob's chunks — into the current epoch, through the
//! `touch` flag of `BatchExists` (which the read role allows).

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

use bazel_remote_apis::build::bazel::remote::execution::v2::{ActionResult, Directory};
use prost::Message as _;
use tidepool_client::{Client, Error, ErrorCode, Result};
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::names::{BlobDigest, Instance, hex};

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorCode::InvalidArgument, message)
}

fn not_found(message: impl Into<String>) -> Error {
    Error::new(ErrorCode::NotFound, message)
}

/// The digests of `digests` the CAS lacks, in the order given (each once);
/// the ones it holds are touched. A chunked blob counts as present only
/// when every chunk is (and they are touched too).
pub(crate) async fn find_missing(
    client: &Client,
    instance: &Instance,
    digests: &[BlobDigest],
) -> Result<Vec<BlobDigest>> {
    let mut seen = HashSet::new();
    let wanted: Vec<BlobDigest> = digests
        .iter()
        .filter(|d| !d.is_empty_blob() && seen.insert(**d))
        .copied()
        .collect();
    let keys: Vec<Vec<u8>> = wanted
        .iter()
        .map(|d| d.hash.to_vec())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let absent: HashSet<Vec<u8>> = client
        .find_missing(&instance.cas, &keys)
        .await?
        .into_iter()
        .collect();
    // Chunked blobs' manifests and chunks are looked up side by side: one
    // after another, a request naming thousands of large outputs took
    // three round trips each, past a build tool's deadline. Each hash
    // once, however many sizes name it (a request naming one large blob
    // with thousands of sizes read its manifest and looked up its chunks
    // as many times); a digest whose size is not the stored blob's counts
    // as missing (its reads would say `NOT_FOUND`).
    let chunk = client.chunk_size() as u64;
    let mut chunked = wanted
        .iter()
        .filter(|d| d.size > chunk && !absent.contains(&d.hash[..]))
        .map(|d| d.hash)
        .collect::<BTreeSet<_>>()
        .into_iter();
    let mut stored_sizes = HashMap::new();
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        while tasks.len() < CHUNKED_AT_ONCE {
            let Some(hash) = chunked.next() else { break };
            let (client, namespace) = (client.clone(), instance.cas.clone());
            tasks.spawn(async move {
                let size = complete_size(&client, &namespace, &hash).await;
                (hash, size)
            });
        }
        let Some(joined) = tasks.join_next().await else {
            break;
        };
        let (hash, size) =
            joined.map_err(|e| Error::new(ErrorCode::Internal, format!("a look-up task: {e}")))?;
        stored_sizes.insert(hash, size?);
    }
    Ok(wanted
        .into_iter()
        .filter(|d| {
            absent.contains(&d.hash[..])
                || stored_sizes
                    .get(&d.hash)
                    .is_some_and(|size| *size != Some(d.size))
        })
        .collect())
}

/// Chunked blobs [`find_missing`] checks at once.
const CHUNKED_AT_ONCE: usize = 32;

/// The size of a blob stored in chunks if every chunk is present (touching
/// them); `None` if one is not.
async fn complete_size(client: &Client, namespace: &str, key: &[u8]) -> Result<Option<u64>> {
    let chunks = match client.chunks(namespace, key).await {
        Err(e) if e.code() == ErrorCode::NotFound => return Ok(None),
        chunks => chunks?,
    };
    let size = chunks
        .iter()
        .map(|c| c.size)
        .fold(0u64, u64::saturating_add);
    let keys: Vec<Vec<u8>> = chunks.into_iter().map(|c| c.key).collect();
    Ok(client
        .find_missing(namespace, &keys)
        .await?
        .is_empty()
        .then_some(size))
}

/// Moves a blob read in an older epoch into the current one. Failing to
/// is not the reader's problem: it is logged.
pub(crate) async fn keep_alive(
    client: &Client,
    namespace: &str,
    reader: &tidepool_client::BlobReader,
) {
    if !reader.touch_due() {
        return;
    }
    if let Err(e) = client.find_missing(namespace, &reader.stored_keys()).await {
        tracing::warn!(namespace, error = %e, "could not touch a blob that was read");
    }
}

/// An opened blob whole, of at most `limit` bytes, verified, kept alive.
async fn read_opened(
    client: &Client,
    namespace: &str,
    key: &[u8],
    mut reader: tidepool_client::BlobReader,
    limit: u64,
) -> Result<Vec<u8>> {
    if reader.size() > limit {
        return Err(invalid(format!(
            "blob {} is {} bytes; at most {limit} fit here (use ByteStream)",
            hex(key),
            reader.size()
        )));
    }
    let mut out = Vec::with_capacity(reader.size() as usize);
    while let Some(piece) = reader.next_piece().await? {
        out.extend_from_slice(&piece);
    }
    keep_alive(client, namespace, &reader).await;
    Ok(out)
}

/// A CAS blob whole (`limit` as in [`read_all`]); the empty blob is
/// always there.
pub(crate) async fn read_cas(
    client: &Client,
    instance: &Instance,
    digest: BlobDigest,
    limit: u64,
) -> Result<Vec<u8>> {
    if digest.is_empty_blob() {
        return Ok(Vec::new());
    }
    // The size is checked before the blob's bytes are sent (the node's
    // first answer names it): a digest claiming another size for a stored
    // blob costs no read of it. Before, a blob stored whole was fetched
    // and hashed first — a request naming one stored blob thousands of
    // times with a wrong size read it thousands of times.
    let reader = client
        .open_sized(&instance.cas, &digest.hash, digest.size, 0, None)
        .await?;
    read_opened(client, &instance.cas, &digest.hash, reader, limit).await
}

/// Checks `bytes` against `digest` and stores them in the CAS. The size
/// is checked here; the hash where the bytes are stored (the SDK hashes
/// them once for the put, and the node refuses content that does not hash
/// to its key in a content-addressed namespace: `DIGEST_MISMATCH`, nothing
/// stored).
pub(crate) async fn write_cas(
    client: &Client,
    instance: &Instance,
    digest: BlobDigest,
    bytes: &[u8],
) -> Result<()> {
    if bytes.len() as u64 != digest.size {
        return Err(Error::new(
            ErrorCode::DigestMismatch,
            format!(
                "the content is {} bytes, not the {} of {}",
                bytes.len(),
                digest.size,
                hex(&digest.hash)
            ),
        ));
    }
    if bytes.is_empty() {
        if digest.is_empty_blob() {
            return Ok(());
        }
        return Err(Error::new(
            ErrorCode::DigestMismatch,
            format!("the empty content is not {}", hex(&digest.hash)),
        ));
    }
    client.put(&instance.cas, &digest.hash, bytes).await?;
    Ok(())
}

/// Every CAS digest an action result needs: its output files, stdout and
/// stderr, its output directories' trees and every file in them.
async fn outputs(
    client: &Client,
    instance: &Instance,
    result: &ActionResult,
) -> Result<Vec<BlobDigest>> {
    let mut digests = Vec::new();
    let mut trees = Vec::new();
    for file in &result.output_files {
        digests.push(BlobDigest::from_proto(file.digest.as_ref()).map_err(invalid)?);
    }
    for digest in [&result.stdout_digest, &result.stderr_digest]
        .into_iter()
        .flatten()
    {
        digests.push(BlobDigest::from_proto(Some(digest)).map_err(invalid)?);
    }
    // Each tree read once, however many output directories name it.
    let mut named = HashSet::new();
    for directory in &result.output_directories {
        let tree = BlobDigest::from_proto(directory.tree_digest.as_ref()).map_err(invalid)?;
        if named.insert(tree.hash) {
            digests.push(tree);
            trees.push(tree);
        }
    }
    for tree in trees {
        // A tree missing, or stored with another size than its digest
        // says, or too large to check: the result is a miss.
        let bytes = match read_cas(client, instance, tree, TREE_READ_BYTES).await {
            Ok(bytes) => bytes,
            Err(e) if e.code() == ErrorCode::NotFound => return Err(e),
            Err(_) if tree.size > TREE_READ_BYTES => {
                return Err(not_found(format!(
                    "output tree {} is {} bytes; the gateway checks trees of at most {TREE_READ_BYTES}",
                    hex(&tree.hash),
                    tree.size
                )));
            }
            Err(e) => return Err(e),
        };
        // Its files' digests, read from the wire form: never the decoded
        // tree (millions of empty entries, a few bytes each stored, took
        // gigabytes decoded, past the memory budget held for it).
        let files = crate::wire::tree_file_digests(&bytes).map_err(|e| {
            not_found(format!(
                "output tree {} is unreadable: {e}",
                hex(&tree.hash)
            ))
        })?;
        for digest in files {
            digests.push(BlobDigest::from_proto(digest.as_ref()).map_err(invalid)?);
        }
    }
    Ok(digests)
}

/// Largest output tree read to check an action result's outputs (a tree
/// of 64 MiB lists some 600,000 files); a larger one makes the result a
/// miss. Not the batch limit: a tree of 40,000 files is over 4 MiB, and
/// its action would never be a cache hit.
const TREE_READ_BYTES: u64 = 64 << 20;

/// The action result stored for `action`, only if every output it
/// references is still in the CAS (they and the entry are touched);
/// otherwise `NOT_FOUND`, as if it had never been cached. An entry larger
/// than `limit` (the most a response carries; stored over HTTP) is a miss
/// too.
pub(crate) async fn get_action_result(
    client: &Client,
    instance: &Instance,
    action: BlobDigest,
    limit: u64,
) -> Result<ActionResult> {
    let mut reader = client
        .open_range(&instance.ac, &action.hash, 0, None)
        .await?;
    if reader.size() > limit {
        return Err(not_found(format!(
            "the action cache entry of {} is {} bytes; at most {limit} are returned",
            hex(&action.hash),
            reader.size()
        )));
    }
    let mut bytes = Vec::with_capacity(reader.size() as usize);
    while let Some(piece) = reader.next_piece().await? {
        bytes.extend_from_slice(&piece);
    }
    if !crate::wire::decodes_in_bounds(&bytes) {
        return Err(not_found(format!(
            "the action cache entry of {} is no ActionResult, or one that would take too much memory decoded (nearly empty entries)",
            hex(&action.hash)
        )));
    }
    let result = ActionResult::decode(&bytes[..]).map_err(|e| {
        not_found(format!(
            "the action cache entry of {} is not an ActionResult: {e}",
            hex(&action.hash)
        ))
    })?;
    require_outputs(client, instance, &result).await?;
    // Kept alive only as a hit: an entry whose outputs are gone, moved to
    // the current epoch at every lookup, never expired — and a caller who
    // may not overwrite (append-only) could never replace it, so the
    // action missed at every build for good.
    keep_alive(client, &instance.ac, &reader).await;
    Ok(result)
}

/// Memory the output trees read by all action-result checks may hold at
/// once (each tree whole and the digests it lists — read from its wire
/// form, never decoded: `wire::tree_file_digests` — counted as four times
/// its size): one of the largest trees at a time,
/// many small ones together. A result whose trees add up to more is a
/// miss.
const TREE_MEMORY_BYTES: u64 = 256 << 20;
static TREE_MEMORY: Semaphore = Semaphore::const_new((TREE_MEMORY_BYTES >> 10) as usize);

/// Holds `bytes` of a budget of `total` bytes (`budget` counts KiB) until
/// dropped: at least 1 KiB, at most the whole budget; `OVERLOADED` after
/// waiting `timeout`. Callers take these budgets in one fixed order
/// (`/ac/` entries, then trees), but hold room under the client's read
/// budget meanwhile (the entry just read) and may need read room while
/// holding them (a chunked entry, the trees read): the timeout ends such a
/// cycle (before, the wait had none).
pub(crate) async fn hold_memory(
    budget: &'static Semaphore,
    total: u64,
    bytes: u64,
    timeout: std::time::Duration,
) -> Result<SemaphorePermit<'static>> {
    let units = (bytes >> 10).clamp(1, total >> 10) as u32;
    match tokio::time::timeout(timeout, budget.acquire_many(units)).await {
        Ok(permit) => Ok(permit.expect("the budget is never closed")),
        Err(_) => Err(Error::new(
            ErrorCode::Overloaded,
            format!(
                "the gateway's memory for action cache checks ({} MiB) stayed taken for {timeout:?}; try again",
                total >> 20
            ),
        )),
    }
}

/// `NOT_FOUND` unless every output of `result` is present.
pub(crate) async fn require_outputs(
    client: &Client,
    instance: &Instance,
    result: &ActionResult,
) -> Result<()> {
    let mut named = HashSet::new();
    let trees: u64 = result
        .output_directories
        .iter()
        .filter_map(|d| d.tree_digest.as_ref())
        .filter(|d| named.insert(d.hash.as_str()))
        .map(|d| d.size_bytes.max(0) as u64)
        .fold(0, u64::saturating_add);
    if trees.saturating_mul(4) > TREE_MEMORY_BYTES {
        return Err(not_found(format!(
            "the result's output trees add up to {trees} bytes; the gateway checks at most {} at once",
            TREE_MEMORY_BYTES / 4
        )));
    }
    // A result without trees holds none of the budget: its permits are
    // handed out in request order, and every lookup waited behind one
    // holding it all for a large tree.
    let _memory = match trees {
        0 => None,
        trees => Some(
            hold_memory(
                &TREE_MEMORY,
                TREE_MEMORY_BYTES,
                trees.saturating_mul(4),
                client.timeout(),
            )
            .await?,
        ),
    };
    let needed = outputs(client, instance, result).await?;
    let missing = find_missing(client, instance, &needed).await?;
    if let Some(first) = missing.first() {
        return Err(not_found(format!(
            "the cached result references {} output(s) no longer stored (e.g. {}/{})",
            missing.len(),
            hex(&first.hash),
            first.size
        )));
    }
    Ok(())
}

/// Whether `bytes` read as an `ActionResult` whose every digest is
/// well-formed (the HTTP cache's `/ac/` also holds other tools' entries,
/// which are returned as they are).
pub(crate) fn as_action_result(bytes: &[u8]) -> Option<ActionResult> {
    if !crate::wire::decodes_in_bounds(bytes) {
        return None;
    }
    let result = ActionResult::decode(bytes).ok()?;
    let digests = result
        .output_files
        .iter()
        .map(|f| f.digest.as_ref())
        .chain(
            result
                .output_directories
                .iter()
                .map(|d| d.tree_digest.as_ref()),
        )
        .chain(
            [result.stdout_digest.as_ref(), result.stderr_digest.as_ref()]
                .into_iter()
                .filter(Option::is_some),
        );
    let mut any = false;
    for digest in digests {
        BlobDigest::from_proto(digest).ok()?;
        any = true;
    }
    any.then_some(result)
}

/// Stores `result` for `action`.
pub(crate) async fn update_action_result(
    client: &Client,
    instance: &Instance,
    action: BlobDigest,
    result: &ActionResult,
) -> Result<()> {
    client
        .put(&instance.ac, &action.hash, &result.encode_to_vec())
        .await?;
    Ok(())
}

/// The directories under `root`, breadth first (each directory once),
/// one at a time: what the walk holds is the digests still to read and
/// those seen, never the directories given out. Directories missing from
/// the CAS are left out (as the spec allows); a missing root is
/// `NOT_FOUND`.
pub(crate) struct TreeWalk {
    root: BlobDigest,
    queue: VecDeque<BlobDigest>,
    // By hash: a directory named again with another size is the same
    // directory (or no directory at all), never a second read.
    seen: HashSet<[u8; 32]>,
    /// Directories given out or skipped so far.
    index: usize,
    limit: u64,
}

impl TreeWalk {
    /// A walk from `root`; each directory read is at most `limit` bytes.
    pub(crate) fn new(root: BlobDigest, limit: u64) -> TreeWalk {
        TreeWalk {
            root,
            queue: VecDeque::from([root]),
            seen: HashSet::from([root.hash]),
            index: 0,
            limit,
        }
    }

    /// How many directories came before the next one.
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// The next directory and its digest, `None` at the end — or once `abandoned` says
    /// so, asked before each read (directories missing from the CAS are
    /// skipped without returning: a directory naming tens of thousands of
    /// missing ones would otherwise be read to the end for nobody).
    pub(crate) async fn next(
        &mut self,
        client: &Client,
        instance: &Instance,
        abandoned: impl Fn() -> bool,
    ) -> Result<Option<(BlobDigest, Directory)>> {
        while let Some(digest) = self.queue.pop_front() {
            if abandoned() {
                return Ok(None);
            }
            let bytes = match read_cas(client, instance, digest, self.limit).await {
                Ok(bytes) => bytes,
                Err(e) if e.code() == ErrorCode::NotFound && digest != self.root => continue,
                Err(e) => return Err(e),
            };
            if !crate::wire::decodes_in_bounds(&bytes) {
                return Err(invalid(format!(
                    "{} is no Directory, or one that would take too much memory decoded (nearly empty entries)",
                    hex(&digest.hash)
                )));
            }
            let directory = Directory::decode(&bytes[..])
                .map_err(|e| invalid(format!("{} is not a Directory: {e}", hex(&digest.hash))))?;
            for child in &directory.directories {
                let child = BlobDigest::from_proto(child.digest.as_ref()).map_err(invalid)?;
                if self.seen.insert(child.hash) {
                    self.queue.push_back(child);
                }
            }
            self.index += 1;
            return Ok(Some((digest, directory)));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use bazel_remote_apis::build::bazel::remote::execution::v2 as re;
    use sha2::Digest as _;
    use tidepool_client::{Client, RetentionPolicy};
    use tidepool_testkit::cluster::LocalCluster;

    use super::*;

    /// A lookup of a result without output trees takes none of the tree
    /// budget: with all of it held (a lookup of a large tree), it is
    /// answered at once instead of queueing behind it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_result_without_trees_does_not_wait_for_the_tree_budget() {
        let cluster = LocalCluster::start(1, 1, 1).await;
        let client = Client::connect(std::slice::from_ref(&cluster.url))
            .await
            .unwrap();
        let instance = Instance::parse("").unwrap();
        client
            .create_namespace(&instance.cas, true, RetentionPolicy::Durable)
            .await
            .unwrap();
        let content = b"an output file".to_vec();
        let hash: [u8; 32] = sha2::Sha256::digest(&content).into();
        client.put(&instance.cas, &hash, &content).await.unwrap();
        let result = ActionResult {
            output_files: vec![re::OutputFile {
                path: "out".into(),
                digest: Some(re::Digest {
                    hash: hex(&hash),
                    size_bytes: content.len() as i64,
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let all = hold_memory(
            &TREE_MEMORY,
            TREE_MEMORY_BYTES,
            TREE_MEMORY_BYTES,
            client.timeout(),
        )
        .await
        .unwrap();
        tokio::time::timeout(
            std::time::Duration::from_secs(20),
            require_outputs(&client, &instance, &result),
        )
        .await
        .expect("answered while the tree budget is held")
        .unwrap();
        drop(all);
        cluster.stop().await;
    }
}
