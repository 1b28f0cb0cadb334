//! Decoders of bytes read from disk, with well-formed inputs, for the
//! fuzzing test (`tests/decoders_survive_hostile_bytes.rs`): every one
//! must return a value or a typed error — never panic, never allocate out
//! of proportion to its input — whatever the bytes.
//!
//! Not part of the engine's API: hidden, and used only by that test.

use crate::config::{CellLayout, KeySpaceConfig};
use crate::control::{CellControl, ControlData, SpaceControl};
use crate::index::blob::{self, BlobKind, DiskRef};
use crate::index::bloom::Bloom;
use crate::index::entry::{Entry, EntryFormat, EntryLayout, Key, key_array};
use crate::table::CellId;
use crate::types::{Epoch, Tag, WalPosition};
use crate::wal::format::{self, ItemSpec, Kind, Op, RecordHeader, RecordView};
use crate::wal::segment::{LogKind, SegmentHeader};

/// Where the record seeds are written (records are position-checked).
const POSITION: WalPosition = WalPosition(8192);

/// A decoder and its seeds: `(name, seeds, decode)`; `decode` returns
/// whether the input was accepted.
pub type Target = (&'static str, Vec<Vec<u8>>, Box<dyn Fn(&[u8]) -> bool>);

/// Every decoder of the engine's on-disk formats.
pub fn targets() -> Vec<Target> {
    vec![
        ("wal record", record_seeds(), Box::new(decode_record)),
        (
            "record header",
            record_seeds(),
            Box::new(|b: &[u8]| matches!(RecordHeader::decode(b), format::HeaderRead::Header(_))),
        ),
        (
            "control file",
            vec![control().encode(), control_of_version_4().encode()],
            Box::new(decode_control),
        ),
        (
            "segment header",
            vec![segment_header().encode().to_vec()],
            Box::new(|b: &[u8]| SegmentHeader::decode(b, &segment_header()).is_ok()),
        ),
        (
            "index blob",
            index_blob_seeds(),
            Box::new(decode_index_blob),
        ),
        (
            "bloom filter",
            vec![bloom_bytes()],
            Box::new(|b: &[u8]| Bloom::decode(b).is_some()),
        ),
        (
            "index entry",
            index_entry_seeds(),
            Box::new(decode_index_entry),
        ),
    ]
}

fn item<'a>(op: Op, key: &'a [u8], value: &'a [u8], version: u64) -> ItemSpec<'a> {
    ItemSpec {
        op,
        key_space: 0,
        key,
        value,
        epoch: Epoch(3),
        tag: Tag(9),
        version,
    }
}

fn write(meta: &[u8], items: &[ItemSpec<'_>]) -> Vec<u8> {
    let mut buf = vec![0u8; format::entry_record_len(meta.len(), items)];
    format::write_entry(&mut buf, POSITION, 0, meta, items);
    buf
}

/// Records as the WAL holds them: a multi-item entry with metadata, a
/// single entry, a delete, a touch, a sync mark.
fn record_seeds() -> Vec<Vec<u8>> {
    let key = [7u8; 32];
    let other = [8u8; 32];
    let value = vec![42u8; 300];
    let mut sync_mark = vec![0u8; format::record_len(8)];
    format::write_plain(
        &mut sync_mark,
        POSITION,
        Kind::SyncMark,
        &1234u64.to_le_bytes(),
    );
    vec![
        write(
            b"raft entry metadata",
            &[
                item(Op::Put, &key, &value, 0),
                item(Op::Delete, &other, &[], 0),
            ],
        ),
        write(&[], &[item(Op::Put, &key, &value, 0)]),
        write(&[], &[item(Op::Delete, &key, &[], 0)]),
        write(&[], &[item(Op::Touch, &key, &[], 4096)]),
        sync_mark,
    ]
}

fn decode_record(bytes: &[u8]) -> bool {
    let Ok(view) = RecordView::verify(POSITION, bytes) else {
        return false;
    };
    let _ = view.meta();
    view.items().count();
    true
}

fn segment_header() -> SegmentHeader {
    SegmentHeader {
        kind: LogKind::Values,
        log_id: [5; 16],
        id: crate::types::SegmentId(3),
        segment_size: 1 << 20,
        epoch: Epoch(2),
    }
}

fn disk_ref(count: u32, bloom_len: u32) -> DiskRef {
    DiskRef {
        position: WalPosition(65_536),
        count,
        bloom_len,
        format: EntryFormat::default(),
    }
}

fn control() -> ControlData {
    ControlData {
        log_id: [3; 16],
        wal_segment_bytes: 1 << 20,
        index_segment_bytes: 1 << 16,
        epoch: Epoch(7),
        replay_from: WalPosition(999),
        synced: WalPosition(1200),
        app_state: b"application state".to_vec(),
        spaces: vec![
            SpaceControl {
                config: KeySpaceConfig {
                    name: "u".into(),
                    key_bytes: 32,
                    layout: CellLayout::Uniform { cells: 8 },
                },
                cells: vec![CellControl {
                    id: CellId::Uniform(3),
                    layers: vec![disk_ref(10, 28)],
                    base_blobs: 1,
                    replay_from: 1000,
                }],
            },
            SpaceControl {
                config: KeySpaceConfig {
                    name: "p".into(),
                    key_bytes: 16,
                    layout: CellLayout::Prefixed { prefix_bytes: 4 },
                },
                cells: vec![CellControl {
                    id: CellId::Prefixed(key_array(b"abcd")),
                    layers: vec![disk_ref(2, 12), disk_ref(1, 12)],
                    base_blobs: 1,
                    replay_from: 7,
                }],
            },
        ],
    }
}

/// [`control`] with a base in two parts: encoded as version 4.
fn control_of_version_4() -> ControlData {
    let mut data = control();
    data.spaces[1].cells[0].base_blobs = 2;
    data
}

fn decode_control(bytes: &[u8]) -> bool {
    ControlData::decode(bytes).is_ok()
}

/// Sorted entries of a cell: puts, and (for a delta) a tombstone.
fn entries(delta: bool) -> Vec<(Key, Entry)> {
    (0..12u8)
        .map(|i| {
            let mut key = [0u8; 32];
            key[0] = i * 16;
            key[1] = i;
            let delete = delta && i == 5;
            let entry = Entry::written(4096 * u64::from(i) + 64, 100, delete, Epoch(1), Tag(2));
            (key_array(&key), entry)
        })
        .collect()
}

fn index_blob_seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    for (delta, kind) in [(false, BlobKind::Base), (true, BlobKind::Delta)] {
        let encoded = blob::encode(32, &entries(delta), 10, kind);
        // The seed: kind byte, bloom length (LE u32), then the body, so a
        // mutant can also lie about what its reference records.
        let mut seed = vec![kind as u8];
        seed.extend_from_slice(&encoded.bloom_len.to_le_bytes());
        seed.push(encoded.format.flags);
        seed.extend_from_slice(&encoded.body);
        seeds.push(seed);
    }
    seeds
}

fn decode_index_blob(bytes: &[u8]) -> bool {
    if bytes.len() < 6 {
        return false;
    }
    let kind = if bytes[0] == 0 {
        BlobKind::Base
    } else {
        BlobKind::Delta
    };
    let bloom_len = u32::from_le_bytes(bytes[1..5].try_into().expect("4 bytes"));
    let body = &bytes[6..];
    let count = body
        .get(4..8)
        .map_or(0, |c| u32::from_le_bytes(c.try_into().expect("4 bytes")));
    let expected = DiskRef {
        format: EntryFormat::from_parts(bytes[5], Epoch(1), Tag(2)),
        ..disk_ref(count, bloom_len)
    };
    let header_and_bloom = expected.header_and_bloom_len().min(body.len());
    let _ = blob::decode_bloom(&body[..header_and_bloom], &expected);
    blob::decode(32, body, &expected, kind).is_ok()
}

fn bloom_bytes() -> Vec<u8> {
    let mut bloom = Bloom::new(20, 10);
    for i in 0..20u8 {
        bloom.insert(&[i; 32]);
    }
    let mut out = Vec::new();
    bloom.encode(&mut out);
    out
}

/// Index entries in every format: the format's flags first, then the
/// encoded entry.
fn index_entry_seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    let samples = entries(true);
    for flags in [0u8, 1, 3, 7, 15, 31] {
        let layout = EntryLayout {
            key_len: 32,
            format: EntryFormat::from_parts(flags, Epoch(1), Tag(2)),
        };
        for (key, entry) in samples.iter().take(6) {
            let mut out = vec![0u8; layout.size()];
            layout.encode(key, entry, &mut out);
            let mut seed = vec![flags];
            seed.extend_from_slice(&out);
            seeds.push(seed);
        }
    }
    seeds
}

fn decode_index_entry(bytes: &[u8]) -> bool {
    let Some((&flags, entry)) = bytes.split_first() else {
        return false;
    };
    let layout = EntryLayout {
        key_len: 32,
        format: EntryFormat::from_parts(flags, Epoch(1), Tag(2)),
    };
    if entry.len() != layout.size() {
        return false;
    }
    layout.decode(entry).is_some()
}
