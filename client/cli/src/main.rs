//! `tidectl`: the Tidepool command-line tool, built on the client SDK.
//!
//! Status: not yet built (issue 8); every command says so and exits with
//! status 2.

use std::process::ExitCode;

use clap::Parser;

/// Command-line interface to a Tidepool cluster.
#[derive(Debug, Parser)]
#[command(name = "tidectl", version, about)]
struct Cli {
    /// Coordinator or node address to start from.
    #[arg(long, default_value = "http://127.0.0.1:7400", global = true)]
    endpoint: String,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true)]
    command: Vec<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match tidepool_client::Client::connect(&[cli.endpoint.as_str()]) {
        Ok(_) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("tidectl: {}: not yet: {error}", cli.command.join(" "));
            ExitCode::from(2)
        }
    }
}
