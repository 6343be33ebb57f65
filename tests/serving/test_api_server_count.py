"""`--api-server-count 2`: two frontend processes on one port, both taking requests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import stop_serve
from tiny_models import ARCHITECTURES, BASE, VOCAB_SIZE, write_tokenizer

REQUESTS = 24
HEALTHY_IN_A_ROW = 16


@pytest.fixture(scope="module")
def mock_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer and config without weights: all a mocker worker needs."""
    path = write_tokenizer(tmp_path_factory.mktemp("mock-model"))
    config = {**BASE, **ARCHITECTURES["llama"], "vocab_size": VOCAB_SIZE}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _wait_healthy(proc: subprocess.Popen, base: str, timeout: float = 120.0) -> None:
    """Until HEALTHY_IN_A_ROW fresh connections in a row answer 200. Each process answers
    /health for itself (503 until it has seen a worker), and the kernel picks a process per
    connection, so a frontend still starting is seen with probability 1 - 2^-15."""
    deadline = time.monotonic() + timeout
    in_a_row = 0
    while in_a_row < HEALTHY_IN_A_ROW:
        assert proc.poll() is None, "shoal serve exited during start-up"
        if time.monotonic() > deadline:
            pytest.fail("shoal serve did not become healthy")
        try:
            healthy = httpx.get(f"{base}/health").status_code == 200
        except httpx.HTTPError:
            healthy = False
        in_a_row = in_a_row + 1 if healthy else 0
        if not healthy:
            time.sleep(0.3)


def _served_by(log: Path) -> dict[str, int]:
    """Access-log lines per frontend process (each tags its lines api-server-N)."""
    counts: dict[str, int] = {}
    for match in re.finditer(r"(api-server-\d+) shoal\.access", log.read_text()):
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


def test_two_api_servers_share_the_port_and_the_requests(mock_model, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "shoal", "serve", "--model", str(mock_model)]
    argv += ["--engine", "mocker", "--speedup", "100", "--served-model-name", "tiny"]
    argv += ["--port", str(port), "--api-server-count", "2", "--shutdown-timeout", "5"]
    argv += ["--discovery", f"file://{tmp_path / 'discovery'}"]
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, stderr=stderr, env={**os.environ, "SHOAL_DRAIN_TIMEOUT": "5"})
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, base)
        body = {"model": "tiny", "prompt": "the river", "max_tokens": 4}
        for _ in range(REQUESTS):  # a new connection each: the kernel picks a process for it
            with httpx.Client(base_url=base, timeout=30) as client:
                out = client.post("/v1/completions", json=body)
                assert out.status_code == 200, out.text
                assert out.json()["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 10
        while sum(_served_by(log).values()) < REQUESTS and time.monotonic() < deadline:
            time.sleep(0.1)
        counts = _served_by(log)
        assert sum(counts.values()) == REQUESTS, counts
        assert set(counts) == {"api-server-0", "api-server-1"}, counts
        for _ in range(4):  # whichever process takes the scrape answers for both
            with httpx.Client(base_url=base, timeout=30) as client:
                text = client.get("/metrics").text
            completions = {"endpoint": "/v1/completions", "status": "200"}
            served = _by_process(text, "shoal_requests_total", **completions)
            assert served == {f"{i}": counts[f"api-server-{i}"] for i in range(2)}, served
            assert _by_process(text, "process_cpu_seconds_total").keys() == {"0", "1"}
    finally:
        stop_serve(proc)
    # the processes shut down cleanly (a thread blocked on stdin once aborted each at exit)
    assert "Fatal Python error" not in log.read_text()


def _by_process(text: str, name: str, **labels: str) -> dict[str, float]:
    """The samples called `name` (with these labels), per `api_server` label."""
    return {
        sample.labels["api_server"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    }


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in the router's metrics"
    return float(match.group(1))


def test_api_servers_ask_one_router_service(mock_model, tmp_path):
    """--router-mode remote: serve starts `shoal router`; both frontends route through it,
    and a repeated prompt goes where its blocks are cached."""
    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "shoal", "serve", "--model", str(mock_model)]
    argv += ["--engine", "mocker", "--speedup", "100", "--served-model-name", "tiny"]
    argv += ["--port", str(port), "--api-server-count", "2", "--shutdown-timeout", "5"]
    argv += ["--workers", "2", "--router-mode", "remote"]
    argv += ["--discovery", f"file://{tmp_path / 'discovery'}"]
    env = {**os.environ, "SHOAL_DRAIN_TIMEOUT": "5", "SHOAL_ROUTER_METRICS_PORT": str(metrics_port)}
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, stderr=stderr, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, base)
        prompt = " ".join(["the river runs past the old mill"] * 20)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
        for _ in range(REQUESTS):
            with httpx.Client(base_url=base, timeout=30) as client:
                out = client.post("/v1/completions", json=body)
                assert out.status_code == 200, out.text
            time.sleep(0.05)  # the worker's KV events reach the service
        counts = _served_by(log)
        deadline = time.monotonic() + 10
        while sum(counts.values()) < REQUESTS and time.monotonic() < deadline:
            time.sleep(0.1)
            counts = _served_by(log)
        assert set(counts) == {"api-server-0", "api-server-1"}, counts
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert _metric(metrics, "shoal_router_requests_total") == REQUESTS
        prompt_blocks = _metric(metrics, "shoal_router_prompt_blocks_total")
        # every request after the first finds the prompt's blocks on the worker it goes to
        assert _metric(metrics, "shoal_router_cached_blocks_total") >= prompt_blocks / 2
    finally:
        stop_serve(proc)
    assert "Fatal Python error" not in log.read_text()
