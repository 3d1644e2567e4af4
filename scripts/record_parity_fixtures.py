#!/usr/bin/env python3
"""Record llama.cpp reference outputs for the forward-pass parity tests.

For each model and each prompt this stores: llama.cpp's prompt tokens, its greedy
continuation (up to 64 tokens, stopping at an end-of-generation token), and for every
step the top-20 (id, logit) pairs and the log-sum-exp of the full logits vector (so
the tests can compute llama.cpp's probabilities of those ids exactly). For the first two
prompts it also stores the full first-step logits as little-endian f32.

llama.cpp is used through the llama-cpp-python 0.3.36 bindings of the same sdist whose
vendored llama.cpp is built with cmake (shared libraries), as
scripts/build-llama-cpp.sh does:

    LLAMA_CPP_LIB_PATH=$HOME/.cache/rustorch/lcpp-build/bin \
    PYTHONPATH=$HOME/.cache/rustorch/llama_cpp_python-0.3.36 \
    python3 scripts/record_parity_fixtures.py [MODEL_KEY ...]

Settings match the llama.cpp command-line defaults: f16 KV cache, flash attention on.
"""
import hashlib
import json
import os
import sys

import numpy as np
import llama_cpp
from llama_cpp import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "parity")

MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen05": "qwen2.5-coder-0.5b-instruct-q4km.gguf",
    "qwen15": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n",
    "The quick brown fox",
    "1, 2, 3, 4, 5,",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Translate to French: Hello, how are you?",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Q: What is 12 * 7?\nA:",
    "The three primary colors are",
    "In machine learning, a transformer is",
    "// C function that reverses a string\n#include <string.h>\n",
]

N_PREDICT = 64
TOP = 20
FULL_LOGITS_CASES = 2


def sha256(path):
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


def record(key, fname):
    path = os.path.join(ROOT, "models", fname)
    llm = Llama(
        model_path=path,
        n_ctx=512,
        n_batch=512,
        n_threads=2,
        logits_all=True,
        flash_attn=True,
        verbose=False,
    )
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    cases = []
    for ci, prompt in enumerate(PROMPTS):
        llm.reset()
        tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        llm.eval(tokens)
        steps, cont = [], []
        for step in range(N_PREDICT):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            if step == 0 and ci < FULL_LOGITS_CASES:
                logits.astype("<f4").tofile(os.path.join(OUT, f"{key}-case{ci}-logits.f32"))
            steps.append({"top": top_k(logits, TOP), "lse": lse(logits)})
            tok = int(np.argmax(logits))
            cont.append(tok)
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                break
            llm.eval([tok])
        cases.append({"prompt": prompt, "tokens": list(map(int, tokens)), "continuation": cont, "steps": steps})
        print(f"{key} case {ci}: {len(tokens)} prompt tokens, {len(cont)} generated", file=sys.stderr)
    doc = {
        "model": fname,
        "sha256": sha256(path),
        "n_vocab": llm.n_vocab(),
        "llama_cpp": "llama-cpp-python 0.3.36 vendored llama.cpp, flash_attn on, f16 KV, n_threads 2",
        # llama.cpp is built for this CPU (-march=native): with AVX512-FP16 its attention
        # accumulates in native f16, without it in f32; the tests reproduce the one recorded
        "avx512fp16": "avx512_fp16" in open("/proc/cpuinfo").read().split(),
        "cases": cases,
    }
    with open(os.path.join(OUT, f"{key}.json"), "w") as f:
        json.dump(doc, f, separators=(",", ":"))


def main():
    os.makedirs(OUT, exist_ok=True)
    keys = sys.argv[1:] or list(MODELS)
    for k in keys:
        record(k, MODELS[k])


if __name__ == "__main__":
    main()
