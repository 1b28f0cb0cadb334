//! The Tidepool Rust SDK: connects to a cluster through its coordinators,
//! routes each key by hash to its shard leader, retries across leader
//! changes and stale maps within a deadline, streams blobs of any size in
//! chunks, and verifies what it reads. A client keeps to the cluster it
//! joined: a coordinator that lost its store and founded a new cluster is
//! not followed (its requests go on by the map held, as the nodes serve on)
//! until the map is restored; a cluster re-created on purpose is joined by
//! a new client.
//!
//! What this crate is **not**: it embeds no storage and depends on neither the
//! engine nor the node; it speaks only the `tidepool.v1` wire contract.
//!
//! # Example
//!
//! ```no_run
//! # async fn demo() -> tidepool_client::Result<()> {
//! use tidepool_client::Client;
//!
//! let client = Client::connect(&["http://127.0.0.1:7400"]).await?;
//! client.put("default", b"greeting", b"hello, tidepool").await?;
//! assert_eq!(client.get("default", b"greeting").await?, b"hello, tidepool");
//! assert!(client.exists("default", b"greeting").await?);
//!
//! // Any size: streamed in chunks below the node's entry limit.
//! let file = tokio::fs::File::open("backup.tar").await?;
//! client.put_stream("default", b"backup.tar", file).await?;
//!
//! // Content addressing: the key is the SHA-256 of the content.
//! let digest = client.put_content("default", b"chunk bytes").await?;
//! assert_eq!(client.get("default", &digest).await?, b"chunk bytes");
//! # Ok(()) }
//! ```
//!
//! Runnable programs: `client/examples/store_file.rs` (store a file and
//! fetch it back) and `client/examples/dedup_chunker.rs` (content-defined
//! chunking that uploads only the chunks the cluster lacks).
//!
//! # Security
//!
//! A cluster running with TLS (every production one) needs the client's
//! certificate, key and the cluster's CA ([`ClientConfig::with_tls`]) and
//! a bearer token ([`ClientConfig::with_token`]) whose roles allow the
//! calls: refusals are `UNAUTHENTICATED` (no or unknown token) and
//! `PERMISSION_DENIED` (a role missing in the namespace); a put with an
//! `append-only` token of a key that holds a blob is `ALREADY_EXISTS`.
//!
//! # Errors
//!
//! Every failure is an [`Error`] with a stable [`ErrorCode`] (the wire
//! contract's): `NOT_FOUND`, `NAMESPACE_NOT_FOUND`, `DIGEST_MISMATCH`,
//! `CORRUPT` (content failed verification; never returned as data),
//! `TIMEOUT` (the call's deadline passed while retrying), … Transient
//! conditions (`NOT_LEADER`, `WRONG_SHARD`, `NO_QUORUM`, unreachable
//! nodes) are retried inside the call and never surface unless the
//! deadline passes.

mod admin;
mod client;
mod cluster;
mod error;
mod list;
mod session;
mod stream;

pub use admin::RetentionPolicy;
pub use client::{BlobMeta, Client, ClientConfig, DEFAULT_HEDGE_AFTER, PutOutcome, sha256};
pub use error::{Error, Result};
pub use list::{ListEntry, ListOptions, ListPage, Lister};
pub use stream::{BlobReader, READ_AHEAD, ReadRoom, UPLOAD_DEPTH, Upload, hex};
pub use tidepool_proto as proto;
pub use tidepool_proto::v1::{Durability, ErrorCode};
pub use tidepool_security::TlsFiles;
pub use tidepool_security::guard::{role_name, role_of};
pub use tidepool_security::token::read_file as read_token_file;
