#!/usr/bin/env python3
"""Record llama-tokenize's ids for prompts with escape sequences (its default -e/--escape
processing of -p), for crates/rustorch-cli/tests/escapes_cli.rs.

    python3 scripts/record_escape_fixtures.py   # needs scripts/build-llama-cpp.sh's llama-tokenize
"""
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(os.environ.get("RUSTORCH_CACHE", os.path.expanduser("~/.cache/rustorch")),
                   "lcpp-build", "bin", "llama-tokenize")
VOCABS = ["ggml-vocab-llama-spm.gguf", "ggml-vocab-qwen2.gguf"]
# each escape, unknown escapes, \x with 0, 1, 2 hex digits, strtol's sign and space forms
PROMPTS = [
    "a\\nb", "tab\\there", "cr\\rlf\\n", "q\\\"x\\'y", "back\\\\slash", "hex\\x41\\x7a!",
    "bad\\xZZ", "end\\x4", "end2\\x", "sign\\x-1", "sp\\x 9", "other\\q", "trail\\",
    "multi\\n\\n\\tline", "utf8 \\xc3\\xa9 accent",
]

cases = []
for vocab in VOCABS:
    path = os.path.join(ROOT, "models", "vocab", vocab)
    for p in PROMPTS:
        for escape in (True, False):
            args = [BIN, "-m", path, "-p", p, "--ids", "--log-disable"]
            if not escape:
                args.append("--no-escape")
            out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
            ids = json.loads(out.strip().splitlines()[-1])
            cases.append({"vocab": vocab, "prompt": p, "escape": escape, "ids": ids})
dst = os.path.join(ROOT, "tests", "fixtures", "escapes", "escapes.json")
with open(dst, "w") as f:
    json.dump({"llama_cpp": "llama-tokenize of llama-cpp-python 0.3.36's llama.cpp", "cases": cases}, f, indent=1)
print(f"{len(cases)} cases -> {dst}")
