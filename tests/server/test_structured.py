"""Structured output through the official `openai` client: `response_format` with a
pydantic model (`client.beta.chat.completions.parse`), `json_object`, llama-server's
`grammar` and `json_schema` fields, and 400s for bad schemas and grammars.

Every parsed output is also validated with the `jsonschema` package against the schema the
client sent; `parse()` runs on SmolLM2, Qwen2.5-Coder 0.5B and Qwen2.5-Coder 1.5B. Needs
`pip install openai pytest jsonschema` and a release build; the servers are fixtures of
test_openai.py. Run: `pytest tests/server`.
"""

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from openai.lib._pydantic import to_strict_json_schema  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from test_openai import (  # noqa: E402,F401
    API_KEY, MODEL_NAME, QWEN05_NAME, QWEN15_NAME, client, qwen05_client, qwen05_server,
    qwen15_client, qwen15_server, server,
)


class Landmark(BaseModel):
    name: str = Field(max_length=40)
    kind: Literal["museum", "park", "monument", "church", "market"]


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=40_000_000)
    is_capital: bool
    landmarks: list[Landmark] = Field(min_length=1, max_length=3)


PROMPTS = [
    "Describe Paris.", "Describe Tokyo.", "Describe Berlin.", "Describe Cairo.",
    "Describe Lima.", "Describe Oslo.", "Describe Toronto.", "Describe Mumbai.",
    "Describe Rome.", "Describe Sydney.",
]


def messages(prompt):
    return [
        {"role": "system", "content": "You answer with a JSON object describing the city."},
        {"role": "user", "content": prompt},
    ]


@pytest.mark.parametrize("fixture, model", [
    ("client", MODEL_NAME), ("qwen05_client", QWEN05_NAME), ("qwen15_client", QWEN15_NAME),
])
def test_parse_with_a_pydantic_model_gives_valid_objects(fixture, model, request):
    """The 10 prompts on SmolLM2, Qwen2.5-Coder 0.5B and 1.5B (two at a time: the
    servers run with -np 2)."""
    c = request.getfixturevalue(fixture)
    schema = to_strict_json_schema(City)

    def parse(seed_prompt):
        seed, prompt = seed_prompt
        return c.beta.chat.completions.parse(
            model=model, messages=messages(prompt), response_format=City,
            temperature=0.8, seed=seed, max_tokens=300,
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(parse, enumerate(PROMPTS)))
    for r in results:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        city = choice.message.parsed
        assert isinstance(city, City), choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_outputs_parse(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=messages(PROMPTS[seed]), max_tokens=200,
            response_format={"type": "json_object"}, temperature=0.8, seed=seed,
        )
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.startswith("{"), text


def test_json_schema_streamed_is_valid(client):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    }
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Is Paris in France?"}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "verdict", "schema": schema, "strict": True}},
        max_tokens=60, temperature=0, stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_bad_schemas_are_400s_that_name_the_problem(client):
    cases = [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}},
         "strange"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}},
         "nope"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": 12}},
         "must be a JSON object"),
        ({"type": "yaml"}, "response_format.type"),
    ]
    for fmt, want in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL_NAME, messages=messages("hi"), response_format=fmt, max_tokens=4,
            )
        assert e.value.status_code == 400
        assert want in str(e.value), str(e.value)


def post(base, path, body):
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_llama_server_grammar_and_json_schema_fields(server):
    grammar = 'root ::= ("yes" | "no") ", because " [a-z ]{1,40} "."'
    status, body = post(server, "/v1/completions", {
        "prompt": "Is the sky blue? Answer: ", "grammar": grammar, "max_tokens": 40, "seed": 3,
    })
    assert status == 200, body
    text = body["choices"][0]["text"]
    assert text.startswith(("yes, because ", "no, because ")), text
    assert body["choices"][0]["finish_reason"] == "stop", text
    assert text.endswith("."), text

    schema = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
              "minItems": 3, "maxItems": 3}
    status, body = post(server, "/v1/chat/completions", {
        "messages": messages("Three digits please."), "json_schema": schema, "max_tokens": 30,
    })
    assert status == 200, body
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)

    status, body = post(server, "/v1/completions", {
        "prompt": "x", "grammar": 'root ::= "a" | root "a"', "max_tokens": 4,
    })
    assert status == 400, body
    assert body["error"]["param"] == "grammar"
    assert "left recursion" in body["error"]["message"]
