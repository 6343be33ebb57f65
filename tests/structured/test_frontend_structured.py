"""Structured outputs through the OpenAI API: response_format and structured_outputs on chat
and completions, and a 400 naming the problem for what cannot be enforced."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from frontend_helpers import ServerThread
from local_client import LocalEngineClient
from schema_check import violations

from shoal.frontend import build_app

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "Describe a user."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "ok"],
}


@pytest.fixture(scope="module")
def server(llama_dir):
    client = LocalEngineClient(llama_dir, MODEL, device="cpu", num_gpu_blocks=2048)
    server = ServerThread(build_app(client)).start()
    yield server
    server.stop()
    client.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", timeout=60)


def test_response_format_json_schema_through_the_sdk(sdk):
    fmt = {"type": "json_schema", "json_schema": {"name": "u", "schema": SCHEMA}}
    reply = sdk.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=48, temperature=1.0, seed=1, n=4, response_format=fmt
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert violations(json.loads(choice.message.content), SCHEMA) == []
    stream = sdk.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=48, seed=2, response_format=fmt, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert violations(json.loads(text), SCHEMA) == []


def test_json_object_and_vllm_fields_on_completions(sdk):
    reply = sdk.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=48,
        seed=3,
        extra_body={"response_format": {"type": "json_object"}, "structured_outputs": None},
    )
    text = reply.choices[0].text
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    reply = sdk.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=12,
        seed=4,
        extra_body={"structured_outputs": {"regex": r"\d{3}-[a-c]{2}"}},
    )
    assert re.fullmatch(r"\d{3}-[a-c]{2}", reply.choices[0].text)
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        n=3,
        seed=5,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert {c.message.content for c in reply.choices} <= {"left", "right"}


def error(http, body: dict, path: str = "/v1/chat/completions") -> dict:
    reply = http.post(path, json={"model": MODEL, "messages": CHAT, "max_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_errors_name_the_problem(http, stream):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "blob"}}}
    e = error(http, {"response_format": bad_schema, "stream": stream})
    assert "blob" in e["message"]
    e = error(http, {"structured_outputs": {"regex": "a(b"}, "stream": stream})
    assert "regex" in e["message"] and "parenthesis" in e["message"]
    e = error(http, {"structured_outputs": {"grammar": "root ::= nope"}, "stream": stream})
    assert "nope" in e["message"]
    unsupported = {"type": "array", "uniqueItems": True}
    e = error(http, {"structured_outputs": {"json": unsupported}, "stream": stream})
    assert "uniqueItems" in e["message"]
    e = error(http, {"structured_outputs": {"structural_tag": "{}"}, "stream": stream})
    assert e["param"] == "structured_outputs.structural_tag"
    e = error(http, {"structured_outputs": {"regex": "a", "choice": ["b"]}, "stream": stream})
    assert "exactly one" in e["message"]
    e = error(http, {"guided_json": SCHEMA, "stream": stream})
    assert e["param"] == "guided_json" and "structured_outputs" in e["message"]
    e = error(http, {"response_format": {"type": "json_schema"}, "stream": stream})
    assert e["param"] == "response_format.json_schema"
    e = error(http, {"response_format": {"type": "yaml"}, "stream": stream})
    assert "response_format" in (e["param"] or e["message"])
