"""`shoal serve` end to end: real processes, real HTTP, the official openai SDK."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from serve_helpers import start_serve, stop_serve, worker_pids

from shoal import LLM, SamplingParams

PROMPT = "The river ran fast and cold between the stones, and the small fish held their place"


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    proc, base, folder = start_serve(llama_dir, tmp_path_factory.mktemp("discovery"), workers=2)
    yield proc, base, folder
    stop_serve(proc)


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(str(llama_dir), device="cpu")


def test_sdk_greedy_equals_offline_engine(server, offline):
    _, base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    expected = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 12
    messages = [{"role": "user", "content": "hi"}]
    chat_expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content == chat_expected.outputs[0].text


def test_async_sdk_streaming(server, offline):
    _, base, _ = server
    expected = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10))[0]

    async def main() -> tuple[str, object]:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
        text, usage = "", None
        stream = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return text, usage

    text, usage = asyncio.run(main())
    assert text == expected.outputs[0].text
    assert usage.completion_tokens == 10


def test_round_robin_spreads_requests_over_workers(server):
    """Same prompt three times: the 2nd lands on the other worker (no cache), the 3rd on the
    first again (its prefix cache hits)."""
    _, base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    prompt = "A router sends each request to the worker that already holds most of its prefix"
    cached = [
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=2
        ).usage.prompt_tokens_details.cached_tokens
        for _ in range(4)
    ]
    assert cached[:2] == [0, 0]
    assert cached[2] > 0 and cached[3] > 0


def test_bad_requests_get_openai_errors_and_server_keeps_serving(server):
    _, base, _ = server
    bad = httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
    long = httpx.post(
        f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5000}
    )
    assert long.status_code == 400 and "1024" in long.json()["error"]["message"]
    ok = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert ok.status_code == 200


def test_killed_worker_does_not_stop_the_service(server):
    proc, base, _ = server
    victim = worker_pids(proc.pid)[0]
    os.kill(victim, signal.SIGKILL)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    for _ in range(6):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
        assert out.choices[0].finish_reason == "length"
    time.sleep(1.5)  # `shoal serve` reaps the dead worker within a second
    assert worker_pids(proc.pid) == [p for p in worker_pids(proc.pid) if p != victim]
    assert len(worker_pids(proc.pid)) == 1
