//! How a blob is stored as an engine value: a small header, then the
//! content.
//!
//! ```text
//! version u8 (1), kind u8 (0 data, 1 SDK manifest), sha256 [32], content
//! ```
//! The SHA-256 is computed by the node that accepted the write, so `Head`
//! and content-addressed checks need no hashing at read time.

use sha2::{Digest, Sha256};
use tidepool_proto::v1::{BlobInfo, BlobKind};

use crate::error::{NodeError, Result};

const VERSION: u8 = 1;
/// Bytes of the header before the content.
pub const HEADER_BYTES: usize = 34;

/// SHA-256 of `content`.
pub fn sha256(content: &[u8]) -> [u8; 32] {
    Sha256::digest(content).into()
}

/// The engine value for `content` with the given digest.
pub fn encode(kind: BlobKind, digest: &[u8; 32], content: &[u8]) -> Vec<u8> {
    let mut value = Vec::with_capacity(HEADER_BYTES + content.len());
    value.resize(HEADER_BYTES, 0);
    value.extend_from_slice(content);
    seal(kind, digest, value)
}

/// The engine value for a buffer holding [`HEADER_BYTES`] of room and then
/// the content with the given digest: the header is written into the room,
/// the content is not moved.
pub fn seal(kind: BlobKind, digest: &[u8; 32], mut value: Vec<u8>) -> Vec<u8> {
    assert!(value.len() >= HEADER_BYTES, "no room for the header");
    value[0] = VERSION;
    value[1] = kind as u8;
    value[2..HEADER_BYTES].copy_from_slice(digest);
    value
}

/// A stored blob's header, parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Data or manifest.
    pub kind: BlobKind,
    /// SHA-256 of the content.
    pub sha256: [u8; 32],
    /// Content length.
    pub size: u64,
}

impl Header {
    /// The wire metadata, with the entry's epoch.
    pub fn info(&self, epoch: u32) -> BlobInfo {
        BlobInfo {
            size: self.size,
            sha256: self.sha256.to_vec(),
            epoch: u64::from(epoch),
            kind: self.kind as i32,
            current_epoch: 0,
        }
    }
}

/// Splits an engine value into header and content.
pub fn decode(value: &[u8]) -> Result<(Header, &[u8])> {
    let header = decode_head(value, value.len() as u64)?;
    Ok((header, &value[HEADER_BYTES..]))
}

/// The header of a stored blob of `len` bytes (header included) from its
/// first bytes (at least [`HEADER_BYTES`]).
pub fn decode_head(prefix: &[u8], len: u64) -> Result<Header> {
    if prefix.len() < HEADER_BYTES || len < HEADER_BYTES as u64 || prefix[0] != VERSION {
        return Err(NodeError::Malformed(format!(
            "stored blob of {len} bytes has no valid header"
        )));
    }
    let kind = BlobKind::try_from(i32::from(prefix[1]))
        .map_err(|_| NodeError::Malformed(format!("stored blob of kind {}", prefix[1])))?;
    let sha256 = prefix[2..HEADER_BYTES].try_into().expect("32 bytes");
    Ok(Header {
        kind,
        sha256,
        size: len.saturating_sub(HEADER_BYTES as u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_damage() {
        let digest = sha256(b"hello");
        let value = encode(BlobKind::Manifest, &digest, b"hello");
        let (header, content) = decode(&value).unwrap();
        assert_eq!(content, b"hello");
        assert_eq!(
            decode_head(&value[..HEADER_BYTES], value.len() as u64).unwrap(),
            header
        );
        assert!(decode_head(&value[..HEADER_BYTES - 1], value.len() as u64).is_err());
        let mut room = vec![0xee; HEADER_BYTES];
        room.extend_from_slice(b"hello");
        assert_eq!(seal(BlobKind::Manifest, &digest, room), value);
        assert_eq!(header.kind, BlobKind::Manifest);
        assert_eq!(header.size, 5);
        assert_eq!(header.sha256, digest);
        assert!(decode(&value[..10]).is_err());
        let mut bad = value.clone();
        bad[0] = 9;
        assert!(decode(&bad).is_err());
        bad = value;
        bad[1] = 200;
        assert!(decode(&bad).is_err());
    }
}
