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

/// Reads a token from a file (first line, trimmed).
pub fn read_file(path: &std::path::Path) -> crate::Result<String> {
    let text = std::fs::read_to_string(path).map_err(|e| crate::Error::File {
        path: path.display().to_string(),
        message: e.to_string(),
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
