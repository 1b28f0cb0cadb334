//! zstd both ways. Decompression is bounded: the output may never exceed
//! the size the client declared, and it is produced in slices, so a small
//! hostile input cannot make the gateway allocate more than that.

use zstd::stream::raw::{DParameter, Decoder, InBuffer, Operation, OutBuffer};

/// Largest zstd window accepted, log2 bytes (8 MiB: what levels 1 to 19
/// use). A decoder holds its frame's window, so a paused upload holds up
/// to this much; the library's default allows 128 MiB per upload, which
/// 64 paused uploads made 8 GiB. Frames of larger windows (`--ultra`,
/// `--long`) are refused as invalid.
const WINDOW_LOG_MAX: u32 = 23;

/// Compression level of what the gateway sends (fast; build outputs are
/// sent once and read often).
const LEVEL: i32 = 1;

/// `bytes` as one zstd frame. Several frames concatenated are one valid
/// zstd stream, so a blob can be compressed piece by piece.
pub(crate) fn compress(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    zstd::bulk::compress(bytes, LEVEL)
}

/// A streaming zstd decoder that refuses to produce more than `limit`
/// bytes in total.
pub(crate) struct Decompressor {
    decoder: Decoder<'static>,
    produced: u64,
    limit: u64,
    /// Whether the last frame ended exactly at the end of the input so
    /// far.
    at_frame_end: bool,
}

impl Decompressor {
    /// A decoder for at most `limit` bytes of output.
    pub(crate) fn new(limit: u64) -> std::io::Result<Decompressor> {
        let mut decoder = Decoder::new()?;
        decoder.set_parameter(DParameter::WindowLogMax(WINDOW_LOG_MAX))?;
        Ok(Decompressor {
            decoder,
            produced: 0,
            limit,
            at_frame_end: true,
        })
    }

    /// Decompresses `input`, appending to `out`. An error if the input is
    /// not zstd or would decompress past the limit.
    pub(crate) fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        let mut at = 0;
        while !self.feed_some(input, &mut at, out, usize::MAX)? {}
        Ok(())
    }

    /// Decompresses `input` from `*at` on, appending to `out`, and stops
    /// once `out` holds `room` bytes or more (`*at` then says where to go
    /// on): a few bytes of zstd can stand for megabytes, so a caller that
    /// stores what it decompresses takes it in pieces. Whether all of
    /// `input` was consumed and its output produced.
    pub(crate) fn feed_some(
        &mut self,
        input: &[u8],
        at: &mut usize,
        out: &mut Vec<u8>,
        room: usize,
    ) -> Result<bool, String> {
        let mut input = InBuffer::around(&input[*at..]);
        let mut slice = vec![0u8; 256 << 10];
        let done = loop {
            let mut output = OutBuffer::around(&mut slice[..]);
            let consumed_before = input.pos();
            let hint = self
                .decoder
                .run(&mut input, &mut output)
                .map_err(|e| format!("the zstd data is not valid: {e}"))?;
            let made = output.pos();
            self.produced += made as u64;
            if self.produced > self.limit {
                return Err(format!(
                    "the zstd data decompresses to more than the {} bytes declared",
                    self.limit
                ));
            }
            out.extend_from_slice(&slice[..made]);
            // A call that did nothing (the frame already ended) hints at
            // the next frame's header; only progress says where we are.
            if made > 0 || input.pos() > consumed_before {
                self.at_frame_end = hint == 0;
            }
            if input.pos() == input.src.len() && made < slice.len() {
                break true;
            }
            if out.len() >= room {
                break false;
            }
        };
        *at += input.pos();
        Ok(done)
    }

    /// Whether the input so far ends at the end of a frame (a stream cut
    /// short is not a complete blob).
    pub(crate) fn complete(&self) -> bool {
        self.at_frame_end
    }
}

/// Decompresses a whole zstd buffer of at most `limit` bytes of output.
pub(crate) fn decompress(input: &[u8], limit: u64) -> Result<Vec<u8>, String> {
    let mut decompressor = Decompressor::new(limit).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    decompressor.feed(input, &mut out)?;
    if !decompressor.complete() {
        return Err("the zstd data ends in the middle of a frame".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_across_frames_and_pieces() {
        let a = vec![7u8; 300_000];
        let b: Vec<u8> = (0..100_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let mut stream = compress(&a).unwrap();
        stream.extend(compress(&b).unwrap());
        let whole = [a.clone(), b.clone()].concat();
        assert_eq!(decompress(&stream, whole.len() as u64).unwrap(), whole);
        // Fed in awkward pieces.
        let mut d = Decompressor::new(whole.len() as u64).unwrap();
        let mut out = Vec::new();
        for piece in stream.chunks(777) {
            d.feed(piece, &mut out).unwrap();
        }
        assert!(d.complete());
        assert_eq!(out, whole);
    }

    #[test]
    fn output_comes_in_pieces_of_the_room_given() {
        let whole: Vec<u8> = (0..3_000_000u32).map(|i| (i % 7) as u8).collect();
        let stream = compress(&whole).unwrap();
        let mut d = Decompressor::new(whole.len() as u64).unwrap();
        let (mut at, mut got, mut pieces) = (0, Vec::new(), 0);
        loop {
            let mut out = Vec::new();
            let done = d.feed_some(&stream, &mut at, &mut out, 1 << 20).unwrap();
            // At most one 256 KiB slice past the room.
            assert!(out.len() < (1 << 20) + (256 << 10), "{}", out.len());
            got.extend_from_slice(&out);
            pieces += 1;
            if done {
                break;
            }
        }
        assert!(pieces >= 3, "{pieces}");
        assert!(d.complete());
        assert_eq!(got, whole);
    }

    #[test]
    fn bombs_and_garbage_are_refused() {
        // 64 MiB of zeros compresses to a few KiB: refused long before it
        // is all produced.
        let bomb = compress(&vec![0u8; 64 << 20]).unwrap();
        assert!(bomb.len() < 64 << 10);
        let err = decompress(&bomb, 1 << 20).unwrap_err();
        assert!(err.contains("more than"), "{err}");
        assert!(decompress(b"not zstd at all", 100).is_err());
        let cut = compress(&vec![1u8; 1000]).unwrap();
        assert!(decompress(&cut[..cut.len() - 2], 1000).is_err());
    }
}
