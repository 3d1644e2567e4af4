#!/usr/bin/env python3
"""Record tokenizer fixtures from llama.cpp itself, for crates/rustorch-llm/tests/tokenizer_models.rs.

For each model below and each text case, runs llama.cpp's `llama-tokenize` (which loads
the vocabulary only) with every combination of --no-parse-special and --no-bos, and
stores the ids, the per-token pieces it prints (`common_token_to_piece(.., special=true)`)
and the special-token ids from its verbose load log, as JSON under
tests/fixtures/tokenizer/<model>.json.

`llama-tokenize` passes `add_special = model_wants_bos && !--no-bos` to `llama_tokenize`,
so each record stores the `add_special` value llama.cpp actually used.

Usage:
    scripts/record_tokenizer_fixtures.py [--bin DIR] [--models DIR] [--out DIR] [MODEL ...]

Defaults: --bin /root/.cache/rustorch/lcpp-build/bin, --models models,
--out tests/fixtures/tokenizer, and the models in MODELS.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

MODELS = [
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-instruct-q4km.gguf",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m-q4_k_m.gguf",
    # No .inp/.out vectors ship for this Unigram (t5) vocabulary; record some here.
    "vocab/ggml-vocab-nomic-bert-moe.gguf",
    # Vocabularies with test vectors, for what those do not cover: special tokens
    # (parse_special), BOS/EOS, Phi-3's rstrip attributes.
    "vocab/ggml-vocab-phi-3.gguf",
    "vocab/ggml-vocab-llama-bpe.gguf",
    "vocab/ggml-vocab-gemma-4.gguf",
    # No test vectors: GPT-NeoX and Aquila have no tokenizer.ggml.pre (llama.cpp's
    # "default" splitting), Baichuan is SentencePiece without one.
    "vocab/ggml-vocab-gpt-neox.gguf",
    "vocab/ggml-vocab-aquila.gguf",
    "vocab/ggml-vocab-baichuan.gguf",
]

CHAT_QWEN = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWrite fizzbuzz in Python.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
CHAT_GEMMA = (
    "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
    "<start_of_turn>model\n4<end_of_turn>\n"
)
CODE = (
    "def fizzbuzz(n):\n"
    "\tfor i in range(1, n + 1):\n"
    "\t\tif i % 15 == 0:\n"
    "\t\t\tprint(\"FizzBuzz\")\n"
    "\t\telif i % 3 == 0: print('Fizz')\n"
    "    # mixed    indentation\r\n"
    "        return {'a': [1, 2, 3], \"b\": None}\n\n\n"
    "fn main() { let x: Vec<u8> = vec![0xff; 3]; println!(\"{x:?}\"); }\n"
)

# (name, text as str, or bytes for input that is not valid UTF-8)
CASES = [
    ("empty", ""),
    ("space", " "),
    ("spaces", "   "),
    ("newline", "\n"),
    ("whitespace_mix", "\t\n  \n\n\n \t\t "),
    ("hello", "Hello world"),
    ("leading_trailing_spaces", "   leading and trailing spaces   "),
    ("digits", "3333+777"),
    ("numbers", "1234567890 3.14159 1e-10 0x1F 100,000.00 ١٢٣ ½"),
    ("contractions", "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"),
    ("punctuation", "Hello, world! ... ?!? -- ''' \"\"\" ``` ((( ))) [[[ ]]] {{{ }}} <<< >>>"),
    ("cjk", "我想在apple工作1314151天～ 日本語のテキスト、カタカナ。한국어 텍스트"),
    ("emoji", "🚀 (normal) 😶\u200d🌫\ufe0f (multiple emojis concatenated) ✅ 🦙🦙 👨\u200d👩\u200d👧\u200d👦 🏳️\u200d🌈"),
    ("combining", "e\u0301 a\u0308 n\u0303 Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d lo\u0319\u0314 \u0915\u094d\u0937\u093f \u0e17\u0e35\u0e48"),
    ("scripts", "Ελληνικά Русский текст العربية עברית ไทย हिन्दी ქართული Ẓ̌ ǅ ﬁ"),
    ("unicode_spaces", "a\u00a0b\u2003c\u3000d\u2028e\u0085f"),
    ("code", CODE),
    ("json_markdown", "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}\n# Title\n\n- item 1\n- item 2\n\n```python\nprint(\"hi\")\n```\n"),
    ("chat_qwen", CHAT_QWEN),
    ("chat_gemma", CHAT_GEMMA),
    ("chat_llama3", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("chat_phi3", "<|system|>\nBe brief.<|end|>\n<|user|>  \n Hi there  <|end|>\n<|assistant|>\n"),
    ("strip_attrs", " <mask> x </s>  y <s>  z <unk>\t w"),
    ("special_mentions", "text<|endoftext|>more </s> <s> <unk> <pad> <eos> <|im_start <|im_end|><|im_end|> <tool_call>{}</tool_call>"),
    ("html_like", "<table><tr><td>x</td></tr></table> <b>bold</b> <code>c</code>"),
    ("many_newlines", "a" + "\n" * 40 + "b" + "\n" * 3),
    ("many_spaces", "a" + " " * 40 + "b" + "\t" * 5 + "c"),
    ("repeated", "a" * 300 + " " + "ab " * 100),
    ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism"),
    ("invalid_utf8", b"abc\xff\xfe def \xe4\xb8 end \x80\x80 \xc3"),
    ("overlong_and_surrogate", b"x\xc0\x80y\xed\xa0\x80z"),
]


def run(cmd, stdin=None):
    res = subprocess.run(cmd, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.decode(errors='replace')[-2000:]}")
    return res.stdout, res.stderr


def model_info(tok_bin, model):
    with tempfile.NamedTemporaryFile("wb", delete=False) as f:
        f.write(b"x")
        path = f.name
    try:
        _, err = run([tok_bin, "-m", model, "-f", path, "--no-escape", "-v"])
    finally:
        os.unlink(path)
    log = err.decode("utf-8", errors="replace")
    info = {"eog": []}
    for key, label in [("bos", "BOS"), ("eos", "EOS"), ("eot", "EOT"), ("unk", "UNK"), ("pad", "PAD")]:
        m = re.search(rf"print_info: {label} token\s+= (\d+) ", log)
        info[key] = int(m.group(1)) if m else None
    m = re.search(r"print_info: n_vocab\s+= (\d+)", log)
    info["n_vocab"] = int(m.group(1))
    info["eog"] = sorted({int(x) for x in re.findall(r"print_info: EOG token\s+= (\d+) ", log)})
    return info


def parse_pieces(out, ids):
    """Splits `%6d -> '<piece>'\\n` lines, knowing the ids, into piece bytes."""
    pieces = []
    pos = 0
    for i, tid in enumerate(ids):
        prefix = b"%6d -> '" % tid
        if not out.startswith(prefix, pos):
            return None
        pos += len(prefix)
        if i + 1 < len(ids):
            end = out.find(b"'\n" + (b"%6d -> '" % ids[i + 1]), pos)
        else:
            end = out.rfind(b"'\n")
        if end < 0:
            return None
        pieces.append(out[pos:end])
        pos = end + 2
    return pieces


def tokenize(tok_bin, model, data, parse_special, no_bos):
    with tempfile.NamedTemporaryFile("wb", delete=False) as f:
        f.write(data)
        path = f.name
    try:
        base = [tok_bin, "-m", model, "-f", path, "--no-escape", "--log-disable"]
        if not parse_special:
            base.append("--no-parse-special")
        if no_bos:
            base.append("--no-bos")
        out, _ = run(base + ["--ids"])
        ids = json.loads(out.decode().strip())
        out, _ = run(base)
        pieces = parse_pieces(out, ids)
    finally:
        os.unlink(path)
    return ids, pieces


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="/root/.cache/rustorch/lcpp-build/bin")
    ap.add_argument("--models", default="models")
    ap.add_argument("--out", default="tests/fixtures/tokenizer")
    ap.add_argument("model", nargs="*", default=MODELS)
    args = ap.parse_args()

    tok_bin = os.path.join(args.bin, "llama-tokenize")
    version = run([tok_bin, "--version"])[1].decode(errors="replace").strip().splitlines()[0]
    os.makedirs(args.out, exist_ok=True)

    for name in args.model:
        model = os.path.join(args.models, name)
        if not os.path.exists(model):
            print(f"skip {name}: not found", file=sys.stderr)
            continue
        info = model_info(tok_bin, model)
        add_bos = None
        cases = []
        for case_name, text in CASES:
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            seen = set()
            for parse_special in (True, False):
                for no_bos in (False, True):
                    ids, pieces = tokenize(tok_bin, model, data, parse_special, no_bos)
                    if case_name == "empty" and not no_bos:
                        add_bos = len(ids) > 0
                    add_special = (add_bos is True) and not no_bos
                    key = (parse_special, add_special)
                    if key in seen:
                        continue
                    seen.add(key)
                    rec = {"name": case_name, "parse_special": parse_special, "add_special": add_special}
                    if isinstance(text, bytes):
                        rec["bytes_hex"] = data.hex()
                    else:
                        rec["text"] = text
                    rec["ids"] = ids
                    if pieces is not None:
                        rec["pieces_hex"] = [p.hex() for p in pieces]
                    cases.append(rec)
        doc = {
            "model": name,
            "recorded_with": f"llama-tokenize {version}",
            "add_bos": add_bos,
            **info,
            "cases": cases,
        }
        stem = os.path.basename(name)[: -len(".gguf")]
        path = os.path.join(args.out, stem + ".json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"{path}: {len(cases)} records", file=sys.stderr)


if __name__ == "__main__":
    main()
