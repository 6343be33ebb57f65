"""What an operator sees: 499 for clients that leave, the access log, an honest OpenAPI document."""

from __future__ import annotations

import logging
import re
import time

import httpx
import pytest
from frontend_helpers import MODEL, ServerThread

from shoal.frontend import build_app

CHAT = [{"role": "user", "content": "Tell me about the river."}]
LONG = 900  # tokens: seconds of CPU work, so a disconnect lands mid-request


@pytest.fixture(scope="module")
def server(engine_client):
    server = ServerThread(build_app(engine_client, access_log=True)).start()
    yield server
    server.stop()


def count(metrics: str, path: str, status: int) -> float:
    """shoal_requests_total of MODEL's requests to `path` answered `status`."""
    series = f'shoal_requests_total{{endpoint="{path}",model="{MODEL}",status="{status}"}} '
    for line in metrics.splitlines():
        if line.startswith(series):
            return float(line[len(series) :])
    return 0.0


def wait_for_count(url: str, path: str, status: int, at_least: float) -> float:
    deadline = time.monotonic() + 10
    while True:
        seen = count(httpx.get(f"{url}/metrics").text, path, status)
        if seen >= at_least or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_is_counted_as_499(server, engine_client, stream):
    path = "/v1/chat/completions"
    before = httpx.get(f"{server.url}/metrics").text
    body = {"model": MODEL, "messages": CHAT, "max_tokens": LONG, "ignore_eos": True}
    if stream:
        with (
            httpx.Client(base_url=server.url, timeout=30) as http,
            http.stream("POST", path, json={**body, "stream": True}) as reply,
        ):
            assert reply.status_code == 200
            lines = reply.iter_lines()
            for _ in range(3):
                next(lines)
    else:
        with (
            httpx.Client(base_url=server.url, timeout=0.5) as http,
            pytest.raises(httpx.ReadTimeout),
        ):
            http.post(path, json=body)
    assert (
        wait_for_count(server.url, path, 499, count(before, path, 499) + 1)
        == count(before, path, 499) + 1
    )
    assert engine_client.wait_idle(5)
    after = httpx.get(f"{server.url}/metrics").text
    assert count(after, path, 200) == count(before, path, 200)


def test_access_log_has_one_line_per_request(server, caplog):
    with caplog.at_level(logging.INFO, logger="shoal.access"):
        with httpx.Client(base_url=server.url, timeout=30) as http:
            reply = http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "The river", "max_tokens": 3}
            )
            usage = reply.json()["usage"]
            http.post("/v1/chat/completions", json={"model": "nope", "messages": CHAT})
            http.get("/health")
        deadline = time.monotonic() + 5
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if r.name == "shoal.access"]
    assert len(lines) == 2, lines  # /health is not an API request
    assert lines[0].startswith('127.0.0.1 "POST /v1/completions" 200 ')
    assert f"model={MODEL}" in lines[0]
    assert f"prompt_tokens={usage['prompt_tokens']}" in lines[0]
    assert f"completion_tokens={usage['completion_tokens']}" in lines[0]
    assert f"request_id={reply.json()['id']}" in lines[0]
    assert re.search(r" 200 \d+\.\d{3}s ", lines[0])
    assert '"POST /v1/chat/completions" 404 ' in lines[1] and "request_id=-" in lines[1]


def test_access_log_is_off_by_default(engine_client, caplog):
    server = ServerThread(build_app(engine_client)).start()
    try:
        with caplog.at_level(logging.INFO, logger="shoal.access"):
            body = {"model": MODEL, "prompt": "The river", "max_tokens": 2}
            assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
        assert not [r for r in caplog.records if r.name == "shoal.access"]
    finally:
        server.stop()


def test_openapi_documents_the_statuses_the_server_answers(server):
    document = httpx.get(f"{server.url}/openapi.json").json()
    assert "422" not in str(document["paths"]) and "HTTPValidationError" not in str(document)
    error_schema = document["components"]["schemas"]["ErrorResponse"]
    assert error_schema["required"] == ["error"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = document["paths"][path]["post"]["responses"]
        for status in ("400", "404", "413", "429", "503"):
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (path, status)
    # and the server does answer a bad field with 400, not 422
    reply = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 7}
    )
    assert reply.status_code == 400
    assert set(reply.json()["error"]) == set(
        document["components"]["schemas"]["ErrorDetail"]["properties"]
    )
