//! `tidepool kubernetes setup`: the Secrets a Helm-installed cluster needs,
//! made inside the cluster by the chart's setup Job so that no private key
//! ever passes through Helm's values, its release records or rendered
//! manifests.
//!
//! Each Secret is created only when absent (create is atomic: of two Jobs
//! racing, one creates and the other reads what it made), so upgrades and
//! re-runs keep the CA, the bootstrap token and issued client certificates
//! — except a client certificate within 30 days of its end (or unreadable),
//! which is issued again in its Secret (a replace that fails if the Secret
//! changed since it was read): certificates last a year, and `helm upgrade`
//! renews the clients' in time.

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use tidepool_security::Identity;
use tidepool_security::certs::{self, Issued};

/// What to make.
#[derive(Debug)]
pub struct Setup {
    /// Namespace of the Secrets.
    pub namespace: String,
    /// The CA Secret.
    pub ca_secret: String,
    /// Its key holding the CA certificate (PEM).
    pub ca_cert_key: String,
    /// Its key holding the CA private key (PKCS#8 PEM).
    pub ca_key_key: String,
    /// Make the CA when the Secret is absent (else it must exist).
    pub create_ca: bool,
    /// The bootstrap admin token's Secret (key `token`), made if absent.
    pub token_secret: Option<String>,
    /// Client certificates: `(client name, Secret)`, each Secret holding
    /// `ca.pem`, `client.pem` and `client-key.pem` (what `tidectl
    /// --tls-dir` reads), made if absent.
    pub clients: Vec<(String, String)>,
    /// Labels of every Secret made.
    pub labels: BTreeMap<String, String>,
}

/// Makes whatever of `setup` is missing; prints what it did.
pub async fn setup(setup: Setup) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("cannot reach the Kubernetes API")?;
    let secrets: Api<Secret> = Api::namespaced(client, &setup.namespace);
    let ca = ensure_ca(&secrets, &setup).await?;
    if let Some(name) = &setup.token_secret {
        let data = BTreeMap::from([("token".to_string(), certs_bytes(&token()))]);
        report(
            name,
            create_if_absent(&secrets, name, &setup.labels, data).await?,
        );
    }
    for (client_name, name) in &setup.clients {
        let existing = secrets.get_opt(name).await?;
        let renew = match &existing {
            None => false,
            Some(secret) => match expires_in(secret) {
                Some(left) if left > RENEW_BEFORE => {
                    report(name, false);
                    continue;
                }
                Some(left) => {
                    println!(
                        "secret/{name}: its certificate expires in {} days; issuing a new one",
                        left.as_secs() / 86_400
                    );
                    true
                }
                None => {
                    println!("secret/{name}: no readable certificate; issuing a new one");
                    true
                }
            },
        };
        let identity = Identity::parse(&format!("tidepool://client/{client_name}"))
            .with_context(|| format!("client name {client_name:?}: 1-64 of [A-Za-z0-9._-]"))?;
        let issued = certs::issue(
            &ca,
            &certs::Request {
                identity,
                hosts: Vec::new(),
                valid_for: certs::CERT_VALIDITY,
                expired: false,
            },
        )?;
        let data = BTreeMap::from([
            ("ca.pem".to_string(), certs_bytes(&ca.cert_pem)),
            ("client.pem".to_string(), certs_bytes(&issued.cert_pem)),
            ("client-key.pem".to_string(), certs_bytes(&issued.key_pem)),
        ]);
        if renew {
            let mut secret = existing.expect("renewing an existing Secret");
            secret.data = Some(data);
            // Replaced only if nobody changed it since it was read.
            secrets
                .replace(name, &PostParams::default(), &secret)
                .await
                .with_context(|| format!("cannot renew Secret {name:?}"))?;
            println!("secret/{name} renewed");
        } else {
            report(
                name,
                create_if_absent(&secrets, name, &setup.labels, data).await?,
            );
        }
    }
    Ok(())
}

/// A client certificate within this long of its end is issued again when
/// the setup Job runs (every `helm install` and `helm upgrade`).
const RENEW_BEFORE: std::time::Duration = std::time::Duration::from_secs(30 * 86_400);

/// How long the certificate a client Secret holds has left (zero once
/// expired); `None` if it holds none that parses.
fn expires_in(secret: &Secret) -> Option<std::time::Duration> {
    let pem = secret.data.as_ref()?.get("client.pem")?;
    let certs = tidepool_security::tls::certificates(&pem.0).ok()?;
    let not_after = tidepool_security::tls::not_after(certs.first()?).ok()?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_secs() as i64;
    Some(std::time::Duration::from_secs(
        not_after.saturating_sub(now).max(0) as u64,
    ))
}

fn token() -> String {
    tidepool_security::token::generate()
}

fn certs_bytes(text: &str) -> ByteString {
    ByteString(text.as_bytes().to_vec())
}

fn report(name: &str, created: bool) {
    if created {
        println!("secret/{name} created");
    } else {
        println!("secret/{name} exists; kept");
    }
}

/// How long setup waits for a CA Secret it may not make.
const EXISTING_CA_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The CA from its Secret, made first if absent and allowed (waited for,
/// up to [`EXISTING_CA_WAIT`], if not).
async fn ensure_ca(secrets: &Api<Secret>, setup: &Setup) -> anyhow::Result<Issued> {
    if !setup.create_ca {
        // Made by someone else, perhaps a moment from now (cert-manager
        // issues it after the chart's Certificate hook is created).
        let began = std::time::Instant::now();
        while secrets.get_opt(&setup.ca_secret).await?.is_none() {
            if began.elapsed() >= EXISTING_CA_WAIT {
                bail!(
                    "CA Secret {:?} not found in namespace {:?} after {EXISTING_CA_WAIT:?} (the chart was told to use an existing one: tls.ca.create=false)",
                    setup.ca_secret,
                    setup.namespace
                );
            }
            println!("waiting for CA Secret {:?}", setup.ca_secret);
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
    }
    if secrets.get_opt(&setup.ca_secret).await?.is_none() {
        if !setup.create_ca {
            bail!(
                "CA Secret {:?} was deleted while setup ran",
                setup.ca_secret
            );
        }
        let ca = certs::new_ca("tidepool", certs::CA_VALIDITY)?;
        let data = BTreeMap::from([
            (setup.ca_cert_key.clone(), certs_bytes(&ca.cert_pem)),
            (setup.ca_key_key.clone(), certs_bytes(&ca.key_pem)),
        ]);
        let created = create_if_absent(secrets, &setup.ca_secret, &setup.labels, data).await?;
        report(&setup.ca_secret, created);
    } else {
        report(&setup.ca_secret, false);
    }
    // Read back what is stored (another Job may have won the race).
    let secret = secrets.get(&setup.ca_secret).await?;
    let field = |key: &str| -> anyhow::Result<String> {
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .with_context(|| format!("CA Secret {:?} has no key {key:?}", setup.ca_secret))?;
        String::from_utf8(bytes.0.clone())
            .with_context(|| format!("CA Secret {:?} key {key:?} is not PEM", setup.ca_secret))
    };
    Ok(Issued {
        cert_pem: field(&setup.ca_cert_key)?,
        key_pem: field(&setup.ca_key_key)?,
    })
}

/// Creates the Secret unless one of that name exists; whether it did.
async fn create_if_absent(
    secrets: &Api<Secret>,
    name: &str,
    labels: &BTreeMap<String, String>,
    data: BTreeMap<String, ByteString>,
) -> anyhow::Result<bool> {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(labels.clone()),
            ..ObjectMeta::default()
        },
        data: Some(data),
        type_: Some("Opaque".into()),
        ..Secret::default()
    };
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(e) => Err(e).with_context(|| format!("cannot create Secret {name:?}")),
    }
}
