//! `rustorch run`: generate text from a prompt, streaming it to stdout.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use rustorch_llm::chat::ChatMessage;
use rustorch_llm::engine::{generate, GenerateParams, Session};
use rustorch_llm::sampler::Sampler;
use rustorch_llm::Runtime;

use crate::common::{self, SamplingArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Prompt text
    #[arg(short = 'p', long = "prompt", allow_hyphen_values = true)]
    pub prompt: Option<String>,
    /// Read the prompt from a file
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Tokens to generate (-1 = until end of generation or context)
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_hyphen_values = true)]
    pub n_predict: i64,
    /// Context size (0 = the model's training context)
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Threads (default: physical cores)
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub device: common::DeviceArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub grammar: common::GrammarArgs,
    /// Stop when this text appears (repeatable); it is not printed
    #[arg(short = 'r', long = "reverse-prompt")]
    pub reverse_prompt: Vec<String>,
    /// Wrap the prompt as a user message with the model's chat template
    #[arg(long = "chat")]
    pub chat: bool,
    /// System message for --chat (`-sys` also works)
    #[arg(long = "system-prompt")]
    pub system_prompt: Option<String>,
    /// Built-in chat template (chatml, llama2, llama3, zephyr, mistral, gemma, phi3) or a file
    #[arg(long = "chat-template")]
    pub chat_template: Option<String>,
    /// Jinja chat template file
    #[arg(long = "chat-template-file")]
    pub chat_template_file: Option<PathBuf>,
    /// Also print the prompt
    #[arg(long = "echo")]
    pub echo: bool,
    /// When the context fills, drop half of it (after --keep tokens) and continue
    #[arg(long = "context-shift")]
    pub context_shift: bool,
    /// Prompt tokens kept by a context shift
    #[arg(long = "keep", default_value_t = 0)]
    pub keep: usize,
    /// Per layer and token: RMS, mean and max |x| of the residual stream (stderr)
    #[arg(long = "dump-layers")]
    pub dump_layers: bool,
    /// Per step: the N most likely tokens with their logits (stderr)
    #[arg(long = "top-logits", value_name = "N")]
    pub top_logits: Option<usize>,
    /// Print the prompt's token ids to stderr before generating
    #[arg(long = "verbose-prompt")]
    pub verbose_prompt: bool,
    #[command(flatten)]
    pub escapes: common::EscapeArgs,
    /// Debug logging (seed, positions of every forward call)
    #[arg(long = "verbose", short = 'v')]
    pub verbose: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    common::init_logging(args.verbose);
    // a malformed schema file or flag combination fails before the model loads
    args.grammar.spec()?;
    let prompt_raw = match (&args.prompt, &args.file) {
        (Some(_), Some(_)) => bail!("give either -p or -f, not both"),
        (Some(p), None) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("cannot read prompt file '{}'", f.display()))?,
        (None, None) => bail!("no prompt: give -p TEXT or -f FILE"),
    };
    // llama.cpp's escapes (\n, \t, \xNN, ...) in the prompt and the reverse prompts
    let unescape =
        |s: &str| String::from_utf8_lossy(&args.escapes.apply(s.as_bytes())).into_owned();
    let prompt_text = unescape(&prompt_raw);
    let path = common::resolve_model(args.model.as_deref())?;
    let loaded = common::load(&path, Some(&args.device), args.ctx_size.unwrap_or(0))?;
    let (model, tok) = (&loaded.model, &loaded.tokenizer);
    let n_ctx = common::ctx_size(args.ctx_size, model);
    eprintln!("rustorch: {}", common::kv_cache_line(model, n_ctx));

    let mut stops: Vec<String> = args.reverse_prompt.iter().map(|r| unescape(r)).collect();
    let text = if args.chat {
        let tmpl = common::chat_template(
            &loaded.gguf,
            args.chat_template.as_deref(),
            args.chat_template_file.as_deref(),
        )?;
        let mut messages = Vec::new();
        if let Some(s) = &args.system_prompt {
            messages.push(ChatMessage::system(s.clone()));
        }
        messages.push(ChatMessage::user(prompt_text.clone()));
        let rendered = tmpl.render(&messages, true)?;
        stops.extend(tmpl.stop_strings().iter().cloned());
        tmpl.strip_special_affixes(&rendered, tok.add_bos(), tok.add_eos())
            .to_string()
    } else {
        if args.system_prompt.is_some() {
            bail!("-sys/--system-prompt needs --chat");
        }
        prompt_text.clone()
    };
    tracing::debug!(prompt = %text, "rendered prompt");
    let tokens = tok.encode(&text, true, true)?;
    if tokens.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    if tokens.len() > n_ctx {
        bail!(
            "the prompt is {} tokens long, but the context holds only {n_ctx} (raise -c/--ctx-size)",
            tokens.len()
        );
    }
    if args.verbose_prompt {
        eprintln!("rustorch: prompt tokens ({}): {:?}", tokens.len(), tokens);
    }
    let n_predict = (args.n_predict >= 0).then_some(args.n_predict as usize);
    if let Some(n) = n_predict {
        if tokens.len() + n > n_ctx && !args.context_shift {
            bail!(
                "-n {n} plus the {}-token prompt exceeds the context size {n_ctx} \
                 (raise -c/--ctx-size or use --context-shift)",
                tokens.len()
            );
        }
    }

    let mut sampler = Sampler::new(args.sampling.to_params(tok, n_ctx)?, tok.n_vocab());
    args.grammar.install(tok, &mut sampler)?;
    tracing::info!(seed = sampler.seed(), "sampler seed");
    if args.verbose {
        eprintln!("rustorch: seed = {}", sampler.seed());
    }
    let mut rt = Runtime::new(common::threads(args.threads));
    rt.dump_layers = args.dump_layers;
    let mut session = Session::new(model, &rt, n_ctx);
    if args.dump_layers || args.top_logits.is_some() {
        let nv = model.hparams().n_vocab;
        let top = args.top_logits;
        session.set_observer(Box::new(move |batch, out| {
            for s in &out.layer_stats {
                eprintln!(
                    "layer {:3} pos {:5} token {:6}: rms {:10.4} mean {:10.4} max|x| {:10.4}",
                    s.layer, s.pos, batch.tokens[s.batch_index], s.rms, s.mean, s.max_abs
                );
            }
            if let (Some(n), Some(l)) = (top, out.last(nv)) {
                let mut idx: Vec<usize> = (0..l.len()).collect();
                idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
                let pos = out.rows.last().map_or(0, |&r| batch.positions[r]);
                let line: Vec<String> = idx
                    .iter()
                    .take(n)
                    .map(|&i| {
                        let piece = String::from_utf8_lossy(&tok.token_to_piece(i as u32, true))
                            .into_owned();
                        format!("{i} {piece:?} {:.4}", l[i])
                    })
                    .collect();
                eprintln!("top-logits after pos {pos}: {}", line.join(" | "));
            }
        }));
    }

    let mut out = std::io::stdout().lock();
    if args.echo {
        write!(out, "{text}")?;
        out.flush()?;
    }
    let params = GenerateParams {
        n_predict,
        stop: stops,
        context_shift: args.context_shift,
        n_keep: args.keep,
        ignore_eos: args.sampling.ignore_eos,
    };
    let mut write_err = None;
    let g = generate(
        &mut session,
        tok,
        &mut sampler,
        &tokens,
        &params,
        &mut |piece| match out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
            Ok(()) => true,
            Err(e) => {
                write_err = Some(e);
                false
            }
        },
    )?;
    if let Some(e) = write_err {
        // a closed pipe (e.g. `| head`) is a normal way to stop
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
    }
    let _ = writeln!(out);
    drop(out);
    if g.stop == rustorch_llm::engine::StopReason::ContextFull {
        eprintln!(
            "rustorch: context full ({n_ctx} tokens); use --context-shift to continue past it"
        );
    }
    eprintln!(
        "{}",
        common::timings(
            loaded.load_time,
            g.prompt_tokens,
            g.prompt_time,
            g.tokens.len(),
            g.gen_time
        )
    );
    Ok(())
}
