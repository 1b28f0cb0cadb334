//! Optimistic lookup in a sorted on-disk index without a directory.
//!
//! Keys are uniformly distributed over the cell's key range, so a key's rank
//! in the sorted entries is close to `count * (key - low) / (high - low)`.
//! The estimate's error is about `sqrt(count)/2` entries (the spread of a
//! uniform sample's rank), so the lookup reads a window of `3·sqrt(count) +
//! 16` entries (±3 standard deviations, capped by `lookup_window_entries`)
//! centred on it; if the key falls before the window's first key or after
//! its last, it shifts the window (keeping one entry of overlap) until the
//! key is bracketed or the array ends, then binary-searches the window. One
//! read almost always suffices, and it is a few KiB — about one value's
//! bytes — however large the cell.

use std::cmp::Ordering;

use crate::index::entry::{Entry, EntryLayout, Key};

/// Why a lookup could not complete.
#[derive(Debug)]
pub(crate) enum LookupError<E> {
    /// Reading a window failed.
    Read(E),
    /// An entry on the search path failed its checksum.
    Corrupt {
        /// Index of the bad entry.
        entry: usize,
    },
}

/// The result of one lookup.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Found {
    pub entry: Option<Entry>,
    /// Windows read.
    pub reads: u32,
}

/// Estimated rank of `rank` (the key's 64-bit position) among `count`
/// entries spread over `[low, high]`.
pub(crate) fn estimate(rank: u64, low: u64, high: u64, count: usize) -> usize {
    if count == 0 || high <= low {
        return 0;
    }
    let offset = u128::from(rank.clamp(low, high) - low);
    let span = u128::from(high - low) + 1;
    ((offset * count as u128 / span) as usize).min(count - 1)
}

/// Entries one lookup reads among `count`: enough to cover the estimate's
/// error (see the module docs), at most `max_window`.
pub(crate) fn window_for(count: usize, max_window: usize) -> usize {
    let fit = 3 * count.isqrt() + 16;
    fit.min(max_window).clamp(2, count.max(2)).min(count)
}

/// Looks `key` up among `count` sorted entries, reading windows of at most
/// `window` entries. `read(first, n)` returns the encoded entries
/// `first..first + n`.
pub(crate) fn lookup<E>(
    layout: &EntryLayout,
    count: usize,
    key: &Key,
    guess: usize,
    window: usize,
    mut read: impl FnMut(usize, usize) -> Result<Vec<u8>, E>,
) -> Result<Found, LookupError<E>> {
    if count == 0 {
        return Ok(Found {
            entry: None,
            reads: 0,
        });
    }
    let size = layout.size();
    let width = window_for(count, window);
    let mut start = guess.saturating_sub(width / 2).min(count - width);
    let mut reads = 0;
    loop {
        let bytes = read(start, width).map_err(LookupError::Read)?;
        reads += 1;
        let at = |i: usize| &bytes[i * size..(i + 1) * size];
        verify(layout, at(0), start)?;
        verify(layout, at(width - 1), start + width - 1)?;
        if layout.cmp_key(key, at(0)) == Ordering::Less && start > 0 {
            start = (start + 1).saturating_sub(width);
            continue;
        }
        if layout.cmp_key(key, at(width - 1)) == Ordering::Greater && start + width < count {
            start = (start + width - 1).min(count - width);
            continue;
        }
        let entry = search(layout, &bytes, width, key, start)?;
        return Ok(Found { entry, reads });
    }
}

fn verify<E>(
    layout: &EntryLayout,
    bytes: &[u8],
    index: usize,
) -> Result<(Key, Entry), LookupError<E>> {
    layout
        .decode(bytes)
        .ok_or(LookupError::Corrupt { entry: index })
}

/// Binary search in a window, verifying every entry it compares against.
fn search<E>(
    layout: &EntryLayout,
    bytes: &[u8],
    width: usize,
    key: &Key,
    start: usize,
) -> Result<Option<Entry>, LookupError<E>> {
    let size = layout.size();
    let (mut lo, mut hi) = (0, width);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let (mid_key, entry) = verify(layout, &bytes[mid * size..(mid + 1) * size], start + mid)?;
        match key.cmp(&mid_key) {
            Ordering::Equal => return Ok(Some(entry)),
            Ordering::Less => hi = mid,
            Ordering::Greater => lo = mid + 1,
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::index::entry::key_array;
    use crate::types::{Epoch, Tag};

    fn build(count: usize, rng: &mut SmallRng) -> (EntryLayout, Vec<Key>, Vec<u8>) {
        let layout = EntryLayout { key_len: 32 };
        let mut keys: Vec<Key> = (0..count)
            .map(|_| key_array(&rng.random::<[u8; 32]>()))
            .collect();
        keys.sort();
        keys.dedup();
        let mut bytes = vec![0u8; keys.len() * layout.size()];
        for (i, key) in keys.iter().enumerate() {
            let entry = Entry {
                version: i as u64,
                location: i as u64,
                len: 1,
                epoch: Epoch(0),
                tag: Tag(0),
            };
            layout.encode(
                key,
                &entry,
                &mut bytes[i * layout.size()..(i + 1) * layout.size()],
            );
        }
        (layout, keys, bytes)
    }

    fn rank(key: &Key) -> u64 {
        u64::from_be_bytes(key[..8].try_into().unwrap())
    }

    #[test]
    fn finds_every_key_and_reports_hit_rate_and_reads_per_lookup() {
        let seed = tidepool_testkit::seed_from_env("LOOKUP_SEED");
        let mut rng = SmallRng::seed_from_u64(seed);
        for (count, window) in [
            (100_000, 800),
            (100_000, 200),
            (20_000, 800),
            (640, 800),
            (1_000, 64),
        ] {
            let (layout, keys, bytes) = build(count, &mut rng);
            let size = layout.size();
            let (mut total_reads, mut first_hits) = (0u64, 0u64);
            for (i, key) in keys.iter().enumerate() {
                let guess = estimate(rank(key), 0, u64::MAX, keys.len());
                let found = lookup::<()>(&layout, keys.len(), key, guess, window, |first, n| {
                    Ok(bytes[first * size..(first + n) * size].to_vec())
                })
                .unwrap();
                assert_eq!(
                    found.entry.map(|e| e.version),
                    Some(i as u64),
                    "seed {seed}"
                );
                total_reads += u64::from(found.reads);
                first_hits += u64::from(found.reads == 1);
            }
            let n = keys.len() as f64;
            let hit_rate = first_hits as f64 / n;
            let reads = total_reads as f64 / n;
            let width = window_for(keys.len(), window);
            println!(
                "optimistic lookup: {count} entries, window {width} (at most {window}): hit rate {:.4}, {reads:.4} reads/lookup",
                hit_rate
            );
            // The rank error of a uniform sample is about sqrt(count)/2, and
            // correlated along the array; a window of 3·sqrt(count) covers
            // ±3 of it. A capped window is smaller and may miss more.
            if width >= 3 * keys.len().isqrt() {
                assert!(
                    hit_rate > 0.99,
                    "seed {seed}: hit rate {hit_rate}, window {width}"
                );
            }
        }
    }

    #[test]
    fn absent_keys_and_skewed_guesses_terminate() {
        let mut rng = SmallRng::seed_from_u64(1);
        let (layout, keys, bytes) = build(5_000, &mut rng);
        let size = layout.size();
        for _ in 0..2_000 {
            let key = key_array(&rng.random::<[u8; 32]>());
            let guess = rng.random_range(0..keys.len());
            let found = lookup::<()>(&layout, keys.len(), &key, guess, 50, |first, n| {
                Ok(bytes[first * size..(first + n) * size].to_vec())
            })
            .unwrap();
            assert_eq!(found.entry.is_some(), keys.binary_search(&key).is_ok());
        }
    }

    #[test]
    fn a_damaged_entry_on_the_path_is_reported() {
        let mut rng = SmallRng::seed_from_u64(2);
        let (layout, keys, mut bytes) = build(100, &mut rng);
        let size = layout.size();
        bytes[50 * size + 3] ^= 1;
        let result = lookup::<()>(&layout, keys.len(), &keys[50], 50, 200, |first, n| {
            Ok(bytes[first * size..(first + n) * size].to_vec())
        });
        assert!(matches!(result, Err(LookupError::Corrupt { entry: 50 })));
    }
}
