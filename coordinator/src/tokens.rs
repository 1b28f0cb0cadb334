//! Client tokens: created, listed and revoked by admins, stored in the
//! cluster map as SHA-256 hashes (so every node has them within a map
//! watch), and a bootstrap admin token adopted while the cluster has none.

use tidepool_proto::v1::{ClusterMap, Role, TokenGrant, TokenRecord};
use tidepool_security::identity::valid_name;
use tidepool_security::token;

use crate::CoordinatorError;
use crate::core::{Shared, unix_ms};

/// Most tokens a cluster holds (each is in every copy of the map).
pub const MAX_TOKENS: usize = 10_000;
/// Most grants per token.
const MAX_GRANTS: usize = 256;

/// Name of the token adopted from the bootstrap file or environment.
pub const BOOTSTRAP: &str = "bootstrap";

fn check_grants(map: &ClusterMap, grants: &[TokenGrant]) -> Result<(), CoordinatorError> {
    let bad = |m: String| Err(CoordinatorError::InvalidArgument(m));
    if grants.len() > MAX_GRANTS {
        return bad(format!("at most {MAX_GRANTS} grants per token"));
    }
    for grant in grants {
        if grant.namespace != "*" && !map.namespaces.iter().any(|n| n.name == grant.namespace) {
            return Err(CoordinatorError::NamespaceNotFound(grant.namespace.clone()));
        }
        if grant.roles.is_empty() {
            return bad(format!("grant for {:?} names no role", grant.namespace));
        }
        for role in &grant.roles {
            match Role::try_from(*role) {
                Ok(Role::Unspecified) | Err(_) => {
                    return bad(format!("unknown role {role} for {:?}", grant.namespace));
                }
                Ok(_) => {}
            }
        }
    }
    Ok(())
}

impl Shared {
    /// Creates a token; returns its secret (shown once) and its record.
    pub async fn create_token(
        &self,
        name: &str,
        admin: bool,
        grants: Vec<TokenGrant>,
    ) -> Result<(String, TokenRecord), CoordinatorError> {
        if !valid_name(name) {
            return Err(CoordinatorError::InvalidArgument(
                "token name: 1 to 64 characters of [A-Za-z0-9._-]".into(),
            ));
        }
        if !admin && grants.is_empty() {
            return Err(CoordinatorError::InvalidArgument(
                "a token needs admin or at least one grant".into(),
            ));
        }
        let secret = token::generate();
        let record = TokenRecord {
            name: name.to_string(),
            sha256: token::hash(&secret).to_vec(),
            admin,
            grants,
            created_ms: unix_ms(),
        };
        self.update_map(|map| {
            if map.tokens.iter().any(|t| t.name == record.name) {
                return Err(CoordinatorError::Conflict(format!(
                    "a token named {:?} exists; revoke it first",
                    record.name
                )));
            }
            if map.tokens.len() >= MAX_TOKENS {
                return Err(CoordinatorError::Conflict(format!(
                    "the cluster holds {MAX_TOKENS} tokens already"
                )));
            }
            check_grants(map, &record.grants)?;
            map.tokens.push(record.clone());
            map.tokens.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(Some(Vec::new()))
        })
        .await?;
        tracing::info!(token = %record.name, admin, "token created");
        Ok((secret, record))
    }

    /// Every token, without hashes.
    pub fn list_tokens(&self) -> Vec<TokenRecord> {
        let mut tokens = self.map().tokens.clone();
        for t in &mut tokens {
            t.sha256.clear();
        }
        tokens
    }

    /// Removes the token named `name`; whether it existed, and the live
    /// nodes that had not yet taken the map without it when the wait for
    /// them ended (`map_taken`; empty: none takes the token any more).
    pub async fn revoke_token(&self, name: &str) -> Result<(bool, Vec<u64>), CoordinatorError> {
        let mut existed = false;
        self.update_map(|map| {
            let before = map.tokens.len();
            map.tokens.retain(|t| t.name != name);
            existed = map.tokens.len() != before;
            Ok(existed.then(Vec::new))
        })
        .await?;
        if existed {
            tracing::info!(token = %name, "token revoked");
        }
        // Answered once every live node's map lacks it (a repeat after a
        // lost answer waits too): before, nodes took its calls until the
        // map watch brought them the change.
        let behind = self.map_taken(self.map().version).await;
        if !behind.is_empty() {
            tracing::warn!(
                token = %name,
                nodes = ?behind,
                "token revoked; live nodes have not taken the map without it yet"
            );
        }
        Ok((existed, behind))
    }

    /// Adopts the configured bootstrap token as admin token `bootstrap`
    /// while the cluster holds no token at all (its first start; an admin
    /// who later revokes every token gets it back only by restarting with
    /// it configured), or, with `bootstrap_token_resets`, in place of the
    /// token named `bootstrap` (dev mode's reset).
    pub async fn adopt_bootstrap_token(&self) -> Result<(), CoordinatorError> {
        let secret = match (
            &self.config.bootstrap_token,
            &self.config.bootstrap_token_file,
        ) {
            (Some(secret), _) => secret.clone(),
            (None, Some(path)) => token::read_file(path)
                .map_err(|e| CoordinatorError::Config(format!("bootstrap token: {e}")))?,
            (None, None) => return Ok(()),
        };
        let record = TokenRecord {
            name: BOOTSTRAP.into(),
            sha256: token::hash(&secret).to_vec(),
            admin: true,
            grants: Vec::new(),
            created_ms: unix_ms(),
        };
        let resets = self.config.bootstrap_token_resets;
        let adopted = self
            .change_map_unled(|map| adopt(map, &record, resets))
            .await?;
        if adopted {
            tracing::info!(resets, "adopted the bootstrap admin token");
        }
        Ok(())
    }
}

/// Puts the bootstrap token `record` in `map`: while it holds no token,
/// or (`resets`) in place of the one named `bootstrap`, whatever else it
/// holds. Whether the map changed.
fn adopt(map: &mut ClusterMap, record: &TokenRecord, resets: bool) -> bool {
    if resets {
        if let Some(held) = map.tokens.iter_mut().find(|t| t.name == BOOTSTRAP) {
            if held.sha256 == record.sha256 && held.admin {
                return false;
            }
            *held = record.clone();
            return true;
        }
    } else if !map.tokens.is_empty() {
        return false;
    }
    map.tokens.push(record.clone());
    true
}

/// The map served to a caller that is not a node or coordinator: without
/// the token hashes.
pub fn for_clients(map: &ClusterMap) -> ClusterMap {
    ClusterMap {
        tokens: Vec::new(),
        ..map.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, secret: &str) -> TokenRecord {
        TokenRecord {
            name: name.into(),
            sha256: token::hash(secret).to_vec(),
            admin: true,
            grants: Vec::new(),
            created_ms: 1,
        }
    }

    /// The bootstrap token is adopted by an empty cluster only; a reset
    /// (dev mode's token file made anew) replaces the token named
    /// `bootstrap` and nothing else, once.
    #[test]
    fn a_reset_replaces_only_the_bootstrap_token() {
        let mut map = ClusterMap::default();
        assert!(adopt(&mut map, &record(BOOTSTRAP, "first"), false));
        map.tokens.push(record("ci", "ci-secret"));
        assert!(!adopt(&mut map, &record(BOOTSTRAP, "second"), false));
        assert_eq!(map.tokens[0].sha256, token::hash("first").to_vec());

        assert!(adopt(&mut map, &record(BOOTSTRAP, "second"), true));
        assert!(!adopt(&mut map, &record(BOOTSTRAP, "second"), true));
        assert_eq!(map.tokens.len(), 2);
        assert_eq!(map.tokens[0].sha256, token::hash("second").to_vec());
        assert_eq!(map.tokens[1].sha256, token::hash("ci-secret").to_vec());
        // Revoked since: a reset puts it back.
        map.tokens.remove(0);
        assert!(adopt(&mut map, &record(BOOTSTRAP, "third"), true));
        assert_eq!(map.tokens.len(), 2);
    }
}
