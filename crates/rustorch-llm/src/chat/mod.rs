//! Chat templates: turning a conversation into the prompt text a model was trained on.
//!
//! A GGUF usually carries its Hugging Face template (`tokenizer.chat_template`, jinja).
//! It is rendered with `minijinja` set up the way transformers sets up jinja2:
//! `trim_blocks` and `lstrip_blocks` on, `raise_exception`, `strftime_now`, a `tojson`
//! that writes Python's JSON, Python's string/dict methods (`.strip()`, `.items()`, ...)
//! and loop controls. The context holds `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token`, and `tools`/`documents` as `none`, as transformers passes
//! them.
//!
//! Models without a template (or users who want another) can pick one of llama.cpp's
//! built-in formats by name ([`ChatTemplate::builtin`], [`builtin_names`]) or load one
//! from a file.

mod builtin;
mod pyjson;

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind, Value};
use rustorch_core::gguf::{GgufError, GgufFile};
use serde::{Deserialize, Serialize};

/// GGUF key of the default chat template.
pub const GGUF_CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";

const TEMPLATE_NAME: &str = "chat";

/// Markers that end a turn in common templates, longest-known first. A template's stop
/// strings are those of these that its source mentions, plus its EOS text.
const END_OF_TURN_MARKERS: &[&str] = &[
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<|END_OF_TURN_TOKEN|>",
    "<｜end▁of▁sentence｜>",
    "<|EOT|>",
    "</s>",
];

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Errors from loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("unknown chat template {name:?}; built-in templates are: {}", known.join(", "))]
    UnknownTemplate {
        name: String,
        known: Vec<&'static str>,
    },
    #[error("chat template does not parse: {0:#}")]
    Syntax(#[source] Error),
    #[error("chat template failed to render: {0:#}")]
    Render(#[source] Error),
    #[error("reading chat template {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("extra template context must be a JSON object with string keys")]
    BadContext,
    #[error("invalid JSON for a chat template: {0}")]
    BadJson(String),
}

/// Names accepted by [`ChatTemplate::builtin`].
pub fn builtin_names() -> Vec<&'static str> {
    builtin::BUILTINS.iter().map(|b| b.name).collect()
}

/// Where a template came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateOrigin {
    /// `tokenizer.chat_template` of a GGUF.
    Gguf,
    /// One of llama.cpp's formats, by name.
    Builtin(&'static str),
    /// A file.
    File(PathBuf),
    /// A string given by the caller.
    Source,
}

/// A compiled chat template plus the special-token texts it is rendered with.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    origin: TemplateOrigin,
    bos_token: String,
    eos_token: String,
    stops: Vec<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("stops", &self.stops)
            .field("source_len", &self.source.len())
            .finish()
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time formatted like Python's `strftime`.
fn strftime_now(format: &str) -> Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    use std::fmt::Write;
    let items: Vec<Item<'_>> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        ));
    }
    let mut out = String::new();
    write!(
        out,
        "{}",
        chrono::Local::now().format_with_items(items.into_iter())
    )
    .map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format {format:?}"),
        )
    })?;
    Ok(out)
}

/// C's `isspace` in the "C" locale, which llama.cpp's `trim` uses.
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')
}

fn trim_ascii(s: &str) -> String {
    s.trim_matches(is_c_space).to_string()
}

/// Rewrites transformers' `{% generation %}` / `{% endgeneration %}` (which only mark
/// assistant text for training masks) into an always-true `if`, keeping whitespace
/// control.
fn rewrite_generation_tags(src: &str) -> Cow<'_, str> {
    if !src.contains("generation") {
        return Cow::Borrowed(src);
    }
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            rest = tag;
            break;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[body.len() - 1..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// The environment transformers renders templates in.
fn make_env() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", pyjson::tojson_filter);
    env.add_filter("trim_ascii", trim_ascii);
    // Python prints None / True / False capitalized.
    env.set_formatter(|out, state, value| match value.kind() {
        ValueKind::None => out.write_str("None").map_err(Error::from),
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    });
    env
}

/// The stop strings of a template: known end-of-turn markers its source mentions, in
/// [`END_OF_TURN_MARKERS`] order, then the EOS text.
fn detect_stops(source: &str, eos: &str) -> Vec<String> {
    let mut stops: Vec<String> = END_OF_TURN_MARKERS
        .iter()
        .filter(|m| source.contains(**m))
        .map(|m| m.to_string())
        .collect();
    if !eos.is_empty() && !stops.iter().any(|s| s == eos) {
        stops.push(eos.to_string());
    }
    stops
}

/// The text of token `id` of the GGUF's vocabulary, or "" when absent.
fn token_text(gguf: &GgufFile, key: &str) -> Result<String, ChatError> {
    if gguf.get(key).is_none() {
        return Ok(String::new());
    }
    let id = gguf.get_u32(key)? as usize;
    let tokens = gguf.get_string_array("tokenizer.ggml.tokens")?;
    Ok(tokens.get(id).map(|s| s.to_string()).unwrap_or_default())
}

impl ChatTemplate {
    /// Compiles `source` (a jinja chat template). `bos_token` / `eos_token` are the
    /// texts of the model's BOS and EOS tokens, as templates use them.
    pub fn from_source(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, ChatError> {
        Self::build(
            source.into(),
            TemplateOrigin::Source,
            bos_token.into(),
            eos_token.into(),
            None,
        )
    }

    fn build(
        source: String,
        origin: TemplateOrigin,
        bos_token: String,
        eos_token: String,
        stops: Option<&[&str]>,
    ) -> Result<Self, ChatError> {
        let mut env = make_env();
        let compiled = rewrite_generation_tags(&source).into_owned();
        env.add_template_owned(TEMPLATE_NAME, compiled)
            .map_err(ChatError::Syntax)?;
        let stops = match stops {
            Some(s) => {
                let mut v: Vec<String> = s.iter().map(|x| x.to_string()).collect();
                if !eos_token.is_empty() && !v.contains(&eos_token) {
                    v.push(eos_token.clone());
                }
                v
            }
            None => detect_stops(&source, &eos_token),
        };
        Ok(ChatTemplate {
            env,
            source,
            origin,
            bos_token,
            eos_token,
            stops,
        })
    }

    /// One of llama.cpp's built-in formats ([`builtin_names`]). An unknown name is an
    /// error that lists the known ones.
    pub fn builtin(name: &str) -> Result<Self, ChatError> {
        let b = builtin::find(name).ok_or_else(|| ChatError::UnknownTemplate {
            name: name.to_string(),
            known: builtin_names(),
        })?;
        Self::build(
            b.source.to_string(),
            TemplateOrigin::Builtin(b.name),
            String::new(),
            String::new(),
            Some(b.stops),
        )
    }

    /// Reads a jinja template from a file.
    pub fn from_file(
        path: impl AsRef<Path>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, ChatError> {
        let path = path.as_ref();
        let source = std::fs::read_to_string(path).map_err(|source| ChatError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::build(
            source,
            TemplateOrigin::File(path.to_path_buf()),
            bos_token.into(),
            eos_token.into(),
            None,
        )
    }

    /// A built-in name, else a path to a template file. Neither is an
    /// [`ChatError::UnknownTemplate`] error listing the built-in names.
    pub fn from_name_or_file(
        spec: &str,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, ChatError> {
        if builtin::find(spec).is_some() {
            return Ok(Self::builtin(spec)?.with_special_tokens(bos_token, eos_token));
        }
        if Path::new(spec).is_file() {
            return Self::from_file(spec, bos_token, eos_token);
        }
        Err(ChatError::UnknownTemplate {
            name: spec.to_string(),
            known: builtin_names(),
        })
    }

    /// The GGUF's `tokenizer.chat_template`, with BOS/EOS texts taken from its
    /// vocabulary; `Ok(None)` when the file has no template.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Option<Self>, ChatError> {
        if gguf.get(GGUF_CHAT_TEMPLATE_KEY).is_none() {
            return Ok(None);
        }
        let source = gguf.get_str(GGUF_CHAT_TEMPLATE_KEY)?.to_string();
        let bos = token_text(gguf, "tokenizer.ggml.bos_token_id")?;
        let eos = token_text(gguf, "tokenizer.ggml.eos_token_id")?;
        Self::build(source, TemplateOrigin::Gguf, bos, eos, None).map(Some)
    }

    /// Replaces the BOS/EOS texts (the EOS text also becomes a stop string).
    pub fn with_special_tokens(
        mut self,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Self {
        let old_eos = std::mem::replace(&mut self.eos_token, eos_token.into());
        self.bos_token = bos_token.into();
        if !old_eos.is_empty() && old_eos != self.eos_token {
            let marker = END_OF_TURN_MARKERS.contains(&old_eos.as_str())
                && self.source.contains(old_eos.as_str());
            if !marker {
                self.stops.retain(|s| *s != old_eos);
            }
        }
        if !self.eos_token.is_empty() && !self.stops.contains(&self.eos_token) {
            self.stops.push(self.eos_token.clone());
        }
        self
    }

    /// The jinja source (as given, before any rewriting).
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn origin(&self) -> &TemplateOrigin {
        &self.origin
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends with the opening
    /// of an assistant turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_values(Value::from_serialize(messages), add_generation_prompt, None)
    }

    /// Renders messages given as JSON (any fields: `tool_calls`, content parts, ...),
    /// with `extra` (a JSON object, e.g. `{"tools": [...]}`) added to the context.
    ///
    /// Object keys come in `serde_json::Map` order, which is sorted unless serde_json's
    /// `preserve_order` feature is on; [`render_json_str`](Self::render_json_str)
    /// keeps the order of the text whatever the features.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Value>,
    ) -> Result<String, ChatError> {
        let extra = match extra {
            None => None,
            Some(serde_json::Value::Object(map)) => Some(
                map.iter()
                    .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
                    .collect(),
            ),
            Some(_) => return Err(ChatError::BadContext),
        };
        self.render_values(
            Value::from_serialize(messages),
            add_generation_prompt,
            extra,
        )
    }

    /// [`render_json`](Self::render_json) from JSON text (`messages`: an array,
    /// `extra`: an object), keeping the key order of the text, as Python does.
    pub fn render_json_str(
        &self,
        messages: &str,
        add_generation_prompt: bool,
        extra: Option<&str>,
    ) -> Result<String, ChatError> {
        let messages: Value =
            serde_json::from_str(messages).map_err(|e| ChatError::BadJson(e.to_string()))?;
        let extra = match extra {
            None => None,
            Some(text) => {
                let v: Value =
                    serde_json::from_str(text).map_err(|e| ChatError::BadJson(e.to_string()))?;
                if v.kind() != ValueKind::Map {
                    return Err(ChatError::BadContext);
                }
                let mut pairs = Vec::new();
                for k in v.try_iter().map_err(ChatError::Render)? {
                    let item = v.get_item(&k).map_err(ChatError::Render)?;
                    let key = k.as_str().ok_or(ChatError::BadContext)?.to_string();
                    pairs.push((key, item));
                }
                Some(pairs)
            }
        };
        self.render_values(messages, add_generation_prompt, extra)
    }

    fn render_values(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        extra: Option<Vec<(String, Value)>>,
    ) -> Result<String, ChatError> {
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), messages),
            (
                "add_generation_prompt".into(),
                Value::from(add_generation_prompt),
            ),
            ("bos_token".into(), Value::from(self.bos_token.as_str())),
            ("eos_token".into(), Value::from(self.eos_token.as_str())),
            ("tools".into(), Value::from(())),
            ("documents".into(), Value::from(())),
        ];
        for (k, v) in extra.into_iter().flatten() {
            match ctx.iter_mut().find(|(name, _)| *name == k) {
                Some(slot) => slot.1 = v,
                None => ctx.push((k, v)),
            }
        }
        let ctx: Value = ctx.into_iter().collect();
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(ChatError::Render)?;
        tmpl.render(ctx).map_err(ChatError::Render)
    }

    /// The text to feed after the already-processed `history` when `new` is added: the
    /// render of `history + [new]` minus the render of `history` (without generation
    /// prompt). `None` when the longer render does not start with the shorter one (the
    /// template rewrites earlier turns), in which case the whole conversation must be
    /// rendered again.
    pub fn render_suffix(
        &self,
        history: &[ChatMessage],
        new: &ChatMessage,
        add_generation_prompt: bool,
    ) -> Result<Option<String>, ChatError> {
        let before = if history.is_empty() {
            String::new()
        } else {
            self.render(history, false)?
        };
        let mut all = history.to_vec();
        all.push(new.clone());
        let after = self.render(&all, add_generation_prompt)?;
        Ok(after.strip_prefix(before.as_str()).map(str::to_string))
    }

    /// Drops a leading BOS text when the tokenizer adds BOS itself, and a trailing EOS
    /// text when it adds EOS, so that they are not doubled (as llama.cpp does).
    pub fn strip_special_affixes<'a>(
        &self,
        rendered: &'a str,
        tokenizer_adds_bos: bool,
        tokenizer_adds_eos: bool,
    ) -> &'a str {
        let mut s = rendered;
        if tokenizer_adds_bos && !self.bos_token.is_empty() {
            s = s.strip_prefix(self.bos_token.as_str()).unwrap_or(s);
        }
        if tokenizer_adds_eos && !self.eos_token.is_empty() {
            s = s.strip_suffix(self.eos_token.as_str()).unwrap_or(s);
        }
        s
    }

    /// Strings that end an assistant turn for this template (`<|im_end|>`,
    /// `<end_of_turn>`, `<|eot_id|>`, `</s>`, ... and the EOS text).
    pub fn stop_strings(&self) -> &[String] {
        &self.stops
    }

    /// Whether a token's text is one of the stop strings (end of turn).
    pub fn is_end_of_turn(&self, piece: &str) -> bool {
        !piece.is_empty() && self.stops.iter().any(|s| s == piece)
    }

    /// Byte offset of the earliest stop string in `text`, if any: generated text is
    /// complete up to there.
    pub fn find_stop(&self, text: &str) -> Option<usize> {
        find_stop(text, &self.stops)
    }

    /// Length in bytes of the longest end of `text` that could be the start of a stop
    /// string: a streaming printer holds that much back until more text arrives.
    pub fn partial_stop_len(&self, text: &str) -> usize {
        partial_stop_len(text, &self.stops)
    }
}

/// `value` as Python's `json.dumps` writes it (`", "` and `": "` separators, non-ASCII
/// kept), with `indent` spaces per level when given: the JSON text templates see.
pub fn python_json(value: &serde_json::Value, indent: Option<usize>) -> String {
    let mut opts = pyjson::DumpOptions {
        indent: indent.map(|n| " ".repeat(n)),
        ..pyjson::DumpOptions::default()
    };
    if opts.indent.is_some() {
        opts.item_sep = ",".into();
    }
    pyjson::dumps(&Value::from_serialize(value), &opts).unwrap_or_else(|_| value.to_string())
}

/// Byte offset of the earliest of `stops` in `text`.
pub fn find_stop<S: AsRef<str>>(text: &str, stops: &[S]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.as_ref().is_empty())
        .filter_map(|s| text.find(s.as_ref()))
        .min()
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `stops`.
pub fn partial_stop_len<S: AsRef<str>>(text: &str, stops: &[S]) -> usize {
    let mut best = 0;
    for stop in stops {
        let stop = stop.as_ref();
        for (i, _) in stop.char_indices().skip(1) {
            let prefix = &stop[..i];
            if i > best && text.ends_with(prefix) {
                best = i;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_ifs() {
        let src = "a{%- generation -%}b{% endgeneration %}c{% if x %}{% endif %}";
        assert_eq!(
            rewrite_generation_tags(src),
            "a{%- if true -%}b{% endif %}c{% if x %}{% endif %}"
        );
    }

    #[test]
    fn partial_stops() {
        let stops = ["<|im_end|>"];
        assert_eq!(partial_stop_len("hello <|im", &stops), 4);
        assert_eq!(partial_stop_len("hello", &stops), 0);
        assert_eq!(find_stop("ab<|im_end|>cd", &stops), Some(2));
    }
}
