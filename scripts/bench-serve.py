#!/usr/bin/env python3
"""Benchmark `rustorch serve`: one stream alone vs many concurrent streams batched.

Starts the server on a free loopback port (or uses --url), then, --rounds times in turn
(so that both phases see the same machine load):
  1. runs each distinct prompt alone (greedy, fixed length) -> single-stream tokens/s
     and the reference text of each prompt;
  2. fires --requests concurrent streaming requests (prompts cycled) -> aggregate
     generated tokens/s, and checks that every stream finished with exactly its
     prompt's reference text (correct and not interleaved with another stream's).
Prints each round, then the medians of both rates and of the rounds' ratios. Standard library only; loopback traffic only,
bounded in count and time. Exit status 1 when a stream is wrong or missing, or
the ratio is below --min-ratio.

  scripts/bench-serve.py                     # -np 8, 32 requests of 64 tokens
  scripts/bench-serve.py --no-prefix-sharing # every prompt evaluated in full
  scripts/bench-serve.py --slots 4 --requests 16 --tokens 32 --threads 2
"""

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms.",
    "List some good habits for staying healthy.",
    "Describe the city of Paris to a tourist.",
    "What are the planets of the solar system?",
    "Give me advice on learning to cook.",
    "Why is the sky blue?",
    "Tell me about the history of the bicycle.",
]


def stream_chat(host, port, prompt, tokens, key, timeout):
    """One streaming chat request; returns (text, completion_tokens, finish, t0, t_first, t_end)."""
    body = json.dumps({
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "max_tokens": tokens, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    })
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, headers)
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    text, n, finish, t_first, done = [], 0, None, None, False
    while True:
        line = r.readline()
        if not line:
            break
        line = line.decode().rstrip("\r\n")
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        if chunk.get("usage"):
            n = chunk["usage"]["completion_tokens"]
        for c in chunk.get("choices", []):
            piece = c.get("delta", {}).get("content")
            if piece:
                if t_first is None:
                    t_first = time.perf_counter()
                text.append(piece)
            if c.get("finish_reason"):
                finish = c["finish_reason"]
    t_end = time.perf_counter()
    conn.close()
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    return "".join(text), n, finish, t0, t_first or t_end, t_end


def start_server(args):
    cmd = [args.bin, "serve", "-m", args.model, "--host", "127.0.0.1", "--port", "0",
           "-np", str(args.slots), "-c", str(args.ctx), "--queue-size", str(args.requests)]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    if args.no_prefix_sharing:
        cmd += ["--no-prefix-sharing"]
    env = {k: v for k, v in os.environ.items() if k != "RUSTORCH_API_KEY"}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    addr = None
    deadline = time.monotonic() + 60
    while addr is None and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        m = re.search(r"listening on http://(\S+)", line)
        if m:
            addr = m.group(1)
    if addr is None:
        proc.kill()
        sys.exit("bench-serve: the server did not start")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + 120
    while True:
        try:
            c = http.client.HTTPConnection(host, int(port), timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            sys.exit("bench-serve: the server never became healthy")
        time.sleep(0.1)
    return proc, host, int(port)


def metric(host, port, key, name):
    c = http.client.HTTPConnection(host, port, timeout=10)
    c.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    body = c.getresponse().read().decode()
    m = re.search(rf"^rustorch_{name} (\S+)$", body, re.M)
    return float(m.group(1)) if m else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="use a running server instead of starting one")
    ap.add_argument("--api-key", default=os.environ.get("RUSTORCH_API_KEY"))
    ap.add_argument("--bin", default=str(ROOT / "target/release/rustorch"))
    ap.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--slots", type=int, default=8, help="-np of the started server")
    ap.add_argument("--ctx", type=int, default=0, help="-c (default: 512 per slot)")
    ap.add_argument("--threads", type=int, default=0, help="-t of the started server")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="distinct prompts used")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternate the single-stream and concurrent phases this many times; "
                         "medians are reported")
    ap.add_argument("--no-prefix-sharing", action="store_true",
                    help="start the server with --no-prefix-sharing (every prompt evaluated in full)")
    ap.add_argument("--min-ratio", type=float, default=0.0,
                    help="fail when aggregate/single is below this")
    args = ap.parse_args()
    args.ctx = args.ctx or 512 * args.slots
    prompts = PROMPTS[: max(1, min(args.prompts, len(PROMPTS)))]

    proc = None
    if args.url:
        u = urlparse(args.url)
        host, port = u.hostname, u.port or 80
        if host not in ("127.0.0.1", "localhost", "::1"):
            sys.exit("bench-serve: loopback servers only")
    else:
        proc, host, port = start_server(args)
    ok = True
    try:
        refs = {}
        singles, single_decodes, aggregates, ratios = [], [], [], []
        for rnd in range(args.rounds):
            # 1. each prompt alone
            rates, decode_rates = [], []
            for p in prompts:
                text, n, finish, t0, tf, te = stream_chat(host, port, p, args.tokens, args.api_key, args.timeout)
                if p in refs and refs[p] != text:
                    ok = False
                    print(f"round {rnd + 1}: the text of {p!r} alone changed between rounds")
                refs.setdefault(p, text)
                rates.append(n / (te - t0))
                if n > 1 and te > tf:
                    decode_rates.append((n - 1) / (te - tf))
            single = statistics.median(rates)
            single_decode = statistics.median(decode_rates) if decode_rates else float("nan")

            # 2. all at once
            steps0 = metric(host, port, args.api_key, "forward_calls_total")
            shared0 = metric(host, port, args.api_key, "prompt_tokens_shared_total")
            prompt0 = metric(host, port, args.api_key, "prompt_tokens_total")
            results = [None] * args.requests
            errors = []

            def worker(i):
                try:
                    results[i] = stream_chat(host, port, prompts[i % len(prompts)], args.tokens,
                                             args.api_key, args.timeout)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(f"request {i}: {e}")

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.requests)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join(args.timeout + 60)
            wall = time.perf_counter() - t0
            steps = metric(host, port, args.api_key, "forward_calls_total") - steps0
            shared = metric(host, port, args.api_key, "prompt_tokens_shared_total") - shared0
            evaluated = metric(host, port, args.api_key, "prompt_tokens_total") - prompt0
            done = [r for r in results if r is not None]
            total = sum(r[1] for r in done)
            wrong = [i for i, r in enumerate(results)
                     if r is None or r[0] != refs[prompts[i % len(prompts)]] or r[1] != args.tokens]
            aggregate = total / wall
            ratio = aggregate / single
            print(f"round {rnd + 1}: single stream {single:8.2f} generated tokens/s end to end "
                  f"(median of {len(prompts)}; {single_decode:.2f} after the first token); "
                  f"{args.requests} concurrent streams (-np {args.slots}) {aggregate:8.2f} tokens/s "
                  f"aggregate ({total} tokens in {wall:.2f} s, {int(steps)} forward passes, "
                  f"{evaluated:.0f} prompt tokens evaluated and {shared:.0f} copied from a request "
                  f"that begins alike); "
                  f"ratio {ratio:.2f}x; finished {len(done)}/{args.requests}, text identical to "
                  f"the stream alone {args.requests - len(wrong)}/{args.requests}")
            singles.append(single)
            single_decodes.append(single_decode)
            aggregates.append(aggregate)
            ratios.append(ratio)
            for e in errors:
                print("error:", e)
            if wrong:
                ok = False
                for i in wrong[:5]:
                    r = results[i]
                    print(f"mismatch in request {i}: got {r[0][:80] if r else None!r} "
                          f"want {refs[prompts[i % len(prompts)]][:80]!r}")
        single = statistics.median(singles)
        aggregate = statistics.median(aggregates)
        ratio = statistics.median(ratios)
        print(f"single stream: {single:8.2f} generated tokens/s end to end (median of {args.rounds} rounds; "
              f"{statistics.median(single_decodes):.2f} tokens/s after the first token), "
              f"{args.tokens} tokens per request")
        print(f"{args.requests} concurrent streams (-np {args.slots}): {aggregate:8.2f} generated tokens/s "
              f"aggregate (median of {args.rounds} rounds)")
        print(f"ratio aggregate / single: {ratio:.2f}x (median of the rounds' ratios)")
        if ratio < args.min_ratio:
            ok = False
            print(f"ratio below --min-ratio {args.min_ratio}")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                code = proc.wait(timeout=30)
                if code != 0:
                    print(f"server exited with {code}")
                    ok = False
            except subprocess.TimeoutExpired:
                proc.kill()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
