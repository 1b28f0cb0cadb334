//! Tidepool's transport security, shared by nodes, coordinators and the SDK.
//!
//! - [`tls`]: mutual TLS from PEM files (certificate, key, CA bundle) that
//!   are re-read when they change, so certificates rotate without a
//!   restart; a listener that completes handshakes off the accept loop; a
//!   connector that dials with the current files.
//! - [`identity`]: who a certificate names (`tidepool://node/<name>`,
//!   `tidepool://coordinator/<name>`, `tidepool://client/<name>`).
//! - [`certs`]: a CA and certificates for a cluster (`tidepool certs`,
//!   dev mode), with rcgen.
//! - [`planes`]: which plane every gRPC method belongs to.
//! - [`guard`]: the tower layer in front of every server that admits a
//!   call only if the caller's certificate or bearer token may reach its
//!   plane, and hands the handlers a [`guard::Caller`] for per-namespace
//!   checks.
//! - [`token`]: bearer tokens, hashed.
//! - [`channel`]: a gRPC channel that dials through the connector and sends
//!   the caller's token with every request.
//!
//! Why one listener with per-method authorization rather than a listener
//! per plane: see `docs/design/security.md`.

pub mod certs;
pub mod channel;
pub mod first_byte;
pub mod guard;
pub mod identity;
pub mod planes;
pub mod tls;
pub mod token;
pub mod trace_context;

pub use channel::{Channel, Security};
pub use guard::{Authority, Caller, GuardLayer};
pub use identity::Identity;
pub use planes::Plane;
pub use tls::{Tls, TlsFiles};

/// Errors of loading or generating security material.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The material is unusable (no certificate in a PEM, a key that does
    /// not parse, a certificate without a Tidepool identity, ...).
    #[error("{0}")]
    Invalid(String),
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// The one crypto provider of every Tidepool binary (ring), preferring
/// AES-128-GCM (rustls's default order puts AES-256 first, about a third
/// slower per byte with AES-NI; bulk transfers pay it on every hop).
pub fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::{cipher_suite, default_provider};
    let mut provider = default_provider();
    provider.cipher_suites = vec![
        cipher_suite::TLS13_AES_128_GCM_SHA256,
        cipher_suite::TLS13_AES_256_GCM_SHA384,
        cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        cipher_suite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
    ];
    std::sync::Arc::new(provider)
}

/// Largest HTTP/2 frame a Tidepool process accepts (it advertises it in its
/// settings, so peers may send a blob's megabyte pieces in one frame
/// instead of sixty-four of the protocol's default 16 KiB).
pub const MAX_FRAME_BYTES: u32 = 1 << 20;
