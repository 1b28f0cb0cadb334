//! A deduplicating backup of one file: split it into content-defined
//! chunks (boundaries follow the content, so an edit moves only nearby
//! chunks), ask the cluster which chunks it lacks, upload only those into
//! a content-addressed namespace, and store the file's recipe (its chunk
//! digests, in order). Run it twice on the same file: the second run
//! uploads nothing.
//!
//! ```sh
//! make run    # in another shell
//! cargo run -p tidepool-client --example dedup_chunker -- some-large-file
//! ```

use tidepool_client::{Client, ClientConfig, ErrorCode, RetentionPolicy, hex, sha256};

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
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: dedup_chunker FILE [COORDINATOR]")?;
    let coordinator = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:7400".to_string());
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

    let data = tokio::fs::read(&path).await?;
    let pieces = chunks(&data);
    let digests: Vec<Vec<u8>> = pieces.iter().map(|c| sha256(c).to_vec()).collect();
    let missing = client.find_missing("chunks", &digests).await?;
    let mut uploaded = 0;
    for (piece, digest) in pieces.iter().zip(&digests) {
        if missing.contains(digest) {
            client.put("chunks", digest, piece).await?;
            uploaded += piece.len();
        }
    }
    // The recipe: the digests in order, under the file's name.
    let recipe: String = digests.iter().map(|d| hex(d) + "\n").collect();
    client
        .put(
            "default",
            format!("recipe/{path}").as_bytes(),
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
