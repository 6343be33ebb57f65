"""Client disconnects abort engine requests; many concurrent streams all complete."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from frontend_helpers import MODEL, ServerThread

from shoal.frontend import build_app

CHAT = [{"role": "user", "content": "Tell me about the river."}]
LONG = 900  # tokens; a full run takes seconds on the CPU, a disconnect must stop it at once


@pytest.fixture(scope="module")
def server(engine_client):
    server = ServerThread(build_app(engine_client)).start()
    yield server
    server.stop()


def body(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": LONG, "ignore_eos": True, **fields}


def test_disconnect_mid_stream_aborts_the_engine_request(server, engine_client):
    assert engine_client.wait_idle(5)
    with (
        httpx.Client(base_url=server.url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body(stream=True)) as stream,
    ):
        lines = stream.iter_lines()
        first = json.loads(next(lines)[len("data: ") :])
        for _ in range(3):
            next(lines)
        assert not engine_client.idle()
        closed_at = time.monotonic()
    assert engine_client.wait_idle(2.0)
    assert time.monotonic() - closed_at < 2.0  # the whole request would take several seconds
    (rid,) = engine_client.engine_ids(first["id"])
    assert rid in engine_client.closed_early
    assert engine_client.tokens[rid] < LONG


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_disconnect_while_waiting_for_a_whole_reply_aborts(server, engine_client, path):
    assert engine_client.wait_idle(5)
    before = set(engine_client.closed_early)
    payload = body() if path.endswith("chat/completions") else {**body(), "prompt": "The river"}
    with httpx.Client(base_url=server.url, timeout=0.4) as http, pytest.raises(httpx.ReadTimeout):
        http.post(path, json=payload)
    assert engine_client.wait_idle(2.0)
    (rid,) = engine_client.closed_early - before
    assert engine_client.tokens[rid] < LONG


def test_200_concurrent_streams_complete(server, engine_client):
    async def run() -> list[tuple[str, str | None, int]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def one(i: int) -> tuple[str, str | None, int]:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Request number {i}, tell me a story."}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, finish, completion_tokens = "", None, 0
            async for chunk in stream:
                if chunk.usage is not None:
                    completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            return text, finish, completion_tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len(results) == 200
    assert all(finish == "length" and tokens == 4 for _, finish, tokens in results)
    assert engine_client.wait_idle(5)
    deadline = time.monotonic() + 2  # a response's last bytes leave just before its slot frees
    while "shoal_requests_in_flight 0.0" not in httpx.get(f"{server.url}/metrics").text:
        assert time.monotonic() < deadline, "requests still counted in flight"
        time.sleep(0.01)
