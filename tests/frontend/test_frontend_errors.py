"""Every error has its status and OpenAI's JSON shape, and the server keeps serving after it."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from frontend_helpers import MODEL, ServerThread, error_shape
from local_client import DyingWorkerClient, EmptyClient, NoWorkerClient

from shoal.frontend import build_app

CHAT = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def server(engine_client):
    server = ServerThread(build_app(engine_client)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}


def assert_serves(http: httpx.Client, headers: dict | None = None) -> None:
    """A normal request still succeeds."""
    reply = http.post("/v1/chat/completions", json=chat_body(), headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def post_error(http: httpx.Client, path: str, status: int, **kw) -> dict:
    reply = http.post(path, **kw)
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    return error_shape(reply.json())


def test_unknown_model_is_404(http):
    for stream in (False, True):
        error = post_error(
            http, "/v1/chat/completions", 404, json=chat_body(model="nope", stream=stream)
        )
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "nope" in error["message"]
    assert_serves(http)


def test_malformed_json_is_400(http):
    error = post_error(
        http,
        "/v1/chat/completions",
        400,
        content=b'{"model": "tiny-llama", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert "JSON" in error["message"] and error["type"] == "invalid_request_error"
    assert_serves(http)


@pytest.mark.parametrize(
    ("headers", "content", "status", "message"),
    [
        ({}, json.dumps(chat_body()).encode(), 400, "valid dictionary"),  # not read as JSON
        ({"content-type": "text/plain"}, json.dumps(chat_body()).encode(), 400, "dictionary"),
        ({"content-type": "application/json"}, b"", 400, "Field required"),
        ({"content-type": "application/json"}, b"[1, 2]", 400, "dictionary"),
        ({"content-type": "application/json"}, b'{"\xd8": 1}', 400, "error parsing the body"),
        ({"content-type": "application/json; charset=utf-8"}, None, 200, None),
        ({"content-type": "application/vnd.api+json"}, None, 200, None),
    ],
)
def test_the_body_is_json_only_with_a_json_content_type(http, headers, content, status, message):
    body = json.dumps(chat_body()).encode() if content is None else content
    reply = http.post("/v1/chat/completions", content=body, headers=headers)
    assert reply.status_code == status, reply.text
    if message is not None:
        error = error_shape(reply.json())
        assert message in error["message"] and error["type"] == "invalid_request_error"
    assert_serves(http)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
        ("/v1/chat/completions", {"stop": ["ok", ""]}, "stop"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logit_bias": {"5": 1.0}}, "logit_bias"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"min_tokens": 9}, "min_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
        ),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [[]]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ],
)
def test_invalid_field_is_400_naming_it(http, path, fields, param):
    body = chat_body(**fields)
    if path == "/v1/completions":
        del body["messages"]
    error = post_error(http, path, 400, json=body)
    assert error["param"] == param
    assert param.split(".")[0] in error["message"]
    assert_serves(http)


def test_missing_model_field_is_400(http):
    error = post_error(http, "/v1/chat/completions", 400, json={"messages": CHAT})
    assert error["param"] == "model"


def test_context_overflow_is_400_with_both_numbers(http, engine_client, tokenizer):
    context = engine_client.card.context_length
    prompt_len = len(tokenizer.encode_chat(CHAT))
    max_tokens = context - prompt_len + 10
    for stream in (False, True):
        body = chat_body(max_tokens=max_tokens, stream=stream)
        error = post_error(http, "/v1/chat/completions", 400, json=body)
        assert error["code"] == "context_length_exceeded"
        assert str(context) in error["message"]
        assert str(prompt_len + max_tokens) in error["message"]
    long_prompt = [5] * (context + 1)
    error = post_error(http, "/v1/completions", 400, json={"model": MODEL, "prompt": long_prompt})
    assert str(context) in error["message"] and str(context + 1) in error["message"]
    assert_serves(http)


def test_engine_rejection_is_400_streaming_or_not(http):
    for stream in (False, True):
        body = {"model": MODEL, "prompt": [5, 999_999], "max_tokens": 2, "stream": stream}
        error = post_error(http, "/v1/completions", 400, json=body)
        assert "999999" in error["message"]
    assert_serves(http)


def test_bad_request_does_not_disturb_a_running_stream(http, server):
    body = chat_body(max_tokens=40, stream=True, ignore_eos=True, temperature=0)
    with (
        httpx.Client(base_url=server.url, timeout=30) as other,
        other.stream("POST", "/v1/chat/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        first = next(line for line in lines if line)
        post_error(http, "/v1/chat/completions", 400, json=chat_body(temperature=-1))
        post_error(http, "/v1/chat/completions", 404, json=chat_body(model="nope"))
        rest = [line for line in lines if line]
    assert first.startswith("data: ")
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "length"


def test_api_key_guards_v1_only(engine_client):
    server = ServerThread(build_app(engine_client, api_key="sekrit")).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                error = post_error(
                    http, "/v1/chat/completions", 401, json=chat_body(), headers=headers
                )
                assert error["code"] == "invalid_api_key"
            assert http.get("/v1/models").status_code == 401
            assert http.get("/health").status_code == 200
            assert http.get("/metrics").status_code == 200
            assert_serves(http, headers={"Authorization": "Bearer sekrit"})
            sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit", max_retries=0)
            assert [m.id for m in sdk.models.list().data] == [MODEL]
            bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
    finally:
        server.stop()


def test_over_the_concurrency_limit_is_429(engine_client):
    server = ServerThread(build_app(engine_client, max_concurrency=1)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            body = chat_body(max_tokens=900, stream=True, ignore_eos=True)
            with (
                httpx.Client(base_url=server.url, timeout=30) as other,
                other.stream("POST", "/v1/chat/completions", json=body) as stream,
            ):
                lines = stream.iter_lines()  # (dropping it would close the stream)
                assert next(lines).startswith("data: ")  # the request is in flight
                error = post_error(http, "/v1/chat/completions", 429, json=chat_body())
                assert error["type"] == "rate_limit_error"
                assert http.get("/v1/models").status_code == 200  # not limited
                sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert engine_client.wait_idle(5)
            assert_serves(http)
    finally:
        server.stop()


def test_no_worker_is_503(engine_client):
    server = ServerThread(build_app(NoWorkerClient(engine_client.card))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for stream in (False, True):
                body = chat_body(stream=stream)
                error = post_error(http, "/v1/chat/completions", 503, json=body)
                assert error["code"] == "no_worker_available"
            sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.InternalServerError) as caught:
                sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert caught.value.status_code == 503
    finally:
        server.stop()


def test_health_is_503_without_models():
    server = ServerThread(build_app(EmptyClient())).start()
    try:
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert httpx.get(f"{server.url}/live").status_code == 200
        assert httpx.get(f"{server.url}/v1/models").json()["data"] == []
        # no worker seen yet: any model may be coming, so 503 with Retry-After, not 404
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2}
        reply = httpx.post(f"{server.url}/v1/completions", json=body)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert error_shape(reply.json())["code"] == "no_worker_available"
    finally:
        server.stop()


def test_worker_dying_mid_request(engine_client):
    server = ServerThread(build_app(DyingWorkerClient(engine_client, 3))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            body = chat_body(max_tokens=20, ignore_eos=True)
            error = post_error(http, "/v1/chat/completions", 502, json=body)
            assert error["code"] == "worker_failed" and "exited" in error["message"]
            lines = [
                line
                for line in http.post(
                    "/v1/chat/completions", json={**body, "stream": True}
                ).text.splitlines()
                if line
            ]
            assert lines[-1] == "data: [DONE]"
            error = error_shape(json.loads(lines[-2][len("data: ") :]))
            assert error["code"] == "worker_failed"
            # the role chunk, up to three token chunks (a token may hold half a character)
            assert json.loads(lines[0][len("data: ") :])["choices"][0]["delta"]["role"]
            assert 1 <= len(lines) - 2 <= 1 + 3
            sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.APIError):
                for _ in sdk.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=20, stream=True
                ):
                    pass
        assert engine_client.wait_idle(5)
    finally:
        server.stop()


def test_error_counts_reach_metrics(http):
    post_error(http, "/v1/chat/completions", 404, json=chat_body(model="nope"))
    text = http.get("/metrics").text
    assert 'shoal_requests_total{endpoint="/v1/chat/completions",model="",status="404"}' in text


def test_concurrent_bad_and_good_requests(server):
    """Bad requests racing good ones: every good one completes."""
    results: list[int] = []

    def hit(good: bool) -> None:
        body = chat_body(max_tokens=6) if good else chat_body(temperature=-5)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            results.append(http.post("/v1/chat/completions", json=body).status_code)

    threads = [threading.Thread(target=hit, args=(i % 2 == 0,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [200] * 8 + [400] * 8
