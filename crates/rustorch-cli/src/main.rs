//! `rustorch`: run, chat with, serve, benchmark and inspect GGUF language models.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod chat;
mod common;
mod diff;
mod imatrix;
mod inspect;
mod make_model;
mod perplexity;
mod quantize;
mod run;
mod serve;
mod tokenize;

#[derive(Parser)]
#[command(
    name = "rustorch",
    version,
    about = "A Rust inference engine for GGUF language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt
    Run(run::Args),
    /// Interactive chat with a model
    Chat(chat::Args),
    /// OpenAI-compatible HTTP server
    Serve(serve::Args),
    /// Measure prompt and generation speed, like llama-bench
    Bench(bench::Args),
    /// Perplexity of a model over a text file
    Perplexity(perplexity::Args),
    /// Convert a GGUF model to another tensor format
    Quantize(quantize::Args),
    /// Compute an importance matrix over a text, like llama-imatrix
    Imatrix(imatrix::Args),
    /// Tokenize text with a model's vocabulary
    Tokenize(tokenize::Args),
    /// Print a GGUF file's metadata, tensors and architecture summary
    Inspect(inspect::Args),
    /// Run one prompt through two backends (or against a llama.cpp dump) and name the
    /// first operation whose output differs past a tolerance
    Diff(diff::Args),
    /// Write a llama-shaped GGUF with seeded random weights (benchmark models)
    MakeModel(make_model::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(common::expand_llama_aliases(std::env::args()));
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Imatrix(a) => imatrix::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Diff(a) => diff::run(a),
        Command::MakeModel(a) => make_model::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}
