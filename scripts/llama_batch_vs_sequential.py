#!/usr/bin/env python3
"""llama.cpp's own batch-versus-one-token-at-a-time difference on a synthetic model: the
44-token prompt of case 2 evaluated as one batch (logits for every token) and one token at
a time, printing the largest logit difference and the positions whose argmax differs. The
sliding-window tests in crates/rustorch-llm/tests/synthetic.rs expect rustorch's to be the
same.

LLAMA_CPP_LIB_PATH=$HOME/.cache/rustorch/lcpp-build/bin \\
PYTHONPATH=$HOME/.cache/rustorch/llama_cpp_python-0.3.36 \\
    python3 scripts/llama_batch_vs_sequential.py gemma2 gemma3 gpt-oss
"""
import json
import os
import sys

import numpy as np
from llama_cpp import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

for arch in sys.argv[1:]:
    fixture = os.path.join(ROOT, "tests", "fixtures", "synthetic", f"{arch}.json")
    toks = json.load(open(fixture))["cases"][2]["tokens"]
    path = os.path.join(ROOT, "models", "synthetic", f"synthetic-{arch}.gguf")
    scores = []
    for n_batch in (512, 1):
        llm = Llama(model_path=path, n_ctx=512, n_batch=n_batch, n_ubatch=n_batch, n_threads=2,
                    logits_all=True, flash_attn=True, verbose=False)
        llm.eval(toks)
        scores.append(np.array(llm.scores[: len(toks)], dtype=np.float32))
    d = float(np.abs(scores[0] - scores[1]).max())
    flips = [i for i in range(len(toks)) if np.argmax(scores[0][i]) != np.argmax(scores[1][i])]
    print(f"{arch}: {len(toks)} tokens, batch vs one at a time max |Δ logit| {d!r}, "
          f"argmax differs at positions {flips}")
