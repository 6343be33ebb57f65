"""`shoal serve` end to end: real processes, real HTTP, the official openai SDK."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from ports import free_port
from serve_helpers import start_serve, stop_serve, worker_pids

from shoal import LLM, SamplingParams
from shoal.serve import POLL_S

PROMPT = "The river ran fast and cold between the stones, and the small fish held their place"


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("discovery")
    secret = ["--plane-secret", "serve-test-secret"]  # the planes sign and check every message
    proc, base, folder = start_serve(llama_dir, folder, workers=2, extra_args=secret)
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


def test_killed_worker_is_replaced_and_the_service_goes_on(server):
    proc, base, _ = server
    victim = worker_pids(proc.pid)[0]
    os.kill(victim, signal.SIGKILL)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    for _ in range(6):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
        assert out.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 90  # --restart-workers (on by default) starts a new one
    while time.monotonic() < deadline:
        pids = worker_pids(proc.pid)
        if len(pids) == 2 and victim not in pids:
            break
        time.sleep(0.5)
    assert len(pids) == 2 and victim not in pids


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("/nonexistent/model", "model path /nonexistent/model is not a directory"),
        ("nobody-shoal-test/no-such-model", "LocalEntryNotFoundError"),  # hub id, no network
    ],
)
def test_serve_exits_with_one_line_when_no_worker_can_start(tmp_path, model, reason):
    argv = [sys.executable, "-m", "shoal", "serve", "--model", model, "--device", "cpu"]
    argv += ["--workers", "2", "--port", str(free_port()), "--discovery", f"file://{tmp_path}"]
    argv += ["--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=150)
    assert out.returncode == 1
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"shoal serve: error: no worker started: cannot start {model}: ")
    assert reason in line


def test_without_restarts_a_dead_worker_is_reported(tmp_path, llama_dir):
    proc, base, _ = start_serve(llama_dir, tmp_path, workers=1, extra_args=["--no-restart-workers"])
    try:
        (victim,) = worker_pids(proc.pid)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30  # serve reaps it at its next poll (later on a busy host)
        while worker_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker_pids(proc.pid) == []
        time.sleep(3 * POLL_S + 1.0)  # several more of serve's polls: no replacement comes
        assert worker_pids(proc.pid) == []
        assert proc.poll() is None  # the frontend keeps answering
        assert httpx.get(f"{base}/v1/models").status_code == 200
    finally:
        stop_serve(proc)
