"""Status codes while workers come and go: a known model without a worker is 503 with
Retry-After (never 404), an unknown model 404, and the model serves again once a worker is
back."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from test_migration import MODEL, Cluster


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    cluster = Cluster(llama_dir, tmp_path_factory.mktemp("discovery"), next_token_timeout=5.0)
    yield cluster.start(1)
    cluster.stop()


def post(url: str, model: str, stream: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": "The river", "max_tokens": 4, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def stream_and_kill(url: str, cluster: Cluster) -> dict:
    """Stream a long completion, kill -9 its worker mid-stream; return the error event."""
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 500, "ignore_eos": True}
    chunks, error = 0, None
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30
    ) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            error = event.get("error", error)
            chunks += 1
            if chunks == 2:
                cluster.kill(cluster.workers[0])
    return error


def test_known_model_without_worker_is_503_unknown_is_404(cluster):
    assert post(cluster.url, MODEL).status_code == 200
    start = time.monotonic()
    # the only worker dies mid-stream: no worker to migrate to, so the stream ends with an
    # error event (not a hang)
    error = stream_and_kill(cluster.url, cluster)
    assert error is not None and error["code"] == "worker_failed", error
    assert cluster.workers[0].wait(5) < 0
    cluster.spawn()  # its replacement starts now and registers in a few seconds
    # the dead worker's record stays in discovery until its lease ends; the frontend saw
    # its connection close and sends it nothing more
    for stream in (False, True, False):
        reply = post(cluster.url, MODEL, stream)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "no_worker_available"
        assert int(reply.headers["retry-after"]) >= 1
    assert time.monotonic() - start < 10
    for stream in (False, True):
        reply = post(cluster.url, "never-served", stream)
        assert reply.status_code == 404, reply.text
        assert reply.json()["error"]["code"] == "model_not_found"
    deadline = time.monotonic() + 25
    while (reply := post(cluster.url, MODEL)).status_code == 503:
        assert time.monotonic() < deadline, "the new worker never served"
        time.sleep(0.2)
    assert reply.status_code == 200, reply.text
