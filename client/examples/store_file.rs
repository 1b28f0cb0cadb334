//! Store a file in Tidepool and fetch it back, verified.
//!
//! ```sh
//! make run    # in another shell: a local cluster on 127.0.0.1:7400
//! cargo run -p tidepool-client --example store_file -- README.md
//! ```

use tidepool_client::{Client, ClientConfig, hex};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: store_file FILE [COORDINATOR]")?;
    let coordinator = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:7400".to_string());
    // A dev cluster's TLS material and admin token (what `make run` makes).
    let config = ClientConfig::new(&[coordinator])
        .with_dev_credentials(std::path::Path::new("tidepool-dev"));
    let client = Client::with_config(config).await?;

    // Any size: the SDK streams it in chunks below the node's entry limit.
    let key = format!("files/{path}");
    let file = tokio::fs::File::open(&path).await?;
    let stored = client.put_stream("default", key.as_bytes(), file).await?;
    println!(
        "stored {path} as {key:?}: {} bytes, sha256 {}",
        stored.size,
        hex(&stored.sha256)
    );

    // Fetch it back; every chunk and the whole are verified on the way.
    let mut copy = Vec::new();
    let size = client
        .get_stream("default", key.as_bytes(), &mut copy)
        .await?;
    let original = tokio::fs::read(&path).await?;
    assert_eq!(copy, original);
    println!("fetched {size} bytes back: identical");
    Ok(())
}
