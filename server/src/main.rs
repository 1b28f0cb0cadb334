//! `tidepool`: the server binary. Composes the node and coordinator libraries
//! (which never depend on each other) behind three subcommands.
//!
//! Status: the subcommands are not built yet; each says so and exits with
//! status 2.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    Node,
    /// Run a coordinator.
    Coordinator,
    /// Run a coordinator and three nodes in one process (local development).
    Dev,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Node => tidepool_node::serve().map_err(anyhow::Error::from),
        Command::Coordinator => tidepool_coordinator::serve().map_err(anyhow::Error::from),
        Command::Dev => Err(anyhow::anyhow!("dev mode is not implemented yet (issue 8)")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("tidepool: not yet: {error:#}");
            ExitCode::from(2)
        }
    }
}
