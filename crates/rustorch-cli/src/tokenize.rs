//! `rustorch tokenize`: text to token ids with a model's vocabulary, printed in the
//! formats of llama.cpp's `llama-tokenize` so the two can be diffed.

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use rustorch_core::gguf::GgufFile;
use rustorch_llm::tokenizer::Tokenizer;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model whose vocabulary is used (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Text to tokenize
    #[arg(short = 'p', long = "prompt", allow_hyphen_values = true)]
    pub prompt: Option<String>,
    /// Read the text from a file
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Read the text from standard input
    #[arg(long = "stdin")]
    pub stdin: bool,
    /// Print only the ids, as one list: [1, 15043, 3186]
    #[arg(long = "ids")]
    pub ids: bool,
    /// Do not add BOS (or EOS) even if the vocabulary asks for it
    #[arg(long = "no-bos")]
    pub no_bos: bool,
    /// Treat control tokens written in the text (<|im_start|>) as plain text
    #[arg(long = "no-parse-special")]
    pub no_parse_special: bool,
    /// Also print the number of tokens
    #[arg(long = "show-count")]
    pub show_count: bool,
    #[command(flatten)]
    pub escapes: crate::common::EscapeArgs,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let sources = [args.prompt.is_some(), args.file.is_some(), args.stdin];
    if sources.iter().filter(|&&s| s).count() != 1 {
        bail!("give exactly one of -p TEXT, -f FILE or --stdin");
    }
    let bytes: Vec<u8> = if let Some(p) = &args.prompt {
        p.clone().into_bytes()
    } else if let Some(f) = &args.file {
        std::fs::read(f).with_context(|| format!("cannot read '{}'", f.display()))?
    } else {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("reading standard input")?;
        buf
    };
    // escapes apply to -p, -f and --stdin alike, as in llama-tokenize
    let bytes = args.escapes.apply(&bytes);
    let path = crate::common::resolve_model(args.model.as_deref())?;
    let gguf = GgufFile::open(&path)?;
    let tok = Tokenizer::from_gguf(&gguf).context("reading the vocabulary")?;
    let ids = tok.encode_bytes(&bytes, !args.no_bos, !args.no_parse_special)?;
    let mut out = std::io::stdout().lock();
    let result = (|| -> std::io::Result<()> {
        if args.ids {
            let list: Vec<String> = ids.iter().map(u32::to_string).collect();
            writeln!(out, "[{}]", list.join(", "))?;
        } else {
            for &id in &ids {
                let piece = tok.token_to_piece(id, true);
                writeln!(out, "{id:6} -> '{}'", String::from_utf8_lossy(&piece))?;
            }
        }
        if args.show_count {
            writeln!(out, "Total number of tokens: {}", ids.len())?;
        }
        Ok(())
    })();
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}
