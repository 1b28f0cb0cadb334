//! Single entries: an entry of one new put or delete written as one record
//! that is also its own item (layout in the parent module's docs).

use super::{
    Item, ItemLocation, ItemSpec, Malformed, Op, RECORD_HEADER_BYTES, align8, get_u32, put_u32,
};
use crate::types::{Epoch, MAX_KEY_BYTES, Tag, WalPosition};

/// Bytes of a single entry's header.
pub(crate) const SINGLE_HEADER_BYTES: usize = 24;
/// The kind byte of a single entry (decoded as [`super::Kind::Entry`]).
pub(super) const SINGLE_KIND: u8 = 6;

/// The item, if an entry of this metadata and these items is written as a
/// single entry: one new put or delete, at most 64 KiB of metadata.
pub(super) fn as_single<'s, 'a>(
    meta_len: usize,
    items: &'s [ItemSpec<'a>],
) -> Option<&'s ItemSpec<'a>> {
    match items {
        [item]
            if item.version == 0 && item.op != Op::Touch && meta_len <= usize::from(u16::MAX) =>
        {
            Some(item)
        }
        _ => None,
    }
}

/// Bytes the single entry of `item` with `meta_len` bytes of metadata
/// occupies, padding included.
pub(super) fn record_len(meta_len: usize, item: &ItemSpec<'_>) -> usize {
    align8(SINGLE_HEADER_BYTES + meta_len + item.key.len() + item.value.len())
}

/// The header of the single entry of `item` (its crc field zero) whose
/// record is `record_len` bytes with `meta_len` bytes of metadata; also
/// where its value ends (record bytes before the padding).
pub(super) fn header(
    record_len: usize,
    flags: u8,
    meta_len: usize,
    item: &ItemSpec<'_>,
) -> ([u8; SINGLE_HEADER_BYTES], usize) {
    let end = SINGLE_HEADER_BYTES + meta_len + item.key.len() + item.value.len();
    let mut head = [0u8; SINGLE_HEADER_BYTES];
    put_u32(&mut head, 0, (record_len - RECORD_HEADER_BYTES) as u32);
    head[4] = SINGLE_KIND;
    head[5] = flags;
    head[6] = item.op as u8;
    head[7] = item.key_space;
    head[12] = item.key.len() as u8;
    head[13] = (record_len - end) as u8;
    head[14..16].copy_from_slice(&(meta_len as u16).to_le_bytes());
    put_u32(&mut head, 16, item.epoch.0);
    put_u32(&mut head, 20, item.tag.0);
    (head, end)
}

/// Writes a single entry into `buf` (exactly its record length): its
/// header, `meta`, the item's key and value, zero padding.
pub(super) fn write(
    buf: &mut [u8],
    position: WalPosition,
    flags: u8,
    meta: &[u8],
    item: &ItemSpec<'_>,
) -> ItemLocation {
    let (head, end) = header(buf.len(), flags, meta.len(), item);
    let key_at = SINGLE_HEADER_BYTES + meta.len();
    let value_at = key_at + item.key.len();
    buf[..SINGLE_HEADER_BYTES].copy_from_slice(&head);
    buf[SINGLE_HEADER_BYTES..key_at].copy_from_slice(meta);
    buf[key_at..value_at].copy_from_slice(item.key);
    buf[value_at..end].copy_from_slice(item.value);
    buf[end..].fill(0);
    put_u32(buf, 8, crc(position, &buf[..end]));
    ItemLocation {
        position,
        len: end as u32,
    }
}

/// Starts the CRC of a single entry at `position` from its header (the
/// crc field skipped); metadata, key and value follow.
pub(super) fn crc_start(position: WalPosition, head: &[u8]) -> crc32fast::Hasher {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&position.0.to_le_bytes());
    hasher.update(&head[..8]);
    hasher.update(&head[12..SINGLE_HEADER_BYTES]);
    hasher
}

/// The CRC of a single entry at `position` whose bytes up to the end of
/// its value are `bytes`.
fn crc(position: WalPosition, bytes: &[u8]) -> u32 {
    let mut hasher = crc_start(position, bytes);
    hasher.update(&bytes[SINGLE_HEADER_BYTES..]);
    hasher.finalize()
}

/// Decodes and verifies the single entry at `position` from `bytes` (the
/// record from its header on, its padding not needed).
pub(super) fn decode(position: WalPosition, bytes: &[u8]) -> Result<Item<'_>, Malformed> {
    let item = parse(bytes)?;
    if crc(position, &bytes[..item.len]) != get_u32(bytes, 8) {
        return Err(Malformed("single entry checksum mismatch".into()));
    }
    Ok(item)
}

/// Decodes a single entry's item from `bytes` (the record from its header
/// on, its padding not needed), checking the lengths but not the CRC.
pub(super) fn parse(bytes: &[u8]) -> Result<Item<'_>, Malformed> {
    if bytes.len() < SINGLE_HEADER_BYTES || bytes[4] != SINGLE_KIND {
        return Err(Malformed("neither an item nor a single entry".into()));
    }
    let op = match bytes[6] {
        1 => Op::Put,
        2 => Op::Delete,
        other => return Err(Malformed(format!("single entry op {other}"))),
    };
    let body_len = get_u32(bytes, 0) as usize;
    let key_len = usize::from(bytes[12]);
    let pad = usize::from(bytes[13]);
    let meta_len = usize::from(u16::from_le_bytes([bytes[14], bytes[15]]));
    let key_at = SINGLE_HEADER_BYTES + meta_len;
    let value_at = key_at + key_len;
    let end = (RECORD_HEADER_BYTES + body_len).checked_sub(pad);
    let Some(end) = end.filter(|&end| {
        body_len.is_multiple_of(8)
            && pad < 8
            && key_len > 0
            && key_len <= MAX_KEY_BYTES
            && end >= value_at
    }) else {
        return Err(Malformed(format!(
            "single entry of body {body_len}, pad {pad}, key {key_len}, meta {meta_len}"
        )));
    };
    if bytes.len() < end {
        return Err(Malformed(format!(
            "single entry of {end} bytes, {} left",
            bytes.len()
        )));
    }
    Ok(Item {
        op,
        key_space: bytes[7],
        key: &bytes[key_at..value_at],
        value: &bytes[value_at..end],
        epoch: Epoch(get_u32(bytes, 16)),
        tag: Tag(get_u32(bytes, 20)),
        version: 0,
        len: end,
    })
}
