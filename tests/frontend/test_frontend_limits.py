"""Hostile and oversized input: every case is a 4xx naming its field, and the server serves on."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from frontend_helpers import MODEL, ServerThread, error_shape

from shoal.frontend import build_app
from shoal.frontend.tokenizer_pool import ModelTokenizer

CHAT = [{"role": "user", "content": "Tell me about the river."}]
BIG = 2**64  # one past uint64's range
INT64_END = 2**63  # one past int64's range


@pytest.fixture(scope="module")
def server(engine_client):
    server = ServerThread(
        build_app(engine_client, max_request_body_bytes=1 << 20, max_prompts_per_request=3)
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def vocab_size(llama_dir) -> int:
    return ModelTokenizer(str(llama_dir)).vocab_size


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}


def completion_body(**fields) -> dict:
    return {"model": MODEL, "prompt": "The river", "max_tokens": 2, **fields}


def error_of(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    return error_shape(reply.json())


def assert_serves(http: httpx.Client) -> None:
    reply = http.post("/v1/chat/completions", json=chat_body())
    assert reply.status_code == 200, reply.text


def post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """Post JSON text as written (json.dumps cannot write a lone surrogate escape or NaN)."""
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"seed": BIG}, "seed"),
        ("/v1/chat/completions", {"seed": INT64_END}, "seed"),
        ("/v1/chat/completions", {"seed": -INT64_END - 1}, "seed"),
        ("/v1/chat/completions", {"top_k": BIG}, "top_k"),
        ("/v1/chat/completions", {"n": BIG}, "n"),
        ("/v1/chat/completions", {"max_tokens": BIG}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": BIG}, "max_completion_tokens"),
        ("/v1/chat/completions", {"min_tokens": BIG}, "min_tokens"),
        ("/v1/chat/completions", {"top_logprobs": BIG, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"stop_token_ids": [BIG]}, "stop_token_ids"),
        ("/v1/chat/completions", {"stop_token_ids": [INT64_END]}, "stop_token_ids"),
        ("/v1/chat/completions", {"logit_bias": {str(BIG): 1.0}}, "logit_bias"),
        ("/v1/completions", {"prompt": [BIG]}, "prompt"),
        ("/v1/completions", {"prompt": [[5, INT64_END]]}, "prompt"),
        ("/v1/completions", {"prompt": [INT64_END], "echo": True}, "prompt"),
        ("/v1/completions", {"prompt": [5, -1]}, "prompt"),
        ("/v1/completions", {"best_of": BIG}, "best_of"),
        ("/v1/completions", {"logprobs": BIG}, "logprobs"),
        ("/v1/completions", {"seed": BIG, "stream": True}, "seed"),
    ],
)
def test_out_of_range_integers_are_400_naming_the_field(http, path, fields, param):
    body = chat_body(**fields) if path.endswith("chat/completions") else completion_body(**fields)
    error = error_of(http.post(path, json=body), 400)
    assert error["param"].split(".")[0] == param  # e.g. stop_token_ids.0
    assert param in error["message"]
    assert_serves(http)


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", {"stop_token_ids": ["VOCAB"]}),
        ("/v1/completions", {"stop_token_ids": ["VOCAB"]}),
        ("/v1/completions", {"prompt": [5, "VOCAB"]}),
        ("/v1/completions", {"prompt": [[5], [6, "VOCAB"]], "echo": True}),
    ],
)
def test_token_ids_at_or_over_the_vocabulary_are_400(http, vocab_size, path, fields):
    text = json.dumps(chat_body(**fields) if "chat" in path else completion_body(**fields))
    reply = post_raw(http, path, text.replace('"VOCAB"', str(vocab_size)))
    error = error_of(reply, 400)
    assert error["param"] in ("prompt", "stop_token_ids")
    assert str(vocab_size) in error["message"] and "vocabulary" in error["message"]
    # the last id inside the vocabulary is served
    reply = post_raw(http, path, text.replace('"VOCAB"', str(vocab_size - 1)))
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    ("path", "text", "param"),
    [
        ("/v1/completions", '"prompt": "a \\ud800 b"', "prompt"),
        ("/v1/completions", '"prompt": ["ok", "\\udfff"]', "prompt"),
        ("/v1/completions", '"prompt": "ok", "stop": ["\\ud83d"]', "stop"),
        ("/v1/completions", '"prompt": "ok", "user": "\\ud800"', "user"),
        (
            "/v1/chat/completions",
            '"messages": [{"role": "user", "content": "\\ud800"}]',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            '"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            '"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]',
            "messages.0",
        ),
        (
            "/v1/chat/completions",
            '"messages": [{"role": "user", "content": "hi"}], '
            '"chat_template_kwargs": {"x": ["\\ud800"]}',
            "chat_template_kwargs",
        ),
    ],
)
def test_lone_surrogates_are_400(http, path, text, param):
    reply = post_raw(http, path, f'{{"model": "{MODEL}", "max_tokens": 2, {text}}}')
    error = error_of(reply, 400)
    assert "surrogate" in error["message"]
    assert error["param"] == param or error["param"].startswith(param + ".")
    # a surrogate pair spelled in escapes is one valid character
    reply = post_raw(http, "/v1/completions", f'{{"model": "{MODEL}", "prompt": "\\ud83d\\ude00"}}')
    assert reply.status_code == 200, reply.text


def test_a_lone_surrogate_in_the_model_name_is_400(http):
    error = error_of(post_raw(http, "/v1/completions", '{"model": "\\ud800", "prompt": "x"}'), 400)
    assert error["param"] == "model"


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "min_p"])
def test_non_finite_floats_are_400(http, field, value):
    reply = post_raw(
        http, "/v1/completions", f'{{"model": "{MODEL}", "prompt": "x", "{field}": {value}}}'
    )
    assert error_of(reply, 400)["param"] == field


def test_too_many_prompts_is_400_and_the_limit_itself_is_served(http):
    error = error_of(http.post("/v1/completions", json=completion_body(prompt=["a"] * 4)), 400)
    assert error["param"] == "prompt" and "3" in error["message"] and "4" in error["message"]
    reply = http.post("/v1/completions", json=completion_body(prompt=["a", "b", "c"]))
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 3


def test_ten_thousand_prompts_under_the_default_limit_is_400(engine_client):
    server = ServerThread(build_app(engine_client)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            body = completion_body(prompt=[[5, 6]] * 10_000)
            error = error_of(http.post("/v1/completions", json=body), 400)
            assert error["param"] == "prompt" and "10000" in error["message"]
            assert_serves(http)
        assert engine_client.wait_idle(5)
    finally:
        server.stop()


def test_body_over_the_limit_is_413_declared_or_chunked(http):
    body = json.dumps(completion_body(prompt="river " * 200_000)).encode()  # 1.2 MB > 1 MiB
    error = error_of(
        http.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
        413,
    )
    assert error["code"] == "request_too_large" and str(1 << 20) in error["message"]

    def chunks():  # no Content-Length: the limit is found while reading
        for at in range(0, len(body), 65536):
            yield body[at : at + 65536]

    reply = http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert error_of(reply, 413)["code"] == "request_too_large"
    assert_serves(http)
    metrics = http.get("/metrics").text
    assert 'endpoint="/v1/completions",model="",status="413"' in metrics


@pytest.mark.parametrize(
    ("path", "param"), [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]
)
def test_prompt_longer_than_the_context_can_hold_is_400_before_tokenizing(
    http, engine_client, llama_dir, path, param
):
    tok = ModelTokenizer(str(llama_dir))
    limit = engine_client.card.context_length * tok.max_token_chars
    text = "x" * (limit + 1)
    body = (
        completion_body(prompt=text)
        if param == "prompt"
        else chat_body(messages=[{"role": "user", "content": text}])
    )
    start = time.perf_counter()
    error = error_of(http.post(path, json=body), 400)
    assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert str(limit) in error["message"]
    assert time.perf_counter() - start < 5
    assert_serves(http)
