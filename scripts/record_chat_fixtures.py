#!/usr/bin/env python3
"""Record the chat-template fixtures that crates/rustorch-llm/tests/chat_templates.rs
compares against.

Two kinds of fixture land in tests/fixtures/chat/:

1. `<model>.json` for each model below: its `tokenizer.chat_template` (read with
   gguf-py's GGUFReader), the text of its BOS and EOS tokens, and the template
   rendered with Python's jinja2 exactly the way Hugging Face transformers renders
   chat templates (`ImmutableSandboxedEnvironment(trim_blocks=True,
   lstrip_blocks=True)` with the loop-controls extension, `raise_exception`,
   `strftime_now`, transformers' `tojson`, and `messages`, `tools=None`,
   `documents=None`, `add_generation_prompt`, `bos_token`, `eos_token` in the
   context) for a set of conversations, each with and without the generation prompt.
   A model whose GGUF has no template (gemma-3-270m) is recorded with `"template":
   null`, the built-in format of its family (`"builtin": "gemma"`) and llama.cpp's
   rendering of that format. (llama.cpp itself falls back to chatml for a GGUF
   without a template.)

2. `features.json`: small templates exercising what HF templates rely on (whitespace
   control under trim_blocks/lstrip_blocks, Python string and dict methods, loop
   controls, `tojson`, `namespace`, printing None/True, `raise_exception`), rendered
   with the same jinja2 setup; an entry whose template raises records the message.

3. `builtins.json`: llama.cpp's own rendering (`llama_chat_apply_template` in
   libllama, called through ctypes) of the same conversations for every built-in
   template name rustorch offers, so the jinja versions in
   crates/rustorch-llm/src/chat/builtin.rs are checked against the C++ code.

Usage (from the repository root):

    python3 scripts/record_chat_fixtures.py [--lib DIR_WITH_LIBLLAMA]

Needs jinja2 (3.1.6 was used) and gguf (0.19). libllama comes from
scripts/build-llama-cpp.sh ($LLAMA_CPP_LIB_PATH or ~/.cache/rustorch/lcpp-build/bin);
without it the llama.cpp renderings are skipped and the committed ones are kept.
Models that are absent are skipped; their committed fixtures are left as they are.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gguf import GGUFReader

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat"
MODELS = [
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-instruct-q4km.gguf",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m-q4_k_m.gguf",
]
# The built-in format of the family of a model whose GGUF has no template.
FALLBACK_BUILTIN = {"gemma-3-270m-q4_k_m.gguf": "gemma"}
BUILTINS = [
    "chatml",
    "llama2",
    "llama2-sys",
    "llama2-sys-bos",
    "llama2-sys-strip",
    "llama3",
    "mistral",
    "mistral-v1",
    "mistral-v3",
    "mistral-v3-tekken",
    "mistral-v7",
    "mistral-v7-tekken",
    "zephyr",
    "gemma",
    "phi3",
]

SPECIAL = (
    "  Line one\nLine two\n\n\tindented \"double\" 'single' \\backslash\\ "
    "{{ not a tag }} {% not a block %} <b>html</b> & ünïcödé 日本語 🙂 Ω\r\nend\u00a0 \n"
)

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello! What is 2 + 2?"}],
    "system_user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colors."},
    ],
    "three_turns": [
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    "system_three_turns": [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Arr, ahoy matey!"},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    "special_chars": [
        {"role": "system", "content": " Be careful\twith   spaces. \n"},
        {"role": "user", "content": SPECIAL},
        {"role": "assistant", "content": "\n Sure: «quotes» — dash… 中文 \u00a0\n"},
        {"role": "user", "content": "Again:\n" + SPECIAL},
    ],
}


# ---------------------------------------------------------------------------
# transformers' jinja2 setup (transformers/utils/chat_template_utils.py)
# ---------------------------------------------------------------------------


class AssistantTracker(Extension):
    """transformers' `{% generation %}` tag; it only renders its body here."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def hf_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render_hf(source: str, messages, add_generation_prompt: bool, bos: str, eos: str) -> str:
    template = hf_environment().from_string(source)
    return template.render(
        messages=messages,
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos,
        eos_token=eos,
    )


FEATURE_MESSAGES = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Hello, wörld! <tag> & \"quotes\"\n"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "a,b,,c"},
]

FEATURES = {
    "whitespace": (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "        U:{{ m.content }}\n"
        "    {% else %}\n"
        "        O:{{ m.role }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{%- if add_generation_prompt %}  GEN  {% endif %}\n"
    ),
    "string_methods": (
        "[{{ messages[0].content.strip() }}][{{ messages[0].content.lstrip() }}]"
        "[{{ messages[0].content.rstrip() }}][{{ messages[1].content.upper() }}]"
        "[{{ messages[1].content.lower() }}][{{ messages[1].content.startswith('Hello') }}]"
        "[{{ messages[1].content.endswith('x') }}][{{ messages[3].content.split(',') | join('|') }}]"
        "[{{ messages[1].content.replace('l', 'L') }}][{{ messages[2].content.strip('.') }}]"
        "[{{ messages[1].content.split() | length }}][{{ messages[3].content.split(',', 1) | join('|') }}]"
    ),
    "dict_methods": (
        "{% for k, v in messages[2].items() %}{{ k }}={{ v }};{% endfor %}"
        "{{ messages[2].keys() | list | join(',') }}|{{ messages[2].get('role') }}|{{ messages[2].get('missing', 'dflt') }}"
    ),
    "loop_controls": (
        "{% for m in messages %}{% if loop.index0 == 0 %}{% continue %}{% endif %}"
        "{% if m.role == 'assistant' %}{% break %}{% endif %}{{ loop.index }}:{{ m.role }} {% endfor %}"
    ),
    "tojson": (
        "{{ messages[2] | tojson }}\n{{ messages[1] | tojson }}\n{{ messages[:2] | tojson(indent=2) }}\n"
        "{{ {'b': 1, 'a': [1.5, none, true, false, 'x'], 'c': {}} | tojson }}\n"
        "{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}\n{{ messages[1].content | tojson(ensure_ascii=true) }}\n"
        "{{ [1, 2] | tojson(separators=(',', ':')) }}\n{{ 'tab\there\x01' | tojson }}"
    ),
    "python_values": "{{ none }}|{{ true }}|{{ false }}|{{ tools }}|{{ documents is none }}|{{ tools is none }}|{{ 1.0 }}|{{ 3 }}",
    "namespace_and_slices": (
        "{% set ns = namespace(n=0, sys='') %}{% for m in messages %}{% if m.role == 'system' %}"
        "{% set ns.sys = m.content | trim %}{% else %}{% set ns.n = ns.n + 1 %}{% endif %}{% endfor %}"
        "{{ ns.n }}/{{ messages | length }}/{{ ns.sys }}/{{ messages[-1].content }}/"
        "{{ messages[1:] | map(attribute='role') | join(',') }}/{{ messages[0].content is string }}/"
        "{{ 'yes' if add_generation_prompt else 'no' }}/{{ bos_token }}/{{ eos_token }}"
        "{% if messages[0].tool_calls is defined %}DEF{% endif %}{{ messages | selectattr('role', 'equalto', 'user') | list | length }}"
    ),
    "raise_on_assistant_first": (
        "{% if messages[2].role == 'assistant' %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}ok"
    ),
}


def features() -> dict:
    out = {}
    for name, source in FEATURES.items():
        entry = {"template": source, "messages": FEATURE_MESSAGES, "add_generation_prompt": True,
                 "bos_token": "<s>", "eos_token": "</s>"}
        try:
            entry["expected"] = render_hf(source, FEATURE_MESSAGES, True, "<s>", "</s>")
        except jinja2.exceptions.TemplateError as e:
            entry["error"] = str(e)
        out[name] = entry
    return out


# ---------------------------------------------------------------------------
# llama.cpp's built-in templates, through libllama
# ---------------------------------------------------------------------------


class ChatMessage(ctypes.Structure):
    _fields_ = [("role", ctypes.c_char_p), ("content", ctypes.c_char_p)]


def load_libllama(lib_dir: str | None):
    candidates = []
    if lib_dir:
        candidates.append(Path(lib_dir))
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        candidates.append(Path(os.environ["LLAMA_CPP_LIB_PATH"]))
    candidates.append(Path.home() / ".cache" / "rustorch" / "lcpp-build" / "bin")
    for d in candidates:
        path = d / "libllama.so"
        if path.exists():
            lib = ctypes.CDLL(str(path))
            lib.llama_chat_apply_template.argtypes = [
                ctypes.c_char_p,
                ctypes.POINTER(ChatMessage),
                ctypes.c_size_t,
                ctypes.c_bool,
                ctypes.c_char_p,
                ctypes.c_int32,
            ]
            lib.llama_chat_apply_template.restype = ctypes.c_int32
            return lib, path
    return None, None


def render_llama_cpp(lib, name: str, messages, add_generation_prompt: bool) -> str:
    # keep the encoded strings alive while the C call reads them
    encoded = [(m["role"].encode(), m["content"].encode()) for m in messages]
    arr = (ChatMessage * len(encoded))(*[ChatMessage(r, c) for r, c in encoded])
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lib.llama_chat_apply_template(name.encode(), arr, len(encoded), add_generation_prompt, buf, size)
        if n < 0:
            raise RuntimeError(f"llama_chat_apply_template({name!r}) failed: {n}")
        if n <= size:
            return buf.raw[:n].decode("utf-8")
        size = n + 1


# ---------------------------------------------------------------------------


def field(reader: GGUFReader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def cases(render) -> list[dict]:
    out = []
    for name, messages in CONVERSATIONS.items():
        for add in (False, True):
            out.append(
                {
                    "name": f"{name}{'_gen' if add else ''}",
                    "messages": messages,
                    "add_generation_prompt": add,
                    "expected": render(messages, add),
                }
            )
    return out


def write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)} ({len(data.get('cases', data.get('templates', [])))} entries)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", help="directory holding libllama.so")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    lib, lib_path = load_libllama(args.lib)
    if lib is None:
        print("note: libllama.so not found; llama.cpp renderings are skipped", file=sys.stderr)

    for model in MODELS:
        path = ROOT / "models" / model
        if not path.exists():
            print(f"note: {model} absent, its fixture is left as it is", file=sys.stderr)
            continue
        reader = GGUFReader(path)
        tokens = field(reader, "tokenizer.ggml.tokens") or []

        def token(key):
            i = field(reader, key)
            return tokens[i] if i is not None and i < len(tokens) else ""

        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        source = field(reader, "tokenizer.chat_template")
        stem = model.removesuffix(".gguf")
        if source is not None:
            data = {
                "model": model,
                "renderer": f"jinja2 {jinja2.__version__}, transformers settings",
                "template": source,
                "builtin": None,
                "bos_token": bos,
                "eos_token": eos,
                "cases": cases(lambda m, add: render_hf(source, m, add, bos, eos)),
            }
        else:
            builtin = FALLBACK_BUILTIN.get(model)
            if builtin is None or lib is None:
                print(f"note: {model} has no template and no llama.cpp to render a fallback", file=sys.stderr)
                continue
            data = {
                "model": model,
                "renderer": "llama.cpp llama_chat_apply_template",
                "template": None,
                "builtin": builtin,
                "bos_token": bos,
                "eos_token": eos,
                "cases": cases(lambda m, add: render_llama_cpp(lib, builtin, m, add)),
            }
        write(OUT / f"{stem}.json", data)

    write(OUT / "features.json", {"renderer": f"jinja2 {jinja2.__version__}, transformers settings",
                                  "templates": features()})

    if lib is not None:
        data = {
            "renderer": "llama.cpp llama_chat_apply_template",
            "templates": {
                name: cases(lambda m, add, name=name: render_llama_cpp(lib, name, m, add)) for name in BUILTINS
            },
        }
        write(OUT / "builtins.json", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
