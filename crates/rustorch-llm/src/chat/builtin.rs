//! Built-in chat templates: jinja versions of llama.cpp's hard-coded formats
//! (`src/llama-chat.cpp`, `llm_chat_apply_template`), so that `--chat-template NAME`
//! gives the same text as llama.cpp's `--chat-template NAME`.
//!
//! `trim_ascii` is a filter registered by [`super::ChatTemplate`]: it strips what C's
//! `isspace` calls space, as llama.cpp's `trim` does.

/// A built-in template: its name, its jinja source and the strings that end a turn.
pub(crate) struct Builtin {
    pub name: &'static str,
    pub source: &'static str,
    pub stops: &'static [&'static str],
}

const CHATML: &str = "{%- for message in messages -%}\
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/// llama.cpp's llama2 family. `sys` wraps system messages in `<<SYS>>`, `bos` opens
/// later turns with `<s>`, `strip` trims every message. `add_generation_prompt` adds
/// nothing: the prompt already ends with `[/INST]`.
macro_rules! llama2 {
    ($system:expr, $open:expr, $content:expr) => {
        concat!(
            "{%- set ns = namespace(inside=true) -%}",
            "{{- '[INST] ' -}}",
            "{%- for message in messages -%}",
            "{%- set content = ",
            $content,
            " -%}",
            "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- '",
            $open,
            "' -}}{%- endif -%}",
            "{%- if message.role == 'system' -%}{{- ",
            $system,
            " -}}",
            "{%- elif message.role == 'user' -%}{{- content + ' [/INST]' -}}",
            "{%- else -%}{{- content + '</s>' -}}{%- set ns.inside = false -%}",
            "{%- endif -%}",
            "{%- endfor -%}"
        )
    };
}

const LLAMA2: &str = llama2!("content + '\\n'", "[INST] ", "message.content");
const LLAMA2_SYS: &str = llama2!(
    "'<<SYS>>\\n' + content + '\\n<</SYS>>\\n\\n'",
    "[INST] ",
    "message.content"
);
const LLAMA2_SYS_BOS: &str = llama2!(
    "'<<SYS>>\\n' + content + '\\n<</SYS>>\\n\\n'",
    "<s>[INST] ",
    "message.content"
);
const LLAMA2_SYS_STRIP: &str = llama2!(
    "'<<SYS>>\\n' + content + '\\n<</SYS>>\\n\\n'",
    "[INST] ",
    "message.content | trim_ascii"
);

/// Mistral v1 / v3 / v3-tekken: `lead` before `[INST]` and `[/INST]`, `trail` after
/// `[INST]` and before answers; v3 trims answers.
macro_rules! mistral_v1_v3 {
    ($lead:expr, $trail:expr, $answer:expr) => {
        concat!(
            "{%- set ns = namespace(inside=false) -%}",
            "{%- for message in messages -%}",
            "{%- if not ns.inside -%}{{- '",
            $lead,
            "[INST]",
            $trail,
            "' -}}{%- set ns.inside = true -%}{%- endif -%}",
            "{%- if message.role == 'system' -%}{{- message.content + '\\n\\n' -}}",
            "{%- elif message.role == 'user' -%}{{- message.content + '",
            $lead,
            "[/INST]' -}}",
            "{%- else -%}{{- '",
            $trail,
            "' + ",
            $answer,
            " + '</s>' -}}{%- set ns.inside = false -%}",
            "{%- endif -%}",
            "{%- endfor -%}"
        )
    };
}

const MISTRAL_V1: &str = mistral_v1_v3!(" ", " ", "message.content");
const MISTRAL_V3: &str = mistral_v1_v3!("", " ", "(message.content | trim_ascii)");
const MISTRAL_V3_TEKKEN: &str = mistral_v1_v3!("", "", "message.content");

macro_rules! mistral_v7 {
    ($space:expr) => {
        concat!(
            "{%- for message in messages -%}",
            "{%- if message.role == 'system' -%}{{- '[SYSTEM_PROMPT]",
            $space,
            "' + message.content + '[/SYSTEM_PROMPT]' -}}",
            "{%- elif message.role == 'user' -%}{{- '[INST]",
            $space,
            "' + message.content + '[/INST]' -}}",
            "{%- else -%}{{- '",
            $space,
            "' + message.content + '</s>' -}}",
            "{%- endif -%}",
            "{%- endfor -%}"
        )
    };
}

const MISTRAL_V7: &str = mistral_v7!(" ");
const MISTRAL_V7_TEKKEN: &str = mistral_v7!("");

const PHI3: &str = "{%- for message in messages -%}\
{{- '<|' + message.role + '|>\\n' + message.content + '<|end|>\\n' -}}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}";

const ZEPHYR: &str = "{%- for message in messages -%}\
{{- '<|' + message.role + '|>\\n' + message.content + '<|endoftext|>\\n' -}}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}";

/// Gemma has no system role: system messages are trimmed, concatenated and put at the
/// start of the next user turn.
const GEMMA: &str = "{%- set ns = namespace(system='') -%}\
{%- for message in messages -%}\
{%- if message.role == 'system' -%}{%- set ns.system = ns.system + (message.content | trim_ascii) -%}\
{%- else -%}\
{%- set role = 'model' if message.role == 'assistant' else message.role -%}\
{{- '<start_of_turn>' + role + '\\n' -}}\
{%- if ns.system != '' and role != 'model' -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}\
{{- (message.content | trim_ascii) + '<end_of_turn>\\n' -}}\
{%- endif -%}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}";

const LLAMA3: &str = "{%- for message in messages -%}\
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content | trim_ascii) + '<|eot_id|>' -}}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}";

pub(crate) const BUILTINS: &[Builtin] = &[
    Builtin {
        name: "chatml",
        source: CHATML,
        stops: &["<|im_end|>"],
    },
    Builtin {
        name: "llama2",
        source: LLAMA2,
        stops: &["</s>"],
    },
    Builtin {
        name: "llama2-sys",
        source: LLAMA2_SYS,
        stops: &["</s>"],
    },
    Builtin {
        name: "llama2-sys-bos",
        source: LLAMA2_SYS_BOS,
        stops: &["</s>"],
    },
    Builtin {
        name: "llama2-sys-strip",
        source: LLAMA2_SYS_STRIP,
        stops: &["</s>"],
    },
    Builtin {
        name: "llama3",
        source: LLAMA3,
        stops: &["<|eot_id|>"],
    },
    // llama.cpp has no template called "mistral": the name falls through its
    // detection to the plain llama2 format, and so it does here.
    Builtin {
        name: "mistral",
        source: LLAMA2,
        stops: &["</s>"],
    },
    Builtin {
        name: "mistral-v1",
        source: MISTRAL_V1,
        stops: &["</s>"],
    },
    Builtin {
        name: "mistral-v3",
        source: MISTRAL_V3,
        stops: &["</s>"],
    },
    Builtin {
        name: "mistral-v3-tekken",
        source: MISTRAL_V3_TEKKEN,
        stops: &["</s>"],
    },
    Builtin {
        name: "mistral-v7",
        source: MISTRAL_V7,
        stops: &["</s>"],
    },
    Builtin {
        name: "mistral-v7-tekken",
        source: MISTRAL_V7_TEKKEN,
        stops: &["</s>"],
    },
    Builtin {
        name: "zephyr",
        source: ZEPHYR,
        stops: &["<|endoftext|>", "</s>"],
    },
    Builtin {
        name: "gemma",
        source: GEMMA,
        stops: &["<end_of_turn>"],
    },
    Builtin {
        name: "phi3",
        source: PHI3,
        stops: &["<|end|>"],
    },
];

pub(crate) fn find(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.name == name)
}
