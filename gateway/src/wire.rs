//! Reading stored protobuf messages in their wire form, before (or
//! instead of) decoding them whole.
//!
//! A decoded message can take far more memory than its encoding: an empty
//! nested message is 2 bytes on the wire and a struct of 100 bytes or more
//! once decoded (a `Vec` element, with its growth on top). A client that
//! can store blobs could store a tree or an action result made of
//! millions of empty entries, and every later lookup that decoded it took
//! gigabytes. Here: the file digests of a stored `Tree` are read from its
//! wire form without decoding it ([`tree_file_digests`]), and a message is
//! decoded only if a bound of its decoded size, counted on the wire, is a
//! small multiple of its encoding ([`decodes_in_bounds`]).

use bazel_remote_apis::build::bazel::remote::execution::v2 as re;
use prost::encoding::{WireType, decode_key, decode_varint};

/// One field of a message's wire form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Value<'a> {
    /// A varint (integers, booleans, enums).
    Varint(u64),
    /// A length-delimited field (strings, bytes, messages, packed lists).
    Bytes(&'a [u8]),
    /// A fixed 32- or 64-bit value.
    Fixed,
}

/// The fields of `bytes` read as a message, in order; an error where they
/// do not read as one (groups, which REAPI does not use, included).
pub(crate) fn fields(bytes: &[u8]) -> Fields<'_> {
    Fields { rest: bytes }
}

/// See [`fields`].
pub(crate) struct Fields<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let result = self.field();
        if result.is_err() {
            self.rest = &[];
        }
        Some(result)
    }
}

impl<'a> Fields<'a> {
    fn field(&mut self) -> Result<(u32, Value<'a>), String> {
        let (tag, wire_type) = decode_key(&mut self.rest).map_err(|e| e.to_string())?;
        let value = match wire_type {
            WireType::Varint => {
                Value::Varint(decode_varint(&mut self.rest).map_err(|e| e.to_string())?)
            }
            WireType::LengthDelimited => {
                let len = decode_varint(&mut self.rest).map_err(|e| e.to_string())?;
                let len = usize::try_from(len)
                    .ok()
                    .filter(|len| *len <= self.rest.len())
                    .ok_or_else(|| format!("field {tag} runs past the end"))?;
                let (value, rest) = self.rest.split_at(len);
                self.rest = rest;
                Value::Bytes(value)
            }
            WireType::SixtyFourBit => self.skip(8, tag)?,
            WireType::ThirtyTwoBit => self.skip(4, tag)?,
            // Skipped whole, as prost skips a group of a field it does not
            // know (refused here, a group let a message past the bound of
            // `decodes_in_bounds` that prost then decoded).
            WireType::StartGroup => {
                self.skip_group(tag, GROUP_DEPTH)?;
                Value::Fixed
            }
            WireType::EndGroup => return Err(format!("field {tag} ends a group never started")),
        };
        Ok((tag, value))
    }

    /// Skips the rest of group `tag` (its start read), nested groups too.
    fn skip_group(&mut self, tag: u32, depth: usize) -> Result<(), String> {
        if depth == 0 {
            return Err("groups nested too deep".into());
        }
        loop {
            if self.rest.is_empty() {
                return Err(format!("group {tag} never ends"));
            }
            let (inner, wire_type) = decode_key(&mut self.rest).map_err(|e| e.to_string())?;
            match wire_type {
                WireType::EndGroup if inner == tag => return Ok(()),
                WireType::EndGroup => return Err(format!("group {tag} ended by field {inner}")),
                WireType::StartGroup => self.skip_group(inner, depth - 1)?,
                WireType::Varint => {
                    decode_varint(&mut self.rest).map_err(|e| e.to_string())?;
                }
                WireType::LengthDelimited => {
                    let len = decode_varint(&mut self.rest).map_err(|e| e.to_string())?;
                    let len = usize::try_from(len)
                        .ok()
                        .filter(|len| *len <= self.rest.len())
                        .ok_or_else(|| format!("field {inner} runs past the end"))?;
                    self.rest = &self.rest[len..];
                }
                WireType::SixtyFourBit => {
                    self.skip(8, inner)?;
                }
                WireType::ThirtyTwoBit => {
                    self.skip(4, inner)?;
                }
            }
        }
    }

    fn skip(&mut self, len: usize, tag: u32) -> Result<Value<'a>, String> {
        if self.rest.len() < len {
            return Err(format!("field {tag} runs past the end"));
        }
        self.rest = &self.rest[len..];
        Ok(Value::Fixed)
    }
}

/// Groups nested in groups that are skipped (prost allows 100 levels of
/// nesting in all; REAPI uses no group).
const GROUP_DEPTH: usize = 100;

/// The length-delimited payload of field `tag`, or an error naming `what`.
fn nested<'a>(tag: u32, value: Value<'a>, what: &str) -> Result<&'a [u8], String> {
    match value {
        Value::Bytes(bytes) => Ok(bytes),
        _ => Err(format!("{what} (field {tag}) is not length-delimited")),
    }
}

/// The digest of every file a `Tree`'s directories list (root first, then
/// the children, each directory's files in order), read from its wire
/// form: what is held is the digests, never the decoded tree. A digest a
/// file node lacks is `None`. Fields are merged as protobuf merges them
/// (a message field given twice is one message; a scalar's last value
/// wins).
pub(crate) fn tree_file_digests(tree: &[u8]) -> Result<Vec<Option<re::Digest>>, String> {
    let mut digests = Vec::new();
    for field in fields(tree) {
        let (tag, value) = field?;
        // Tree.root = 1, Tree.children = 2.
        if tag != 1 && tag != 2 {
            continue;
        }
        for field in fields(nested(tag, value, "a tree's directory")?) {
            let (tag, value) = field?;
            // Directory.files = 1.
            if tag != 1 {
                continue;
            }
            let mut digest: Option<re::Digest> = None;
            for field in fields(nested(tag, value, "a directory's file")?) {
                let (tag, value) = field?;
                // FileNode.digest = 2.
                if tag != 2 {
                    continue;
                }
                let digest = digest.get_or_insert_default();
                for field in fields(nested(tag, value, "a file's digest")?) {
                    // Digest.hash = 1, Digest.size_bytes = 2.
                    match field? {
                        (1, Value::Bytes(hash)) => {
                            digest.hash = std::str::from_utf8(hash)
                                .map_err(|_| "a digest's hash is not UTF-8".to_string())?
                                .to_string();
                        }
                        (2, Value::Varint(size)) => digest.size_bytes = size as i64,
                        (1 | 2, _) => return Err("a digest field of the wrong type".into()),
                        _ => {}
                    }
                }
            }
            digests.push(digest);
        }
    }
    Ok(digests)
}

/// Memory charged per nested message by [`decodes_in_bounds`]: about
/// twice the largest REAPI struct kept in a list (a file node is some 140
/// bytes decoded, and a list's growth can double it).
const MESSAGE_BYTES: u64 = 320;

/// Message levels [`decodes_in_bounds`] looks into (REAPI nests about
/// five deep); a length-delimited field at the last level counts as a
/// message.
const DEPTH: usize = 8;

/// Most a message's decoded form may take, by [`decodes_in_bounds`]'s
/// count, as a multiple of its encoding (and [`SLACK_BYTES`] more).
/// Well-formed REAPI messages count up to about 37: a symlink node with a
/// one-letter name and target `..`, 320 bytes for 9 stored (a file node
/// with a SHA-256 digest counts two messages in some 80 bytes: 9; one with
/// node properties about 20). Empty entries count 160 and more.
pub(crate) const MAX_DECODED_RATIO: u64 = 40;

/// What [`decodes_in_bounds`] allows beyond [`MAX_DECODED_RATIO`] times
/// the encoding (small messages always decode).
pub(crate) const SLACK_BYTES: u64 = 64 << 10;

/// Whether `bytes` may be decoded as a message: a bound of its decoded
/// size — its encoding plus [`MESSAGE_BYTES`] for every length-delimited
/// field that reads as a message (strings and bytes that do not read as
/// one cost their length, already counted; one that reads as one until a
/// bad byte is charged the messages before it, as prost builds them before
/// it fails), [`DEPTH`] levels down — is at most [`MAX_DECODED_RATIO`]
/// times its encoding and [`SLACK_BYTES`] more. Bytes that do not read as
/// a message are refused (prost would build all it read before failing).
pub(crate) fn decodes_in_bounds(bytes: &[u8]) -> bool {
    let len = bytes.len() as u64;
    let (messages, whole) = nested_messages(bytes, DEPTH);
    let bound = len.saturating_add(messages.saturating_mul(MESSAGE_BYTES));
    whole
        && bound
            <= len
                .saturating_mul(MAX_DECODED_RATIO)
                .saturating_add(SLACK_BYTES)
}

/// The messages nested in `bytes` read as a message — each
/// length-delimited field that reads as one, with those nested in it,
/// `depth` levels down — and whether all of `bytes` reads as a message
/// (if not, the count is of what came before the first bad byte). Each
/// byte is read at most `depth` times.
fn nested_messages(bytes: &[u8], depth: usize) -> (u64, bool) {
    let mut count = 0u64;
    for field in fields(bytes) {
        match field {
            Err(_) => return (count, false),
            Ok((_, Value::Bytes(_))) if depth <= 1 => count += 1,
            Ok((_, Value::Bytes(inner))) => {
                let (nested, whole) = nested_messages(inner, depth - 1);
                count = count.saturating_add(nested + u64::from(whole));
            }
            Ok(_) => {}
        }
    }
    (count, true)
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    fn digest(n: u8, size: i64) -> re::Digest {
        re::Digest {
            hash: format!("{n:02x}").repeat(32),
            size_bytes: size,
        }
    }

    fn file(name: &str, digest: Option<re::Digest>) -> re::FileNode {
        re::FileNode {
            name: name.into(),
            digest,
            is_executable: true,
            ..Default::default()
        }
    }

    /// The digests read from the wire are those the decoded tree lists, in
    /// its order, a missing one included; bytes that are no tree are an
    /// error.
    #[test]
    fn a_tree_s_file_digests_are_read_as_decoding_would() {
        let directory = |files: Vec<re::FileNode>| re::Directory {
            files,
            directories: vec![re::DirectoryNode {
                name: "sub".into(),
                digest: Some(digest(9, 99)),
            }],
            ..Default::default()
        };
        let tree = re::Tree {
            root: Some(directory(vec![
                file("a", Some(digest(1, 10))),
                file("b", None),
            ])),
            children: vec![
                directory(vec![file("c", Some(digest(2, 0)))]),
                directory(Vec::new()),
                directory(vec![file("d", Some(digest(3, 1 << 40)))]),
            ],
        };
        let bytes = tree.encode_to_vec();
        let expected: Vec<Option<re::Digest>> = tree
            .root
            .iter()
            .chain(&tree.children)
            .flat_map(|d| d.files.iter().map(|f| f.digest.clone()))
            .collect();
        assert_eq!(tree_file_digests(&bytes).unwrap(), expected);
        assert_eq!(expected.len(), 4);
        // A digest given in two pieces merges as decoding merges it.
        let mut split = Vec::new();
        let first = re::FileNode {
            digest: Some(re::Digest {
                hash: digest(4, 0).hash,
                size_bytes: 0,
            }),
            ..Default::default()
        };
        let second = re::FileNode {
            digest: Some(re::Digest {
                hash: String::new(),
                size_bytes: 44,
            }),
            ..Default::default()
        };
        let mut file_bytes = first.encode_to_vec();
        file_bytes.extend(second.encode_to_vec());
        let merged = re::FileNode::decode(&file_bytes[..]).unwrap();
        prost::encoding::encode_key(1, WireType::LengthDelimited, &mut split);
        let directory_bytes = {
            let mut d = Vec::new();
            prost::encoding::encode_key(1, WireType::LengthDelimited, &mut d);
            prost::encoding::encode_varint(file_bytes.len() as u64, &mut d);
            d.extend(&file_bytes);
            d
        };
        prost::encoding::encode_varint(directory_bytes.len() as u64, &mut split);
        split.extend(&directory_bytes);
        assert_eq!(
            tree_file_digests(&split).unwrap(),
            vec![merged.digest.clone()]
        );
        assert_eq!(merged.digest.unwrap().size_bytes, 44);
        // Damage: cut short, or a group.
        for cut in [bytes.len() - 1, bytes.len() / 2, 3] {
            assert!(
                tree_file_digests(&bytes[..cut]).is_err(),
                "cut at {cut} of {}",
                bytes.len()
            );
        }
        // A group is skipped, as decoding skips one of an unknown field.
        let mut grouped = bytes.clone();
        grouped.extend([0xc3, 0x3e, 0x08, 0x01, 0xc4, 0x3e]);
        re::Tree::decode(&grouped[..]).unwrap();
        assert_eq!(tree_file_digests(&grouped).unwrap(), expected);
        assert!(
            tree_file_digests(&[0xc3, 0x3e]).is_err(),
            "a group never ended"
        );
        assert!(
            tree_file_digests(&[0xc4, 0x3e]).is_err(),
            "an end of no group"
        );
    }

    /// Well-formed REAPI messages decode; millions of empty entries (a
    /// few bytes each on the wire, a struct each decoded) do not.
    #[test]
    fn empty_entries_are_refused_and_real_messages_pass() {
        let files: Vec<re::FileNode> = (0..2000)
            .map(|i| {
                file(
                    &format!("out/file-{i}.o"),
                    Some(digest(i as u8, i64::from(i))),
                )
            })
            .collect();
        let directory = re::Directory {
            files: files.clone(),
            ..Default::default()
        };
        assert!(decodes_in_bounds(&directory.encode_to_vec()));
        let result = re::ActionResult {
            output_files: files
                .iter()
                .map(|f| re::OutputFile {
                    path: f.name.clone(),
                    digest: f.digest.clone(),
                    is_executable: false,
                    ..Default::default()
                })
                .collect(),
            stdout_digest: Some(digest(7, 12)),
            exit_code: 1,
            ..Default::default()
        };
        assert!(decodes_in_bounds(&result.encode_to_vec()));
        // Small messages always pass.
        assert!(decodes_in_bounds(&[]));
        assert!(decodes_in_bounds(&re::Directory::default().encode_to_vec()));

        // 1 MiB of empty file nodes, of empty output files, of empty
        // directory nodes nested in a tree.
        let empties = |tag: u32| {
            let mut bytes = Vec::new();
            while bytes.len() < 1 << 20 {
                prost::encoding::encode_key(tag, WireType::LengthDelimited, &mut bytes);
                bytes.push(0);
            }
            bytes
        };
        let empty_files = empties(1);
        assert_eq!(
            re::Directory::decode(&empty_files[..]).unwrap().files.len(),
            1 << 19
        );
        assert!(!decodes_in_bounds(&empty_files));
        assert!(!decodes_in_bounds(&empties(2)), "empty output files");
        let mut tree = Vec::new();
        prost::encoding::encode_key(1, WireType::LengthDelimited, &mut tree);
        prost::encoding::encode_varint(empty_files.len() as u64, &mut tree);
        tree.extend(&empty_files);
        assert!(!decodes_in_bounds(&tree), "nested one level down");
        // A group after them hides nothing (prost skips it and decodes the
        // rest).
        let mut grouped = empty_files.clone();
        grouped.extend([0xc3, 0x3e, 0x12, 0x00, 0xc4, 0x3e]);
        assert_eq!(
            re::Directory::decode(&grouped[..]).unwrap().files.len(),
            1 << 19
        );
        assert!(!decodes_in_bounds(&grouped), "a group at the end");
        let mut nested = tree.clone();
        nested.extend([0xc3, 0x3e, 0xc4, 0x3e]);
        assert!(!decodes_in_bounds(&nested), "a group one level up");
        // A bad byte at the end: prost builds everything before it.
        let mut bad = empty_files.clone();
        bad.push(0x00);
        assert!(!decodes_in_bounds(&bad), "a bad byte at the end");
        let mut inner_bad = empty_files.clone();
        inner_bad.push(0x00);
        let mut wrapped = Vec::new();
        prost::encoding::encode_key(1, WireType::LengthDelimited, &mut wrapped);
        prost::encoding::encode_varint(inner_bad.len() as u64, &mut wrapped);
        wrapped.extend(&inner_bad);
        assert!(!decodes_in_bounds(&wrapped), "a bad byte one level down");
        // Entries of 7 bytes (an output file with a 3-letter path).
        let mut sevens = Vec::new();
        while sevens.len() < 1 << 20 {
            sevens.extend([0x12, 0x05, 0x0a, 0x03, b'a', b'b', b'c']);
        }
        assert!(!decodes_in_bounds(&sevens), "7-byte entries");
    }

    /// Directories of many short symlinks, or of files with node
    /// properties and short names, decode.
    #[test]
    fn short_symlinks_and_node_properties_pass() {
        let symlinks = re::Directory {
            symlinks: (0..20_000)
                .map(|i| re::SymlinkNode {
                    name: format!("{}", i % 10),
                    target: "..".into(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        assert!(decodes_in_bounds(&symlinks.encode_to_vec()));
        let properties = re::Directory {
            files: (0..20_000)
                .map(|i| re::FileNode {
                    name: format!("f{}", i % 100),
                    digest: Some(digest(i as u8, 1)),
                    node_properties: Some({
                        let mut properties = re::NodeProperties {
                            properties: vec![re::NodeProperty {
                                name: "p".into(),
                                value: "v".into(),
                            }],
                            mtime: Some(Default::default()),
                            unix_mode: Some(Default::default()),
                        };
                        if let Some(mtime) = properties.mtime.as_mut() {
                            mtime.seconds = 1_700_000_000;
                        }
                        if let Some(mode) = properties.unix_mode.as_mut() {
                            mode.value = 0o755;
                        }
                        properties
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        assert!(decodes_in_bounds(&properties.encode_to_vec()));
    }
}
