"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the
official `anthropic` client.

Needs `pip install anthropic pytest` and a release build; the server (SmolLM2, started with
an API key, which the client sends as `x-api-key`) is the `server` fixture of
test_openai.py. Run: `pytest tests/server`.
"""

import pytest

anthropic = pytest.importorskip("anthropic")

from test_openai import API_KEY, MODEL_NAME, server  # noqa: E402,F401

SYSTEM = "You are a helpful assistant."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# recent clients no longer type `temperature`, `top_p` and `top_k`; the API still takes them
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server):  # noqa: F811
    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0)


def create(claude, **kw):
    args = dict(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=48,
                extra_body=GREEDY)
    args.update(kw)
    return claude.messages.create(**args)


def test_create_answers_paris(claude):
    m = create(claude)
    assert m.type == "message" and m.role == "assistant"
    assert m.id.startswith("msg_")
    assert m.model == MODEL_NAME
    assert [b.type for b in m.content] == ["text"]
    assert "Paris" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0


def test_stream_deltas_equal_the_created_text(claude):
    full = create(claude).content[0].text
    with claude.messages.stream(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES,
                                max_tokens=48, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1, "the answer came in one piece"
    assert "".join(pieces) == full
    assert final.content[0].text == full
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0


def test_stop_sequence_and_max_tokens(claude):
    m = create(claude, stop_sequences=["Paris"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    assert "Paris" not in m.content[0].text
    m = create(claude, max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_count_tokens_equals_input_tokens(claude):
    n = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES)
    assert n.input_tokens == create(claude, max_tokens=1).usage.input_tokens


def test_wrong_key_is_an_authentication_error(server):  # noqa: F811
    bad = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        create(bad)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"


def test_missing_max_tokens_is_an_invalid_request(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.post("/v1/messages", cast_to=anthropic.types.Message,
                    body={"model": MODEL_NAME, "messages": MESSAGES})
    assert e.value.status_code == 400
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]


def test_tool_blocks_are_refused_until_tool_calling_exists(claude):
    blocks = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        create(claude, messages=[{"role": "user", "content": blocks}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "tool" in e.value.body["error"]["message"]
