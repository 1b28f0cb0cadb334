//! A per-cell bloom filter over the keys of the cell's on-disk index: a
//! "no" skips the disk lookup.

use std::sync::Arc;

/// A bloom filter with `hashes` probes over `bits.len() * 64` bits. Cheap
/// to clone (the bits are shared, read-only once built): a cell's layer
/// holds it by value, so a check follows one pointer from the layer to
/// the bits, not one to a shared filter and another to its bits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bloom {
    bits: Arc<[u64]>,
    hashes: u32,
}

/// SplitMix64 finalizer: a fast, well-mixed 64-bit hash step.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn hash_key(key: &[u8]) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15_u64 ^ key.len() as u64;
    for chunk in key.chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(word));
    }
    h
}

/// A key's hash, computed once and probed in any number of filters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeyHash(u64, u64);

impl KeyHash {
    /// Hashes `key`.
    pub fn of(key: &[u8]) -> Self {
        let h1 = hash_key(key);
        KeyHash(h1, mix(h1) | 1)
    }
}

impl Bloom {
    /// An empty filter sized for `keys` keys at `bits_per_key`.
    pub fn new(keys: usize, bits_per_key: u32) -> Self {
        let bits = (keys.max(1) as u64 * u64::from(bits_per_key.max(1))).div_ceil(64) as usize;
        let hashes =
            ((f64::from(bits_per_key) * std::f64::consts::LN_2).round() as u32).clamp(1, 16);
        Self {
            bits: vec![0; bits.max(1)].into(),
            hashes,
        }
    }

    /// The (word, mask) of each probe of `hash` in a filter of `words`
    /// words and `hashes` probes.
    fn probes(words: usize, hashes: u32, hash: &KeyHash) -> impl Iterator<Item = (usize, u64)> {
        let (h1, h2) = (hash.0, hash.1);
        let m = words as u64 * 64;
        (0..u64::from(hashes)).map(move |i| {
            let bit = h1.wrapping_add(i.wrapping_mul(h2)) % m;
            ((bit / 64) as usize, 1u64 << (bit % 64))
        })
    }

    /// Adds a key (copying the bits first if the filter is shared).
    pub fn insert(&mut self, key: &[u8]) {
        let hash = KeyHash::of(key);
        let bits = Arc::make_mut(&mut self.bits);
        for (word, mask) in Self::probes(bits.len(), self.hashes, &hash) {
            bits[word] |= mask;
        }
    }

    /// False means the key was certainly never inserted.
    #[cfg(test)]
    pub fn may_contain(&self, key: &[u8]) -> bool {
        self.may_contain_hash(&KeyHash::of(key))
    }

    /// [`Bloom::may_contain`] for a key hashed once (a cell's layers each
    /// have a filter; the key is hashed once for all of them).
    pub fn may_contain_hash(&self, hash: &KeyHash) -> bool {
        Self::probes(self.bits.len(), self.hashes, hash)
            .all(|(word, mask)| self.bits[word] & mask != 0)
    }

    /// Bytes of the encoded filter.
    pub fn encoded_len(&self) -> usize {
        4 + self.bits.len() * 8
    }

    /// Bytes of memory held.
    pub fn memory_bytes(&self) -> usize {
        self.bits.len() * 8
    }

    /// Encodes as `hashes: u32` then the bit words, little-endian.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.hashes.to_le_bytes());
        for word in self.bits.iter() {
            out.extend_from_slice(&word.to_le_bytes());
        }
    }

    /// Decodes what [`Bloom::encode`] wrote.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < 12 || !(bytes.len() - 4).is_multiple_of(8) {
            return None;
        }
        let hashes = u32::from_le_bytes(bytes[..4].try_into().ok()?);
        if !(1..=16).contains(&hashes) {
            return None;
        }
        let bits = bytes[4..]
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .collect();
        Some(Self { bits, hashes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_false_negatives_and_a_low_false_positive_rate() {
        let mut bloom = Bloom::new(10_000, 10);
        let key = |i: u64| mix(i).to_be_bytes();
        for i in 0..10_000 {
            bloom.insert(&key(i));
        }
        assert!((0..10_000).all(|i| bloom.may_contain(&key(i))));
        let false_positives = (10_000..110_000)
            .filter(|&i| bloom.may_contain(&key(i)))
            .count();
        let rate = false_positives as f64 / 100_000.0;
        // 10 bits per key gives about 1%; allow slack.
        assert!(rate < 0.02, "false positive rate {rate}");
        let mut encoded = Vec::new();
        bloom.encode(&mut encoded);
        assert_eq!(encoded.len(), bloom.encoded_len());
        assert_eq!(Bloom::decode(&encoded), Some(bloom));
    }
}
