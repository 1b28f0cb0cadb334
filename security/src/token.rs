//! Bearer tokens: 32 random bytes, sent as `authorization: Bearer
//! tp_<64 hex digits>`, stored only as their SHA-256.

use rand::RngCore as _;
use sha2::{Digest, Sha256};

/// Prefix of every token (so secret scanners and humans recognise one).
pub const PREFIX: &str = "tp_";

/// A new random token.
pub fn generate() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let mut token = String::with_capacity(PREFIX.len() + 64);
    token.push_str(PREFIX);
    for b in bytes {
        token.push_str(&format!("{b:02x}"));
    }
    token
}

/// What the cluster stores of a token.
pub fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The token of an `authorization` header value (`Bearer <token>`,
/// scheme case-insensitive), if it is one.
pub fn from_header(value: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(value).ok()?;
    let (scheme, token) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = token.trim();
    // Longer than any token we issue is not worth hashing.
    (!token.is_empty() && token.len() <= 256).then_some(token)
}

/// Reads a token from a file (first line, trimmed). From a pipe or a
/// terminal (`--token-file /dev/stdin`) only that line is read: the rest is
/// left for whoever reads after (`tidectl put … -` reading its content
/// from the same stdin stored an empty blob when the whole input went to
/// the token).
pub fn read_file(path: &std::path::Path) -> crate::Result<String> {
    use std::io::Read as _;
    let failed = |e: std::io::Error| crate::Error::File {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let mut file = std::fs::File::open(path).map_err(failed)?;
    let mut line = Vec::new();
    if file.metadata().map_err(failed)?.is_file() {
        file.read_to_end(&mut line).map_err(failed)?;
    } else {
        // A byte at a time up to the newline: nothing past it is taken.
        let mut byte = [0u8; 1];
        while line.len() <= 4096 && file.read(&mut byte).map_err(failed)? == 1 {
            if byte[0] == b'\n' {
                break;
            }
            line.push(byte[0]);
        }
    }
    let text = String::from_utf8(line).map_err(|_| {
        crate::Error::Invalid(format!("{}: the token is not UTF-8", path.display()))
    })?;
    let token = text.lines().next().unwrap_or_default().trim().to_string();
    if token.is_empty() {
        return Err(crate::Error::Invalid(format!(
            "{}: holds no token",
            path.display()
        )));
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// From a pipe, the token's line is read and the rest left in it.
    #[test]
    fn a_token_from_a_pipe_leaves_the_rest_unread() {
        use std::io::{Read as _, Write as _};
        use std::os::fd::AsRawFd as _;
        let (mut reader, mut writer) = std::io::pipe().unwrap();
        writer
            .write_all(b"secret-token\nthe content after it")
            .unwrap();
        drop(writer);
        let path = std::path::PathBuf::from(format!("/proc/self/fd/{}", reader.as_raw_fd()));
        assert_eq!(read_file(&path).unwrap(), "secret-token");
        let mut rest = String::new();
        reader.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "the content after it");
    }

    #[test]
    fn tokens_are_random_and_parse_from_headers() {
        let a = generate();
        let b = generate();
        assert_ne!(a, b);
        assert_eq!(a.len(), 67);
        assert_ne!(hash(&a), hash(&b));
        let header = format!("Bearer {a}");
        assert_eq!(from_header(header.as_bytes()), Some(a.as_str()));
        assert_eq!(
            from_header(format!("bearer {a}").as_bytes()),
            Some(a.as_str())
        );
        assert_eq!(from_header(b"Basic abc"), None);
        assert_eq!(from_header(b"Bearer "), None);
        assert_eq!(from_header(&[0xff, 0xfe]), None);
    }
}
