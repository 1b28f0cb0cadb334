//! A cluster's certificates: a CA, and certificates it issues to nodes,
//! coordinators and clients (`tidepool certs`, and dev mode's own).
//!
//! Every issued certificate carries its [`Identity`] as a SAN URI, the DNS
//! names and IP addresses it serves under (nodes and coordinators), and
//! both server and client authentication usages (nodes dial each other).
//! Keys are ECDSA P-256, written with mode 0600.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::OffsetDateTime;

use crate::identity::Identity;
use crate::{Error, Result};

/// A certificate and its private key, PEM.
#[derive(Clone, Debug)]
pub struct Issued {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key (PKCS#8).
    pub key_pem: String,
}

fn invalid(what: &str, e: rcgen::Error) -> Error {
    Error::Invalid(format!("{what}: {e}"))
}

fn validity(params: &mut CertificateParams, valid_for: Duration) {
    let now = OffsetDateTime::now_utc();
    // An hour of slack for clocks behind ours.
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::seconds(valid_for.as_secs() as i64);
}

/// A new self-signed CA named `name`.
pub fn new_ca(name: &str, valid_for: Duration) -> Result<Issued> {
    let key = KeyPair::generate().map_err(|e| invalid("key generation", e))?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("{name} Tidepool CA"));
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut params, valid_for);
    let cert = params
        .self_signed(&key)
        .map_err(|e| invalid("CA certificate", e))?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// What a certificate is for.
#[derive(Clone, Debug)]
pub struct Request {
    /// Who holds it.
    pub identity: Identity,
    /// DNS names and IP addresses it serves under (may be empty for
    /// clients).
    pub hosts: Vec<String>,
    /// How long from now it is valid.
    pub valid_for: Duration,
    /// Issue it already expired (for tests of expiry handling).
    pub expired: bool,
}

/// A certificate for `request`, signed by `ca`.
pub fn issue(ca: &Issued, request: &Request) -> Result<Issued> {
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(|e| invalid("CA key", e))?;
    let issuer =
        Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key).map_err(|e| invalid("CA certificate", e))?;
    let key = KeyPair::generate().map_err(|e| invalid("key generation", e))?;
    let mut params =
        CertificateParams::new(request.hosts.clone()).map_err(|e| invalid("host names", e))?;
    let uri = request.identity.uri();
    params.subject_alt_names.push(SanType::URI(
        uri.clone().try_into().map_err(|e| invalid("identity", e))?,
    ));
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, uri);
    params.distinguished_name = dn;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = match request.identity {
        Identity::Client(_) => vec![ExtendedKeyUsagePurpose::ClientAuth],
        _ => vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
    };
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, request.valid_for);
    if request.expired {
        let now = OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::days(30);
        params.not_after = now - time::Duration::days(1);
    }
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(|e| invalid("certificate", e))?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Writes `issued` as `<dir>/<base>.pem` and `<dir>/<base>-key.pem` (mode
/// 0600), each replaced atomically (a reader never sees half a file);
/// returns the paths.
pub fn write(dir: &Path, base: &str, issued: &Issued) -> Result<(PathBuf, PathBuf)> {
    std::fs::create_dir_all(dir).map_err(|e| file_error(dir, e))?;
    let cert = dir.join(format!("{base}.pem"));
    let key = dir.join(format!("{base}-key.pem"));
    write_atomically(&key, issued.key_pem.as_bytes(), 0o600)?;
    write_atomically(&cert, issued.cert_pem.as_bytes(), 0o644)?;
    Ok((cert, key))
}

/// Reads `<dir>/<base>.pem` and `<dir>/<base>-key.pem`.
pub fn read(dir: &Path, base: &str) -> Result<Issued> {
    let read = |path: PathBuf| std::fs::read_to_string(&path).map_err(|e| file_error(&path, e));
    Ok(Issued {
        cert_pem: read(dir.join(format!("{base}.pem")))?,
        key_pem: read(dir.join(format!("{base}-key.pem")))?,
    })
}

fn file_error(path: &Path, e: std::io::Error) -> Error {
    Error::File {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension("pem.tmp");
    // A file left there (a crash, or planted: readable by others, or a
    // link elsewhere) is removed and the file made anew: opened as it
    // was, it kept its own mode (a key written world-readable) or wrote
    // through the link. `create_new` follows no link either.
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(file_error(&tmp, e)),
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(|e| file_error(&tmp, e))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| file_error(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| file_error(path, e))
}

/// Ten years: a CA's default validity.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 86_400);
/// One year: an issued certificate's default validity.
pub const CERT_VALIDITY: Duration = Duration::from_secs(365 * 86_400);

/// The file names of a process's material in a directory made by
/// [`ensure_dev`]: `ca.pem`, `<base>.pem`, `<base>-key.pem`.
pub fn files(dir: &Path, base: &str) -> crate::TlsFiles {
    crate::TlsFiles {
        cert: dir.join(format!("{base}.pem")),
        key: dir.join(format!("{base}-key.pem")),
        ca: dir.join("ca.pem"),
    }
}

/// How long before it expires [`ensure_dev`] renews a certificate.
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * 86_400);

/// Makes a CA and certificates in `dir` for a cluster on this host: `ca`,
/// `coordinator`, `node-1` .. `node-<nodes>` (served as `localhost` and
/// 127.0.0.1) and `client` (for `tidectl` and the SDK). Certificates that
/// are fit are kept, so restarts keep their identities; one that is
/// missing, not signed by the CA in `ca.pem` (the CA was made anew: every
/// handshake with it failed), not matching its key, or expiring within
/// [`RENEW_BEFORE`] is issued anew. Returns why each existing certificate
/// was replaced, for the operator.
pub fn ensure_dev(dir: &Path, nodes: u32) -> Result<Vec<String>> {
    let mut replaced = Vec::new();
    let now = OffsetDateTime::now_utc();
    // A CA whose key is not its own (a crash between its two files) or
    // that nears its end is made anew too (every certificate then follows).
    let existing = read(dir, "ca").ok();
    let ca = match existing.filter(|ca| match unfit(ca, ca, now) {
        None => true,
        Some(why) => {
            replaced.push(format!("ca.pem made anew: {why}"));
            false
        }
    }) {
        Some(ca) => ca,
        None => {
            let ca = new_ca("dev", CA_VALIDITY)?;
            write(dir, "ca", &ca)?;
            ca
        }
    };
    let local = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    let mut wanted = vec![
        (
            "coordinator".to_string(),
            Identity::Coordinator("dev".into()),
            local.clone(),
        ),
        (
            "client".to_string(),
            Identity::Client("dev".into()),
            Vec::new(),
        ),
    ];
    for i in 1..=nodes {
        wanted.push((
            format!("node-{i}"),
            Identity::Node(format!("node-{i}")),
            local.clone(),
        ));
    }
    for (base, identity, hosts) in wanted {
        if dir.join(format!("{base}.pem")).exists() {
            let why = match read(dir, &base) {
                Ok(existing) => unfit(&ca, &existing, now),
                Err(e) => Some(e.to_string()),
            };
            let Some(why) = why else {
                continue;
            };
            replaced.push(format!("{base}.pem issued anew: {why}"));
        }
        let issued = issue(
            &ca,
            &Request {
                identity,
                hosts,
                valid_for: CERT_VALIDITY,
                expired: false,
            },
        )?;
        write(dir, &base, &issued)?;
    }
    Ok(replaced)
}

/// Why `issued` is not fit to keep under `ca` at `now` (`None`: fit): a
/// peer trusting `ca` would refuse it, it is not its key's, or it expires
/// within [`RENEW_BEFORE`]. (A CA checked against itself: self-signed,
/// its own key's, not near its end.)
fn unfit(ca: &Issued, issued: &Issued, now: OffsetDateTime) -> Option<String> {
    use x509_parser::pem::parse_x509_pem;
    let parse = |pem: &str| -> std::result::Result<_, String> {
        let (_, pem) = parse_x509_pem(pem.as_bytes()).map_err(|e| format!("unreadable: {e}"))?;
        Ok(pem)
    };
    let (ca_pem, pem) = match (parse(&ca.cert_pem), parse(&issued.cert_pem)) {
        (Ok(ca), Ok(cert)) => (ca, cert),
        (Err(e), _) => return Some(format!("the CA certificate is {e}")),
        (_, Err(e)) => return Some(format!("the certificate is {e}")),
    };
    let (ca_cert, cert) = match (ca_pem.parse_x509(), pem.parse_x509()) {
        (Ok(ca), Ok(cert)) => (ca, cert),
        (Err(e), _) => return Some(format!("the CA certificate is unreadable: {e}")),
        (_, Err(e)) => return Some(format!("the certificate is unreadable: {e}")),
    };
    if cert.verify_signature(Some(ca_cert.public_key())).is_err() {
        return Some("it is not signed by the CA in ca.pem (was the CA made anew?)".into());
    }
    match KeyPair::from_pem(&issued.key_pem) {
        Ok(key) if key.public_key_raw() == &cert.public_key().subject_public_key.data[..] => {}
        Ok(_) => return Some("its key file holds another key".into()),
        Err(e) => return Some(format!("its key is unreadable: {e}")),
    }
    let renew_at = now + time::Duration::seconds(RENEW_BEFORE.as_secs() as i64);
    let not_after = cert.validity().not_after.timestamp();
    if not_after <= renew_at.unix_timestamp() {
        return Some(format!(
            "it expires within {} days",
            RENEW_BEFORE.as_secs() / 86_400
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_carry_their_identity() {
        let ca = new_ca("test", CA_VALIDITY).unwrap();
        let issued = issue(
            &ca,
            &Request {
                identity: Identity::Node("n7".into()),
                hosts: vec!["localhost".into(), "10.0.0.7".into()],
                valid_for: CERT_VALIDITY,
                expired: false,
            },
        )
        .unwrap();
        let der = crate::tls::certificates(issued.cert_pem.as_bytes()).unwrap();
        assert_eq!(
            Identity::of_certificate(&der[0]).unwrap(),
            Identity::Node("n7".into())
        );
        let ca_der = crate::tls::certificates(ca.cert_pem.as_bytes()).unwrap();
        assert!(
            Identity::of_certificate(&ca_der[0]).is_err(),
            "a CA names no one"
        );
    }

    /// Dev material is kept while fit and made anew when not: a CA made
    /// anew (its files deleted) had every certificate issued by the old
    /// one kept, and every handshake failed; a certificate near its end,
    /// or whose key file holds another key, was never renewed.
    #[test]
    fn dev_certificates_are_issued_anew_when_unfit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path();
        assert!(ensure_dev(path, 2).unwrap().is_empty());
        let bases = ["coordinator", "client", "node-1", "node-2"];
        let certs = |bases: &[&str]| -> Vec<String> {
            bases
                .iter()
                .map(|b| read(path, b).unwrap().cert_pem)
                .collect()
        };
        let signed_by_ca = || {
            let ca = read(path, "ca").unwrap();
            bases
                .iter()
                .all(|b| unfit(&ca, &read(path, b).unwrap(), OffsetDateTime::now_utc()).is_none())
        };
        assert!(signed_by_ca());
        // Fit: kept as they are.
        let first = certs(&bases);
        assert!(ensure_dev(path, 2).unwrap().is_empty());
        assert_eq!(certs(&bases), first);

        // The CA made anew: every certificate issued again under it.
        std::fs::remove_file(path.join("ca.pem")).unwrap();
        std::fs::remove_file(path.join("ca-key.pem")).unwrap();
        let notes = ensure_dev(path, 2).unwrap();
        assert_eq!(notes.len(), 4, "{notes:?}");
        assert!(notes[0].contains("not signed by the CA"), "{notes:?}");
        assert!(signed_by_ca());
        let second = certs(&bases);
        assert!(second.iter().zip(&first).all(|(a, b)| a != b));

        // One expiring within the renewal window, one whose key file holds
        // another key: only those two issued again.
        let ca = read(path, "ca").unwrap();
        let short = issue(
            &ca,
            &Request {
                identity: Identity::Node("node-1".into()),
                hosts: vec!["localhost".into()],
                valid_for: Duration::from_secs(5 * 86_400),
                expired: false,
            },
        )
        .unwrap();
        write(path, "node-1", &short).unwrap();
        let mut swapped = read(path, "client").unwrap();
        swapped.key_pem = read(path, "node-2").unwrap().key_pem;
        write(path, "client", &swapped).unwrap();
        let notes = ensure_dev(path, 2).unwrap();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with("client.pem") && n.contains("another key"))
        );
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with("node-1.pem") && n.contains("expires"))
        );
        assert!(signed_by_ca());
        let third = certs(&bases);
        assert_eq!(third[0], second[0], "the coordinator's is kept");
        assert_eq!(third[3], second[3], "node-2's is kept");
        assert_ne!(third[2], short.cert_pem);

        // A CA whose key file holds another key: made anew, and every
        // certificate with it.
        let mut ca = read(path, "ca").unwrap();
        ca.key_pem = read(path, "node-2").unwrap().key_pem;
        write(path, "ca", &ca).unwrap();
        let notes = ensure_dev(path, 2).unwrap();
        assert_eq!(notes.len(), 5, "{notes:?}");
        assert!(notes[0].starts_with("ca.pem made anew") && notes[0].contains("another key"));
        assert!(signed_by_ca());
    }

    /// A temporary file left where a key is written — readable by others,
    /// or a link to elsewhere — is replaced, not written through: the key
    /// ends up mode 0600 and the link's target untouched.
    #[test]
    fn a_key_is_written_private_whatever_was_left_in_its_place() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let ca = new_ca("test", CA_VALIDITY).unwrap();
        let left = dir.path().join("ca-key.pem.tmp");
        std::fs::write(&left, b"left over").unwrap();
        std::fs::set_permissions(&left, std::fs::Permissions::from_mode(0o644)).unwrap();
        write(dir.path(), "ca", &ca).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.path().join("ca-key.pem")), 0o600);
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, b"someone's file").unwrap();
        std::os::unix::fs::symlink(&elsewhere, &left).unwrap();
        write(dir.path(), "ca", &ca).unwrap();
        assert_eq!(std::fs::read(&elsewhere).unwrap(), b"someone's file");
        assert_eq!(mode(&dir.path().join("ca-key.pem")), 0o600);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("ca-key.pem")).unwrap(),
            ca.key_pem
        );
    }

    /// What the expiry metric reads: the loaded certificate's and CA's
    /// `notAfter`, and the renewed one's after the files change.
    #[test]
    fn loaded_material_tells_when_it_expires() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let dir = tempfile::tempdir().unwrap();
        let ca = new_ca("test", CA_VALIDITY).unwrap();
        write(dir.path(), "ca", &ca).unwrap();
        let issue_for = |days: u64| {
            let issued = issue(
                &ca,
                &Request {
                    identity: Identity::Node("n1".into()),
                    hosts: vec!["localhost".into()],
                    valid_for: Duration::from_secs(days * 86_400),
                    expired: false,
                },
            )
            .unwrap();
            write(dir.path(), "node", &issued).unwrap();
        };
        issue_for(20);
        let tls = crate::Tls::load(crate::TlsFiles {
            cert: dir.path().join("node.pem"),
            key: dir.path().join("node-key.pem"),
            ca: dir.path().join("ca.pem"),
        })
        .unwrap();
        let near = |at: i64, want: i64| (at - want).abs() < 120;
        let expiry = tls.expiry();
        assert!(near(expiry.certificate, now + 20 * 86_400), "{expiry:?}");
        assert!(
            near(expiry.ca, now + CA_VALIDITY.as_secs() as i64),
            "{expiry:?}"
        );
        // Renewed in place: reloaded (checked at most once a second).
        issue_for(400);
        std::thread::sleep(Duration::from_millis(1_100));
        assert!(near(tls.expiry().certificate, now + 400 * 86_400));
    }
}
