"""Request migration with real worker processes: kill -9 or SIGSTOP a worker mid-stream and
every client stream still ends, with the output an undisturbed run gives."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from shoal.frontend import build_app
from shoal.frontend.worker_client import WorkerClient
from shoal.runtime.distributed import DistributedRuntime

MODEL = "tiny"
STREAMS = 12
MAX_TOKENS = 120  # long enough that streams are still running when the fault comes
LEASE_TTL = 10.0  # a killed worker's discovery record outlives it by this much at most


class Cluster:
    """`shoal worker` processes of the tiny model in file discovery, and a frontend (the
    app over a WorkerClient with `options`) on a thread of the test process."""

    def __init__(self, model_dir: Path, folder: Path, **options) -> None:
        self.model_dir, self.folder, self.options = model_dir, folder, options
        self.workers: list[subprocess.Popen] = []
        self.client: WorkerClient | None = None
        self.server: uvicorn.Server | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self.url = ""
        self.last_kill = -LEASE_TTL

    def start(self, workers: int) -> Cluster:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not (self.server and self.server.started):
            assert self.thread.is_alive() and time.monotonic() < deadline, "no frontend"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self.ensure(workers)

    async def _serve(self) -> None:
        runtime = DistributedRuntime(f"file://{self.folder}")
        self.client = await WorkerClient(runtime, **self.options).start()
        config = uvicorn.Config(
            build_app(self.client),
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="off",
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        try:
            await self.server.serve()
        finally:
            await self.client.close()
            await runtime.close()

    def live(self) -> list[subprocess.Popen]:
        return [w for w in self.workers if w.poll() is None]

    def spawn(self) -> None:
        """Start one more worker (it registers once its engine is up)."""
        argv = [sys.executable, "-m", "shoal", "worker", "--model", str(self.model_dir)]
        argv += ["--device", "cpu", "--served-model-name", MODEL, "--log-level", "warning"]
        argv += ["--discovery", f"file://{self.folder}"]
        self.workers.append(subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": "1"}))

    def kill(self, worker: subprocess.Popen) -> None:
        """kill -9 (its discovery record stays until its lease runs out)."""
        worker.kill()
        self.last_kill = time.monotonic()

    def ensure(self, count: int, timeout: float = 90) -> Cluster:
        """Start workers until `count` run, and wait until the frontend sees exactly them
        (a killed worker's record gone)."""
        self.workers = self.live()
        while len(self.workers) < count:
            self.spawn()
        deadline = time.monotonic() + timeout
        while (
            len(self.client.endpoint.instances()) != count
            or time.monotonic() - self.last_kill < LEASE_TTL + 1
        ):
            assert time.monotonic() < deadline, "the workers did not register"
            assert all(w.poll() is None for w in self.workers), "a worker exited"
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for w in self.workers:
            if w.poll() is None:
                w.send_signal(signal.SIGCONT)
                w.kill()
            w.wait()
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    # next_token_timeout is short for the SIGSTOP test; a spurious migration on a loaded
    # machine would still give identical greedy outputs
    cluster = Cluster(llama_dir, tmp_path_factory.mktemp("discovery"), next_token_timeout=3.0)
    yield cluster.start(2)
    cluster.stop()


class Stream:
    """One client's streamed completion: its text, token strings, logprobs and ending."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens: list[str] = []
        self.logprobs: list[float] = []
        self.chunks = 0
        self.finish: str | None = None
        self.error: dict | None = None
        self.usage: dict | None = None

    def take(self, event: dict) -> None:
        if "error" in event:
            self.error = event["error"]
            return
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices", []):
            self.chunks += 1
            self.text += choice["text"]
            if choice.get("logprobs"):
                self.tokens += choice["logprobs"]["tokens"]
                self.logprobs += choice["logprobs"]["token_logprobs"]
            self.finish = choice.get("finish_reason") or self.finish

    def result(self) -> tuple:
        """What must not change when the stream migrates (cache hits may: a second run of
        the same prompts hits the prefix cache)."""
        counts = {k: v for k, v in (self.usage or {}).items() if k != "prompt_tokens_details"}
        return self.text, self.tokens, self.finish, counts


def body(i: int, sampling: dict) -> dict:
    return {
        "model": MODEL,
        "prompt": f"Stream {i} tells the story of river number {i * 7} and its fish",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 1,
        **sampling,
    }


async def stream_one(http: httpx.AsyncClient, payload: dict, into: Stream) -> None:
    async with http.stream("POST", "/v1/completions", json=payload) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                into.take(json.loads(line[6:]))


def run_streams(url: str, sampling: dict, fault=None) -> list[Stream]:
    """STREAMS concurrent streams; `fault()` runs once every stream has two chunks (or
    ended: sampled text may come in few chunks)."""

    async def main() -> list[Stream]:
        streams = [Stream() for _ in range(STREAMS)]
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            tasks = [
                asyncio.create_task(stream_one(http, body(i, sampling(i)), s))
                for i, s in enumerate(streams)
            ]
            if fault is not None:
                pairs = list(zip(streams, tasks, strict=True))
                while any(s.chunks < 2 and not t.done() for s, t in pairs):
                    await asyncio.sleep(0.005)
                fault()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return streams

    return asyncio.run(main())


def assert_same(disturbed: list[Stream], undisturbed: list[Stream]) -> None:
    for got, want in zip(disturbed, undisturbed, strict=True):
        assert got.error is None, got.error
        assert got.finish == "length" and len(got.tokens) == MAX_TOKENS
        assert got.result() == want.result()
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def migrations(caplog) -> int:
    return sum("migration" in r.getMessage() for r in caplog.records)


GREEDY = {"temperature": 0.0}


def seeded(i: int) -> dict:
    return {"temperature": 1.0, "seed": 1000 + i}


def kill_9_mid_stream(cluster: Cluster, caplog, sampling) -> None:
    cluster.ensure(2)
    undisturbed = run_streams(cluster.url, sampling)
    victim = cluster.workers[0]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="shoal.frontend.worker_client"):
        disturbed = run_streams(cluster.url, sampling, fault=lambda: cluster.kill(victim))
    assert victim.wait(5) == -signal.SIGKILL
    assert migrations(caplog) >= 1  # the victim had streams in flight
    assert time.monotonic() - start < 25
    assert_same(disturbed, undisturbed)


def test_kill_9_mid_stream_greedy_streams_complete_identical(cluster, caplog):
    kill_9_mid_stream(cluster, caplog, lambda i: GREEDY)


def test_kill_9_mid_stream_seeded_streams_continue_their_draws(cluster, caplog):
    kill_9_mid_stream(cluster, caplog, seeded)


def test_a_stopped_worker_has_its_requests_migrated(cluster, caplog):
    cluster.ensure(2)
    undisturbed = run_streams(cluster.url, lambda i: GREEDY)
    victim = cluster.workers[0]
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="shoal.frontend.worker_client"):
            disturbed = run_streams(
                cluster.url, lambda i: GREEDY, fault=lambda: victim.send_signal(signal.SIGSTOP)
            )
        took = time.monotonic() - start
        # a new request while the worker is stopped is served (not 404, not lost)
        reply = httpx.post(
            f"{cluster.url}/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 3},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
    finally:
        victim.send_signal(signal.SIGCONT)
    assert migrations(caplog) >= 1
    assert 3.0 <= took < 25
    assert_same(disturbed, undisturbed)
    assert len(cluster.client.endpoint.instances()) == 2  # slow, not dead: still registered
