//! Who a certificate names.
//!
//! Every certificate a Tidepool cluster issues carries one SAN URI,
//! `tidepool://<kind>/<name>`: the kind says which planes the holder may
//! reach, the name binds it (a node's name is recorded in the cluster map
//! at its first registration; only that certificate may speak for that node
//! id afterwards).

use std::fmt;

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

/// The URI scheme of Tidepool identities.
pub const SCHEME: &str = "tidepool://";

/// Longest name accepted in an identity.
pub const MAX_NAME: usize = 64;

/// A certificate holder.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Identity {
    /// A storage node: peer traffic, registration and heartbeats.
    Node(String),
    /// A coordinator: the nodes' admin calls.
    Coordinator(String),
    /// A client: nothing by itself; its bearer token says what it may do.
    Client(String),
    /// A server outside Tidepool that the cluster's CA certifies (the
    /// chart's etcd members): no plane of a Tidepool process admits it.
    Server(String),
}

impl Identity {
    /// The kind's word in the URI.
    pub fn kind(&self) -> &'static str {
        match self {
            Identity::Node(_) => "node",
            Identity::Coordinator(_) => "coordinator",
            Identity::Client(_) => "client",
            Identity::Server(_) => "server",
        }
    }

    /// The name.
    pub fn name(&self) -> &str {
        match self {
            Identity::Node(n)
            | Identity::Coordinator(n)
            | Identity::Client(n)
            | Identity::Server(n) => n,
        }
    }

    /// `tidepool://<kind>/<name>`.
    pub fn uri(&self) -> String {
        format!("{SCHEME}{}/{}", self.kind(), self.name())
    }

    /// Parses `tidepool://<kind>/<name>`.
    pub fn parse(uri: &str) -> Option<Identity> {
        let rest = uri.strip_prefix(SCHEME)?;
        let (kind, name) = rest.split_once('/')?;
        if !valid_name(name) {
            return None;
        }
        let name = name.to_string();
        Some(match kind {
            "node" => Identity::Node(name),
            "coordinator" => Identity::Coordinator(name),
            "client" => Identity::Client(name),
            "server" => Identity::Server(name),
            _ => return None,
        })
    }

    /// The identity of a DER certificate: its one `tidepool://` SAN URI.
    pub fn of_certificate(der: &[u8]) -> crate::Result<Identity> {
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|e| crate::Error::Invalid(format!("certificate does not parse: {e}")))?;
        let san = cert
            .subject_alternative_name()
            .map_err(|e| crate::Error::Invalid(format!("bad subjectAltName: {e}")))?;
        let mut found = None;
        for name in san.iter().flat_map(|s| s.value.general_names.iter()) {
            if let GeneralName::URI(uri) = name
                && uri.starts_with(SCHEME)
            {
                if found.is_some() {
                    return Err(crate::Error::Invalid(
                        "certificate names more than one Tidepool identity".into(),
                    ));
                }
                found = Some(Identity::parse(uri).ok_or_else(|| {
                    crate::Error::Invalid(format!("malformed Tidepool identity {uri:?}"))
                })?);
            }
        }
        found.ok_or_else(|| {
            crate::Error::Invalid("certificate names no tidepool:// identity".into())
        })
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri())
    }
}

/// A name of 1 to [`MAX_NAME`] characters of `[A-Za-z0-9._-]`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_round_trip_and_malformed_ones_are_refused() {
        for id in [
            Identity::Node("node-1".into()),
            Identity::Coordinator("c".into()),
            Identity::Client("ci.bazel_7".into()),
            Identity::Server("etcd-0".into()),
        ] {
            assert_eq!(Identity::parse(&id.uri()), Some(id));
        }
        for bad in [
            "tidepool://node/",
            "tidepool://node/a/b",
            "tidepool://admin/x",
            "https://node/x",
            "tidepool://node",
            "tidepool://node/a b",
        ] {
            assert_eq!(Identity::parse(bad), None, "{bad}");
        }
        assert!(!valid_name(&"x".repeat(MAX_NAME + 1)));
    }
}
