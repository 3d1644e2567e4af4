"""`rustorch serve` through the official `openai` Python client.

Needs `pip install openai pytest` (this file installs nothing) and a release build
(`cargo build --release`): the server is target/release/rustorch (or $RUSTORCH_BIN)
with SmolLM2 (models/SmolLM2-135M-Instruct.Q4_1.gguf, `scripts/fetch-models.sh`), started
on a free loopback port with an API key. The other test files share `launch` and the
fixtures here, Qwen2.5-Coder 0.5B and 1.5B servers included. Run: `pytest tests/server`.
"""

import os
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("RUSTORCH_BIN", ROOT / "target" / "release" / "rustorch"))
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = ROOT / "models" / MODEL_NAME
API_KEY = "test-key-123"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def launch(model):
    """Starts `rustorch serve` on `model` (a free loopback port, -np 2, the API key) and
    yields its base URL once /health answers; stops it (expecting exit 0) afterwards."""
    if not BIN.is_file():
        pytest.skip(f"{BIN} is not built (cargo build --release)")
    if not model.is_file():
        pytest.skip(f"{model} is absent (scripts/fetch-models.sh --all)")
    env = {k: v for k, v in os.environ.items() if k != "RUSTORCH_API_KEY"}
    proc = subprocess.Popen(
        [str(BIN), "serve", "-m", str(model), "--host", "127.0.0.1", "--port", "0",
         "-np", "2", "-c", "4096", "--api-key", API_KEY],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=env, text=True,
    )
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
        pytest.fail("the server did not print its address")
    # keep draining stderr so the server never blocks on it
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    base = f"http://{addr}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except Exception:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("the server never became healthy")
        time.sleep(0.1)
    yield base
    proc.terminate()
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def server():
    yield from launch(MODEL)


# Qwen2.5-Coder 0.5B and 1.5B (`scripts/fetch-models.sh --all`): Hermes-style tool calls
# (`<tool_call>` in their templates) and bigger vocabularies than SmolLM2's
QWEN05_NAME = "qwen2.5-coder-0.5b-instruct-q4km.gguf"
QWEN15_NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


@pytest.fixture(scope="module")
def qwen05_server():
    yield from launch(ROOT / "models" / QWEN05_NAME)


@pytest.fixture(scope="module")
def qwen15_server():
    yield from launch(ROOT / "models" / QWEN15_NAME)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def qwen05_client(qwen05_server):
    return openai.OpenAI(base_url=qwen05_server + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def qwen15_client(qwen15_server):
    return openai.OpenAI(base_url=qwen15_server + "/v1", api_key=API_KEY, max_retries=0)


def test_chat_completion_answers_paris(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=64,
    )
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == MODEL_NAME
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_yields_the_same_text_in_chunks(client):
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=64,
    ).choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=64, stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, roles, usage = [], None, [], None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        if delta.content:
            pieces.append(delta.content)
        if chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert roles == ["assistant"]
    assert len(pieces) > 1, "the answer came in one piece"
    assert "".join(pieces) == full
    assert "Paris" in full
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens > 0


def test_text_completion(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=4, temperature=0,
    )
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 4


def test_models_lists_the_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL_NAME]


def test_wrong_api_key_is_refused(server):
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)


def test_bad_request_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2)
    assert e.value.status_code == 400
    body = e.value.body if isinstance(e.value.body, dict) else {}
    assert getattr(e.value, "param", None) == "n" or body.get("param") == "n"
