//! Blobs of any size: split into chunks of at most the cluster's value
//! limit, each stored as its own blob, plus a manifest blob
//! (`BLOB_KIND_MANIFEST`, a `ChunkManifest`) under the caller's key.
//! Reads verify every chunk before its bytes reach the caller, and the
//! whole blob's digest at the end.
//!
//! Chunk keys: in a content-addressed namespace, the chunk's SHA-256 (so
//! chunks are shared and deduplicated; deleting a blob leaves them to
//! retention); elsewhere `SHA-256("tidepool.v1.chunk" || key || nonce ||
//! index)` with a random nonce per put, so concurrent puts of one key never
//! mix chunks, and a replaced or deleted blob's chunks are deleted after
//! the new manifest is stored.

use prost::Message as _;
use sha2::{Digest, Sha256};
use tidepool_proto::v1::{
    BlobInfo, BlobKind, ChunkManifest, ChunkRef, ErrorCode, GetRequest, ReadConsistency,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::client::{Client, PutOutcome, blob_ref, read_blob, sha256};
use crate::cluster::Cluster;
use crate::error::{Error, Result};

/// Reads until `buf` holds `limit` bytes or the input ends.
async fn read_up_to<R: AsyncRead + Unpin>(reader: &mut R, limit: usize) -> Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(limit.min(8 << 20));
    (&mut *reader)
        .take(limit as u64)
        .read_to_end(&mut buf)
        .await?;
    Ok(buf)
}

fn chunk_key(key: &[u8], nonce: u64, index: u64) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"tidepool.v1.chunk");
    h.update((key.len() as u32).to_le_bytes());
    h.update(key);
    h.update(nonce.to_le_bytes());
    h.update(index.to_le_bytes());
    h.finalize().into()
}

fn corrupt(what: String) -> Error {
    Error::new(ErrorCode::Corrupt, what)
}

impl Client {
    /// Stores everything `reader` yields under `key`, in chunks when it is
    /// larger than one node entry.
    pub async fn put_stream<R: AsyncRead + Unpin>(
        &self,
        namespace: &str,
        key: &[u8],
        reader: R,
    ) -> Result<PutOutcome> {
        self.put_stream_progress(namespace, key, reader, |_| {})
            .await
    }

    /// [`Client::put_stream`], calling `progress` with the bytes stored so
    /// far after each chunk.
    pub async fn put_stream_progress<R: AsyncRead + Unpin>(
        &self,
        namespace: &str,
        key: &[u8],
        mut reader: R,
        mut progress: impl FnMut(u64),
    ) -> Result<PutOutcome> {
        let limit = self.chunk_size();
        let mut current = read_up_to(&mut reader, limit).await?;
        let mut next = read_up_to(&mut reader, limit).await?;
        if next.is_empty() {
            let outcome = self
                .put_one(namespace, key, &current, BlobKind::Data)
                .await?;
            progress(current.len() as u64);
            return Ok(outcome);
        }
        let cas = self.content_addressed(namespace).await?;
        let replaced = if cas {
            None
        } else {
            self.manifest_if_chunked(namespace, key).await?
        };
        let nonce: u64 = rand::random();
        let mut whole = Sha256::new();
        let mut manifest = ChunkManifest {
            nonce: if cas { 0 } else { nonce },
            ..ChunkManifest::default()
        };
        for index in 0.. {
            let digest = sha256(&current);
            let chunk_key = if cas {
                digest
            } else {
                chunk_key(key, nonce, index)
            };
            self.put_one(namespace, &chunk_key, &current, BlobKind::Data)
                .await?;
            whole.update(&current);
            manifest.size += current.len() as u64;
            manifest.chunks.push(ChunkRef {
                key: chunk_key.to_vec(),
                size: current.len() as u64,
                sha256: digest.to_vec(),
            });
            progress(manifest.size);
            if next.is_empty() {
                break;
            }
            current = std::mem::take(&mut next);
            next = read_up_to(&mut reader, limit).await?;
        }
        let digest: [u8; 32] = whole.finalize().into();
        if cas && key != digest {
            return Err(Error::new(
                ErrorCode::DigestMismatch,
                "the content's SHA-256 is not the key; the chunks were stored, the blob was not",
            ));
        }
        manifest.sha256 = digest.to_vec();
        let mut outcome = self
            .put_one(
                namespace,
                key,
                &manifest.encode_to_vec(),
                BlobKind::Manifest,
            )
            .await?;
        outcome.size = manifest.size;
        outcome.sha256 = digest;
        if let Some(old) = replaced {
            for chunk in own_chunks(key, &old) {
                self.delete_chunk(namespace, &chunk).await?;
            }
        }
        Ok(outcome)
    }

    async fn delete_chunk(&self, namespace: &str, key: &[u8]) -> Result<()> {
        self.delete_one(namespace, key).await.map(|_| ())
    }

    /// Writes the blob to `writer` (reassembling a chunked one); returns
    /// its size. Every chunk is verified before it is written; the whole
    /// blob's digest is checked at the end (and against the key in a
    /// content-addressed namespace).
    pub async fn get_stream<W: AsyncWrite + Unpin>(
        &self,
        namespace: &str,
        key: &[u8],
        writer: W,
    ) -> Result<u64> {
        self.get_stream_progress(namespace, key, writer, |_, _| {})
            .await
    }

    /// [`Client::get_stream`], calling `progress(done, total)` after each
    /// chunk.
    pub async fn get_stream_progress<W: AsyncWrite + Unpin>(
        &self,
        namespace: &str,
        key: &[u8],
        mut writer: W,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<u64> {
        let cas = self.content_addressed(namespace).await?;
        let (info, content) = self.get_verified(namespace, key, cas).await?;
        if info.kind != BlobKind::Manifest as i32 {
            if cas && sha256(&content)[..] != key[..] {
                return Err(corrupt(format!(
                    "the content read under {} does not hash to it",
                    hex(key)
                )));
            }
            writer.write_all(&content).await?;
            writer.flush().await?;
            progress(content.len() as u64, content.len() as u64);
            return Ok(content.len() as u64);
        }
        let manifest = ChunkManifest::decode(&content[..])
            .map_err(|e| corrupt(format!("the manifest of {} is unreadable: {e}", hex(key))))?;
        let mut whole = Sha256::new();
        let mut done = 0;
        for chunk in &manifest.chunks {
            let (_, bytes) = self.get_verified(namespace, &chunk.key, cas).await?;
            if sha256(&bytes)[..] != chunk.sha256[..] || bytes.len() as u64 != chunk.size {
                return Err(corrupt(format!(
                    "chunk {} of {} does not match its manifest",
                    hex(&chunk.key),
                    hex(key)
                )));
            }
            whole.update(&bytes);
            writer.write_all(&bytes).await?;
            done += bytes.len() as u64;
            progress(done, manifest.size);
        }
        writer.flush().await?;
        let digest: [u8; 32] = whole.finalize().into();
        if digest[..] != manifest.sha256[..]
            || (cas && digest[..] != key[..])
            || done != manifest.size
        {
            return Err(corrupt(format!(
                "the chunks of {} do not add up to the blob its manifest describes",
                hex(key)
            )));
        }
        Ok(done)
    }

    /// One stored blob, verified against its stored digest. In a
    /// content-addressed namespace a replica that returns bad bytes is
    /// skipped: the others are asked directly.
    async fn get_verified(
        &self,
        namespace: &str,
        key: &[u8],
        cas: bool,
    ) -> Result<(BlobInfo, Vec<u8>)> {
        let first = self
            .get_one(namespace, key, ReadConsistency::Linearizable)
            .await;
        match first {
            Err(e) if cas && e.code() == ErrorCode::Corrupt => {
                let map = self.cluster.map();
                let route = Cluster::route(&map, namespace, key)?;
                for replica in &route.shard.replicas {
                    let Some(address) = Cluster::address(&map, replica.node_id) else {
                        continue;
                    };
                    if let Ok((info, bytes)) = self.get_any_replica(&address, namespace, key).await
                        && sha256(&bytes)[..] == key[..]
                    {
                        return Ok((info, bytes));
                    }
                }
                Err(e)
            }
            other => other,
        }
    }

    /// A read from one replica's applied state.
    async fn get_any_replica(
        &self,
        address: &str,
        namespace: &str,
        key: &[u8],
    ) -> Result<(BlobInfo, Vec<u8>)> {
        let channel = self.cluster.channel(address)?;
        let request = GetRequest {
            blob: blob_ref(namespace, key),
            consistency: ReadConsistency::AnyReplica as i32,
            ..GetRequest::default()
        };
        read_blob(channel, request, self.chunk_size())
            .await
            .map_err(|s| Error::new(ErrorCode::Internal, s.message().to_string()))
    }

    /// The manifest stored under `key` (which must be chunked).
    pub(crate) async fn manifest(&self, namespace: &str, key: &[u8]) -> Result<ChunkManifest> {
        self.manifest_if_chunked(namespace, key)
            .await?
            .ok_or_else(|| Error::new(ErrorCode::Internal, "the blob is not chunked"))
    }

    /// The manifest under `key` if the blob there is chunked; `None` if it
    /// is a plain blob or absent.
    pub(crate) async fn manifest_if_chunked(
        &self,
        namespace: &str,
        key: &[u8],
    ) -> Result<Option<ChunkManifest>> {
        match self.head_info(namespace, key).await {
            Ok(info) if info.kind == BlobKind::Manifest as i32 => {}
            Ok(_) => return Ok(None),
            Err(e) if e.code() == ErrorCode::NotFound => return Ok(None),
            Err(e) => return Err(e),
        }
        let (_, content) = self
            .get_one(namespace, key, ReadConsistency::Linearizable)
            .await?;
        ChunkManifest::decode(&content[..])
            .map(Some)
            .map_err(|e| corrupt(format!("the manifest of {} is unreadable: {e}", hex(key))))
    }
}

/// The keys of `manifest`'s chunks that belong to the blob under `key`:
/// those derived from its key and the manifest's nonce. A manifest is data
/// a node returned; deleting whatever keys it lists would let a forged one
/// delete any blob of the namespace, so any other key is left alone (and
/// so are the chunks of manifests written before the nonce was recorded).
pub(crate) fn own_chunks(key: &[u8], manifest: &ChunkManifest) -> Vec<[u8; 32]> {
    manifest
        .chunks
        .iter()
        .enumerate()
        .map(|(index, _)| chunk_key(key, manifest.nonce, index as u64))
        .zip(&manifest.chunks)
        .filter(|(derived, chunk)| derived[..] == chunk.key[..])
        .map(|(derived, _)| derived)
        .collect()
}

/// Lower-case hex of `bytes` (keys in messages).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(key: &[u8]) -> ChunkRef {
        ChunkRef {
            key: key.to_vec(),
            size: 1,
            sha256: vec![0; 32],
        }
    }

    #[test]
    fn only_chunks_derived_from_the_blob_are_its_own() {
        let nonce = 42;
        let own: Vec<[u8; 32]> = (0..3).map(|i| chunk_key(b"blob", nonce, i)).collect();
        let genuine = ChunkManifest {
            chunks: own.iter().map(|k| chunk(k)).collect(),
            nonce,
            ..ChunkManifest::default()
        };
        assert_eq!(own_chunks(b"blob", &genuine), own);
        // Forged: another blob's key, a chunk of another blob, a chunk out
        // of place; only the genuine first chunk survives the filter.
        let forged = ChunkManifest {
            chunks: vec![
                chunk(&own[0]),
                chunk(b"someone else's blob"),
                chunk(&chunk_key(b"other", nonce, 2)),
                chunk(&own[1]),
            ],
            nonce,
            ..ChunkManifest::default()
        };
        assert_eq!(own_chunks(b"blob", &forged), vec![own[0]]);
        // Another key's manifest, or one without its nonce: nothing.
        assert!(own_chunks(b"other", &genuine).is_empty());
        let old = ChunkManifest {
            nonce: 0,
            ..genuine
        };
        assert!(own_chunks(b"blob", &old).is_empty());
    }
}
