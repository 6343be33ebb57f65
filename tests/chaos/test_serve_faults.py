"""Faults an operator meets with `shoal serve` (mocker workers, KV routing): clients that
leave, a frozen frontend, garbage on the frontend's sockets, a worker stopped with SIGTERM;
and what the operator reads meanwhile (access log, stats line, workers joined and left)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from mock_serve import MODEL, MockServe, run_streams, stream_one
from ports import free_port

from shoal.protocol import GENERATE_ENDPOINT
from shoal.router.replica_sync import replicas_endpoint
from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.discovery import make_discovery

BLOCKS = 2048  # KV blocks of the worker: a few streams show in its usage gauge
SPEEDUP = "0.25"  # steps of ~30 ms: a 900-token request runs far longer than any deadline here


@pytest.fixture(scope="module")
def serve(mock_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    metrics_port = free_port()
    env = {"SHOAL_METRICS_PORT": str(metrics_port), "SHOAL_STATS_INTERVAL": "1"}
    flags = ("--router-mode", "kv", "--num-gpu-blocks", str(BLOCKS), "--speedup", SPEEDUP)
    serve = MockServe(mock_model_dir, tmp_path_factory.mktemp("serve"), *flags, env=env)
    serve.worker_metrics = f"http://127.0.0.1:{metrics_port}"
    try:
        yield serve.wait_for_workers(1)
    finally:
        serve.stop()


def worker_gauge(serve: MockServe, name: str) -> float:
    return serve.metric(serve.worker_metrics, f'{name}{{model="{MODEL}"}}')


def requests_total(serve: MockServe, status: int) -> float:
    labels = f'endpoint="/v1/completions",model="{MODEL}",status="{status}"'
    return serve.metric(serve.url, f"shoal_requests_total{{{labels}}}")


def test_client_disconnects_free_the_workers_kv_and_count_499(serve: MockServe) -> None:
    before = {status: requests_total(serve, status) for status in (200, 499)}

    async def leave() -> None:
        async with httpx.AsyncClient(base_url=serve.url, timeout=60) as http:
            streams = [stream_one(http, i, 900, _Ignored()) for i in range(6)]
            whole = [
                http.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": f"r{i}", "max_tokens": 900, "ignore_eos": True},
                )
                for i in range(4)
            ]
            tasks = [asyncio.create_task(c) for c in (*streams, *whole)]
            gauge = functools.partial(asyncio.to_thread, worker_gauge, serve)
            async with asyncio.timeout(30):
                while await gauge("shoal_worker_requests_running") < 10:
                    await asyncio.sleep(0.05)
            assert await gauge("shoal_worker_kv_cache_usage") > 0
            for task in tasks:  # the clients go away: their connections close
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(leave())
    deadline = time.monotonic() + 10  # the requests would run for about 25 s more
    while any(
        worker_gauge(serve, gauge)
        for gauge in (
            "shoal_worker_requests_running",
            "shoal_worker_requests_waiting",
            "shoal_worker_kv_cache_usage",
        )
    ):
        assert time.monotonic() < deadline, "the worker kept the requests or their KV blocks"
        time.sleep(0.1)
    while requests_total(serve, 499) < before[499] + 10:
        assert time.monotonic() < deadline, "disconnects not counted as 499"
        time.sleep(0.1)
    assert requests_total(serve, 499) == before[499] + 10
    assert requests_total(serve, 200) == before[200]


class _Ignored:
    """A stream sink for clients that leave before the end."""

    def take(self, event: dict) -> None:
        """Nothing to keep."""


def test_frozen_frontend_loses_no_stream(serve: MockServe) -> None:
    def freeze() -> None:
        serve.proc.send_signal(signal.SIGSTOP)  # the frontend alone: workers are children
        time.sleep(6.0)  # longer than the old 4 s reply timeout
        serve.proc.send_signal(signal.SIGCONT)

    streams = run_streams(serve.url, 8, 200, fault=freeze)
    assert all(s.complete(200) for s in streams), [vars(s) for s in streams]
    assert serve.complete().status_code == 200
    assert not serve.lines("worker left|migrat"), serve.log()[-3000:]


def blast(port: int, payload: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)


def test_garbage_on_the_frontends_sockets(serve: MockServe) -> None:
    async def publisher_port() -> int:
        discovery = make_discovery(serve.discovery)
        try:
            workers = EndpointAddress.parse(GENERATE_ENDPOINT)
            (record,) = await discovery.list(str(replicas_endpoint(workers)))
            return int(record.address.rsplit(":", 1)[1])
        finally:
            await discovery.close()

    junk = [b"\x00" * 64, b"\xff" * 4096, b"\x16\x03\x01\x02\x00" + b"\x01" * 512, b"\r\n" * 900]
    for port in (serve.port, asyncio.run(publisher_port())):
        for payload in junk:
            blast(port, payload)
    half = socket.create_connection(("127.0.0.1", serve.port))  # a request never finished
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
    try:
        streams = run_streams(serve.url, 4, 50)
        assert all(s.complete(50) for s in streams), [vars(s) for s in streams]
    finally:
        half.close()
    assert serve.proc.poll() is None and serve.healthy()


def test_operators_logs(serve: MockServe) -> None:
    accessed = len(serve.lines(r"shoal\.access .*\"POST /v1/completions\" 200 "))
    ids = [serve.complete(20).json()["id"] for _ in range(3)]
    deadline = time.monotonic() + 10
    while not all(serve.lines(f"request_id={i}") for i in ids):
        assert time.monotonic() < deadline, "no access log line"
        time.sleep(0.1)
    assert len(serve.lines(r"shoal\.access .*\"POST /v1/completions\" 200 ")) == accessed + 3
    assert not serve.lines(r"shoal\.access .*/health")
    stats = r"shoal\.worker\.worker Avg prompt throughput: [\d.]+ tokens/s, Avg generation "
    stats += r"throughput: ([\d.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, GPU KV "
    stats += r"cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%"
    while not any(float(m) > 0 for m in _groups(serve, stats)):
        assert time.monotonic() < deadline, "no stats line with the generated tokens"
        time.sleep(0.1)
    (joined,) = serve.lines("worker joined")
    assert f"model={MODEL} address=tcp://127.0.0.1:" in joined and joined.endswith("(1 workers)")


def _groups(serve: MockServe, pattern: str) -> list[str]:
    return [m.group(1) for line in serve.lines(pattern) if (m := re.search(pattern, line))]


def test_sigterm_drains_a_workers_streams_and_serve_replaces_it(serve: MockServe) -> None:
    (victim,) = serve.worker_pids()
    streams = run_streams(serve.url, 20, 100, fault=lambda: os.kill(victim, signal.SIGTERM))
    assert all(s.complete(100) for s in streams), [vars(s) for s in streams]
    (left,) = serve.lines("worker left")
    assert left.endswith("(0 workers)")
    serve.wait_for_workers(1)  # --restart-workers: a new one joins
    assert victim not in serve.worker_pids()
    assert serve.complete().status_code == 200


FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "logprobs",
    "top_logprobs", "echo", "logit_bias", "stream", "stream_options", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "best_of",
    "response_format", "tools", "tool_choice", "user", "suffix", "prompt_logprobs", "role",
)  # fmt: skip
ODD = (
    None, True, False, -1, 0, 1.5, -1e308, 2**63, 2**64, -(2**64), 10**30, "", "x",
    "\ud800", "9" * 400, [], {}, [1, 2], [[1, -5]], [2**64], {"a": 1}, {"1": 1e300},
    [{"role": "user"}], [{"role": "user", "content": ["x"]}], [{"content": 5}],
)  # fmt: skip


def fuzzed_body(rng) -> tuple[str, bytes]:
    """A request path and a body mutated from a valid one (fields, JSON text or bytes)."""
    path, body = rng.choice(
        [
            ("/v1/completions", {"model": MODEL, "prompt": "The river", "max_tokens": 3}),
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            ),
        ]
    )
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(FIELDS)
        if rng.random() < 0.15:
            body.pop(field, None)
        else:
            body[field] = rng.choice(ODD)
    if not (isinstance(body.get("max_tokens"), int) and 0 <= body["max_tokens"] <= 3):
        body["max_tokens"] = rng.choice([3, -1, 2**64, "3", 1.5])  # no long generations
    text = json.dumps(body, ensure_ascii=True).encode()
    kind = rng.random()
    if kind < 0.1:
        text = text[: rng.randrange(len(text))]
    elif kind < 0.2:
        raw = bytearray(text)
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        text = bytes(raw)
    elif kind < 0.25:
        text = rng.choice([b"[]", b"1", b'"s"', b"null", b"[" * 50_000, b'{"model":' * 20_000])
    return path, text


def test_fuzzed_bodies_get_clean_4xx(serve: MockServe) -> None:
    rng = random.Random(14)
    seen: dict[int, int] = {}
    with httpx.Client(base_url=serve.url, timeout=30) as http:
        for _ in range(300):
            path, text = fuzzed_body(rng)
            headers = {"content-type": "application/json"}
            reply = http.post(path, content=text, headers=headers)
            seen[reply.status_code] = seen.get(reply.status_code, 0) + 1
            assert reply.status_code < 500, (path, text[:300], reply.text[:300])
            if reply.status_code >= 400:
                assert isinstance(reply.json()["error"]["message"], str), reply.text
    assert seen.get(400, 0) > 150 and seen.get(200, 0) > 5, seen
    assert serve.complete().status_code == 200
