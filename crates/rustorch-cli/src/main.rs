//! `rustorch`: run, chat with, serve, benchmark and inspect GGUF language models.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod inspect;
mod tokenize;

#[derive(Parser)]
#[command(name = "rustorch", version, about = "A Rust inference engine for GGUF language models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a GGUF file's metadata, tensors and architecture summary
    Inspect(inspect::Args),
    /// Tokenize text with a model's vocabulary
    Tokenize(tokenize::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(a) => inspect::run(a),
        Command::Tokenize(a) => tokenize::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}
