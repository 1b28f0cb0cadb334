//! The name index: the keys of every namespace a replica holds, in key
//! order, so a shard can list them.
//!
//! Blobs are stored under hashed storage keys (`proto::storage_key`), which
//! keep no order and not even the name. The name index is a second engine
//! key space holding a **burst trie** of the names, one trie per namespace:
//!
//! ```text
//! index key (18 bytes) = scope [16] ++ label u16 (big-endian)
//!   scope of the root of namespace n = SHA-256("tidepool.v1.names" ++ u32_le(n))[..16]
//!   scope of the child of node s by byte b = SHA-256(s ++ [b])[..16]
//!   label END (0x0000): the name that is exactly the node's path
//!   label 0x0100 | b:   the names that continue with byte b
//! value = 1 (leaf), kind u8, size u64, sha256 [32], name   -- one name
//!       | 2 (interior)                                     -- go to the child node
//! ```
//!
//! A node's entries sort in name order (END first: a name sorts before its
//! extensions), scopes are hashes, so the index's keys are spread evenly
//! over the engine's cells and one node (at most 257 entries) is one small
//! contiguous range. A label holds a single name as a *leaf* until a second
//! name with the same byte arrives; then it *bursts*: the label becomes
//! interior and both names move one level down (repeatedly, while they
//! share bytes). A name costs one index entry plus its share of the
//! interior ones; a walk in order keeps one node's keys per level.
//!
//! Updates happen where blobs are applied, in log order: every applied put
//! of a named blob inserts (or refreshes) its leaf with the blob's kind, size
//! and SHA-256, every applied delete removes it and removes nodes left empty;
//! one Raft entry's changes are one engine record (atomic), or several in a
//! row when they outnumber one ([`NameBatch::commit`]). Blobs expired by
//! an epoch drop leave their leaves behind, and after a split both groups
//! hold the parent's names: listing checks each leaf's blob and range and
//! skips the others, and each replica sweeps them out in the background
//! ([`sweep_step`]). Interior
//! nodes never move a name to a place a concurrent walk already passed, so
//! a listing needs no lock: it sees every name present throughout it. See
//! `docs/design/listing.md`.

use std::collections::BTreeMap;
use std::ops::Bound;

use sha2::{Digest, Sha256};
use tidepool_engine::{Durability, Engine, KeySpace, Tag, WriteBatch};

use crate::error::{NodeError, Result};

/// The engine key space of the name index.
pub const NAMES_KEY_SPACE: &str = "names";
/// Bytes of an index key.
pub const NAME_KEY_BYTES: usize = 18;
/// Tag of index entries: no namespace's (ids count from 1), so epoch drops
/// of a namespace keep them.
const NAMES_TAG: Tag = Tag(u32::MAX);

const SCOPE_BYTES: usize = 16;
const END: u16 = 0;
const LAST_LABEL: u16 = 0x01FF;
const LEAF: u8 = 1;
const INTERIOR: u8 = 2;
/// Bytes of a leaf value before the name.
const LEAF_HEADER: usize = 1 + 1 + 8 + 32;

/// The key of the replica's indexing state, and its values.
const STATE_LABEL: u16 = 0xFFFF;
const STATE_COMPLETE: u8 = 3;
const STATE_INCOMPLETE: u8 = 4;

type Scope = [u8; SCOPE_BYTES];
type NameKey = [u8; NAME_KEY_BYTES];

fn root(namespace: u32) -> Scope {
    let mut h = Sha256::new();
    h.update(b"tidepool.v1.names");
    h.update(namespace.to_le_bytes());
    h.finalize()[..SCOPE_BYTES].try_into().expect("16 bytes")
}

fn child(scope: &Scope, byte: u8) -> Scope {
    let mut h = Sha256::new();
    h.update(scope);
    h.update([byte]);
    h.finalize()[..SCOPE_BYTES].try_into().expect("16 bytes")
}

fn child_label(byte: u8) -> u16 {
    0x0100 | u16::from(byte)
}

fn key(scope: &Scope, label: u16) -> NameKey {
    let mut key = [0u8; NAME_KEY_BYTES];
    key[..SCOPE_BYTES].copy_from_slice(scope);
    key[SCOPE_BYTES..].copy_from_slice(&label.to_be_bytes());
    key
}

fn label_of(key: &[u8]) -> u16 {
    u16::from_be_bytes([key[SCOPE_BYTES], key[SCOPE_BYTES + 1]])
}

fn state_key() -> NameKey {
    let mut h = Sha256::new();
    h.update(b"tidepool.v1.names.state");
    key(
        &h.finalize()[..SCOPE_BYTES].try_into().expect("16 bytes"),
        STATE_LABEL,
    )
}

/// The name index's key space, in `cells` cells (its keys are spread
/// evenly, as blob keys are).
pub fn key_space_config(cells: u32) -> tidepool_engine::KeySpaceConfig {
    tidepool_engine::KeySpaceConfig {
        name: NAMES_KEY_SPACE.into(),
        key_bytes: NAME_KEY_BYTES as u32,
        layout: tidepool_engine::CellLayout::Uniform { cells },
    }
}

/// What the index keeps of a listed blob (its epoch is read from the blob's
/// own entry, which touches move).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meta {
    /// `BlobKind` as stored.
    pub kind: u8,
    /// Content size.
    pub size: u64,
    /// SHA-256 of the content.
    pub sha256: [u8; 32],
}

enum Node<'a> {
    Leaf(Meta, &'a [u8]),
    Interior,
}

fn encode_leaf(meta: &Meta, name: &[u8]) -> Vec<u8> {
    let mut value = Vec::with_capacity(LEAF_HEADER + name.len());
    value.push(LEAF);
    value.push(meta.kind);
    value.extend_from_slice(&meta.size.to_le_bytes());
    value.extend_from_slice(&meta.sha256);
    value.extend_from_slice(name);
    value
}

fn decode(value: &[u8]) -> Result<Node<'_>> {
    match value.first() {
        Some(&LEAF) if value.len() >= LEAF_HEADER => Ok(Node::Leaf(
            Meta {
                kind: value[1],
                size: u64::from_le_bytes(value[2..10].try_into().expect("8 bytes")),
                sha256: value[10..42].try_into().expect("32 bytes"),
            },
            &value[LEAF_HEADER..],
        )),
        Some(&INTERIOR) if value.len() == 1 => Ok(Node::Interior),
        _ => Err(NodeError::Malformed(format!(
            "name index value of {} bytes is neither a leaf nor an interior node",
            value.len()
        ))),
    }
}

/// The name index changes of one Raft entry, written as one engine record
/// (several when they outnumber one: [`NameBatch::commit`]). Reads see the
/// batch's own earlier changes.
pub struct NameBatch<'a> {
    engine: &'a Engine,
    space: KeySpace,
    overlay: BTreeMap<NameKey, Option<Vec<u8>>>,
    /// Links made interior by this batch, in the order made (a burst makes
    /// them top-down): written last, deepest first (see `ordered`).
    interiors: Vec<NameKey>,
    /// Entries removed by this batch, in the order removed (a removal
    /// takes its leaf, then the links of the nodes it empties, bottom-up):
    /// written first, in that order (see `ordered`).
    removals: Vec<NameKey>,
}

impl<'a> NameBatch<'a> {
    /// An empty batch over the index in `space`.
    pub fn new(engine: &'a Engine, space: KeySpace) -> Self {
        Self {
            engine,
            space,
            overlay: BTreeMap::new(),
            interiors: Vec::new(),
            removals: Vec::new(),
        }
    }

    fn get(&self, key: &NameKey) -> Result<Option<Vec<u8>>> {
        if let Some(value) = self.overlay.get(key) {
            return Ok(value.clone());
        }
        Ok(self.engine.get(self.space, key)?.map(|v| v.to_vec()))
    }

    fn set(&mut self, key: NameKey, value: Option<Vec<u8>>) {
        if value.as_deref() == Some(&[INTERIOR][..]) {
            self.interiors.push(key);
        }
        if value.is_none() {
            self.removals.push(key);
        }
        self.overlay.insert(key, value);
    }

    /// Whether node `scope` has no entry left.
    fn node_is_empty(&self, scope: &Scope) -> Result<bool> {
        let (low, high) = (key(scope, END), key(scope, LAST_LABEL));
        if self
            .overlay
            .range(low..=high)
            .any(|(_, value)| value.is_some())
        {
            return Ok(false);
        }
        let mut keys = self.engine.scan(
            self.space,
            Bound::Included(&low),
            Bound::Included(&high),
            tidepool_engine::Direction::Forward,
        )?;
        while let Some(found) = keys.next_key() {
            let found: NameKey = found?.try_into().expect("key length");
            if !matches!(self.overlay.get(&found), Some(None)) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether the index holds `name` (in namespace `namespace`).
    pub fn contains(&self, namespace: u32, name: &[u8]) -> Result<bool> {
        let mut scope = root(namespace);
        let mut depth = 0;
        loop {
            let at = match name.get(depth) {
                None => key(&scope, END),
                Some(&byte) => key(&scope, child_label(byte)),
            };
            let Some(value) = self.get(&at)? else {
                return Ok(false);
            };
            match decode(&value)? {
                Node::Leaf(_, other) => return Ok(other == name),
                Node::Interior if depth < name.len() => {
                    scope = child(&scope, name[depth]);
                    depth += 1;
                }
                Node::Interior => {
                    return Err(NodeError::Malformed(
                        "name index: an END label holds an interior node".into(),
                    ));
                }
            }
        }
    }

    /// Records `name` (in namespace `namespace`) with its metadata,
    /// replacing what the index held for it.
    pub fn insert(&mut self, namespace: u32, name: &[u8], meta: &Meta) -> Result<()> {
        let leaf = encode_leaf(meta, name);
        let mut scope = root(namespace);
        let mut depth = 0;
        loop {
            if depth == name.len() {
                self.set(key(&scope, END), Some(leaf));
                return Ok(());
            }
            let byte = name[depth];
            let link = key(&scope, child_label(byte));
            let Some(value) = self.get(&link)? else {
                self.set(link, Some(leaf));
                return Ok(());
            };
            match decode(&value)? {
                Node::Leaf(_, other) if other == name => {
                    self.set(link, Some(leaf));
                    return Ok(());
                }
                Node::Leaf(_, other) => {
                    // Burst: the label becomes a node of its own, holding
                    // the other name one level down; go on inserting there.
                    let below = child(&scope, byte);
                    let moved = match other.get(depth + 1) {
                        None => key(&below, END),
                        Some(&next) => key(&below, child_label(next)),
                    };
                    self.set(moved, Some(value.clone()));
                    self.set(link, Some(vec![INTERIOR]));
                    scope = below;
                }
                Node::Interior => scope = child(&scope, byte),
            }
            depth += 1;
        }
    }

    /// Removes `name` from namespace `namespace`'s index, and the nodes it
    /// leaves empty. Returns whether it was there.
    pub fn remove(&mut self, namespace: u32, name: &[u8]) -> Result<bool> {
        // The links followed, each with the scope of the node holding it.
        let mut path: Vec<(Scope, NameKey)> = Vec::new();
        let mut scope = root(namespace);
        let mut depth = 0;
        let found = loop {
            let at = match name.get(depth) {
                None => key(&scope, END),
                Some(&byte) => key(&scope, child_label(byte)),
            };
            let Some(value) = self.get(&at)? else {
                break None;
            };
            match decode(&value)? {
                Node::Leaf(_, other) if other == name => break Some(at),
                Node::Leaf(..) => return Ok(false),
                Node::Interior if depth < name.len() => {
                    path.push((scope, at));
                    scope = child(&scope, name[depth]);
                    depth += 1;
                }
                Node::Interior => {
                    return Err(NodeError::Malformed(
                        "name index: an END label holds an interior node".into(),
                    ));
                }
            }
        };
        if let Some(found) = found {
            self.set(found, None);
        }
        // Absent, the name may still have left empty nodes on its path: a
        // crash kept the removal of its leaf, not of the links above it,
        // and the entry applied again finds no leaf (in an index written
        // whole, no link leads to an empty node and nothing is pruned).
        while let Some((parent, link)) = path.pop() {
            if !self.node_is_empty(&scope)? {
                break;
            }
            self.set(link, None);
            scope = parent;
        }
        Ok(found.is_some())
    }

    /// Removes the leaf of `name` a walk found where `located` says (the
    /// index unchanged since, but for this batch's own removals of other
    /// names), and the nodes it leaves empty: [`NameBatch::remove`]
    /// without descending from the root again.
    fn remove_located(&mut self, name: &[u8], located: &Located<'_>) -> Result<()> {
        self.set(located.at, None);
        let frames = located.frames;
        for depth in (1..frames.len()).rev() {
            debug_assert_eq!(frames[depth].path.as_slice(), &name[..depth]);
            if !self.node_is_empty(&frames[depth].scope)? {
                break;
            }
            self.set(
                key(&frames[depth - 1].scope, child_label(name[depth - 1])),
                None,
            );
        }
        Ok(())
    }

    /// The batch's writes in the order the engine makes them visible (one
    /// at a time: a record is atomic across a crash, not to readers, and a
    /// listing walks the index without a lock): the removals first, each
    /// leaf before the links of the nodes its removal emptied; then every
    /// leaf; then the links made interior, deepest first. A link that
    /// turned interior before the leaves moved below it were there made a
    /// concurrent walk descend into an empty node and skip a name that
    /// existed all along (a restic prune through the gateway takes a
    /// listing as whole). Until its link turns, a node's new leaves are
    /// unreachable and the old leaf still answers; a removal only takes
    /// away what is gone (leaves never move up, so no name that stays is
    /// under an entry removed). Removals first and bottom-up keep a batch
    /// written as several records whole across a crash between them: a
    /// link removed (or a leaf written over an emptied node) while the
    /// entries below it stayed left them unreachable, and applying the
    /// entry again did not find them to remove — a dead name that a later
    /// burst of that link brought back.
    fn ordered(&self) -> Vec<(&NameKey, &Option<Vec<u8>>)> {
        let interior = |value: &Option<Vec<u8>>| value.as_deref() == Some(&[INTERIOR][..]);
        let mut seen = std::collections::HashSet::new();
        let mut out: Vec<(&NameKey, &Option<Vec<u8>>)> = Vec::with_capacity(self.overlay.len());
        for key in &self.removals {
            if let Some((key, value)) = self.overlay.get_key_value(key)
                && value.is_none()
                && seen.insert(*key)
            {
                out.push((key, value));
            }
        }
        out.extend(
            self.overlay
                .iter()
                .filter(|(_, value)| value.is_some() && !interior(value)),
        );
        for key in self.interiors.iter().rev() {
            if let Some((key, value)) = self.overlay.get_key_value(key)
                && interior(value)
                && seen.insert(*key)
            {
                out.push((key, value));
            }
        }
        out
    }

    /// Records that the index lacks a blob the replica holds (a put
    /// proposed without its name, by an older version): listings say they
    /// are incomplete from then on, as for blobs stored before the index
    /// existed ([`check_complete`]).
    pub fn mark_incomplete(&mut self) {
        self.set(state_key(), Some(vec![STATE_INCOMPLETE]));
    }

    /// Writes the batch in the order of `ordered`: one
    /// record, or several in a row when it holds more than one record
    /// takes (the engine's item and byte bounds). An entry of 256 puts of
    /// long names sharing long prefixes bursts a level per shared byte:
    /// over 65,535 index writes, refused as one record — and the replica,
    /// failing at every apply of the committed entry, never came back, on
    /// every node of the shard. Records are no more atomic to a listing
    /// than their items are (the order is what keeps it whole); a crash
    /// between them leaves part of the batch, as one between the entry's
    /// data and its index always could: applying the entry again after
    /// the restart makes the rest.
    pub fn commit(self, durability: Durability) -> Result<()> {
        if self.overlay.is_empty() {
            return Ok(());
        }
        let max_bytes = (self.engine.max_record_bytes() / 2).max(1);
        let mut batch = WriteBatch::new();
        let mut bytes = 0u64;
        for (key, value) in self.ordered() {
            let size =
                RECORD_ITEM_OVERHEAD + (key.len() + value.as_ref().map_or(0, Vec::len)) as u64;
            if !batch.is_empty()
                && (batch.len() >= Engine::MAX_RECORD_ITEMS || bytes + size > max_bytes)
            {
                self.engine.write_batch(&batch, durability)?;
                batch = WriteBatch::new();
                bytes = 0;
            }
            bytes += size;
            match value {
                Some(value) => batch.put_tagged(self.space, key, value, NAMES_TAG),
                None => batch.delete(self.space, key),
            };
        }
        self.engine.write_batch(&batch, durability)?;
        Ok(())
    }
}

/// What an item takes in a record besides its key and value (its header
/// and padding), at most.
const RECORD_ITEM_OVERHEAD: u64 = 40;

/// Whether the walk goes on after a leaf.
pub enum Step {
    /// Visit the next leaf.
    Continue,
    /// Stop after this leaf.
    Stop,
}

/// How a walk ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Walked {
    /// Every matching name was visited.
    Done,
    /// Stopped: names after this one (the last visited) are left.
    StoppedAfter(Vec<u8>),
}

/// One level of a walk: a node and the labels of it still to visit.
struct Frame {
    scope: Scope,
    path: Vec<u8>,
    keys: std::vec::IntoIter<Vec<u8>>,
}

/// The labels of node `path` a walk of names starting with `prefix` and
/// after `start_after` must visit.
fn label_range(path: &[u8], prefix: &[u8], start_after: Option<&[u8]>) -> Option<(u16, u16)> {
    let (mut low, mut high) = (END, LAST_LABEL);
    if path.len() < prefix.len() {
        // Only the branch toward the prefix; the node's own name is shorter.
        let label = child_label(prefix[path.len()]);
        (low, high) = (label, label);
    }
    if let Some(after) = start_after
        && after.starts_with(path)
    {
        // The node's own name is at most `after`; so are the branches below
        // `after`'s next byte.
        low = low.max(match after.get(path.len()) {
            Some(&byte) => child_label(byte),
            None => child_label(0),
        });
    }
    (low <= high).then_some((low, high))
}

fn node_keys(
    engine: &Engine,
    space: KeySpace,
    scope: &Scope,
    (low, high): (u16, u16),
) -> Result<Vec<Vec<u8>>> {
    let (low, high) = (key(scope, low), key(scope, high));
    let mut scan = engine.scan(
        space,
        Bound::Included(&low),
        Bound::Included(&high),
        tidepool_engine::Direction::Forward,
    )?;
    let mut keys = Vec::new();
    while let Some(found) = scan.next_key() {
        keys.push(found?);
    }
    Ok(keys)
}

/// Visits namespace `namespace`'s names that start with `prefix` and sort
/// after `start_after`, in order, with their recorded metadata (dead
/// leaves included: the caller checks the blobs). Memory: one node's keys
/// per level of the trie.
pub fn walk(
    engine: &Engine,
    space: KeySpace,
    namespace: u32,
    prefix: &[u8],
    start_after: Option<&[u8]>,
    mut visit: impl FnMut(&[u8], &Meta) -> Result<Step>,
) -> Result<Walked> {
    walk_located(
        engine,
        space,
        namespace,
        prefix,
        start_after,
        |name, meta, _| visit(name, meta),
    )
}

/// Where a visited leaf is: its index key, and the walk's frames from the
/// namespace's root down to the node holding it (frame `i`'s node is the
/// one of the name's first `i` bytes).
struct Located<'a> {
    at: NameKey,
    frames: &'a [Frame],
    /// Nodes the walk entered so far (each one an engine scan): a page or
    /// a sweep step stops on them as on leaves, or a trie of long chains
    /// (names sharing hundreds of bytes) made one page enter millions.
    entered: usize,
}

/// [`walk`], telling the visitor where each leaf is.
fn walk_located(
    engine: &Engine,
    space: KeySpace,
    namespace: u32,
    prefix: &[u8],
    start_after: Option<&[u8]>,
    mut visit: impl FnMut(&[u8], &Meta, Located<'_>) -> Result<Step>,
) -> Result<Walked> {
    let mut stack: Vec<Frame> = Vec::new();
    let mut entered = 0;
    let push =
        |stack: &mut Vec<Frame>, entered: &mut usize, scope: Scope, path: Vec<u8>| -> Result<()> {
            if let Some(range) = label_range(&path, prefix, start_after) {
                *entered += 1;
                let keys = node_keys(engine, space, &scope, range)?;
                stack.push(Frame {
                    scope,
                    path,
                    keys: keys.into_iter(),
                });
            }
            Ok(())
        };
    push(&mut stack, &mut entered, root(namespace), Vec::new())?;
    while let Some(frame) = stack.last_mut() {
        let Some(at) = frame.keys.next() else {
            stack.pop();
            continue;
        };
        // Deleted since the node was read: nothing to visit.
        let Some(value) = engine.get(space, &at)? else {
            continue;
        };
        match decode(&value)? {
            Node::Leaf(meta, name) => {
                if !name.starts_with(prefix) || start_after.is_some_and(|after| name <= after) {
                    continue;
                }
                let located = Located {
                    at: at.as_slice().try_into().map_err(|_| {
                        NodeError::Malformed(format!("name index: a key of {} bytes", at.len()))
                    })?,
                    frames: &stack,
                    entered,
                };
                if let Step::Stop = visit(name, &meta, located)? {
                    return Ok(Walked::StoppedAfter(name.to_vec()));
                }
            }
            Node::Interior => {
                let label = label_of(&at);
                if label == END {
                    return Err(NodeError::Malformed(
                        "name index: an END label holds an interior node".into(),
                    ));
                }
                let byte = (label & 0xFF) as u8;
                let scope = child(&frame.scope, byte);
                let mut path = frame.path.clone();
                path.push(byte);
                push(&mut stack, &mut entered, scope, path)?;
            }
        }
    }
    Ok(Walked::Done)
}

/// One listed blob.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    /// Its key.
    pub name: Vec<u8>,
    /// Kind, size and SHA-256.
    pub meta: Meta,
    /// Its epoch, from the blob's entry.
    pub epoch: u32,
}

/// One page of a listing.
#[derive(Debug, PartialEq, Eq)]
pub struct Page {
    /// Live blobs, in key order.
    pub entries: Vec<Listed>,
    /// No matching name follows.
    pub done: bool,
    /// When not done: the last name examined; the next page starts after it.
    pub resume_after: Vec<u8>,
}

/// Bounds of one page.
#[derive(Clone, Copy, Debug)]
pub struct PageLimits {
    /// Most entries.
    pub entries: usize,
    /// Most bytes of names (the page ends after the leaf that reaches it).
    pub name_bytes: usize,
    /// Most leaves examined (dead ones included).
    pub examined: usize,
    /// Most trie nodes entered (each an engine scan): the page ends at the
    /// first leaf after it, so a trie of long chains (names sharing
    /// hundreds of bytes) costs a page no more than this plus one chain.
    pub entered: usize,
    /// Only names whose blob's hash position is in this range (the
    /// replica's group's: after a split, the other group's names stay in
    /// the index until swept, and are not this group's to list); `None`:
    /// every name.
    pub owned: Option<(u64, u64)>,
}

/// The epoch of `name`'s blob, if it is stored (and its hash position is
/// in `owned`).
fn blob_epoch(
    engine: &Engine,
    blobs: KeySpace,
    namespace: u32,
    name: &[u8],
    owned: Option<(u64, u64)>,
) -> Result<Option<u32>> {
    let key = tidepool_proto::storage_key(namespace, name);
    if let Some((start, end)) = owned {
        let position = tidepool_proto::hash_position(&key);
        if position < start || position > end {
            return Ok(None);
        }
    }
    Ok(engine.epoch_of(blobs, &key)?.map(|epoch| epoch.0))
}

/// One page of namespace `namespace`'s live blobs that start with `prefix`
/// and sort after `start_after`.
pub fn list_page(
    engine: &Engine,
    names: KeySpace,
    blobs: KeySpace,
    namespace: u32,
    prefix: &[u8],
    start_after: Option<&[u8]>,
    limits: PageLimits,
) -> Result<Page> {
    let mut entries = Vec::new();
    let (mut examined, mut bytes) = (0, 0);
    let walked = walk_located(
        engine,
        names,
        namespace,
        prefix,
        start_after,
        |name, meta, located| {
            examined += 1;
            if let Some(epoch) = blob_epoch(engine, blobs, namespace, name, limits.owned)? {
                bytes += name.len();
                entries.push(Listed {
                    name: name.to_vec(),
                    meta: *meta,
                    epoch,
                });
            }
            let full = entries.len() >= limits.entries
                || bytes >= limits.name_bytes
                || examined >= limits.examined
                || located.entered >= limits.entered;
            Ok(if full { Step::Stop } else { Step::Continue })
        },
    )?;
    Ok(match walked {
        Walked::Done => Page {
            entries,
            done: true,
            resume_after: Vec::new(),
        },
        Walked::StoppedAfter(name) => Page {
            entries,
            done: false,
            resume_after: name,
        },
    })
}

/// What the last finished sweep of a namespace's names left in the
/// index: every name inside `range`, and none of a blob dropped below
/// epoch `below` (nor any other whose blob was gone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Swept {
    /// Every name's blob lies in this hash range.
    pub range: (u64, u64),
    /// No name of a blob dropped by a drop below this epoch.
    pub below: u32,
}

impl Swept {
    /// An index never swept: no split or drop has left anything to sweep
    /// (a put outside the range is refused, a delete removes its name).
    pub const NEVER: Swept = Swept {
        range: (0, u64::MAX),
        below: 0,
    };

    /// Whether an index swept to `self` needs no sweep to be `want`.
    pub fn covers(&self, want: &Swept) -> bool {
        self.range == want.range && self.below >= want.below
    }

    fn encode(&self) -> Vec<u8> {
        let mut record = Vec::with_capacity(20);
        record.extend_from_slice(&self.range.0.to_le_bytes());
        record.extend_from_slice(&self.range.1.to_le_bytes());
        record.extend_from_slice(&self.below.to_le_bytes());
        record
    }
}

/// The key recording what namespace `namespace`'s last finished sweep
/// left ([`Swept`]). Not a trie key: no walk reaches it, and binaries that
/// predate it never read it.
fn swept_key(namespace: u32) -> NameKey {
    let mut h = Sha256::new();
    h.update(b"tidepool.v1.names.swept");
    h.update(namespace.to_le_bytes());
    key(
        &h.finalize()[..SCOPE_BYTES].try_into().expect("16 bytes"),
        STATE_LABEL,
    )
}

/// What namespace `namespace`'s last finished sweep left
/// ([`Swept::NEVER`] if none finished).
pub fn swept(engine: &Engine, names: KeySpace, namespace: u32) -> Result<Swept> {
    let Some(value) = engine.get(names, &swept_key(namespace))? else {
        return Ok(Swept::NEVER);
    };
    if value.len() != 20 {
        return Err(NodeError::Malformed(format!(
            "name index: a sweep record of {} bytes",
            value.len()
        )));
    }
    let u64_at = |at: usize| u64::from_le_bytes(value[at..at + 8].try_into().expect("8 bytes"));
    Ok(Swept {
        range: (u64_at(0), u64_at(8)),
        below: u32::from_le_bytes(value[16..20].try_into().expect("4 bytes")),
    })
}

/// Where a sweep stands after a step.
#[derive(Debug, PartialEq, Eq)]
pub struct SweepStep {
    /// Leaves removed by the step.
    pub removed: u64,
    /// How the walk ended: `Done` once every name was examined (and
    /// the sweep recorded), else the name to go on after.
    pub walked: Walked,
}

/// One step of sweeping namespace `namespace`'s names to `want`: examines
/// the leaves after `after`, removing those whose blob's hash position
/// lies outside `want.range` (after a split, the other group's half) and
/// those whose blob is gone (dropped with its epoch), until `max_leaves`
/// were examined or `until` passed; once the walk reaches the end it
/// records `want` ([`swept`]). One engine record per step; a walk cut
/// short (a crash) is redone from the start, removing nothing twice.
pub fn sweep_step(
    engine: &Engine,
    names: KeySpace,
    blobs: KeySpace,
    namespace: u32,
    want: Swept,
    after: Option<&[u8]>,
    (max_leaves, until): (usize, std::time::Instant),
) -> Result<SweepStep> {
    let (start, end) = want.range;
    // Removals go to the batch as the walk goes (it reads the engine, not
    // the batch), so the time bound covers them too.
    let mut batch = NameBatch::new(engine, names);
    let (mut examined, mut removed) = (0, 0);
    let walked = walk_located(engine, names, namespace, &[], after, |name, _, located| {
        examined += 1;
        let key = tidepool_proto::storage_key(namespace, name);
        let position = tidepool_proto::hash_position(&key);
        let gone = position < start || position > end || engine.epoch_of(blobs, &key)?.is_none();
        if gone {
            batch.remove_located(name, &located)?;
            removed += 1;
        }
        Ok(
            if examined >= max_leaves
                || located.entered >= max_leaves
                || std::time::Instant::now() >= until
            {
                Step::Stop
            } else {
                Step::Continue
            },
        )
    })?;
    if walked == Walked::Done {
        batch.set(swept_key(namespace), Some(want.encode()));
    }
    batch.commit(Durability::Buffered)?;
    Ok(SweepStep { removed, walked })
}

/// Whether the index is missing blobs stored before it existed: decided
/// the first time a replica's engine is opened with the index (not
/// missing if the replica held no blob then), and kept.
pub fn check_complete(engine: &Engine, names: KeySpace, blobs: KeySpace) -> Result<bool> {
    let state = state_key();
    if let Some(value) = engine.get(names, &state)? {
        return Ok(value.first() == Some(&STATE_COMPLETE));
    }
    let held_blobs = engine
        .scan(
            blobs,
            Bound::Unbounded,
            Bound::Unbounded,
            tidepool_engine::Direction::Forward,
        )?
        .next_key()
        .transpose()?
        .is_some();
    let value = if held_blobs {
        STATE_INCOMPLETE
    } else {
        STATE_COMPLETE
    };
    let mut batch = WriteBatch::new();
    batch.put_tagged(names, &state, &[value], NAMES_TAG);
    engine.write_batch(&batch, Durability::Synced)?;
    Ok(!held_blobs)
}

/// Whether the replica's index holds every blob (see [`check_complete`];
/// an engine never checked counts as complete).
pub fn is_complete(engine: &Engine, names: KeySpace) -> Result<bool> {
    Ok(engine
        .get(names, &state_key())?
        .is_none_or(|value| value.first() == Some(&STATE_COMPLETE)))
}

/// Removes the indexing state, as an engine of a version from before the
/// index has none (tests).
#[cfg(test)]
pub(crate) fn forget_state(engine: &Engine, names: KeySpace) -> Result<()> {
    engine.delete(names, &state_key(), Durability::Synced)?;
    Ok(())
}

#[cfg(test)]
mod tests;
