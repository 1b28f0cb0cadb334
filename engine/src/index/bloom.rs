//! A per-cell bloom filter over the keys of the cell's on-disk index: a
//! "no" skips the disk lookup.

/// Bits of one block of a blocked filter: one 64-byte cache line.
const BLOCK_BITS: u64 = 512;

/// Flag in the encoded `hashes` word: the filter is blocked.
const BLOCKED: u32 = 1 << 31;

/// One cache line of filter bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(align(64))]
struct Block([u64; 8]);

/// How a filter places a key's bits.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Bits {
    /// Every probe anywhere in the filter (the format written before
    /// 2026-11-23; still read): a check costs a cache miss per probe.
    Spread(Vec<u64>),
    /// All of a key's probes inside one 512-bit block chosen by the hash:
    /// a check costs one cache miss, whatever the number of probes.
    Blocked(Vec<Block>),
}

/// A bloom filter with `hashes` probes per key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bloom {
    bits: Bits,
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

/// `hash` mapped onto `0..n` without a division (Lemire's multiply-shift).
fn reduce(hash: u64, n: usize) -> usize {
    ((u128::from(hash) * n as u128) >> 64) as usize
}

impl Bloom {
    /// An empty (blocked) filter sized for `keys` keys at `bits_per_key`.
    pub fn new(keys: usize, bits_per_key: u32) -> Self {
        let bits = keys.max(1) as u64 * u64::from(bits_per_key.max(1));
        let hashes =
            ((f64::from(bits_per_key) * std::f64::consts::LN_2).round() as u32).clamp(1, 16);
        Self {
            bits: Bits::Blocked(vec![Block::default(); bits.div_ceil(BLOCK_BITS) as usize]),
            hashes,
        }
    }

    /// Adds a key.
    pub fn insert(&mut self, key: &[u8]) {
        let hash = KeyHash::of(key);
        match &mut self.bits {
            Bits::Spread(words) => {
                for bit in spread_bits(&hash, self.hashes, words.len()) {
                    words[bit / 64] |= 1 << (bit % 64);
                }
            }
            Bits::Blocked(blocks) => {
                let n = blocks.len();
                let block = &mut blocks[reduce(hash.0, n)].0;
                for bit in block_bits(&hash, self.hashes) {
                    block[bit / 64] |= 1 << (bit % 64);
                }
            }
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
        match &self.bits {
            Bits::Spread(words) => spread_bits(hash, self.hashes, words.len())
                .all(|bit| words[bit / 64] & (1 << (bit % 64)) != 0),
            Bits::Blocked(blocks) => {
                let block = &blocks[reduce(hash.0, blocks.len())].0;
                block_bits(hash, self.hashes).all(|bit| block[bit / 64] & (1 << (bit % 64)) != 0)
            }
        }
    }

    fn words(&self) -> usize {
        match &self.bits {
            Bits::Spread(words) => words.len(),
            Bits::Blocked(blocks) => blocks.len() * 8,
        }
    }

    /// Bytes of the encoded filter.
    pub fn encoded_len(&self) -> usize {
        4 + self.words() * 8
    }

    /// Bytes of memory held.
    pub fn memory_bytes(&self) -> usize {
        self.words() * 8
    }

    /// Encodes as `hashes: u32` (with the [`BLOCKED`] flag for a blocked
    /// filter) then the bit words, little-endian.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (flag, words): (u32, Box<dyn Iterator<Item = &u64>>) = match &self.bits {
            Bits::Spread(words) => (0, Box::new(words.iter())),
            Bits::Blocked(blocks) => (BLOCKED, Box::new(blocks.iter().flat_map(|b| b.0.iter()))),
        };
        out.extend_from_slice(&(self.hashes | flag).to_le_bytes());
        for word in words {
            out.extend_from_slice(&word.to_le_bytes());
        }
    }

    /// Decodes what [`Bloom::encode`] wrote (either layout).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < 12 || !(bytes.len() - 4).is_multiple_of(8) {
            return None;
        }
        let word = u32::from_le_bytes(bytes[..4].try_into().ok()?);
        let hashes = word & !BLOCKED;
        if !(1..=16).contains(&hashes) {
            return None;
        }
        let mut words = bytes[4..]
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")));
        let bits = if word & BLOCKED == 0 {
            Bits::Spread(words.collect())
        } else {
            let n = (bytes.len() - 4) / 8;
            if !n.is_multiple_of(8) {
                return None;
            }
            Bits::Blocked(
                (0..n / 8)
                    .map(|_| Block(std::array::from_fn(|_| words.next().expect("counted"))))
                    .collect(),
            )
        };
        Some(Self { bits, hashes })
    }
}

/// The bits of a spread filter of `words` words a key sets.
fn spread_bits(hash: &KeyHash, hashes: u32, words: usize) -> impl Iterator<Item = usize> {
    let (h1, h2) = (hash.0, hash.1);
    let m = words as u64 * 64;
    (0..u64::from(hashes)).map(move |i| (h1.wrapping_add(i.wrapping_mul(h2)) % m) as usize)
}

/// The bits inside its block a key sets: the block is chosen by the hash's
/// first half, the bits by its second (double hashing with an odd step,
/// so the probes are distinct).
fn block_bits(hash: &KeyHash, hashes: u32) -> impl Iterator<Item = usize> {
    let start = (hash.1 >> 1) as u32;
    let step = (hash.1 >> 33) as u32 | 1;
    (0..hashes)
        .map(move |i| (start.wrapping_add(i.wrapping_mul(step)) as u64 % BLOCK_BITS) as usize)
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

    #[test]
    fn blocked_filters_of_every_size_keep_each_key_and_few_others() {
        let key = |i: u64| mix(i ^ 0x5eed).to_le_bytes().repeat(4);
        for keys in [1u64, 3, 17, 64, 640, 5_000] {
            let mut bloom = Bloom::new(keys as usize, 10);
            assert!(matches!(bloom.bits, Bits::Blocked(_)));
            for i in 0..keys {
                bloom.insert(&key(i));
            }
            assert!((0..keys).all(|i| bloom.may_contain(&key(i))), "{keys} keys");
            let tries = 200_000;
            let false_positives = (keys..keys + tries)
                .filter(|&i| bloom.may_contain(&key(i)))
                .count();
            let rate = false_positives as f64 / tries as f64;
            // A blocked filter at 10 bits per key: about 1% (a little above
            // a spread filter's 0.8%); tiny filters have more bits per key.
            eprintln!("{keys} keys: false positive rate {rate}");
            assert!(rate < 0.02, "{keys} keys: false positive rate {rate}");
            let mut encoded = Vec::new();
            bloom.encode(&mut encoded);
            assert_eq!(encoded.len(), bloom.encoded_len());
            assert_eq!(encoded.len() % 64, 4, "whole blocks");
            assert_eq!(Bloom::decode(&encoded), Some(bloom));
        }
    }

    /// A filter written by the spread format (before 2026-11-23: 40 keys
    /// `[i; 32]` at 10 bits per key), read and probed by today's code.
    #[test]
    fn spread_filters_written_before_still_answer() {
        const FIXTURE: &str = "07000000c25cab88ef6ad206a0383cdf336b89526786126c873d8141ab7645c765cc4693f862d0ff219c74461cb25fb91348b0212d8518a3db3401e9";
        let bytes: Vec<u8> = (0..FIXTURE.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&FIXTURE[i..i + 2], 16).unwrap())
            .collect();
        let bloom = Bloom::decode(&bytes).expect("decodes");
        assert!(matches!(bloom.bits, Bits::Spread(_)));
        assert!((0..40u8).all(|i| bloom.may_contain(&[i; 32])));
        let absent = (40..=255u8)
            .filter(|&i| bloom.may_contain(&[i; 32]))
            .count();
        assert!(absent < 20, "{absent} of 216 absent keys pass");
        let mut encoded = Vec::new();
        bloom.encode(&mut encoded);
        assert_eq!(encoded, bytes, "re-encodes byte for byte");
    }

    #[test]
    fn damaged_encodings_are_refused() {
        let mut good = Vec::new();
        Bloom::new(100, 10).encode(&mut good);
        assert!(Bloom::decode(&good).is_some());
        // A blocked filter whose words are not whole blocks.
        assert!(Bloom::decode(&good[..good.len() - 8]).is_none());
        // No probes, or too many.
        for hashes in [0u32, 17, BLOCKED, BLOCKED | 17] {
            let mut bad = good.clone();
            bad[..4].copy_from_slice(&hashes.to_le_bytes());
            assert!(Bloom::decode(&bad).is_none(), "hashes word {hashes:#x}");
        }
        assert!(Bloom::decode(&good[..11]).is_none());
    }
}
