#!/usr/bin/env python3
"""Record llama.cpp's greedy chat answers and rendered prompt tokens.

Runs `llama-completion -cnv -st --jinja --temp 0 --verbose-prompt` (the vendored
llama.cpp of llama-cpp-python 0.3.36, built by scripts/build-llama-cpp.sh) for a few
(model, system message, question) cases and stores the prompt token ids it printed and
the answer it wrote to stdout in tests/fixtures/chat_answers.json. The CLI test
`crates/rustorch-cli/tests/run_chat_parity.rs` runs `rustorch run --chat` on the same
cases and requires identical tokens and text.

    python3 scripts/record_chat_answers.py [LLAMA_BIN_DIR]
"""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/rustorch/lcpp-build/bin")
Q = "What is the capital of France?"
SYS = "You are a helpful assistant."
N_PREDICT = 64
CASES = [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", SYS, Q),
    ("SmolLM2-135M-Instruct.Q4_1.gguf", None, Q),
    ("SmolLM2-135M-Instruct.Q4_1.gguf", SYS, "Write a haiku about the sea."),
    ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", None, Q),
    ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", SYS, Q),
    ("qwen2.5-coder-0.5b-instruct-q4km.gguf", None, "Write a Python function that adds two numbers."),
]
TOKEN_LINE = re.compile(r"^\S+ I\s+(\d+) -> '")


def run(model, system, prompt):
    cmd = [os.path.join(BIN, "llama-completion"), "-m", os.path.join(ROOT, "models", model),
           "-cnv", "-st", "--jinja", "--temp", "0", "-n", str(N_PREDICT), "-t", "2",
           "--verbose-prompt", "--no-display-prompt", "-p", prompt]
    if system is not None:
        cmd += ["-sys", system]
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
    err = r.stderr.decode("utf-8", "replace").splitlines()
    tokens = []
    started = False
    for line in err:
        if "number of tokens in prompt" in line:
            started = True
            continue
        if started:
            m = TOKEN_LINE.match(line)
            if m:
                tokens.append(int(m.group(1)))
            elif "sampler seed" in line:
                break
    out = r.stdout.decode("utf-8")
    out = out.split(" [end of text]")[0]
    return tokens, out.strip("\n")


def main():
    results = []
    for model, system, prompt in CASES:
        tokens, answer = run(model, system, prompt)
        print(f"{model} sys={system is not None}: {len(tokens)} tokens -> {answer[:60]!r}", file=sys.stderr)
        results.append({"model": model, "system": system, "prompt": prompt, "n_predict": N_PREDICT,
                        "prompt_tokens": tokens, "answer": answer})
    with open(os.path.join(ROOT, "tests", "fixtures", "chat_answers.json"), "w") as f:
        json.dump(results, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
