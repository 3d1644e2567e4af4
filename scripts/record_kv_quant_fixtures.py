#!/usr/bin/env python3
"""Record llama.cpp reference outputs for the quantized KV cache tests (-ctk / -ctv).

For each model, each pair of cache types and each of 4 prompts this stores llama.cpp's
prompt tokens, its greedy continuation (32 tokens, stopping early only at an
end-of-generation token) and, for every step, the top-5 (id, logit) pairs, the
log-sum-exp of the full logits vector and the SHA-256 of the full logits vector as
little-endian f32 (so the test can check every step bit for bit without storing the
vectors). Output: tests/fixtures/kv_quant/<model>-<type_k>-<type_v>.json. It also records
a shift of cached keys (a prompt, its cells from a position on moved by a delta, then greedy
decoding) per pair in SHIFTS: <model>-<type_k>-<type_v>-shift.json; and llama-perplexity's
saved log-probabilities (SHA-256) with quantized caches: perplexity.json.

Settings are those of scripts/record_parity_fixtures.py (n_ctx 512, n_batch 512, logits
for every prompt token, 2 threads, flash attention on: llama.cpp needs it for a quantized
V cache) with the cache types set through the context parameters `type_k` / `type_v`.
llama.cpp then also applies its Hadamard rotation to queries/keys (quantized K) and
values/output (quantized V); LLAMA_ATTN_ROT_DISABLE must not be set.

llama.cpp is used through the llama-cpp-python 0.3.36 bindings of the same sdist whose
vendored llama.cpp is built with cmake (shared libraries), as scripts/build-llama-cpp.sh
does:

    LLAMA_CPP_LIB_PATH=$HOME/.cache/rustorch/lcpp-build/bin \\
    PYTHONPATH=$HOME/.cache/rustorch/llama_cpp_python-0.3.36 \\
    python3 scripts/record_kv_quant_fixtures.py [MODEL_KEY ...]
"""
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import llama_cpp
from llama_cpp import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "kv_quant")

MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen05": "qwen2.5-coder-0.5b-instruct-q4km.gguf",
}

TYPES = {
    "f32": llama_cpp.GGML_TYPE_F32,
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
    "q4_1": llama_cpp.GGML_TYPE_Q4_1,
    "q5_0": llama_cpp.GGML_TYPE_Q5_0,
    "q5_1": llama_cpp.GGML_TYPE_Q5_1,
    "iq4_nl": llama_cpp.GGML_TYPE_IQ4_NL,
}

# (type_k, type_v) per model: the two the issue asks for on both models, and on SmolLM2 the
# other types and mixed pairs (Q8_1 queries, f16 keys with quantized values and the
# reverse, f32 cast to f16)
PAIRS = {
    "smollm2": [
        ("q8_0", "q8_0"),
        ("q4_0", "q4_0"),
        ("q4_1", "q5_1"),
        ("q5_0", "iq4_nl"),
        ("f16", "q8_0"),
        ("q4_0", "f16"),
        ("f32", "f32"),
    ],
    "qwen05": [("q8_0", "q8_0"), ("q4_0", "q4_0")],
}

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    # long enough (more than 64 tokens) that the prompt batch would take llama.cpp's tiled
    # flash attention with an f16 cache; quantized types never do
    "Once upon a time, in a small village nestled between two mountains, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning, a stranger arrived "
    "carrying a broken pocket watch that had stopped at midnight, and asked the clockmaker to "
    "make it run again before the first snow of the season fell on the village square, because",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]

N_PREDICT = 32
TOP = 5


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def top_k(logits, k):
    idx = np.argsort(-logits, kind="stable")[:k]
    return [[int(i), float(logits[i])] for i in idx]


def lse(logits):
    m = float(np.max(logits))
    return m + float(np.log(np.sum(np.exp(logits.astype(np.float64) - m))))


def record(key, fname, tk, tv, prompts=PROMPTS, n_ctx=512, n_predict=N_PREDICT, suffix=""):
    path = os.path.join(ROOT, "models", fname)
    llm = Llama(
        model_path=path,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=2,
        logits_all=True,
        flash_attn=True,
        type_k=TYPES[tk],
        type_v=TYPES[tv],
        verbose=False,
    )
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    cases = []
    for ci, prompt in enumerate(prompts):
        llm.reset()
        tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        llm.eval(tokens)
        steps, cont = [], []
        for step in range(n_predict):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            steps.append(
                {
                    "top": top_k(logits, TOP),
                    "lse": lse(logits),
                    "sha256": hashlib.sha256(logits.astype("<f4").tobytes()).hexdigest(),
                }
            )
            tok = int(np.argmax(logits))
            cont.append(tok)
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                break
            llm.eval([tok])
        cases.append({"prompt": prompt, "tokens": list(map(int, tokens)), "continuation": cont, "steps": steps})
        print(f"{key} K {tk} V {tv} case {ci}: {len(tokens)} prompt tokens, {len(cont)} generated", file=sys.stderr)
    doc = {
        "model": fname,
        "sha256": sha256_file(path),
        "n_vocab": llm.n_vocab(),
        "type_k": tk,
        "type_v": tv,
        "n_ctx": n_ctx,
        "llama_cpp": f"llama-cpp-python 0.3.36 vendored llama.cpp, flash_attn on, n_ctx = n_batch = n_ubatch = {n_ctx}, n_threads 2",
        # llama.cpp is built for this CPU (-march=native): with AVX512-FP16 its f16 attention
        # accumulator is native f16, without it f32 (see tests/parity.rs)
        "avx512fp16": "avx512_fp16" in open("/proc/cpuinfo").read().split(),
        "cases": cases,
    }
    with open(os.path.join(OUT, f"{key}-{tk}-{tv}{suffix}.json"), "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    del llm


# one prompt of over 512 tokens as one batch, then decoding over more than 512 cells: with an
# f16 cache llama.cpp would take its tiled and then its split-KV algorithm here; with a
# quantized one it stays with the one-row algorithm
LONG = [("smollm2", "q8_0", "q8_0")]
LONG_PROMPT = " ".join(PROMPTS[:3]) * 7


# key shifts: (model, type_k, type_v); f16 is the control
SHIFTS = [
    ("smollm2", "f16", "f16"),
    ("smollm2", "q8_0", "q8_0"),
    ("smollm2", "q4_0", "q4_0"),
    ("qwen05", "q8_0", "q8_0"),
]
# under 64 tokens, so that the f16 control's prompt batch is not llama.cpp's tiled algorithm
SHIFT_PROMPT = (
    "Once upon a time, in a small village nestled between two mountains, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning,"
)
SHIFT_FROM = 4
SHIFT_DELTA = 16
SHIFT_STEPS = 16


def record_shift(key, fname, tk, tv):
    """Cached keys moved to other positions: the prompt evaluated, then the cells from
    position FROM on moved by DELTA (llama_memory_seq_add, whose keys llama.cpp re-rotates
    at the next decode: for a quantized type decoded, un-rotated, RoPE'd, rotated and
    encoded again), then greedy decoding after them. (A shift that first removes cells, as
    llama-cli's context shift does, lets llama.cpp put the next tokens into the freed cells,
    before the moved ones; attention then visits cells in another order than ours and the
    results differ by rounding, f16 caches too. Moving cells without removing any keeps
    the order, so this checks the re-rotation itself.)"""
    path = os.path.join(ROOT, "models", fname)
    llm = Llama(
        model_path=path,
        n_ctx=512,
        n_batch=512,
        n_threads=2,
        logits_all=True,
        flash_attn=True,
        type_k=TYPES[tk],
        type_v=TYPES[tv],
        verbose=False,
    )
    tokens = llm.tokenize(SHIFT_PROMPT.encode("utf-8"), add_bos=True, special=True)
    llm.eval(tokens)
    first = int(np.argmax(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)))
    mem = llama_cpp.llama_get_memory(llm.ctx)
    llama_cpp.llama_memory_seq_add(mem, 0, SHIFT_FROM, -1, SHIFT_DELTA)
    # Llama.eval places the next token at n_tokens (and removes cells from there on)
    llm.n_tokens = len(tokens) + SHIFT_DELTA
    steps, cont, tok = [], [first], first
    for _ in range(SHIFT_STEPS):
        llm.eval([tok])
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        steps.append(
            {
                "top": top_k(logits, TOP),
                "lse": lse(logits),
                "sha256": hashlib.sha256(logits.astype("<f4").tobytes()).hexdigest(),
            }
        )
        tok = int(np.argmax(logits))
        cont.append(tok)
    doc = {
        "model": fname,
        "sha256": sha256_file(path),
        "n_vocab": llm.n_vocab(),
        "type_k": tk,
        "type_v": tv,
        "llama_cpp": "llama-cpp-python 0.3.36 vendored llama.cpp, flash_attn on, n_ctx 512, n_batch 512, n_threads 2",
        "avx512fp16": "avx512_fp16" in open("/proc/cpuinfo").read().split(),
        "tokens": list(map(int, tokens)),
        "from": SHIFT_FROM,
        "delta": SHIFT_DELTA,
        # continuation[0] follows the prompt (computed before the shift); steps[i] are the
        # logits after feeding continuation[i] at position len(tokens) + delta + i
        "continuation": cont,
        "steps": steps,
    }
    with open(os.path.join(OUT, f"{key}-{tk}-{tv}-shift.json"), "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    print(f"{key} K {tk} V {tv} shift: {len(tokens)} prompt tokens, {len(cont)} generated", file=sys.stderr)
    del llm


BIN = os.path.join(os.environ.get("RUSTORCH_CACHE", os.path.expanduser("~/.cache/rustorch")),
                   "lcpp-build", "bin")
# llama-perplexity with quantized caches and its default micro-batches (512): an f16 cache
# would take llama.cpp's tiled flash attention for these 128-row sequences, a quantized one
# does not, so the saved log-probabilities compare exactly
PPL_TYPES = [("q8_0", "q8_0"), ("q4_0", "q4_0")]
PPL_ARGS = ["-c", "128", "--chunks", "2", "-t", "2"]


def record_perplexity():
    """SHA-256 of llama-perplexity's --kl-divergence-base file (every scored position's
    log-probabilities) and its final estimate, per pair of cache types."""
    model = os.path.join(ROOT, "models", MODELS["smollm2"])
    text = os.path.join(ROOT, "tests", "fixtures", "kld", "text.txt")
    runs = []
    for tk, tv in PPL_TYPES:
        with tempfile.TemporaryDirectory() as d:
            base = os.path.join(d, "base.bin")
            r = subprocess.run(
                [os.path.join(BIN, "llama-perplexity"), "-m", model, "-f", text] + PPL_ARGS
                + ["-fa", "on", "-ctk", tk, "-ctv", tv, "--kl-divergence-base", base],
                capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=BIN), check=True)
            m = re.search(r"Final estimate: PPL = \S+ \+/- \S+", r.stderr)
            assert m, r.stderr[-2000:]
            runs.append({"type_k": tk, "type_v": tv, "base_sha256": sha256_file(base),
                         "base_bytes": os.path.getsize(base), "final": m.group(0)})
        print(f"perplexity K {tk} V {tv}: {runs[-1]['final']}", file=sys.stderr)
    doc = {
        "model": MODELS["smollm2"],
        "text": "tests/fixtures/kld/text.txt",
        "args": PPL_ARGS,
        "llama_cpp": "llama-perplexity of llama-cpp-python 0.3.36's llama.cpp (scripts/build-llama-cpp.sh), "
                     "-fa on, defaults otherwise (-b 2048, -ub 512)",
        "runs": runs,
    }
    with open(os.path.join(OUT, "perplexity.json"), "w") as f:
        json.dump(doc, f, indent=1)


def main():
    if os.environ.get("LLAMA_ATTN_ROT_DISABLE"):
        sys.exit("unset LLAMA_ATTN_ROT_DISABLE: the fixtures record llama.cpp's default rotation")
    os.makedirs(OUT, exist_ok=True)
    keys = sys.argv[1:] or list(MODELS)
    for k in keys:
        for tk, tv in PAIRS[k]:
            record(k, MODELS[k], tk, tv)
    for k, tk, tv in LONG:
        if k in keys:
            record(k, MODELS[k], tk, tv, [LONG_PROMPT], n_ctx=1024, n_predict=8, suffix="-long")
    for k, tk, tv in SHIFTS:
        if k in keys:
            record_shift(k, MODELS[k], tk, tv)
    if "smollm2" in keys:
        record_perplexity()


if __name__ == "__main__":
    main()
