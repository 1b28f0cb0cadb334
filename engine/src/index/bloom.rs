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
    /// Divides by the number of bits (see [`Modulus`]).
    modulus: Modulus,
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

/// `x % d` for a fixed `d`, without a division: two or three
/// multiplications, exact for every 64-bit `x` (Lemire, Kaser and Kurz,
/// "Faster remainder by direct computation", 2019: with the 128-bit
/// `M = ceil(2^128 / d)`, `x % d` is the top 64 bits of the 192-bit
/// `((M * x) mod 2^128) * d`). Probing a filter takes `hashes` remainders
/// per key, and a hardware division costs tens of cycles: most of the time
/// flushes spent building filters. The bits probed are the same as with
/// `%`, so filters already on disk read the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Modulus {
    d: u64,
    m: u128,
}

impl Modulus {
    fn new(d: u64) -> Self {
        assert!(d > 0, "a filter has at least one word");
        Self {
            d,
            // ceil(2^128 / d); wraps to 0 for d = 1, which gives 0, right.
            m: (u128::MAX / u128::from(d)).wrapping_add(1),
        }
    }

    fn of(self, x: u64) -> u64 {
        let low = self.m.wrapping_mul(u128::from(x));
        let bottom = (u128::from(low as u64) * u128::from(self.d)) >> 64;
        let top = u128::from((low >> 64) as u64) * u128::from(self.d);
        ((top + bottom) >> 64) as u64
    }
}

impl Bloom {
    /// An empty filter sized for `keys` keys at `bits_per_key`.
    pub fn new(keys: usize, bits_per_key: u32) -> Self {
        let hashes =
            ((f64::from(bits_per_key) * std::f64::consts::LN_2).round() as u32).clamp(1, 16);
        let words = Self::words_for(keys, bits_per_key);
        Self {
            bits: vec![0; words].into(),
            hashes,
            modulus: Modulus::new(words as u64 * 64),
        }
    }

    /// The (word, mask) of each probe of `hash` in a filter of `words`
    /// words and `hashes` probes.
    fn probes(modulus: Modulus, hashes: u32, hash: &KeyHash) -> impl Iterator<Item = (usize, u64)> {
        let (h1, h2) = (hash.0, hash.1);
        (0..u64::from(hashes)).map(move |i| {
            let bit = modulus.of(h1.wrapping_add(i.wrapping_mul(h2)));
            ((bit / 64) as usize, 1u64 << (bit % 64))
        })
    }

    /// Adds a key (copying the bits first if the filter is shared).
    pub fn insert(&mut self, key: &[u8]) {
        let hash = KeyHash::of(key);
        let bits = Arc::make_mut(&mut self.bits);
        for (word, mask) in Self::probes(self.modulus, self.hashes, &hash) {
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
        Self::probes(self.modulus, self.hashes, hash)
            .all(|(word, mask)| self.bits[word] & mask != 0)
    }

    /// Bytes of the encoded filter.
    pub fn encoded_len(&self) -> usize {
        4 + self.bits.len() * 8
    }

    /// [`Bloom::encoded_len`] of a filter made for `keys` keys.
    pub fn encoded_len_for(keys: usize, bits_per_key: u32) -> usize {
        4 + Self::words_for(keys, bits_per_key) * 8
    }

    fn words_for(keys: usize, bits_per_key: u32) -> usize {
        ((keys.max(1) as u64 * u64::from(bits_per_key.max(1))).div_ceil(64) as usize).max(1)
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
        let bits: Arc<[u64]> = bytes[4..]
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .collect();
        let modulus = Modulus::new(bits.len() as u64 * 64);
        Some(Self {
            bits,
            hashes,
            modulus,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_modulus_is_the_remainder() {
        let seed: u64 = rand::random();
        println!("seed {seed}");
        let mut x = seed;
        let divisors = [
            1,
            2,
            3,
            7,
            64,
            640,
            1 << 20,
            999_999_937,
            u64::MAX / 3,
            u64::MAX,
        ];
        for d in divisors.into_iter().chain((0..200).map(|i| 64 * (i + 1))) {
            let modulus = Modulus::new(d);
            for edge in [0, 1, d - 1, d, d.wrapping_add(1), u64::MAX, u64::MAX - 1] {
                assert_eq!(modulus.of(edge), edge % d, "{edge} % {d}");
            }
            for _ in 0..2_000 {
                x = mix(x.wrapping_add(0x9e37_79b9_7f4a_7c15));
                assert_eq!(modulus.of(x), x % d, "{x} % {d}");
            }
        }
    }

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
