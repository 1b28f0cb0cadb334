//! Names the build-cache protocols use, parsed: instance names (which map
//! to namespaces), digests (which are keys) and ByteStream resource names.
//! Pure functions; every refusal says what was expected.

use bazel_remote_apis::build::bazel::remote::execution::v2::Digest;

/// The instance an empty instance name (and an HTTP path without one)
/// means.
pub const DEFAULT_INSTANCE: &str = "cache";

/// Suffix of the namespace holding an instance's action cache and its
/// HTTP path keys.
pub const AC_SUFFIX: &str = ".ac";

/// SHA-256 of the empty blob, which is always present.
pub const EMPTY_SHA256: [u8; 32] = [
    0xe3, 0xb0, 0xc4, 0x42, 0x98, 0xfc, 0x1c, 0x14, 0x9a, 0xfb, 0xf4, 0xc8, 0x99, 0x6f, 0xb9, 0x24,
    0x27, 0xae, 0x41, 0xe4, 0x64, 0x9b, 0x93, 0x4c, 0xa4, 0x95, 0x99, 0x1b, 0x78, 0x52, 0xb8, 0x55,
];

/// An instance: the content-addressed namespace of its CAS and the
/// namespace of its action cache (and mutable HTTP keys).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    /// The name as the client gave it (`""` for the default).
    pub name: String,
    /// Namespace of the CAS (content-addressed).
    pub cas: String,
    /// Namespace of the action cache and of HTTP path keys.
    pub ac: String,
}

impl Instance {
    /// The instance `name` names: `""` is [`DEFAULT_INSTANCE`]; any other
    /// must be a namespace name short enough to take [`AC_SUFFIX`].
    pub fn parse(name: &str) -> Result<Instance, String> {
        // ccache's `subdirs` layout puts the default instance's keys at
        // `/<two hex digits>/…`: an instance of such a name took over (and
        // stored into another tenant's namespace) 1 in 256 of them.
        if name.len() == 2
            && name
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(format!(
                "instance name {name:?} is two hex digits, which ccache's `subdirs` layout uses as paths of its own: not an instance"
            ));
        }
        let base = if name.is_empty() {
            DEFAULT_INSTANCE
        } else {
            name
        };
        let ac = format!("{base}{AC_SUFFIX}");
        tidepool_client::proto::validate_namespace_name(&ac)
            .and_then(|()| tidepool_client::proto::validate_namespace_name(base))
            .map_err(|e| {
                format!("instance name {name:?} is not a Tidepool instance (a namespace name of at most 60 bytes): {e}")
            })?;
        Ok(Instance {
            name: name.to_string(),
            cas: base.to_string(),
            ac,
        })
    }
}

/// A validated SHA-256 digest: the key and the size the client claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobDigest {
    /// The SHA-256.
    pub hash: [u8; 32],
    /// Size in bytes.
    pub size: u64,
}

impl BlobDigest {
    /// From the wire form; only SHA-256 (64 hex digits) and sizes >= 0.
    pub fn from_proto(digest: Option<&Digest>) -> Result<BlobDigest, String> {
        let digest = digest.ok_or("a digest is required")?;
        let size = u64::try_from(digest.size_bytes)
            .map_err(|_| format!("digest size {} is negative", digest.size_bytes))?;
        Ok(BlobDigest {
            hash: parse_hash(&digest.hash)?,
            size,
        })
    }

    /// The wire form.
    pub fn to_proto(self) -> Digest {
        Digest {
            hash: hex(&self.hash),
            size_bytes: self.size as i64,
        }
    }

    /// Whether this is the empty blob (always present, never stored).
    pub fn is_empty_blob(&self) -> bool {
        self.size == 0 && self.hash == EMPTY_SHA256
    }
}

/// A SHA-256 in lower-case hex.
pub fn parse_hash(text: &str) -> Result<[u8; 32], String> {
    if text.len() != 64
        || !text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(format!(
            "{text:?} is not a SHA-256 (64 lower-case hex digits; this server speaks SHA-256 only)"
        ));
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    tidepool_client::hex(bytes)
}

/// How the bytes of a ByteStream resource travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// As they are.
    Identity,
    /// zstd-compressed (`compressed-blobs/zstd/…`); a read's offset counts
    /// uncompressed bytes (REAPI), an upload's compressed bytes after its
    /// start.
    Zstd,
}

/// A ByteStream resource name, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    /// The instance.
    pub instance: Instance,
    /// The blob.
    pub digest: BlobDigest,
    /// The transfer's encoding.
    pub compression: Compression,
    /// The upload's id (writes only).
    pub upload: Option<String>,
}

/// Parses `{instance}/blobs/{hash}/{size}` or
/// `{instance}/compressed-blobs/zstd/{hash}/{size}` (reads), and the same
/// after `{instance}/uploads/{uuid}/` (writes); anything after the size
/// (optional metadata) is ignored. The instance may hold slashes only as
/// far as namespace names allow (they do not): it is everything before
/// the first `blobs`, `compressed-blobs` or `uploads` segment.
pub fn parse_resource(name: &str, write: bool) -> Result<Resource, String> {
    let parts: Vec<&str> = name.split('/').collect();
    let marker = if write { "uploads" } else { "blobs" };
    let start = parts
        .iter()
        .position(|p| *p == marker || (!write && *p == "compressed-blobs"))
        .ok_or_else(|| {
            format!(
                "resource name {name:?} is not `[instance/]{}`",
                if write {
                    "uploads/{uuid}/blobs/{hash}/{size}"
                } else {
                    "blobs/{hash}/{size}"
                }
            )
        })?;
    let instance = Instance::parse(&parts[..start].join("/"))?;
    let mut rest = &parts[start..];
    let mut upload = None;
    if write {
        let id = rest
            .get(1)
            .filter(|id| !id.is_empty())
            .ok_or_else(|| format!("resource name {name:?} has no upload id after `uploads/`"))?;
        upload = Some(id.to_string());
        rest = &rest[2..];
    }
    let (compression, rest) = match rest.first() {
        Some(&"blobs") => (Compression::Identity, &rest[1..]),
        Some(&"compressed-blobs") => match rest.get(1) {
            Some(&"zstd") => (Compression::Zstd, &rest[2..]),
            other => {
                return Err(format!(
                    "compressor {:?} is not supported (zstd is)",
                    other.unwrap_or(&"")
                ));
            }
        },
        _ => return Err(format!("resource name {name:?} names no blob")),
    };
    let (Some(hash), Some(size)) = (rest.first(), rest.get(1)) else {
        return Err(format!("resource name {name:?} lacks `{{hash}}/{{size}}`"));
    };
    let size: u64 = size
        .parse()
        .map_err(|_| format!("{size:?} in {name:?} is not a size"))?;
    Ok(Resource {
        instance,
        digest: BlobDigest {
            hash: parse_hash(hash)?,
            size,
        },
        compression,
        upload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn instances_map_to_namespace_pairs() {
        let default = Instance::parse("").unwrap();
        assert_eq!(
            (default.cas.as_str(), default.ac.as_str()),
            ("cache", "cache.ac")
        );
        let ci = Instance::parse("ci-main").unwrap();
        assert_eq!((ci.cas.as_str(), ci.ac.as_str()), ("ci-main", "ci-main.ac"));
        assert!(Instance::parse("Upper").is_err());
        assert!(Instance::parse("a/b").is_err());
        assert!(Instance::parse(&"a".repeat(61)).is_err());
        assert!(Instance::parse(&"a".repeat(60)).is_ok());
        // ccache `subdirs` paths, never instances.
        for name in ["ab", "0f", "99"] {
            assert!(Instance::parse(name).is_err(), "{name}");
        }
        assert!(Instance::parse("ag").is_ok());
        assert!(Instance::parse("abc").is_ok());
    }

    #[test]
    fn digests_are_sha256_with_a_size() {
        let ok = Digest {
            hash: H.into(),
            size_bytes: 0,
        };
        let d = BlobDigest::from_proto(Some(&ok)).unwrap();
        assert!(d.is_empty_blob());
        assert_eq!(d.to_proto(), ok);
        assert_eq!(d.hash, tidepool_client::sha256(b""));
        for bad in [
            Digest {
                hash: H.to_uppercase(),
                size_bytes: 0,
            },
            Digest {
                hash: H[..63].into(),
                size_bytes: 0,
            },
            Digest {
                hash: format!("{H}00"),
                size_bytes: 0,
            },
            Digest {
                hash: H.into(),
                size_bytes: -1,
            },
        ] {
            assert!(BlobDigest::from_proto(Some(&bad)).is_err(), "{bad:?}");
        }
        assert!(BlobDigest::from_proto(None).is_err());
    }

    #[test]
    fn resource_names() {
        let r = parse_resource(&format!("blobs/{H}/0"), false).unwrap();
        assert_eq!(r.instance.cas, "cache");
        assert_eq!(r.compression, Compression::Identity);
        let r = parse_resource(&format!("ci/compressed-blobs/zstd/{H}/12/extra"), false).unwrap();
        assert_eq!((r.instance.cas.as_str(), r.digest.size), ("ci", 12));
        assert_eq!(r.compression, Compression::Zstd);
        let r = parse_resource(&format!("ci/uploads/u-1/blobs/{H}/7/meta"), true).unwrap();
        assert_eq!(r.upload.as_deref(), Some("u-1"));
        assert_eq!(r.digest.size, 7);
        let r = parse_resource(&format!("uploads/u/compressed-blobs/zstd/{H}/7"), true).unwrap();
        assert_eq!(r.compression, Compression::Zstd);
        for (bad, write) in [
            (format!("blobs/{H}"), false),
            (format!("blobs/{H}/x"), false),
            (format!("compressed-blobs/deflate/{H}/1"), false),
            (format!("uploads//blobs/{H}/1"), true),
            (format!("blobs/{H}/1"), true),
            ("nothing".to_string(), false),
            (format!("Bad/blobs/{H}/1"), false),
        ] {
            assert!(parse_resource(&bad, write).is_err(), "{bad}");
        }
    }
}
