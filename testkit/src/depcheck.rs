//! The dependency-direction check: crates are boundaries and dependencies
//! point one way (see `ARCHITECTURE.md`, "Dependency rules").
//!
//! The check reads `cargo metadata --format-version 1` output and walks the
//! resolved graph along normal and build dependencies (dev-dependencies are
//! test-only and exempt). Each violation names the rule and the path that
//! breaks it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde_json::Value;

/// One dependency rule: `from` must not reach any crate in `forbidden`.
#[derive(Debug)]
pub struct Rule {
    /// Short name of the rule, printed with every violation.
    pub name: &'static str,
    /// The package the rule constrains.
    pub from: &'static str,
    /// Packages it must not depend on, directly or transitively.
    pub forbidden: &'static [&'static str],
    /// Why the rule exists.
    pub why: &'static str,
}

/// The workspace's rules.
pub const RULES: &[Rule] = &[
    Rule {
        name: "engine-is-synchronous-and-standalone",
        from: "tidepool-engine",
        forbidden: &[
            "tokio",
            "tonic",
            "prost",
            "raft",
            "raft-proto",
            "tidepool-proto",
            "tidepool-node",
            "tidepool-coordinator",
            "tidepool-client",
        ],
        why: "the engine is synchronous (std threads) and knows nothing of RPC, protobuf or Raft",
    },
    Rule {
        name: "client-does-not-embed-storage",
        from: "tidepool-client",
        forbidden: &["tidepool-engine", "tidepool-node", "tidepool-coordinator"],
        why: "the SDK speaks the wire contract only",
    },
    Rule {
        name: "gateway-is-a-client",
        from: "tidepool-gateway",
        forbidden: &["tidepool-engine", "tidepool-node", "tidepool-coordinator"],
        why: "the gateway is stateless and built on the SDK; it holds no data and no cluster role",
    },
    Rule {
        name: "coordinator-does-not-store-blobs",
        from: "tidepool-coordinator",
        forbidden: &["tidepool-engine", "tidepool-node"],
        why: "the coordinator manages metadata; nodes own the data",
    },
    Rule {
        name: "telemetry-is-plumbing",
        from: "tidepool-telemetry",
        forbidden: &[
            "tidepool-engine",
            "tidepool-node",
            "tidepool-coordinator",
            "tidepool-client",
            "tidepool-gateway",
        ],
        why: "the observability plumbing serves every process; what each measures lives with it",
    },
    Rule {
        name: "node-does-not-depend-on-coordinator",
        from: "tidepool-node",
        forbidden: &["tidepool-coordinator"],
        why: "nodes talk to the coordinator over gRPC; only the server binary composes both",
    },
];

/// A broken rule, with one dependency path that breaks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The rule's name.
    pub rule: &'static str,
    /// Why the rule exists.
    pub why: &'static str,
    /// Package names from the constrained crate to the forbidden one.
    pub path: Vec<String>,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dependency rule `{}` broken: {} ({})",
            self.rule,
            self.path.join(" -> "),
            self.why
        )
    }
}

/// Errors reading the metadata.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    /// A field the check needs is missing or has the wrong type.
    #[error("cargo metadata output has no usable `{0}`")]
    Missing(&'static str),
    /// A rule names a package the workspace does not have.
    #[error("rule `{rule}` constrains package `{package}`, which is not in the workspace")]
    UnknownPackage {
        /// The rule.
        rule: &'static str,
        /// The missing package.
        package: &'static str,
    },
}

/// The resolved graph: package id -> (name, non-dev dependency ids).
struct Graph {
    names: BTreeMap<String, String>,
    edges: BTreeMap<String, Vec<String>>,
}

impl Graph {
    fn from_metadata(metadata: &Value) -> Result<Self, MetadataError> {
        let packages = metadata["packages"]
            .as_array()
            .ok_or(MetadataError::Missing("packages"))?;
        let mut names = BTreeMap::new();
        for package in packages {
            let id = package["id"]
                .as_str()
                .ok_or(MetadataError::Missing("packages[].id"))?;
            let name = package["name"]
                .as_str()
                .ok_or(MetadataError::Missing("packages[].name"))?;
            names.insert(id.to_string(), name.to_string());
        }
        let nodes = metadata["resolve"]["nodes"]
            .as_array()
            .ok_or(MetadataError::Missing("resolve.nodes"))?;
        let mut edges = BTreeMap::new();
        for node in nodes {
            let id = node["id"]
                .as_str()
                .ok_or(MetadataError::Missing("resolve.nodes[].id"))?;
            let deps = node["deps"]
                .as_array()
                .ok_or(MetadataError::Missing("deps"))?;
            let targets = deps
                .iter()
                .filter(|dep| is_non_dev(dep))
                .filter_map(|dep| dep["pkg"].as_str().map(str::to_string))
                .collect();
            edges.insert(id.to_string(), targets);
        }
        Ok(Self { names, edges })
    }

    fn id_of(&self, name: &str) -> Option<&String> {
        self.names
            .iter()
            .find(|(_, n)| n.as_str() == name)
            .map(|(id, _)| id)
    }

    /// Breadth-first search from `start`; returns the shortest path (as
    /// names) to each reachable package name.
    fn paths_from(&self, start: &str) -> BTreeMap<String, Vec<String>> {
        let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
        let mut seen = BTreeSet::from([start]);
        let mut queue = VecDeque::from([start]);
        let mut paths = BTreeMap::new();
        while let Some(id) = queue.pop_front() {
            let mut path = vec![self.names[id].clone()];
            let mut cursor = id;
            while let Some(&up) = parent.get(cursor) {
                path.push(self.names[up].clone());
                cursor = up;
            }
            path.reverse();
            paths.entry(self.names[id].clone()).or_insert(path);
            for next in self.edges.get(id).into_iter().flatten() {
                if seen.insert(next.as_str()) {
                    parent.insert(next.as_str(), id);
                    queue.push_back(next.as_str());
                }
            }
        }
        paths
    }
}

/// A dependency entry counts unless every kind it is used as is `dev`.
fn is_non_dev(dep: &Value) -> bool {
    match dep["dep_kinds"].as_array() {
        Some(kinds) if !kinds.is_empty() => kinds.iter().any(|k| k["kind"].as_str() != Some("dev")),
        _ => true,
    }
}

/// Checks `rules` against `metadata` (the JSON of `cargo metadata`).
pub fn check(metadata: &Value, rules: &[Rule]) -> Result<Vec<Violation>, MetadataError> {
    let graph = Graph::from_metadata(metadata)?;
    let mut violations = Vec::new();
    for rule in rules {
        let start = graph
            .id_of(rule.from)
            .ok_or(MetadataError::UnknownPackage {
                rule: rule.name,
                package: rule.from,
            })?;
        let reachable = graph.paths_from(start);
        for forbidden in rule.forbidden {
            if let Some(path) = reachable.get(*forbidden) {
                violations.push(Violation {
                    rule: rule.name,
                    why: rule.why,
                    path: path.clone(),
                });
            }
        }
    }
    Ok(violations)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn metadata(edges: &[(&str, &str, &str)], packages: &[&str]) -> Value {
        let packages: Vec<Value> = packages
            .iter()
            .map(|p| json!({"id": p, "name": p}))
            .collect();
        let mut nodes: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
        for p in packages.iter() {
            nodes.entry(p["id"].as_str().unwrap()).or_default();
        }
        for (from, to, kind) in edges {
            let kind = if kind.is_empty() {
                Value::Null
            } else {
                json!(kind)
            };
            nodes
                .entry(from)
                .or_default()
                .push(json!({"pkg": to, "dep_kinds": [{"kind": kind}]}));
        }
        let nodes: Vec<Value> = nodes
            .into_iter()
            .map(|(id, deps)| json!({"id": id, "deps": deps}))
            .collect();
        json!({"packages": packages, "resolve": {"nodes": nodes}})
    }

    const ENGINE_RULE: &[Rule] = &[Rule {
        name: "r",
        from: "tidepool-engine",
        forbidden: &["tokio"],
        why: "w",
    }];

    #[test]
    fn transitive_normal_dependency_is_a_violation_with_its_path() {
        let m = metadata(
            &[("tidepool-engine", "helper", ""), ("helper", "tokio", "")],
            &["tidepool-engine", "helper", "tokio"],
        );
        let v = check(&m, ENGINE_RULE).unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].path, ["tidepool-engine", "helper", "tokio"]);
        assert!(v[0].to_string().contains("dependency rule `r` broken"));
    }

    #[test]
    fn build_dependency_counts_dev_dependency_does_not() {
        let build = metadata(
            &[("tidepool-engine", "tokio", "build")],
            &["tidepool-engine", "tokio"],
        );
        assert_eq!(check(&build, ENGINE_RULE).unwrap().len(), 1);
        let dev = metadata(
            &[("tidepool-engine", "tokio", "dev")],
            &["tidepool-engine", "tokio"],
        );
        assert!(check(&dev, ENGINE_RULE).unwrap().is_empty());
    }

    #[test]
    fn unknown_package_is_an_error_not_a_pass() {
        let m = metadata(&[], &["other"]);
        assert!(matches!(
            check(&m, ENGINE_RULE),
            Err(MetadataError::UnknownPackage { .. })
        ));
    }
}
