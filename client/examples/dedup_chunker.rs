//! A deduplicating backup of files: split each into content-defined
//! chunks (boundaries follow the content, so an edit moves only nearby
//! chunks), ask the cluster which chunks it lacks (10,000 digests per
//! call), upload only those into a content-addressed namespace, and store
//! the file's recipe (its chunk digests, in order). Run it twice on the
//! same file: the second run uploads nothing. `gc` deletes the chunks no
//! recipe references any more, found by listing both namespaces; `forget`
//! drops a file's recipe.
//!
//! ```sh
//! make run    # in another shell
//! cargo run -p tidepool-client --example dedup_chunker -- backup some-large-file
//! cargo run -p tidepool-client --example dedup_chunker -- forget some-large-file
//! cargo run -p tidepool-client --example dedup_chunker -- gc
//! ```
//! A coordinator other than the dev cluster's: `TIDEPOOL_COORDINATOR=...`.

use std::collections::HashSet;

use tidepool_client::{Client, ClientConfig, ErrorCode, ListOptions, RetentionPolicy, hex, sha256};

/// Digests asked per `find_missing` call.
const BATCH: usize = 10_000;
/// Where recipes are kept (namespace `default`).
const RECIPES: &str = "recipe/";

/// Chunk sizes: at least 16 KiB, about 64 KiB on average, at most 256 KiB.
const MIN: usize = 16 << 10;
const MAX: usize = 256 << 10;
const MASK: u64 = (64 << 10) - 1;

/// 256 pseudo-random values for the rolling "gear" hash.
fn gear() -> [u64; 256] {
    let mut table = [0u64; 256];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for slot in table.iter_mut() {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        *slot = z ^ (z >> 31);
    }
    table
}

/// Splits `data` where the rolling hash of the bytes since the last cut
/// has its low bits zero (after `MIN`, forced at `MAX`).
fn chunks(data: &[u8]) -> Vec<&[u8]> {
    let gear = gear();
    let mut out = Vec::new();
    let mut start = 0;
    let mut hash = 0u64;
    for (i, byte) in data.iter().enumerate() {
        hash = (hash << 1).wrapping_add(gear[*byte as usize]);
        let len = i + 1 - start;
        if (len >= MIN && hash & MASK == 0) || len >= MAX {
            out.push(&data[start..=i]);
            start = i + 1;
            hash = 0;
        }
    }
    if start < data.len() {
        out.push(&data[start..]);
    }
    out
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let coordinator = std::env::var("TIDEPOOL_COORDINATOR")
        .unwrap_or_else(|_| "http://127.0.0.1:7400".to_string());
    // A dev cluster's TLS material and admin token (what `make run` makes).
    let config = ClientConfig::new(&[coordinator])
        .with_dev_credentials(std::path::Path::new("tidepool-dev"));
    let client = Client::with_config(config).await?;
    match client
        .create_namespace("chunks", true, RetentionPolicy::Durable)
        .await
    {
        Ok(_) => {}
        Err(e) if e.code() == ErrorCode::NamespaceExists => {}
        Err(e) => return Err(e.into()),
    }
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["gc"] => gc(&client).await,
        ["forget", path] => {
            let existed = client
                .delete("default", format!("{RECIPES}{path}").as_bytes())
                .await?;
            println!(
                "{path}: recipe {}",
                if existed { "dropped" } else { "not found" }
            );
            Ok(())
        }
        ["backup", ref paths @ ..] if !paths.is_empty() => {
            for path in paths {
                backup(&client, path).await?;
            }
            Ok(())
        }
        _ => Err("usage: dedup_chunker backup FILE... | forget FILE | gc".into()),
    }
}

async fn backup(client: &Client, path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let data = tokio::fs::read(path).await?;
    let pieces = chunks(&data);
    let digests: Vec<Vec<u8>> = pieces.iter().map(|c| sha256(c).to_vec()).collect();
    // Which chunks the cluster lacks, 10,000 at a time (each call also
    // keeps the present ones alive: it touches them).
    let mut missing = HashSet::new();
    for batch in digests.chunks(BATCH) {
        missing.extend(client.find_missing("chunks", batch).await?);
    }
    let mut uploaded = 0;
    let mut stored = HashSet::new();
    for (piece, digest) in pieces.iter().zip(&digests) {
        if missing.contains(digest) && stored.insert(digest.clone()) {
            client.put("chunks", digest, piece).await?;
            uploaded += piece.len();
        }
    }
    // The recipe: the digests in order, under the file's name.
    let recipe: String = digests.iter().map(|d| hex(d) + "\n").collect();
    client
        .put(
            "default",
            format!("{RECIPES}{path}").as_bytes(),
            recipe.as_bytes(),
        )
        .await?;
    println!(
        "{path}: {} bytes in {} chunks; {} were missing, {uploaded} bytes uploaded",
        data.len(),
        pieces.len(),
        missing.len()
    );
    Ok(())
}

/// Deletes every chunk no recipe references: the references are gathered
/// by listing the recipes, the candidates by listing the chunk namespace.
/// (A chunk uploaded by a backup still running, whose recipe is not yet
/// stored, would be deleted too: run gc when no backup runs.)
async fn gc(client: &Client) -> Result<(), Box<dyn std::error::Error>> {
    let mut referenced: HashSet<Vec<u8>> = HashSet::new();
    let mut recipes = client.list(
        "default",
        ListOptions {
            prefix: RECIPES.as_bytes().to_vec(),
            ..ListOptions::default()
        },
    );
    let mut count = 0;
    while let Some(recipe) = recipes.next().await? {
        let text = String::from_utf8(client.get("default", &recipe.key).await?)?;
        for line in text.lines() {
            referenced.insert(parse_hex(line).ok_or("a recipe line is not a digest")?);
        }
        count += 1;
    }
    if recipes.incomplete() {
        // Recipes stored before keys were indexed are missing from the
        // listing: the chunks only they reference would be deleted.
        return Err(
            "the recipe listing is incomplete (blobs stored by an older version): \
                    gc would delete chunks those recipes reference; not run"
                .into(),
        );
    }
    let mut chunks = client.list("chunks", ListOptions::default());
    let (mut kept, mut deleted, mut freed) = (0u64, 0u64, 0u64);
    while let Some(chunk) = chunks.next().await? {
        if referenced.contains(&chunk.key) {
            kept += 1;
        } else if client.delete("chunks", &chunk.key).await? {
            deleted += 1;
            freed += chunk.size;
        }
    }
    println!(
        "gc: {count} recipes reference {} chunks; {kept} kept, {deleted} deleted ({freed} bytes)",
        referenced.len()
    );
    Ok(())
}

fn parse_hex(text: &str) -> Option<Vec<u8>> {
    if text.len() != 64 {
        return None;
    }
    (0..64)
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}
