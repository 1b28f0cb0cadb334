//! The guard in front of every gRPC server: it finds the method's
//! [`Plane`], authenticates the caller (its certificate's
//! [`Identity`], its bearer token), refuses a caller that may not reach the
//! plane (`UNAUTHENTICATED` / `PERMISSION_DENIED`) before any handler or
//! decoder runs, and otherwise hands the handler a [`Caller`] in the
//! request's extensions for the checks that need the request's content
//! (namespace roles, a Raft message's sender).
//!
//! A server without TLS (insecure mode) admits everyone: its [`Caller`] is
//! open.

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll};

use tidepool_proto::ErrorInfo;
use tidepool_proto::v1::{ErrorCode, Role, TokenRecord};
use tonic::body::Body;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::identity::Identity;
use crate::planes::{Plane, plane_of};
use crate::token;

/// What a token may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The token's name.
    pub name: String,
    /// Cluster admin.
    pub admin: bool,
    /// Roles per namespace name (`*`: every namespace).
    pub namespaces: Vec<(String, Vec<Role>)>,
}

impl Grant {
    /// The grant a stored record gives.
    pub fn of(record: &TokenRecord) -> Grant {
        Grant {
            name: record.name.clone(),
            admin: record.admin,
            namespaces: record
                .grants
                .iter()
                .map(|g| (g.namespace.clone(), g.roles().collect()))
                .collect(),
        }
    }

    /// Whether it holds `role` in `namespace`.
    pub fn holds(&self, namespace: &str, role: Role) -> bool {
        self.admin
            || self
                .namespaces
                .iter()
                .any(|(ns, roles)| (ns == namespace || ns == "*") && roles.contains(&role))
    }
}

/// A role as operators write it (`read`, `write`, `append-only`,
/// `delete`).
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Read => "read",
        Role::Write => "write",
        Role::AppendOnly => "append-only",
        Role::Delete => "delete",
        Role::Unspecified => "unspecified",
    }
}

/// The role an operator's word names.
pub fn role_of(name: &str) -> Option<Role> {
    Some(match name {
        "read" => Role::Read,
        "write" => Role::Write,
        "append-only" => Role::AppendOnly,
        "delete" => Role::Delete,
        _ => return None,
    })
}

/// The tokens a server accepts, by hash.
#[derive(Debug, Default)]
pub struct TokenTable {
    by_hash: HashMap<[u8; 32], Arc<Grant>>,
}

impl TokenTable {
    /// The table of a cluster map's token records.
    pub fn of(records: &[TokenRecord]) -> TokenTable {
        TokenTable {
            by_hash: records
                .iter()
                .filter_map(|r| {
                    Some((
                        <[u8; 32]>::try_from(&r.sha256[..]).ok()?,
                        Arc::new(Grant::of(r)),
                    ))
                })
                .collect(),
        }
    }

    /// The grant of the token with this hash.
    pub fn get(&self, hash: &[u8; 32]) -> Option<Arc<Grant>> {
        self.by_hash.get(hash).cloned()
    }
}

/// Where a guard looks tokens up (a node's or coordinator's current map).
pub trait Authority: Send + Sync + 'static {
    /// The grant of the token whose SHA-256 is `hash`, if it is valid now.
    fn token(&self, hash: &[u8; 32]) -> Option<Arc<Grant>>;
}

/// Who is calling, as the guard established it.
#[derive(Clone, Debug, Default)]
pub struct Caller {
    /// Insecure server: everything is allowed.
    pub open: bool,
    /// The identity in the client certificate.
    pub identity: Option<Identity>,
    /// The bearer token's grant.
    pub grant: Option<Arc<Grant>>,
    /// SHA-256 of the bearer token (how the map stores it): a long call
    /// (a map watch) ends once the token is revoked.
    pub token_sha256: Option<[u8; 32]>,
    /// A node reading a blob for another node (a chunk of a manifest it
    /// verifies): `read` in every namespace, nothing else.
    pub peer_read: bool,
}

impl Caller {
    /// The caller of an insecure server.
    pub fn open() -> Caller {
        Caller {
            open: true,
            ..Caller::default()
        }
    }

    /// The caller the guard attached to `request` (a closed caller, which
    /// may do nothing, if none was: fail closed).
    pub fn of<T>(request: &tonic::Request<T>) -> Caller {
        request
            .extensions()
            .get::<Caller>()
            .cloned()
            .unwrap_or_default()
    }

    /// Whether the caller holds `role` in `namespace`.
    pub fn may(&self, namespace: &str, role: Role) -> bool {
        self.open
            || (self.peer_read && role == Role::Read)
            || self
                .grant
                .as_ref()
                .is_some_and(|g| g.holds(namespace, role))
    }

    /// `PERMISSION_DENIED` unless the caller holds `role` in `namespace`.
    pub fn require(&self, namespace: &str, role: Role) -> Result<(), ErrorInfo> {
        if self.may(namespace, role) {
            return Ok(());
        }
        Err(ErrorInfo::new(
            ErrorCode::PermissionDenied,
            format!(
                "token {:?} does not hold role {} in namespace {}",
                self.grant.as_ref().map_or("", |g| g.name.as_str()),
                role_name(role),
                tidepool_proto::quoted_namespace(namespace)
            ),
        ))
    }

    /// The node name the caller's certificate speaks for (`None` on an
    /// insecure server or for any other caller).
    pub fn node_name(&self) -> Option<&str> {
        match &self.identity {
            Some(Identity::Node(name)) => Some(name),
            _ => None,
        }
    }
}

/// The one client method a node certificate may call without a token.
const PEER_READ: &str = "/tidepool.v1.BlobService/Get";

/// The layer: `None` for an insecure server.
#[derive(Clone)]
pub struct GuardLayer {
    authority: Option<Arc<dyn Authority>>,
}

impl GuardLayer {
    /// A guard that authenticates against `authority`.
    pub fn secured(authority: Arc<dyn Authority>) -> Self {
        Self {
            authority: Some(authority),
        }
    }

    /// A guard that admits everyone (no TLS).
    pub fn open() -> Self {
        Self { authority: None }
    }
}

impl<S> tower::Layer<S> for GuardLayer {
    type Service = Guard<S>;

    fn layer(&self, inner: S) -> Guard<S> {
        Guard {
            inner,
            authority: self.authority.clone(),
        }
    }
}

/// The guard service (see the module docs).
#[derive(Clone)]
pub struct Guard<S> {
    inner: S,
    authority: Option<Arc<dyn Authority>>,
}

fn refuse(code: ErrorCode, message: impl Into<String>) -> ErrorInfo {
    ErrorInfo::new(code, message)
}

/// Decides whether a caller may reach `plane`.
pub fn admit(
    plane: Plane,
    identity: Option<&Identity>,
    grant: Option<&Grant>,
) -> Result<(), ErrorInfo> {
    use ErrorCode::{PermissionDenied, Unauthenticated};
    let certificate = |wanted: &str, ok: bool| {
        if ok {
            Ok(())
        } else {
            Err(refuse(
                PermissionDenied,
                format!(
                    "{plane:?} methods need a {wanted} certificate; the caller is {}",
                    identity.map_or("unknown".to_string(), Identity::uri)
                ),
            ))
        }
    };
    match plane {
        Plane::Peer | Plane::Registration => {
            certificate("node", matches!(identity, Some(Identity::Node(_))))
        }
        Plane::NodeAdmin => certificate(
            "coordinator",
            matches!(identity, Some(Identity::Coordinator(_))),
        ),
        Plane::ClusterRead
            if matches!(identity, Some(Identity::Node(_) | Identity::Coordinator(_))) =>
        {
            Ok(())
        }
        Plane::ClusterRead | Plane::Client => match grant {
            Some(_) => Ok(()),
            None => Err(refuse(Unauthenticated, "a bearer token is required")),
        },
        Plane::ClusterAdmin => match grant {
            Some(g) if g.admin => Ok(()),
            Some(g) => Err(refuse(
                PermissionDenied,
                format!("token {:?} is not a cluster admin token", g.name),
            )),
            None => Err(refuse(Unauthenticated, "an admin bearer token is required")),
        },
    }
}

impl<S> Guard<S> {
    fn check(&self, request: &http::Request<Body>) -> Result<Caller, ErrorInfo> {
        let Some(authority) = &self.authority else {
            return Ok(Caller::open());
        };
        let path = request.uri().path();
        let plane = plane_of(path).ok_or_else(|| {
            refuse(
                ErrorCode::PermissionDenied,
                format!("{path} is not a Tidepool method"),
            )
        })?;
        let certificate = request
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(TlsConnectInfo::peer_certs)
            .ok_or_else(|| refuse(ErrorCode::Unauthenticated, "no client certificate"))?;
        let leaf = certificate
            .first()
            .ok_or_else(|| refuse(ErrorCode::Unauthenticated, "no client certificate"))?;
        let identity = Identity::of_certificate(leaf)
            .map_err(|e| refuse(ErrorCode::Unauthenticated, e.to_string()))?;
        let token_sha256 = match request.headers().get(http::header::AUTHORIZATION) {
            None => None,
            Some(value) => {
                let secret = token::from_header(value.as_bytes()).ok_or_else(|| {
                    refuse(
                        ErrorCode::Unauthenticated,
                        "authorization must be `Bearer <token>`",
                    )
                })?;
                Some(token::hash(secret))
            }
        };
        let grant =
            match &token_sha256 {
                None => None,
                Some(hash) => Some(authority.token(hash).ok_or_else(|| {
                    refuse(ErrorCode::Unauthenticated, "unknown or revoked token")
                })?),
            };
        // Nodes read blobs from each other (chunks of a manifest they
        // verify) with their certificate alone.
        let peer_read =
            path == PEER_READ && grant.is_none() && matches!(identity, Identity::Node(_));
        if !peer_read {
            admit(plane, Some(&identity), grant.as_deref())?;
        }
        Ok(Caller {
            open: false,
            identity: Some(identity),
            grant,
            token_sha256,
            peer_read,
        })
    }
}

impl<S> tower::Service<http::Request<Body>> for Guard<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        match self.check(&request) {
            Ok(caller) => {
                request.extensions_mut().insert(caller);
                // The clone that was polled ready serves this call.
                let clone = self.inner.clone();
                let mut ready = std::mem::replace(&mut self.inner, clone);
                Box::pin(ready.call(request))
            }
            Err(info) => {
                tracing::debug!(path = request.uri().path(), "refused: {info}");
                let response = tonic::Status::from(info).into_http();
                Box::pin(std::future::ready(Ok(response)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(admin: bool) -> Grant {
        Grant {
            name: "t".into(),
            admin,
            namespaces: vec![("ci".into(), vec![Role::Read, Role::Write])],
        }
    }

    #[test]
    fn planes_admit_only_their_callers() {
        let node = Identity::Node("n1".into());
        let coordinator = Identity::Coordinator("c".into());
        let client = Identity::Client("app".into());
        let user = grant(false);
        let admin = grant(true);
        let code = |r: Result<(), ErrorInfo>| r.err().map(|e| e.code());
        // A client, even with an admin token, never reaches peer or node
        // admin methods.
        for plane in [Plane::Peer, Plane::Registration, Plane::NodeAdmin] {
            assert_eq!(
                code(admit(plane, Some(&client), Some(&admin))),
                Some(ErrorCode::PermissionDenied),
                "{plane:?}"
            );
        }
        assert_eq!(code(admit(Plane::Peer, Some(&node), None)), None);
        assert_eq!(
            code(admit(Plane::Peer, Some(&coordinator), None)),
            Some(ErrorCode::PermissionDenied)
        );
        assert_eq!(
            code(admit(Plane::NodeAdmin, Some(&coordinator), None)),
            None
        );
        assert_eq!(
            code(admit(Plane::NodeAdmin, Some(&node), None)),
            Some(ErrorCode::PermissionDenied)
        );
        assert_eq!(
            code(admit(Plane::Client, Some(&client), None)),
            Some(ErrorCode::Unauthenticated)
        );
        assert_eq!(code(admit(Plane::Client, Some(&client), Some(&user))), None);
        assert_eq!(code(admit(Plane::ClusterRead, Some(&node), None)), None);
        assert_eq!(
            code(admit(Plane::ClusterAdmin, Some(&client), Some(&user))),
            Some(ErrorCode::PermissionDenied)
        );
        assert_eq!(
            code(admit(Plane::ClusterAdmin, Some(&client), Some(&admin))),
            None
        );
        // A server certificate (the chart's etcd) reaches no plane that a
        // certificate opens.
        let server = Identity::Server("etcd-0".into());
        for plane in [
            Plane::Peer,
            Plane::Registration,
            Plane::NodeAdmin,
            Plane::ClusterRead,
        ] {
            assert!(
                code(admit(plane, Some(&server), None)).is_some(),
                "{plane:?}"
            );
        }
    }

    #[test]
    fn roles_are_per_namespace() {
        let caller = Caller {
            open: false,
            identity: None,
            grant: Some(Arc::new(grant(false))),
            token_sha256: None,
            peer_read: false,
        };
        assert!(caller.may("ci", Role::Read));
        assert!(!caller.may("ci", Role::Delete));
        assert!(!caller.may("backups", Role::Read));
        assert_eq!(
            caller.require("backups", Role::Read).unwrap_err().code(),
            ErrorCode::PermissionDenied
        );
        assert!(
            !Caller::default().may("ci", Role::Read),
            "no caller: closed"
        );
        assert!(Caller::open().may("anything", Role::Delete));
    }
}
