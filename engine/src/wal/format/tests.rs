//! Tests of the record and item layouts.

use super::*;

fn spec<'a>(key: &'a [u8], value: &'a [u8]) -> ItemSpec<'a> {
    ItemSpec {
        op: Op::Put,
        key_space: 0,
        key,
        value,
        epoch: Epoch(3),
        tag: Tag(9),
        version: 0,
    }
}

fn entry(position: u64, meta: &[u8], items: &[ItemSpec<'_>]) -> Vec<u8> {
    let mut buf = vec![0u8; entry_record_len(meta.len(), items)];
    write_entry(&mut buf, WalPosition(position), FLAG_APPLIED, meta, items);
    buf
}

/// Writes an entry at `at` and checks what reading it back gives:
/// the record, its metadata, and every item read alone at its location.
fn round_trip(at: u64, meta: &[u8], items: &[ItemSpec<'_>]) -> RecordHeader {
    let mut buf = vec![0u8; entry_record_len(meta.len(), items)];
    let locs = write_entry(&mut buf, WalPosition(at), FLAG_APPLIED, meta, items);
    let view = RecordView::verify(WalPosition(at), &buf).expect("valid");
    assert_eq!(view.header.record_len(), buf.len());
    assert_eq!(view.header.kind, Kind::Entry);
    assert_eq!(view.meta(), meta);
    let decoded: Vec<_> = view.items().collect();
    assert_eq!(decoded.len(), items.len());
    for (((offset, item), loc), spec) in decoded.iter().zip(&locs).zip(items) {
        assert_eq!((item.key, item.value), (spec.key, spec.value));
        assert_eq!(
            (item.op, item.epoch, item.tag),
            (spec.op, spec.epoch, spec.tag)
        );
        assert_eq!(item.version, spec.version);
        assert_eq!(loc.position.0, at + *offset as u64);
        assert_eq!(loc.len as usize, item.len);
        // An item can be read and verified alone, at its location.
        let alone = &buf[*offset..*offset + item.len];
        assert_eq!(decode_item(loc.position, alone).expect("valid item"), *item);
        // Its span, from the bytes before its value alone.
        let head = &alone[..alone.len() - item.value.len()];
        let span = item_span(head).expect("span");
        assert_eq!(span.op, item.op);
        assert_eq!(&alone[span.key_at..span.key_at + span.key_len], item.key);
        assert_eq!(&alone[span.value_at..span.len()], item.value);
        assert_eq!(span.len(), item.len);
        assert!(
            decode_item(loc.position.plus(8), alone).is_ok() != view.header.single,
            "a single entry's item checks its position"
        );
    }
    view.header
}

#[test]
fn entry_round_trips_and_reports_item_locations() {
    let items = [spec(b"k1", b"value-one"), spec(b"key2", b"")];
    assert!(!round_trip(800, b"abc", &items).single);
}

#[test]
fn one_new_put_or_delete_is_a_single_entry_24_bytes_smaller() {
    let key = [7u8; 32];
    let value = vec![0x5Au8; 1024];
    for meta in [&b""[..], b"raft", &[1u8; 300]] {
        for op in [Op::Put, Op::Delete] {
            let value = if op == Op::Put { &value[..] } else { &[][..] };
            let item = ItemSpec {
                op,
                ..spec(&key, value)
            };
            let header = round_trip(4096, meta, &[item]);
            assert!(header.single);
            let listed = record_len(entry_body_len(meta.len(), &[item]));
            assert_eq!(entry_record_len(meta.len(), &[item]), listed - 24);
        }
    }
    // A value whose length leaves every padding from 0 to 7 bytes.
    for len in 0..8 {
        let value = vec![1u8; len];
        assert!(round_trip(64, b"m", &[spec(b"key", &value)]).single);
    }
}

#[test]
fn touches_copies_batches_and_huge_metadata_stay_listed() {
    let touch = ItemSpec {
        op: Op::Touch,
        version: 64,
        ..spec(b"key", b"")
    };
    let copy = ItemSpec {
        version: 640,
        ..spec(b"key", b"value")
    };
    let put = spec(b"key", b"value");
    assert!(!round_trip(8, b"", &[touch]).single);
    assert!(!round_trip(8, b"", &[copy]).single);
    assert!(!round_trip(8, b"", &[put, put]).single);
    assert!(!round_trip(8, &vec![3u8; 70_000], &[put]).single);
    assert!(round_trip(8, &vec![3u8; 65_535], &[put]).single);
}

#[test]
fn any_flipped_bit_is_detected() {
    // A single entry, then a listed one.
    for buf in [
        entry(64, b"m", &[spec(b"key", b"some value bytes")]),
        entry(64, b"m", &[spec(b"key", b"some value"), spec(b"k2", b"v")]),
    ] {
        flips_are_detected(&buf);
    }
}

/// Flips every bit of the entry `buf` written at 64: the record and
/// each item read alone either fail to verify or read as before (a
/// flip in the zero padding).
fn flips_are_detected(buf: &[u8]) {
    let good = RecordView::verify(WalPosition(64), buf).unwrap();
    let items: Vec<_> = good.items().collect();
    for byte in 0..buf.len() {
        for bit in 0..8 {
            let mut bad = buf.to_vec();
            bad[byte] ^= 1 << bit;
            if let Ok(view) = RecordView::verify(WalPosition(64), &bad) {
                assert_eq!(view.meta(), good.meta(), "byte {byte} bit {bit}");
                assert!(view.items().eq(good.items()), "byte {byte} bit {bit}");
            }
            for (offset, item) in &items {
                let alone = &bad[*offset..*offset + item.len];
                if let Ok(read) = decode_item(WalPosition(64 + *offset as u64), alone) {
                    assert_eq!(read, *item, "byte {byte} bit {bit}");
                }
            }
        }
    }
}

#[test]
fn a_record_moved_to_another_position_is_rejected() {
    let buf = entry(64, b"", &[spec(b"key", b"v")]);
    assert!(RecordView::verify(WalPosition(72), &buf).is_err());
}

#[test]
fn zeroes_are_unwritten_and_truncation_is_caught() {
    assert_eq!(RecordHeader::decode(&[0u8; 16]), HeaderRead::Unwritten);
    let buf = entry(0, b"", &[spec(b"key", b"a longer value")]);
    assert!(RecordView::verify(WalPosition(0), &buf[..buf.len() - 8]).is_err());
}

#[test]
fn plain_records_and_pads_verify() {
    let mut buf = vec![0u8; record_len(5)];
    write_plain(&mut buf, WalPosition(16), Kind::IndexBlob, b"hello");
    let view = RecordView::verify(WalPosition(16), &buf).unwrap();
    assert_eq!(
        (view.header.kind, view.body),
        (Kind::IndexBlob, &b"hello"[..])
    );
    let mut pad = vec![0xAAu8; 40];
    write_pad(&mut pad, WalPosition(24));
    assert_eq!(
        RecordView::verify(WalPosition(24), &pad)
            .unwrap()
            .header
            .kind,
        Kind::Pad
    );
}

/// A record gathered for a vectored write is the record `write_entry`
/// writes, byte for byte, with the same item locations: single entries and
/// multi-item ones, values below and above the size written from the
/// caller's memory, metadata of every padding. Seeded; the seed is printed.
#[test]
fn gathered_records_equal_written_ones() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    for round in 0..300 {
        let meta: Vec<u8> = (0..rng.random_range(0..40)).map(|_| rng.random()).collect();
        let count = if round % 3 == 0 {
            1
        } else {
            rng.random_range(1..6)
        };
        let values: Vec<Vec<u8>> = (0..count)
            .map(|_| {
                let len = match rng.random_range(0..4) {
                    0 => 0,
                    1 => rng.random_range(1..64),
                    2 => rng.random_range(4000..4200),
                    _ => rng.random_range(60_000..70_000),
                };
                (0..len).map(|_| rng.random()).collect()
            })
            .collect();
        let keys: Vec<Vec<u8>> = (0..count)
            .map(|_| {
                (0..rng.random_range(1..=MAX_KEY_BYTES))
                    .map(|_| rng.random())
                    .collect()
            })
            .collect();
        let items: Vec<ItemSpec<'_>> = keys
            .iter()
            .zip(&values)
            .map(|(key, value)| ItemSpec {
                op: if value.is_empty() && rng.random_bool(0.5) {
                    Op::Delete
                } else {
                    Op::Put
                },
                key_space: rng.random_range(0..3),
                key,
                value,
                epoch: Epoch(rng.random_range(0..9)),
                tag: Tag(rng.random()),
                version: if rng.random_bool(0.2) {
                    8 * rng.random_range(1..1000)
                } else {
                    0
                },
            })
            .collect();
        let position = WalPosition(8 * rng.random_range(0..1_000_000u64));
        let mut written = vec![0xEEu8; entry_record_len(meta.len(), &items)];
        let locations = write_entry(&mut written, position, FLAG_APPLIED, &meta, &items);
        let gathered = gather_entry(position, FLAG_APPLIED, &meta, &items);
        let bytes: Vec<u8> = gathered.slices().iter().flat_map(|s| s.to_vec()).collect();
        assert_eq!(gathered.len(), written.len(), "seed {seed} round {round}");
        assert!(bytes == written, "seed {seed} round {round}: bytes differ");
        assert_eq!(gathered.locations, locations, "seed {seed} round {round}");
        RecordView::verify(position, &bytes).expect("valid");
    }
}
