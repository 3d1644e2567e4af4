"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the
official `anthropic` client.

Tools: `tools` / `tool_choice`, `tool_use` blocks in answers (streamed as
`input_json_delta`s) and `tool_use` / `tool_result` blocks sent back, on Qwen2.5-Coder.

Needs `pip install anthropic pytest jsonschema` and a release build; the servers (SmolLM2,
and Qwen2.5-Coder 0.5B and 1.5B for tools, started with an API key, which the client sends
as `x-api-key`) are fixtures of test_openai.py. Run: `pytest tests/server`.
"""

import json

import pytest

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from test_openai import (  # noqa: E402,F401
    API_KEY, MODEL_NAME, QWEN05_NAME, QWEN15_NAME, qwen05_server, qwen15_server, server,
)

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


def test_tool_blocks_render_as_calls_and_results(claude):
    """tool_use blocks of an assistant turn and tool_result blocks of a user turn are
    rendered through the template (SmolLM2's has no tool support: the generic format
    writes them into the messages), so they count as prompt tokens and get an answer."""
    plain = [
        {"role": "user", "content": "What is the weather like in Paris?"},
    ]
    with_tools = plain + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "17 degrees Celsius"},
        ]},
    ]
    n_plain = claude.messages.count_tokens(model=MODEL_NAME, messages=plain).input_tokens
    n_tools = claude.messages.count_tokens(model=MODEL_NAME, messages=with_tools).input_tokens
    # the call's name and input and the result's text are all in the prompt
    assert n_tools > n_plain + 20, (n_plain, n_tools)
    m = create(claude, messages=with_tools, max_tokens=8)
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in m.content] == ["text"]
    # a tool_result block belongs in a user turn
    bad = plain + [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "17"},
    ]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        create(claude, messages=bad)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "tool_result" in e.value.body["error"]["message"]


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city",
          "input_schema": WEATHER_SCHEMA}]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def claude_qwen05(qwen05_server):  # noqa: F811
    return anthropic.Anthropic(base_url=qwen05_server, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude_qwen15(qwen15_server):  # noqa: F811
    return anthropic.Anthropic(base_url=qwen15_server, api_key=API_KEY, max_retries=0)


def test_tool_use_round_trip(claude_qwen15):
    m = claude_qwen15.messages.create(
        model=QWEN15_NAME, messages=QUESTION, tools=TOOLS, max_tokens=100, extra_body=GREEDY,
    )
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1, m.content
    use = uses[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    assert "paris" in use.input["city"].lower()
    # the call and its result go back; offered the tool again this model calls it again
    # (see test_tools.py), so the answer is asked for without tools
    messages = QUESTION + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "17 degrees Celsius, cloudy"},
        ]},
    ]
    m = claude_qwen15.messages.create(
        model=QWEN15_NAME, messages=messages, max_tokens=60, extra_body=GREEDY,
    )
    assert m.stop_reason == "end_turn"
    assert [b.type for b in m.content] == ["text"]
    assert "17" in m.content[0].text, m.content[0].text


def test_stream_with_tools(claude_qwen05):
    with claude_qwen05.messages.stream(
        model=QWEN05_NAME, messages=QUESTION, tools=TOOLS, tool_choice={"type": "any"},
        max_tokens=100, extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["tool_use"], starts
    assert starts[0].id.startswith("toolu_") and starts[0].name == "get_weather"
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas), deltas
    assert len(deltas) > 1, "the input came in one piece"
    streamed = json.loads("".join(d.partial_json for d in deltas))
    jsonschema.validate(streamed, WEATHER_SCHEMA)
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].input == streamed
    assert final.content[0].id == starts[0].id


def test_tool_choice_tool_and_none(claude_qwen05):
    tools = TOOLS + [{"name": "get_time", "description": "Get the current time in a timezone",
                      "input_schema": {"type": "object",
                                       "properties": {"timezone": {"type": "string"}},
                                       "required": ["timezone"]}}]
    m = claude_qwen05.messages.create(
        model=QWEN05_NAME, messages=QUESTION, tools=tools, max_tokens=80, extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_time"},
    )
    assert m.stop_reason == "tool_use"
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "get_time")]
    assert isinstance(m.content[0].input.get("timezone"), str)
    m = claude_qwen05.messages.create(
        model=QWEN05_NAME, messages=QUESTION, tools=tools, max_tokens=30, extra_body=GREEDY,
        tool_choice={"type": "none"},
    )
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in m.content] == ["text"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude_qwen05.messages.create(
            model=QWEN05_NAME, messages=QUESTION, tools=tools, max_tokens=8,
            tool_choice={"type": "tool", "name": "nope"},
        )
    assert "nope" in e.value.body["error"]["message"]
