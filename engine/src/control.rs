//! The control region: one small file, replaced atomically, that says where
//! every cell's on-disk index is and where recovery must start replaying.
//!
//! ```text
//! magic "TPCONTRL", version u32 (4; versions 1 to 3 are read too)
//! log id [16], wal segment bytes u64, index segment bytes u64
//! epoch u32, replay_from u64, synced u64
//! app state: len u32 + bytes
//! key spaces: count u32 + per space:
//!   name: len u16 + bytes, key bytes u32, layout kind u8 (1 uniform,
//!   2 prefixed), layout parameter u32,
//!   cells: count u32 + per cell:
//!     id (uniform: u32; prefixed: the prefix bytes), blob count u16
//!     (u8 before version 4; version 1: has_disk u8, 0 or 1), base blobs
//!     u16 (version 4: the first this many blobs are the base's parts;
//!     before, the first blob alone), per blob (the base, then its
//!     deltas, oldest first) [position u64, count u32, bloom_len u32,
//!     entry format flags u8 (version 3; 0 before), the shared epoch u32
//!     if flagged `SHARED_EPOCH`, the shared tag u32 if `SHARED_TAG`],
//!     replay_from u64
//! crc32 of everything above, u32
//! ```
//! All integers little-endian.

use crate::config::{CellLayout, KeySpaceConfig};
use crate::index::blob::DiskRef;
use crate::index::entry::{EntryFormat, key_array};
use crate::table::CellId;
use crate::types::{Epoch, Tag, WalPosition};

const MAGIC: &[u8; 8] = b"TPCONTRL";
const VERSION: u32 = 4;
/// The oldest version this build reads: version 1 had at most one blob per
/// cell (a base, no deltas), with the same bytes as a count of 0 or 1.
const OLDEST_VERSION: u32 = 1;

/// Name of the control file in the engine directory.
pub const CONTROL_FILE: &str = "control";

/// One cell's durable state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CellControl {
    pub id: CellId,
    /// The cell's on-disk index: its base blob (or the base's parts),
    /// then the deltas over it, oldest first (empty: nothing on disk).
    pub layers: Vec<DiskRef>,
    /// How many of `layers` are the base's (at least one unless `layers`
    /// is empty: a cell's deltas lie over a base).
    pub base_blobs: u16,
    /// Replay must apply this cell's items at or after this position.
    pub replay_from: u64,
}

/// One key space's durable state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SpaceControl {
    pub config: KeySpaceConfig,
    pub cells: Vec<CellControl>,
}

/// The whole control region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ControlData {
    pub log_id: [u8; 16],
    pub wal_segment_bytes: u64,
    pub index_segment_bytes: u64,
    pub epoch: Epoch,
    pub replay_from: WalPosition,
    /// The value WAL's synced watermark when the snapshot was taken: damage
    /// below it is damage to acknowledged data.
    pub synced: WalPosition,
    pub app_state: Vec<u8>,
    pub spaces: Vec<SpaceControl>,
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.0.extend_from_slice(v);
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len());
        let end = end.ok_or_else(|| format!("control file ends early (at byte {})", self.at))?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// A count of items each at least `min_item_bytes` long, checked
    /// against the bytes left so a damaged count cannot allocate wildly.
    fn count(&mut self, min_item_bytes: usize) -> Result<usize, String> {
        let count = self.u32()? as usize;
        if count.saturating_mul(min_item_bytes) > self.bytes.len() - self.at {
            return Err(format!("control file count {count} exceeds its size"));
        }
        Ok(count)
    }
}

impl ControlData {
    /// The index log segments holding a blob this snapshot references.
    pub fn index_segments(&self) -> std::collections::BTreeSet<crate::types::SegmentId> {
        self.spaces
            .iter()
            .flat_map(|s| &s.cells)
            .flat_map(|c| &c.layers)
            .map(|d| crate::types::SegmentId(d.position.0 / self.index_segment_bytes))
            .collect()
    }

    /// Encodes the control region: as version 3 unless a cell's base is
    /// in parts or a cell has more than 255 blobs, so that a build before
    /// version 4 still opens what needs nothing newer.
    pub fn encode(&self) -> Vec<u8> {
        let version = if self
            .spaces
            .iter()
            .flat_map(|s| &s.cells)
            .all(|c| c.base_blobs <= 1 && c.layers.len() <= usize::from(u8::MAX))
        {
            3
        } else {
            VERSION
        };
        let mut w = Writer(Vec::new());
        w.bytes(MAGIC);
        w.u32(version);
        w.bytes(&self.log_id);
        w.u64(self.wal_segment_bytes);
        w.u64(self.index_segment_bytes);
        w.u32(self.epoch.0);
        w.u64(self.replay_from.0);
        w.u64(self.synced.0);
        w.u32(self.app_state.len() as u32);
        w.bytes(&self.app_state);
        w.u32(self.spaces.len() as u32);
        for space in &self.spaces {
            encode_space(&mut w, space, version);
        }
        let crc = crc32fast::hash(&w.0);
        w.u32(crc);
        w.0
    }

    /// Decodes and verifies a control region.
    pub fn decode(bytes: &[u8]) -> Result<ControlData, String> {
        if bytes.len() < MAGIC.len() + 8 {
            return Err("control file too short".into());
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        if crc32fast::hash(body).to_le_bytes() != crc {
            return Err("control file checksum mismatch".into());
        }
        let mut r = Reader { bytes: body, at: 0 };
        if r.take(8)? != MAGIC {
            return Err("not a control file".into());
        }
        let version = r.u32()?;
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(format!(
                "control file version {version}, this build reads {OLDEST_VERSION} to {VERSION}"
            ));
        }
        let log_id = r.take(16)?.try_into().expect("16 bytes");
        let wal_segment_bytes = r.u64()?;
        let index_segment_bytes = r.u64()?;
        let epoch = Epoch(r.u32()?);
        let replay_from = WalPosition(r.u64()?);
        let synced = WalPosition(r.u64()?);
        let app_len = r.count(1)?;
        let app_state = r.take(app_len)?.to_vec();
        let mut spaces = Vec::new();
        for _ in 0..r.count(15)? {
            spaces.push(decode_space(&mut r, version)?);
        }
        if r.at != body.len() {
            return Err("control file has trailing bytes".into());
        }
        Ok(ControlData {
            log_id,
            wal_segment_bytes,
            index_segment_bytes,
            epoch,
            replay_from,
            synced,
            app_state,
            spaces,
        })
    }
}

fn encode_space(w: &mut Writer, space: &SpaceControl, version: u32) {
    let config = &space.config;
    w.u16(config.name.len() as u16);
    w.bytes(config.name.as_bytes());
    w.u32(config.key_bytes);
    let prefix_bytes = match config.layout {
        CellLayout::Uniform { cells } => {
            w.u8(1);
            w.u32(cells);
            0
        }
        CellLayout::Prefixed { prefix_bytes } => {
            w.u8(2);
            w.u32(prefix_bytes);
            prefix_bytes as usize
        }
    };
    w.u32(space.cells.len() as u32);
    for cell in &space.cells {
        match &cell.id {
            CellId::Uniform(i) => w.u32(*i),
            CellId::Prefixed(prefix) => w.bytes(&prefix[..prefix_bytes]),
        }
        if version >= 4 {
            w.u16(
                u16::try_from(cell.layers.len()).expect("a flush installs at most MAX_CELL_BLOBS"),
            );
            w.u16(cell.base_blobs);
        } else {
            w.u8(cell.layers.len() as u8);
        }
        for disk in &cell.layers {
            w.u64(disk.position.0);
            w.u32(disk.count);
            w.u32(disk.bloom_len);
            let format = &disk.format;
            w.u8(format.flags);
            if format.flags & EntryFormat::SHARED_EPOCH != 0 {
                w.u32(format.epoch.0);
            }
            if format.flags & EntryFormat::SHARED_TAG != 0 {
                w.u32(format.tag.0);
            }
        }
        w.u64(cell.replay_from);
    }
}

fn decode_space(r: &mut Reader<'_>, version: u32) -> Result<SpaceControl, String> {
    let name_len = usize::from(r.u16()?);
    let name =
        String::from_utf8(r.take(name_len)?.to_vec()).map_err(|_| "key space name is not UTF-8")?;
    let key_bytes = r.u32()?;
    let kind = r.u8()?;
    let parameter = r.u32()?;
    let layout = match kind {
        1 => CellLayout::Uniform { cells: parameter },
        2 if parameter > 0 && parameter <= crate::types::MAX_KEY_BYTES as u32 => {
            CellLayout::Prefixed {
                prefix_bytes: parameter,
            }
        }
        _ => return Err(format!("key space {name:?} has an unknown layout")),
    };
    let mut cells = Vec::new();
    for _ in 0..r.count(9)? {
        let id = match layout {
            CellLayout::Uniform { cells } => {
                let i = r.u32()?;
                if i >= cells {
                    return Err(format!("cell {i} out of range in key space {name:?}"));
                }
                CellId::Uniform(i)
            }
            CellLayout::Prefixed { prefix_bytes } => {
                CellId::Prefixed(key_array(r.take(prefix_bytes as usize)?))
            }
        };
        let (blobs, base_blobs) = if version >= 4 {
            (r.u16()?, r.u16()?)
        } else {
            let blobs = u16::from(r.u8()?);
            (blobs, blobs.min(1))
        };
        if version == 1 && blobs > 1 {
            return Err(format!("bad cell flag {blobs}"));
        }
        // Each blob takes at least 17 bytes: a damaged count cannot
        // allocate wildly.
        if usize::from(blobs) * 17 > r.bytes.len() - r.at {
            return Err(format!("control file blob count {blobs} exceeds its size"));
        }
        if base_blobs > blobs || (blobs > 0 && base_blobs == 0) {
            return Err(format!(
                "a cell of {blobs} index blobs whose base is {base_blobs} of them"
            ));
        }
        let mut layers = Vec::with_capacity(usize::from(blobs));
        for _ in 0..blobs {
            let position = WalPosition(r.u64()?);
            let count = r.u32()?;
            let bloom_len = r.u32()?;
            let format = if version >= 3 {
                decode_format(r)?
            } else {
                EntryFormat::default()
            };
            layers.push(DiskRef {
                position,
                count,
                bloom_len,
                format,
            });
        }
        let replay_from = r.u64()?;
        cells.push(CellControl {
            id,
            layers,
            base_blobs,
            replay_from,
        });
    }
    let config = KeySpaceConfig {
        name,
        key_bytes,
        layout,
    };
    Ok(SpaceControl { config, cells })
}

/// A blob's entry format (control file version 3).
fn decode_format(r: &mut Reader<'_>) -> Result<EntryFormat, String> {
    let flags = r.u8()?;
    if flags & !EntryFormat::KNOWN != 0 {
        return Err(format!("unknown index entry format flags {flags:#x}"));
    }
    let epoch = if flags & EntryFormat::SHARED_EPOCH != 0 {
        Epoch(r.u32()?)
    } else {
        Epoch(0)
    };
    let tag = if flags & EntryFormat::SHARED_TAG != 0 {
        Tag(r.u32()?)
    } else {
        Tag(0)
    };
    Ok(EntryFormat::from_parts(flags, epoch, tag))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ControlData {
        let disk = DiskRef {
            position: WalPosition(4096),
            count: 12,
            bloom_len: 28,
            format: EntryFormat::default(),
        };
        ControlData {
            log_id: [3; 16],
            wal_segment_bytes: 1 << 20,
            index_segment_bytes: 1 << 16,
            epoch: Epoch(7),
            replay_from: WalPosition(999),
            synced: WalPosition(1200),
            app_state: b"raft hard state".to_vec(),
            spaces: vec![
                SpaceControl {
                    config: KeySpaceConfig {
                        name: "u".into(),
                        key_bytes: 32,
                        layout: CellLayout::Uniform { cells: 8 },
                    },
                    cells: vec![CellControl {
                        id: CellId::Uniform(3),
                        layers: vec![disk],
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
                        layers: vec![],
                        base_blobs: 0,
                        replay_from: 999,
                    }],
                },
            ],
        }
    }

    /// `sample()` as version 1 of the format wrote it (one blob per cell
    /// at most), kept to prove old control files still open.
    const SAMPLE_VERSION_1: &str = "5450434f4e54524c01000000030303030303030303030303030303030000100000000000000001000000000007000000e703000000000000b0040000000000000f0000007261667420686172642073746174650200000001007520000000010800000001000000030000000100100000000000000c0000001c000000e803000000000000010070100000000204000000010000006162636400e70300000000000047068425";

    fn unhex(hex: &str) -> Vec<u8> {
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn round_trips() {
        let mut data = sample();
        assert_eq!(ControlData::decode(&data.encode()), Ok(data.clone()));
        data.spaces[0].cells[0].layers.push(DiskRef {
            position: WalPosition(9000),
            count: 3,
            bloom_len: 12,
            format: EntryFormat::from_parts(
                EntryFormat::NO_VERSION | EntryFormat::SHARED_EPOCH | EntryFormat::SHARED_TAG,
                Epoch(6),
                Tag(9),
            ),
        });
        data.spaces[1].cells[0].layers.push(DiskRef {
            position: WalPosition(9100),
            count: 2,
            bloom_len: 12,
            format: EntryFormat::from_parts(EntryFormat::LEN_16, Epoch(0), Tag(0)),
        });
        data.spaces[1].cells[0].base_blobs = 1;
        assert_eq!(ControlData::decode(&data.encode()), Ok(data));
    }

    fn version_of(bytes: &[u8]) -> u32 {
        u32::from_le_bytes(bytes[8..12].try_into().unwrap())
    }

    fn disk_at(position: u64) -> DiskRef {
        DiskRef {
            position: WalPosition(position),
            count: 3,
            bloom_len: 12,
            format: EntryFormat::default(),
        }
    }

    #[test]
    fn a_base_in_parts_or_many_blobs_take_version_4_and_nothing_else_does() {
        let mut data = sample();
        data.spaces[0].cells[0].layers.push(disk_at(9000));
        let bytes = data.encode();
        assert_eq!(version_of(&bytes), 3, "a base and a delta: version 3");
        assert_eq!(ControlData::decode(&bytes), Ok(data.clone()));

        data.spaces[0].cells[0].base_blobs = 2;
        let bytes = data.encode();
        assert_eq!(version_of(&bytes), 4, "a base of two parts");
        assert_eq!(ControlData::decode(&bytes), Ok(data.clone()));

        let cell = &mut data.spaces[0].cells[0];
        cell.layers = (0..300).map(|i| disk_at(10_000 + i * 100)).collect();
        cell.base_blobs = 1;
        let bytes = data.encode();
        assert_eq!(version_of(&bytes), 4, "300 blobs");
        assert_eq!(ControlData::decode(&bytes), Ok(data));
    }

    #[test]
    fn a_cell_whose_base_is_not_among_its_blobs_is_refused() {
        for (blobs, base_blobs) in [(2, 0), (2, 3)] {
            let mut data = sample();
            let cell = &mut data.spaces[0].cells[0];
            cell.layers = (0..blobs).map(|i| disk_at(9000 + i * 100)).collect();
            cell.base_blobs = base_blobs;
            // 256 blobs in another cell: written as version 4.
            data.spaces[1].cells[0].layers = (0..256).map(|i| disk_at(i * 100)).collect();
            data.spaces[1].cells[0].base_blobs = 1;
            let bytes = data.encode();
            assert_eq!(version_of(&bytes), 4);
            let error = ControlData::decode(&bytes).unwrap_err();
            assert!(error.contains("whose base is"), "{error}");
        }
    }

    #[test]
    fn a_blob_count_past_the_files_size_is_refused() {
        let mut data = sample();
        data.spaces[0].cells[0].base_blobs = 2;
        data.spaces[0].cells[0].layers.push(disk_at(9000));
        let mut bytes = data.encode();
        assert_eq!(version_of(&bytes), 4);
        // The first cell's blob count: after the space's name, key bytes,
        // layout, cell count and cell id.
        let at = 8 + 4 + 16 + 8 + 8 + 4 + 8 + 8 + 4 + 15 + 4 + (2 + 1) + 4 + 1 + 4 + 4 + 4;
        assert_eq!(&bytes[at..at + 4], &[2, 0, 2, 0], "blob and base counts");
        bytes[at..at + 4].copy_from_slice(&[0xff, 0xff, 1, 0]);
        let body = bytes.len() - 4;
        let crc = crc32fast::hash(&bytes[..body]);
        bytes[body..].copy_from_slice(&crc.to_le_bytes());
        let error = ControlData::decode(&bytes).unwrap_err();
        assert!(error.contains("exceeds its size"), "{error}");
    }

    #[test]
    fn version_2_files_still_open() {
        // Version 2 wrote version 1's bytes for a cell of at most one blob.
        let mut bytes = unhex(SAMPLE_VERSION_1);
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        let body = bytes.len() - 4;
        let crc = crc32fast::hash(&bytes[..body]);
        bytes[body..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(ControlData::decode(&bytes), Ok(sample()));
    }

    #[test]
    fn version_1_files_still_open() {
        assert_eq!(ControlData::decode(&unhex(SAMPLE_VERSION_1)), Ok(sample()));
    }

    #[test]
    fn any_damage_or_truncation_is_an_error_never_a_panic() {
        let bytes = sample().encode();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x01;
            assert!(ControlData::decode(&bad).is_err(), "flip at {i}");
            assert!(
                ControlData::decode(&bytes[..i]).is_err(),
                "truncated to {i}"
            );
        }
    }
}
