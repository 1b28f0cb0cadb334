//! A cell's on-disk index as layers: a base (a whole index) and the delta
//! blobs flushed over it (the changes of one flush each, tombstones
//! included), oldest first — how they are merged, when a flush writes a
//! delta or merges, and how lookups and loads read them.
//!
//! A base, or one flush's delta, larger than a record of the index log is
//! written as several blobs of its kind ("parts", `IndexStore::write_parts`):
//! disjoint runs of keys, so a key is in at most one part of a base or of a
//! delta, and the parts can be read in any order.
//!
//! A key's entry is in the newest layer that has one: every layer was
//! written from changes that were never older than the layers below
//! (`docs/design/cell-states.md`), so reading newest first is the same as
//! taking the superseding entry. Merges take the superseding entry anyway.

use std::sync::Arc;

use crate::error::Result;
use crate::index::blob::{BlobKind, DiskRef};
use crate::index::bloom::{Bloom, KeyHash};
use crate::index::entry::{Entry, Key, SortedEntries};
use crate::index::store::IndexStore;

/// One blob of a cell's on-disk index, with its bloom filter once read.
#[derive(Clone, Debug)]
pub(crate) struct Layer {
    pub disk: DiskRef,
    pub bloom: Option<Bloom>,
    /// A part of the base, or a delta (what the blob's header says).
    pub kind: BlobKind,
}

/// A cell's on-disk index, oldest first: the base's parts (a whole index:
/// no tombstones; one blob unless it outgrew a record), then the deltas
/// (the changes of one flush each, tombstones included). Empty when
/// nothing is on disk. Shared read-only; a flush installs a new one.
pub(crate) type Layers = Arc<[Layer]>;

/// Whether two layer lists name the same blobs (bloom filters aside).
pub(crate) fn same_layers(a: &[Layer], b: &[Layer]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.disk == y.disk)
}

/// The blobs of a layer list.
pub(crate) fn layer_refs(layers: &[Layer]) -> Vec<DiskRef> {
    layers.iter().map(|l| l.disk).collect()
}

/// The most blobs a cell's index may have (the control file counts them
/// in 16 bits): a flush that would install more fails instead.
pub(crate) const MAX_CELL_BLOBS: usize = u16::MAX as usize;

/// The blobs of the base among `layers`: how many lead them.
pub(crate) fn base_blobs(layers: &[Layer]) -> usize {
    layers
        .iter()
        .take_while(|l| l.kind == BlobKind::Base)
        .count()
}

/// Layers over blobs read from a snapshot, the first `base_blobs` of them
/// the base's parts, filters not read.
pub(crate) fn restored_layers(disk: &[DiskRef], base_blobs: usize) -> Layers {
    disk.iter()
        .enumerate()
        .map(|(i, &disk)| Layer {
            disk,
            bloom: None,
            kind: if i < base_blobs {
                BlobKind::Base
            } else {
                BlobKind::Delta
            },
        })
        .collect()
}

/// Merges `changes` into the sorted `base`: per key the change wins unless
/// the base entry supersedes it; tombstones and drop markers remove keys and
/// are not kept.
pub(crate) fn merge(base: &[(Key, Entry)], changes: &[(Key, Entry)]) -> Vec<(Key, Entry)> {
    combine(base, changes, false)
}

/// Lays the sorted `newer` over the sorted `older` as [`merge`] does, but
/// keeps tombstones and drop markers: the result can itself be laid over
/// an older index (a delta, or deltas read together).
pub(crate) fn overlay(older: &[(Key, Entry)], newer: &[(Key, Entry)]) -> Vec<(Key, Entry)> {
    combine(older, newer, true)
}

fn combine(
    base: &[(Key, Entry)],
    changes: &[(Key, Entry)],
    keep_tombstones: bool,
) -> Vec<(Key, Entry)> {
    let mut merged = Vec::with_capacity(base.len() + changes.len());
    let (mut b, mut c) = (0, 0);
    while b < base.len() || c < changes.len() {
        let pick = match (base.get(b), changes.get(c)) {
            (Some(x), Some(y)) if x.0 == y.0 => {
                b += 1;
                c += 1;
                if x.1.supersedes(&y.1) { *x } else { *y }
            }
            (Some(x), Some(y)) if x.0 < y.0 => {
                b += 1;
                *x
            }
            (Some(x), None) => {
                b += 1;
                *x
            }
            (_, Some(y)) => {
                c += 1;
                *y
            }
            (None, None) => unreachable!("loop condition"),
        };
        if keep_tombstones || !pick.1.tombstone() {
            merged.push(pick);
        }
    }
    merged
}

/// How a flush writes a cell's changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FlushKind {
    /// Merge the on-disk index and the changes into a new base blob.
    Merge,
    /// Append the changes alone as a delta blob over the current index.
    Delta,
}

/// Whether a flush of `changes` changes, `deletes` of them tombstones or
/// relocation moves, over `layers` writes a delta or merges: it merges when
/// there is no base yet, when `max_deltas` deltas are already there, or
/// when the deltas would hold `ratio` times as many entries as the base —
/// a delete or a move of this flush counting `ratio` times, since it adds
/// no key and a merge keeps one entry where a delta keeps two (a flush
/// deleting or relocating the whole base merges, as at ratio 1, instead of
/// keeping the dead base beside its tombstones or copies' entries). Merges then rewrite the base once per `ratio` times its size in
/// new entries, so every delta entry is written about `2 + 1/ratio` times
/// over its life (the delta, the merge that folds it into a base, and its
/// share of the base rewrites), however large the cell — instead of once
/// per flush. Where `max_deltas` binds first (a base many flushes large),
/// the base is rewritten every `max_deltas` flushes instead.
pub(crate) fn flush_kind(
    layers: &[Layer],
    changes: usize,
    deletes: usize,
    max_deltas: u32,
    ratio: u32,
) -> FlushKind {
    let (base, deltas) = layers.split_at(base_blobs(layers));
    if base.is_empty() {
        return FlushKind::Merge;
    }
    let count = |blobs: &[Layer]| blobs.iter().map(|b| b.disk.count as usize).sum::<usize>();
    let ratio = ratio as usize;
    let in_deltas = count(deltas) + changes + deletes.saturating_mul(ratio.saturating_sub(1));
    if deltas.len() >= max_deltas as usize || in_deltas >= count(base).saturating_mul(ratio) {
        FlushKind::Merge
    } else {
        FlushKind::Delta
    }
}

/// What a lookup through a cell's layers found.
#[derive(Debug, Default)]
pub(crate) struct LayeredFound {
    /// The key's entry in the newest layer that has one (a tombstone if
    /// it was deleted there).
    pub entry: Option<Entry>,
    /// Bloom filters read from disk on the way, to install in the cell.
    pub blooms: Vec<(DiskRef, Bloom)>,
    /// Blobs searched (the filter let the key through).
    pub searched: u32,
    /// Windows read.
    pub reads: u32,
}

impl IndexStore {
    /// Looks `key` up in `layers`, newest first, skipping each blob whose
    /// bloom filter (read now if not known) rules the key out. `guess`
    /// estimates the key's rank among a blob's `count` entries.
    pub fn lookup_layers(
        &self,
        key_len: usize,
        layers: &[Layer],
        key: &Key,
        guess: impl Fn(usize) -> usize,
    ) -> Result<LayeredFound> {
        let hash = KeyHash::of(&key[..key_len]);
        let mut found = LayeredFound::default();
        for layer in layers.iter().rev() {
            let bloom = match &layer.bloom {
                Some(bloom) => bloom,
                None => {
                    let bloom = self.load_bloom(&layer.disk)?;
                    found.blooms.push((layer.disk, bloom));
                    &found.blooms.last().expect("just pushed").1
                }
            };
            if !bloom.may_contain_hash(&hash) {
                continue;
            }
            let count = layer.disk.count as usize;
            let hit = self.lookup(key_len, &layer.disk, key, guess(count))?;
            found.searched += 1;
            found.reads += hit.reads;
            if hit.entry.is_some() {
                found.entry = hit.entry;
                break;
            }
        }
        Ok(found)
    }

    /// Reads every blob of `layers` whole: the merged index (live entries
    /// only) and the layers with their bloom filters.
    pub fn load_layers(
        &self,
        key_len: usize,
        layers: &[Layer],
    ) -> Result<(SortedEntries, Vec<Layer>)> {
        let mut merged: Vec<(Key, Entry)> = Vec::new();
        let mut loaded = Vec::with_capacity(layers.len());
        for (i, layer) in layers.iter().enumerate() {
            let (entries, bloom) = self.load(key_len, &layer.disk, layer.kind)?;
            // The base's parts are disjoint: laid over one another, they
            // are their union.
            merged = if i == 0 {
                entries
            } else {
                overlay(&merged, &entries)
            };
            loaded.push(Layer {
                disk: layer.disk,
                bloom: Some(layer.bloom.clone().unwrap_or(bloom)),
                kind: layer.kind,
            });
        }
        merged.retain(|(_, e)| !e.tombstone());
        Ok((merged, loaded))
    }
}

/// Entries and layers for unit tests of the index and the cells.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use crate::types::{Epoch, Tag, WalPosition};

    /// An entry of `version` (at location `version`), or its tombstone.
    pub fn entry(version: u64, tombstone: bool) -> Entry {
        Entry {
            version,
            location: version,
            len: if tombstone { 0 } else { 40 },
            epoch: Epoch(1),
            tag: Tag(0),
        }
    }

    /// A blob reference of `count` entries at `position`.
    pub fn disk_at(position: u64, count: u32) -> DiskRef {
        DiskRef {
            position: WalPosition(position),
            count,
            bloom_len: 12,
            format: Default::default(),
        }
    }

    /// Layers over `refs` (a base of one blob, then deltas), filters not
    /// read.
    pub fn layers(refs: &[DiskRef]) -> Layers {
        restored_layers(refs, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{disk_at, entry, layers};
    use super::*;
    use crate::index::entry::key_array;

    #[test]
    fn flushes_merge_without_a_base_at_the_delta_limit_or_past_the_base_size() {
        assert_eq!(flush_kind(&[], 5, 0, 8, 1), FlushKind::Merge);
        let base = disk_at(0, 100);
        assert_eq!(flush_kind(&layers(&[base]), 10, 0, 8, 1), FlushKind::Delta);
        assert_eq!(flush_kind(&layers(&[base]), 100, 0, 8, 1), FlushKind::Merge);
        let three = layers(&[base, disk_at(1, 30), disk_at(2, 30)]);
        assert_eq!(flush_kind(&three, 39, 0, 8, 1), FlushKind::Delta);
        assert_eq!(flush_kind(&three, 40, 0, 8, 1), FlushKind::Merge);
        assert_eq!(flush_kind(&three, 1, 0, 2, 1), FlushKind::Merge);
        assert_eq!(flush_kind(&layers(&[base]), 1, 0, 0, 1), FlushKind::Merge);
        // At ratio 1 a delete counts once.
        assert_eq!(flush_kind(&three, 39, 39, 8, 1), FlushKind::Delta);
        // A ratio of 3 lets the deltas grow to three times the base.
        assert_eq!(flush_kind(&three, 40, 0, 8, 3), FlushKind::Delta);
        assert_eq!(flush_kind(&three, 239, 0, 8, 3), FlushKind::Delta);
        assert_eq!(flush_kind(&three, 240, 0, 8, 3), FlushKind::Merge);
        assert_eq!(flush_kind(&three, 1, 0, 2, 3), FlushKind::Merge);
        // ... but a delete counts three times: deleting as many keys as the
        // base holds merges.
        assert_eq!(
            flush_kind(&layers(&[base]), 100, 100, 8, 3),
            FlushKind::Merge
        );
        assert_eq!(
            flush_kind(&layers(&[base]), 100, 99, 8, 3),
            FlushKind::Delta
        );
        assert_eq!(flush_kind(&three, 80, 80, 8, 3), FlushKind::Merge);
        assert_eq!(flush_kind(&three, 80, 79, 8, 3), FlushKind::Delta);
    }

    #[test]
    fn a_base_in_parts_counts_as_one_base() {
        let parts = restored_layers(&[disk_at(0, 60), disk_at(1, 40), disk_at(2, 30)], 2);
        assert_eq!(base_blobs(&parts), 2);
        // The deltas grow to the whole base (100 entries), not its first part.
        assert_eq!(flush_kind(&parts, 69, 0, 8, 1), FlushKind::Delta);
        assert_eq!(flush_kind(&parts, 70, 0, 8, 1), FlushKind::Merge);
        // The limit counts deltas, not the base's parts.
        assert_eq!(flush_kind(&parts, 1, 0, 2, 1), FlushKind::Delta);
        let two_deltas = restored_layers(
            &[disk_at(0, 60), disk_at(1, 40), disk_at(2, 5), disk_at(3, 5)],
            2,
        );
        assert_eq!(flush_kind(&two_deltas, 1, 0, 2, 1), FlushKind::Merge);
    }

    #[test]
    fn overlay_keeps_tombstones_and_merge_of_the_overlay_equals_merging_in_turn() {
        let k = |s: &[u8]| key_array(s);
        let base = vec![(k(b"a"), entry(1, false)), (k(b"b"), entry(2, false))];
        let delta1 = vec![(k(b"a"), entry(5, true)), (k(b"c"), entry(6, false))];
        let delta2 = vec![(k(b"a"), entry(7, false)), (k(b"c"), entry(8, true))];
        let deltas = overlay(&delta1, &delta2);
        assert_eq!(deltas.len(), 2);
        assert!(
            deltas[1].1.tombstone(),
            "c's delete is kept for older layers"
        );
        let at_once = merge(&base, &deltas);
        let in_turn = merge(&merge(&base, &delta1), &delta2);
        assert_eq!(at_once, in_turn);
        let keys: Vec<_> = at_once.iter().map(|(key, e)| (key[0], e.version)).collect();
        assert_eq!(keys, vec![(b'a', 7), (b'b', 2)]);
    }

    #[test]
    fn merge_keeps_the_superseding_entry_and_drops_tombstones() {
        let k = |s: &[u8]| key_array(s);
        let base = vec![
            (k(b"a"), entry(1, false)),
            (k(b"b"), entry(2, false)),
            (k(b"d"), entry(3, false)),
        ];
        let changes = vec![
            (k(b"b"), entry(10, true)),
            (k(b"c"), entry(11, false)),
            (k(b"d"), entry(2, false)),
        ];
        let merged = merge(&base, &changes);
        let keys: Vec<_> = merged.iter().map(|(key, e)| (key[0], e.version)).collect();
        assert_eq!(keys, vec![(b'a', 1), (b'c', 11), (b'd', 3)]);
    }
}
