//! The storage key of a blob and its place in the hash space.
//!
//! Clients route by it and nodes store by it, so both must compute it with
//! this one function.

use sha2::{Digest, Sha256};

/// Length of a storage key in bytes.
pub const STORAGE_KEY_BYTES: usize = 32;

/// Largest user key accepted, in bytes.
pub const KEY_MAX_BYTES: usize = 1024;

/// Longest namespace name, in bytes.
pub const NAMESPACE_NAME_MAX_BYTES: usize = 63;

/// The 32-byte key a blob is stored under.
pub type StorageKey = [u8; STORAGE_KEY_BYTES];

/// Domain separator so storage keys never collide with other SHA-256 uses.
const KEY_DOMAIN: &[u8] = b"tidepool.v1.key";

/// Storage key of `key` in the namespace with id `namespace_id`:
/// `SHA-256("tidepool.v1.key" || u32_le(namespace_id) || key)`.
pub fn storage_key(namespace_id: u32, key: &[u8]) -> StorageKey {
    let mut hasher = Sha256::new();
    hasher.update(KEY_DOMAIN);
    hasher.update(namespace_id.to_le_bytes());
    hasher.update(key);
    hasher.finalize().into()
}

/// Position of a storage key in the 64-bit hash space: its first 8 bytes,
/// big-endian. Shard ranges are ranges of this value.
pub fn hash_position(key: &StorageKey) -> u64 {
    let mut prefix = [0u8; 8];
    prefix.copy_from_slice(&key[..8]);
    u64::from_be_bytes(prefix)
}

/// The hash ranges of `shards` shards splitting `[0, 2^64)` evenly, in
/// order: `(first, last)` inclusive, the last ending at `u64::MAX`. Shard
/// `i + 1` owns range `i`. `shards` must be positive.
pub fn even_shard_ranges(shards: u32) -> Vec<(u64, u64)> {
    let span = u64::MAX / u64::from(shards.max(1));
    (0..shards)
        .map(|i| {
            let start = u64::from(i) * span;
            let end = if i + 1 == shards {
                u64::MAX
            } else {
                start + span - 1
            };
            (start, end)
        })
        .collect()
}

/// A namespace name as an error message may quote it: a name the caller
/// sent can be megabytes long (no valid one is over 63 bytes), and an
/// error carrying it whole in its headers arrived as a transport error
/// instead of the typed one, if at all.
pub fn quoted_namespace(name: &str) -> String {
    if name.len() <= NAMESPACE_NAME_MAX_BYTES {
        return format!("{name:?}");
    }
    let mut end = NAMESPACE_NAME_MAX_BYTES;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &name[..end], name.len())
}

/// Checks a namespace name: 1 to 63 bytes of `[a-z0-9._-]`, starting with a
/// letter or digit. Returns a sentence saying what is wrong.
pub fn validate_namespace_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > NAMESPACE_NAME_MAX_BYTES {
        return Err(format!(
            "namespace name must be 1 to {NAMESPACE_NAME_MAX_BYTES} bytes, got {}",
            name.len()
        ));
    }
    let first_ok = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !first_ok {
        return Err(format!(
            "namespace name {name:?} must start with a lowercase letter or a digit"
        ));
    }
    let allowed = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b);
    if let Some(bad) = name.bytes().find(|&b| !allowed(b)) {
        return Err(format!(
            "namespace name {name:?} contains {:?}; allowed are a-z, 0-9, '.', '_' and '-'",
            bad as char
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_key_separates_namespaces_and_keys() {
        let a = storage_key(1, b"k");
        assert_ne!(a, storage_key(2, b"k"));
        assert_ne!(a, storage_key(1, b"k2"));
        assert_eq!(a, storage_key(1, b"k"));
    }

    #[test]
    fn storage_key_is_stable_across_versions() {
        // Changing the derivation would orphan every stored blob: pin it.
        let key = storage_key(0, b"");
        let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
        let expected: String = {
            let mut h = Sha256::new();
            h.update(b"tidepool.v1.key\0\0\0\0");
            h.finalize().iter().map(|b| format!("{b:02x}")).collect()
        };
        assert_eq!(hex, expected);
    }

    #[test]
    fn hash_position_is_big_endian_prefix() {
        let mut key = [0u8; 32];
        key[0] = 0x80;
        key[7] = 0x01;
        assert_eq!(hash_position(&key), 0x8000_0000_0000_0001);
    }

    #[test]
    fn namespace_names() {
        assert!(validate_namespace_name("ci-cache.v2_x").is_ok());
        assert!(validate_namespace_name("0abc").is_ok());
        assert!(validate_namespace_name("").is_err());
        assert!(validate_namespace_name("-x").is_err());
        assert!(validate_namespace_name("Upper").is_err());
        assert!(validate_namespace_name("a/b").is_err());
        assert!(validate_namespace_name(&"a".repeat(64)).is_err());
        assert!(validate_namespace_name(&"a".repeat(63)).is_ok());
    }
}
