#!/usr/bin/env python3
"""Record llama.cpp reference outputs for the synthetic-model parity tests.

The models are the random-weight GGUFs of scripts/make-synthetic-models.py (llama
with Llama-3 rope factors, qwen3, qwen3moe, gemma2, phi3, gemma3, gpt-oss). This script first
rebuilds them into models/synthetic/ (they are deterministic), then, for each model and
each of 4 prompts, stores llama.cpp's prompt tokens, its greedy continuation (32 tokens,
stopping early only at an end-of-generation token), for every step the top-20
(id, logit) pairs and the log-sum-exp of the full logits vector, and the full
first-step logits as little-endian f32 (the vocab has 32256 tokens, so 126 KiB per
prompt). Output in tests/fixtures/synthetic/:

    <arch>.json                  model path under models/, its sha256 (and the numpy and
                                 gguf-py versions that built it), the cases
    <arch>-case<N>-logits.f32    full first-step logits of prompt N
    <arch>-kv.json               for the architectures in KV_TYPES: with each pair of
                                 quantized KV cache types, the SHA-256 of the full logits
                                 (little-endian f32) of 16 greedy steps per prompt

A test rebuilds the model with make-synthetic-models.py, checks its sha256 against
the JSON (a mismatch means a different numpy/gguf-py changed the bytes, not that the
engine is wrong), and compares. The prompts are long enough, with the continuation,
to cross the 16-token sliding window of gemma2, gemma3 and gpt-oss; prompt 2 crosses it inside
the prompt batch.

llama.cpp is used through the llama-cpp-python 0.3.36 bindings of the same sdist whose
vendored llama.cpp is built with cmake (shared libraries), as
scripts/build-llama-cpp.sh does:

    LLAMA_CPP_LIB_PATH=$HOME/.cache/rustorch/lcpp-build/bin \\
    PYTHONPATH=$HOME/.cache/rustorch/llama_cpp_python-0.3.36 \\
    python3 scripts/record_synthetic_fixtures.py [ARCH ...]

Settings are those of scripts/record_parity_fixtures.py: n_ctx 512, n_batch 512,
logits for every prompt token, f16 KV cache, flash attention on, 2 threads.
"""
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys

import numpy as np
import llama_cpp
from llama_cpp import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "synthetic")
MODEL_DIR = os.path.join(ROOT, "models", "synthetic")


def load_generator():
    path = os.path.join(ROOT, "scripts", "make-synthetic-models.py")
    spec = importlib.util.spec_from_file_location("make_synthetic_models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village nestled between two mountains, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning, a stranger arrived "
    "carrying a broken pocket watch and",
    "1, 2, 3, 4, 5,",
]

N_PREDICT = 32
TOP = 20

# quantized KV caches (type_k, type_v) recorded per architecture, for 16 greedy steps
KV_TYPES = {"gpt-oss": [("q8_0", "q8_0"), ("q4_0", "q8_0")]}
KV_STEPS = 16


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


def open_model(path, **extra):
    """The model with the recording settings: 512 cells, one batch, 2 threads, every
    position's logits, flash attention (`extra`: KV cache types)."""
    return Llama(
        model_path=path,
        n_ctx=512,
        n_batch=512,
        n_threads=2,
        logits_all=True,
        flash_attn=True,
        verbose=False,
        **extra,
    )


def record(arch, path):
    llm = open_model(path)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    cases = []
    for ci, prompt in enumerate(PROMPTS):
        llm.reset()
        tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        llm.eval(tokens)
        steps, cont = [], []
        for step in range(N_PREDICT):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            if step == 0:
                logits.astype("<f4").tofile(os.path.join(OUT, f"{arch}-case{ci}-logits.f32"))
            steps.append({"top": top_k(logits, TOP), "lse": lse(logits)})
            tok = int(np.argmax(logits))
            cont.append(tok)
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                break
            llm.eval([tok])
        cases.append({"prompt": prompt, "tokens": list(map(int, tokens)), "continuation": cont, "steps": steps})
        margins = [s["top"][0][1] - s["top"][1][1] for s in steps]
        print(
            f"{arch} case {ci}: {len(tokens)} prompt tokens, {len(cont)} generated, "
            f"top-2 margin min {min(margins):.3f} median {float(np.median(margins)):.3f}, "
            f"{sum(m < 0.05 for m in margins)} steps under 0.05",
            file=sys.stderr,
        )
    doc = {
        "model": os.path.relpath(path, os.path.join(ROOT, "models")),
        "sha256": sha256(path),
        "generator": "scripts/make-synthetic-models.py",
        "generator_versions": {"numpy": np.__version__, "gguf": importlib.metadata.version("gguf")},
        "n_vocab": llm.n_vocab(),
        "n_ctx": 512,
        "llama_cpp": "llama-cpp-python 0.3.36 vendored llama.cpp, flash_attn on, f16 KV, n_threads 2",
        # llama.cpp is built for this CPU (-march=native): with AVX512-FP16 its attention
        # accumulates in native f16, without it in f32; the tests reproduce the one recorded
        "avx512fp16": "avx512_fp16" in open("/proc/cpuinfo").read().split(),
        "cases": cases,
    }
    with open(os.path.join(OUT, f"{arch}.json"), "w") as f:
        json.dump(doc, f, separators=(",", ":"))


def record_kv(arch, path):
    """Per pair of KV_TYPES[arch]: for each prompt, the SHA-256 of the full logits of
    KV_STEPS greedy steps (the prompt as one batch, then one token at a time)."""
    ggml = {"q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    types = {}
    for tk, tv in KV_TYPES[arch]:
        llm = open_model(path, type_k=ggml[tk], type_v=ggml[tv])
        cases = []
        for prompt in PROMPTS:
            llm.reset()
            tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
            llm.eval(tokens)
            steps = []
            for _ in range(KV_STEPS):
                logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
                steps.append(hashlib.sha256(logits.astype("<f4").tobytes()).hexdigest())
                llm.eval([int(np.argmax(logits))])
            cases.append({"tokens": list(map(int, tokens)), "steps": steps})
        types[f"{tk}-{tv}"] = cases
    doc = {
        "model": os.path.relpath(path, os.path.join(ROOT, "models")),
        "sha256": sha256(path),
        "llama_cpp": "llama-cpp-python 0.3.36 vendored llama.cpp, flash_attn on, n_threads 2",
        "avx512fp16": "avx512_fp16" in open("/proc/cpuinfo").read().split(),
        "steps": KV_STEPS,
        "types": types,
    }
    with open(os.path.join(OUT, f"{arch}-kv.json"), "w") as f:
        json.dump(doc, f, separators=(",", ":"))


def main():
    gen = load_generator()
    archs = sys.argv[1:] or list(gen.SPECS)
    unknown = [a for a in archs if a not in gen.SPECS]
    if unknown:
        sys.exit(f"unknown architecture(s) {', '.join(unknown)}; known: {', '.join(gen.SPECS)}")
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(MODEL_DIR, exist_ok=True)
    tokenizer = gen.read_tokenizer(gen.VOCAB)
    for arch in archs:
        path = gen.build(arch, MODEL_DIR, tokenizer)
        record(arch, path)
        if arch in KV_TYPES:
            record_kv(arch, path)


if __name__ == "__main__":
    main()
