"""`rustorch serve` shutting down with requests in flight, through the official `openai`
client: nothing is lost.

Each test starts its own server (it is stopped with SIGTERM) with SmolLM2, 8 slots and
8192 tokens of context, opens 8 streams of 400 tokens (`ignore_eos`, so that every one
runs to its limit) and sends SIGTERM once each has its first text:

- with time enough (`--shutdown-timeout 300`) every stream ends with its 400 tokens,
  its last chunk (`finish_reason`), usage and `[DONE]`; meanwhile `/health` and new
  generation requests (OpenAI and Anthropic endpoints) get 503;
- with `--shutdown-timeout 1` they end early, each still with a last chunk carrying
  `finish_reason: "length"`, usage and `[DONE]`;
- the server exits with code 0 in both cases.

Needs `pip install openai pytest` and a release build (`cargo build --release`); run:
`pytest tests/server/test_drain.py`.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
from openai.types.chat import ChatCompletionChunk  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("RUSTORCH_BIN", ROOT / "target" / "release" / "rustorch"))
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = ROOT / "models" / MODEL_NAME
N_STREAMS = 8
N_TOKENS = 400


class Server:
    """`rustorch serve` on a free loopback port, waited for until healthy."""

    def __init__(self, *args):
        if not BIN.is_file():
            pytest.skip(f"{BIN} is not built (cargo build --release)")
        if not MODEL.is_file():
            pytest.skip(f"{MODEL} is absent (scripts/fetch-models.sh)")
        env = {k: v for k, v in os.environ.items() if k != "RUSTORCH_API_KEY"}
        self.proc = subprocess.Popen(
            [str(BIN), "serve", "-m", str(MODEL), "--host", "127.0.0.1", "--port", "0",
             "-np", str(N_STREAMS), "-c", "8192", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=env, text=True,
        )
        self.log = []
        addr = None
        deadline = time.monotonic() + 60
        while addr is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"listening on http://(\S+)", line)
            if m:
                addr = m.group(1)
        if addr is None:
            self.proc.kill()
            pytest.fail("the server did not print its address: " + "".join(self.log))
        # keep reading stderr so the server never blocks on it
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        self.base = f"http://{addr}"
        deadline = time.monotonic() + 120
        while self.health()[0] != 200:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                pytest.fail("the server never became healthy")
            time.sleep(0.1)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0)

    def health(self):
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")
        except OSError:
            return None, None

    def post(self, path, body):
        """(status, headers, JSON body) of a POST."""
        req = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.loads(e.read())

    def wait_exit(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail("the server did not exit: " + "".join(self.log))

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def servers():
    started = []

    def start(*args):
        s = Server(*args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def stream(client, i, first_text):
    """One stream of N_TOKENS tokens, read raw so that `[DONE]` is seen; every chunk
    is validated against the client's own types. Returns (chunks, data lines)."""
    chunks, lines = [], []
    with client.chat.completions.with_streaming_response.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": f"Tell me a long story about the number {i}."}],
        max_tokens=N_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ) as resp:
        assert resp.status_code == 200
        told = False
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            lines.append(data)
            if data == "[DONE]":
                continue
            chunk = ChatCompletionChunk.model_validate(json.loads(data))
            chunks.append(chunk)
            if not told and chunk.choices and chunk.choices[0].delta.content:
                told = True
                first_text.wait()
    return chunks, lines


def run_streams(server):
    """Starts N_STREAMS streams, sends SIGTERM once every one has text; returns a
    function that waits for their results."""
    first_text = threading.Barrier(N_STREAMS + 1, timeout=120)
    results, errors = [None] * N_STREAMS, []

    def run(i):
        try:
            results[i] = stream(server.client, i, first_text)
        except Exception as e:  # reported below, with the server's log
            errors.append(repr(e))
            first_text.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_STREAMS)]
    for t in threads:
        t.start()
    first_text.wait()
    server.proc.send_signal(signal.SIGTERM)

    def join():
        for t in threads:
            t.join(timeout=600)
        assert not errors, f"{errors}\n{''.join(server.log)}"
        return results

    return join


def check_terminal(chunks, lines):
    """The stream ended properly: a last chunk with a finish_reason, the usage chunk,
    then `[DONE]`. Returns (finish_reason, completion_tokens, text)."""
    assert lines[-1] == "[DONE]", lines[-3:]
    assert lines.count("[DONE]") == 1
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None, usage
    last = chunks[-2]
    assert last.choices[0].finish_reason is not None, last
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    return last.choices[0].finish_reason, usage.usage.completion_tokens, text


def test_sigterm_lets_every_stream_finish(servers):
    s = servers("--shutdown-timeout", "300")
    join = run_streams(s)

    # while the streams go on, nothing new is taken
    status, body = s.health()
    assert (status, body) == (503, {"status": "draining"})
    with pytest.raises(openai.APIStatusError) as e:
        s.client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        )
    assert e.value.status_code == 503
    assert e.value.body["code"] == "shutting_down"
    with pytest.raises(openai.APIStatusError) as e:
        s.client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4)
    assert e.value.status_code == 503
    status, headers, body = s.post("/v1/messages", {
        "model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
    })
    assert status == 503
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert headers["Connection"].lower() == "close"
    assert s.proc.poll() is None, "the server exited before its streams ended"

    for chunks, lines in join():
        finish, n, text = check_terminal(chunks, lines)
        assert (finish, n) == ("length", N_TOKENS)
        assert len(text) > N_TOKENS  # SmolLM2's tokens average several characters
    assert s.wait_exit(60) == 0
    log = "".join(s.log)
    assert "every request finished" in log, log


def test_shutdown_timeout_ends_streams_with_a_finish_reason(servers):
    s = servers("--shutdown-timeout", "1")
    t0 = time.monotonic()
    join = run_streams(s)
    results = join()
    assert time.monotonic() - t0 < 60
    for chunks, lines in results:
        finish, n, text = check_terminal(chunks, lines)
        assert finish == "length"
        assert 0 < n < N_TOKENS
        assert text
    assert s.wait_exit(60) == 0
    log = "".join(s.log)
    assert "shutdown timeout" in log, log
