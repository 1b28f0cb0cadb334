//! `tidepool`: the server binary. Composes the node and coordinator libraries
//! (which never depend on each other) behind three subcommands.
//!
//! `tidepool node` runs a storage node from a TOML file (`--config`) and/or
//! flags (flags win); see `tidepool node --help` and the README. The
//! coordinator and dev mode are not built yet: they say so and exit with
//! status 2.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use tidepool_node::config::{NamespaceSpec, NodeConfig, Peer, StaticCluster};

/// Tidepool, a distributed replicated blob store.
#[derive(Debug, Parser)]
#[command(name = "tidepool", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a storage node.
    Node(Box<NodeArgs>),
    /// Run a coordinator.
    Coordinator,
    /// Run a coordinator and three nodes in one process (local development).
    Dev,
}

/// Settings of `tidepool node`; each flag overrides the config file.
#[derive(Debug, Args)]
struct NodeArgs {
    /// TOML configuration file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Node id (required without a config file).
    #[arg(long)]
    node_id: Option<u64>,
    /// gRPC listen address.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// URL other nodes and clients use to reach this node.
    #[arg(long)]
    advertise: Option<String>,
    /// Data directory.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Prometheus metrics listen address.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// A fixed cluster's peer, `ID=URL` (repeat for each node, this one
    /// included).
    #[arg(long = "peer", value_name = "ID=URL")]
    peers: Vec<String>,
    /// A fixed cluster's shard count.
    #[arg(long)]
    shards: Option<u32>,
    /// A fixed cluster's replica nodes, comma-separated ids (default: every
    /// peer).
    #[arg(long, value_delimiter = ',')]
    replicas: Vec<u64>,
    /// A fixed cluster's namespace, `NAME=ID` or `NAME=ID:cas` for a
    /// content-addressed one (default: `default=1`).
    #[arg(long = "namespace", value_name = "NAME=ID[:cas]")]
    namespaces: Vec<String>,
}

impl NodeArgs {
    fn into_config(self) -> anyhow::Result<NodeConfig> {
        let mut config = match (&self.config, self.node_id) {
            (Some(path), _) => NodeConfig::from_file(path)?,
            (None, Some(id)) => NodeConfig::new(id),
            (None, None) => bail!("give --config or --node-id"),
        };
        if let Some(id) = self.node_id {
            config.node_id = id;
        }
        if let Some(listen) = self.listen {
            config.listen = listen;
        }
        if self.advertise.is_some() {
            config.advertise = self.advertise;
        }
        if let Some(dir) = self.data_dir {
            config.data_dir = dir;
        }
        if self.metrics_listen.is_some() {
            config.metrics_listen = self.metrics_listen;
        }
        if !self.peers.is_empty() || self.shards.is_some() {
            let peers = self
                .peers
                .iter()
                .map(|p| {
                    let (id, address) = p.split_once('=').context("--peer takes ID=URL")?;
                    Ok(Peer {
                        id: id.parse().with_context(|| format!("--peer {p}: bad id"))?,
                        address: address.to_string(),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let replicas = if self.replicas.is_empty() {
                peers.iter().map(|p| p.id).collect()
            } else {
                self.replicas
            };
            let namespaces = if self.namespaces.is_empty() {
                vec![NamespaceSpec {
                    name: "default".into(),
                    id: 1,
                    content_addressed: false,
                }]
            } else {
                self.namespaces
                    .iter()
                    .map(|n| {
                        let (name, rest) = n
                            .split_once('=')
                            .context("--namespace takes NAME=ID[:cas]")?;
                        let (id, cas) = match rest.split_once(':') {
                            Some((id, "cas")) => (id, true),
                            Some(_) => bail!("--namespace {n}: the only flag is :cas"),
                            None => (rest, false),
                        };
                        Ok(NamespaceSpec {
                            name: name.into(),
                            id: id
                                .parse()
                                .with_context(|| format!("--namespace {n}: bad id"))?,
                            content_addressed: cas,
                        })
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?
            };
            config.cluster = Some(StaticCluster {
                shards: self.shards.unwrap_or(1),
                replicas,
                peers,
                namespaces,
            });
        }
        config.validate()?;
        Ok(config)
    }
}

fn run_node(args: NodeArgs) -> anyhow::Result<()> {
    let config = args.into_config()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tidepool-node")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let mut running = tidepool_node::server::start(config).await?;
        eprintln!(
            "tidepool node {} serving on {}",
            running.node.config.node_id, running.address
        );
        tokio::select! {
            result = running.wait() => result?,
            _ = shutdown_signal() => {
                tracing::info!("shutting down");
                running.stop().await?;
            }
        }
        Ok(())
    })
}

async fn shutdown_signal() {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Node(args) => run_node(*args),
        Command::Coordinator => {
            if let Err(error) = tidepool_coordinator::serve() {
                eprintln!("tidepool: not yet: {error}");
            }
            return ExitCode::from(2);
        }
        Command::Dev => {
            eprintln!("tidepool: not yet: dev mode is not implemented yet (issue 8)");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("tidepool: {error:#}");
            ExitCode::FAILURE
        }
    }
}
