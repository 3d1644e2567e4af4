//! `rustorch chat`: an interactive conversation. The whole conversation is rendered with
//! the chat template every turn and synced against the KV cache, so only the tokens
//! that are new since the last turn are evaluated.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use rustorch_llm::chat::{ChatMessage, ChatTemplate};
use rustorch_llm::engine::{generate, GenerateParams, Generation, Session, StopReason};
use rustorch_llm::sampler::Sampler;
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::Runtime;
use rustyline::error::ReadlineError;

use crate::common::{self, SamplingArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Context size (0 = the model's training context)
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Threads (default: physical cores)
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub device: common::DeviceArgs,
    /// Most tokens per reply (-1 = until end of turn or context)
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_hyphen_values = true)]
    pub n_predict: i64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub grammar: common::GrammarArgs,
    /// System message (`-sys` also works); the template's default is used otherwise
    #[arg(long = "system-prompt")]
    pub system_prompt: Option<String>,
    /// Built-in chat template (chatml, llama2, llama3, zephyr, mistral, gemma, phi3) or a file
    #[arg(long = "chat-template")]
    pub chat_template: Option<String>,
    /// Jinja chat template file
    #[arg(long = "chat-template-file")]
    pub chat_template_file: Option<PathBuf>,
    /// When the context fills: keep --keep tokens, drop half of the rest, continue
    #[arg(long = "context-shift")]
    pub context_shift: bool,
    /// Tokens kept at the start by a context shift
    #[arg(long = "keep", default_value_t = 0)]
    pub keep: usize,
    /// History file for the line editor
    #[arg(long = "history")]
    pub history: Option<PathBuf>,
    /// Debug logging
    #[arg(long = "verbose", short = 'v')]
    pub verbose: bool,
}

const HELP: &str = "\
commands:
  /system TEXT   set the system message (starts a new conversation)
  /clear         forget the conversation
  /save FILE     save the conversation as JSON
  /load FILE     load a conversation saved with /save
  /stats         context use and speed of the last reply
  /help          this text
  /exit          leave (also Ctrl-D)
end a line with \\ to continue on the next one; Ctrl-C stops a reply";

struct Chat<'a> {
    session: Session<'a>,
    tokenizer: &'a Tokenizer,
    template: ChatTemplate,
    sampler: Sampler,
    params: GenerateParams,
    system: Option<String>,
    messages: Vec<ChatMessage>,
    last: Option<(usize, Duration, usize, Duration)>,
    interrupted: Arc<AtomicBool>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Saved {
    messages: Vec<ChatMessage>,
}

impl Chat<'_> {
    fn conversation(&self) -> Vec<ChatMessage> {
        let mut all = Vec::new();
        if let Some(s) = &self.system {
            all.push(ChatMessage::system(s.clone()));
        }
        all.extend(self.messages.iter().cloned());
        all
    }

    fn render_tokens(&self) -> anyhow::Result<Vec<u32>> {
        let rendered = self.template.render(&self.conversation(), true)?;
        let text = self.template.strip_special_affixes(
            &rendered,
            self.tokenizer.add_bos(),
            self.tokenizer.add_eos(),
        );
        Ok(self.tokenizer.encode(text, true, true)?)
    }

    /// One user turn: returns false when the reply could not start.
    fn turn(&mut self, user: &str, out: &mut dyn Write) -> anyhow::Result<()> {
        self.messages.push(ChatMessage::user(user));
        let mut tokens = self.render_tokens()?;
        let n_ctx = self.session.n_ctx();
        while tokens.len() + 1 > n_ctx {
            if !self.params.context_shift || self.messages.len() <= 1 {
                self.messages.pop();
                bail!(
                    "the conversation ({} tokens) no longer fits in the context of {n_ctx} tokens; \
                     /clear it or restart with a larger -c or --context-shift",
                    tokens.len()
                );
            }
            // drop the oldest exchange, keep the system message
            let drop = if self.messages.len() >= 3 { 2 } else { 1 };
            self.messages.drain(..drop);
            eprintln!("[context full: dropped the oldest {drop} message(s)]");
            tokens = self.render_tokens()?;
        }
        self.interrupted.store(false, Ordering::SeqCst);
        let flag = self.interrupted.clone();
        let mut reply_ok = true;
        let g: Generation = generate(
            &mut self.session,
            self.tokenizer,
            &mut self.sampler,
            &tokens,
            &self.params,
            &mut |piece| {
                if flag.load(Ordering::SeqCst) {
                    return false;
                }
                reply_ok &= out
                    .write_all(piece.as_bytes())
                    .and_then(|_| out.flush())
                    .is_ok();
                reply_ok
            },
        )?;
        writeln!(out)?;
        match g.stop {
            StopReason::Cancelled => eprintln!("[reply interrupted]"),
            StopReason::ContextFull => eprintln!(
                "[context full ({n_ctx} tokens): reply cut; use /clear or --context-shift]"
            ),
            _ => {}
        }
        self.messages
            .push(ChatMessage::assistant(g.text.trim_end().to_string()));
        self.last = Some((g.prompt_tokens, g.prompt_time, g.tokens.len(), g.gen_time));
        Ok(())
    }

    fn command(&mut self, line: &str) -> anyhow::Result<bool> {
        let (cmd, arg) = line.split_once(' ').unwrap_or((line, ""));
        let arg = arg.trim();
        match cmd {
            "/exit" | "/quit" => return Ok(false),
            "/help" => println!("{HELP}"),
            "/clear" => {
                self.messages.clear();
                self.session.clear();
                println!("[conversation cleared]");
            }
            "/system" => {
                self.system = (!arg.is_empty()).then(|| arg.to_string());
                self.messages.clear();
                self.session.clear();
                println!("[system message set; new conversation]");
            }
            "/save" => {
                if arg.is_empty() {
                    bail!("usage: /save FILE");
                }
                let doc = Saved {
                    messages: self.conversation(),
                };
                std::fs::write(arg, serde_json::to_string_pretty(&doc)?)
                    .with_context(|| format!("cannot write '{arg}'"))?;
                println!("[saved {} messages to {arg}]", doc.messages.len());
            }
            "/load" => {
                if arg.is_empty() {
                    bail!("usage: /load FILE");
                }
                let raw =
                    std::fs::read_to_string(arg).with_context(|| format!("cannot read '{arg}'"))?;
                let doc: Saved = serde_json::from_str(&raw)
                    .with_context(|| format!("'{arg}' is not a saved conversation"))?;
                let mut msgs = doc.messages;
                self.system = match msgs.first() {
                    Some(m) if m.role == "system" => Some(msgs.remove(0).content),
                    _ => None,
                };
                self.messages = msgs;
                println!("[loaded {} messages from {arg}]", self.messages.len());
            }
            "/stats" => {
                println!(
                    "context: {} of {} tokens used; {} messages",
                    self.session.n_past(),
                    self.session.n_ctx(),
                    self.messages.len()
                );
                if let Some((pt, ptime, gt, gtime)) = self.last {
                    let tps = |n: usize, d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
                    println!(
                        "last reply: {pt} new prompt tokens evaluated ({:.1} t/s), {gt} tokens generated ({:.1} t/s)",
                        tps(pt, ptime),
                        tps(gt, gtime)
                    );
                }
            }
            _ => bail!("unknown command '{cmd}' (/help lists them)"),
        }
        Ok(true)
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    common::init_logging(args.verbose);
    args.grammar.spec()?;
    let path = common::resolve_model(args.model.as_deref())?;
    let loaded = common::load(&path, Some(&args.device), args.ctx_size.unwrap_or(0))?;
    let (model, tok) = (&loaded.model, &loaded.tokenizer);
    let n_ctx = common::ctx_size(args.ctx_size, model);
    eprintln!("rustorch: {}", common::kv_cache_line(model, n_ctx));
    let template = common::chat_template(
        &loaded.gguf,
        args.chat_template.as_deref(),
        args.chat_template_file.as_deref(),
    )?;
    let mut sampler = Sampler::new(args.sampling.to_params(tok, n_ctx)?, tok.n_vocab());
    // every reply follows the grammar (it starts over at each turn)
    args.grammar.install(tok, &mut sampler)?;
    if args.verbose {
        eprintln!("rustorch: seed = {}", sampler.seed());
    }
    let rt = Runtime::new(common::threads(args.threads));
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .context("installing the Ctrl-C handler")?;
    }
    let mut chat = Chat {
        session: Session::new(model, &rt, n_ctx),
        tokenizer: tok,
        params: GenerateParams {
            n_predict: (args.n_predict >= 0).then_some(args.n_predict as usize),
            stop: template.stop_strings().to_vec(),
            context_shift: args.context_shift,
            n_keep: args.keep,
            ignore_eos: false,
        },
        template,
        sampler,
        system: args.system_prompt.clone(),
        messages: Vec::new(),
        last: None,
        interrupted,
    };
    let mut editor = rustyline::DefaultEditor::new().context("starting the line editor")?;
    if let Some(h) = &args.history {
        let _ = editor.load_history(h);
    }
    eprintln!(
        "rustorch chat: {} ({} ctx). /help for commands, /exit or Ctrl-D to leave.",
        path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned()
        ),
        n_ctx
    );
    let mut stdout = std::io::stdout();
    loop {
        let mut text = String::new();
        let mut prompt = "> ";
        let line = loop {
            match editor.readline(prompt) {
                Ok(l) => {
                    if let Some(stripped) = l.strip_suffix('\\') {
                        text.push_str(stripped);
                        text.push('\n');
                        prompt = "… ";
                        continue;
                    }
                    text.push_str(&l);
                    break Some(std::mem::take(&mut text));
                }
                Err(ReadlineError::Interrupted) => {
                    eprintln!("[Ctrl-C: /exit or Ctrl-D to leave]");
                    text.clear();
                    prompt = "> ";
                }
                Err(ReadlineError::Eof) => break None,
                Err(e) => return Err(e.into()),
            }
        };
        let Some(line) = line else { break };
        let line = line.trim().to_string();
        if line.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(line.as_str());
        let result = if line.starts_with('/') {
            match chat.command(&line) {
                Ok(true) => Ok(()),
                Ok(false) => break,
                Err(e) => Err(e),
            }
        } else {
            chat.turn(&line, &mut stdout)
        };
        if let Err(e) = result {
            eprintln!("error: {e:#}");
        }
    }
    if let Some(h) = &args.history {
        let _ = editor.save_history(Path::new(h));
    }
    Ok(())
}
