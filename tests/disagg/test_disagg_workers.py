"""Disaggregated serving with real worker processes: one `shoal worker --role prefill`, one
`--role decode`, and a DisaggClient in the test process; outputs match an aggregated engine
token for token, only missing blocks travel, and pinned blocks never leak. Every test runs
once per KV transfer backend: host and NIXL (where a NIXL wheel imports) on the CPU, and
CUDA IPC and NIXL with the workers on the GPU (marked gpu: the device machine runs them)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from ports import free_port

from shoal.disagg.nixl import load_nixl
from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.frontend.disagg_client import DisaggClient
from shoal.frontend.worker_client import WorkerClient
from shoal.protocol import EngineRequest, SamplingParams
from shoal.runtime.distributed import DistributedRuntime

MODEL = "tiny"
PIN_TIMEOUT = 4.0
BACKENDS = [
    "host",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(load_nixl() is None, reason="no NIXL wheel installed")
    ),
    pytest.param(
        "cuda_ipc",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
    pytest.param(  # NIXL reading VRAM: backend:device
        "nixl:cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            pytest.mark.skipif(load_nixl() is None, reason="no NIXL wheel installed"),
        ],
    ),
]
GPU_KV_BYTES = 64 * 2**20  # each process's KV cache on the one GPU


class Worker:
    """One `shoal worker` process with its /metrics port."""

    def __init__(
        self, model_dir: Path, folder: Path, role: str, backend: str, device: str = "cpu"
    ) -> None:
        self.port = free_port()
        self.device = device
        argv = [sys.executable, "-m", "shoal", "worker", "--model", str(model_dir)]
        argv += ["--device", device, "--served-model-name", MODEL, "--log-level", "warning"]
        argv += ["--discovery", f"file://{folder}", "--role", role]
        argv += ["--kv-transfer-backend", backend]
        if device == "cuda":
            argv += ["--kv-cache-memory-bytes", str(GPU_KV_BYTES)]
        argv += ["--metrics-port", str(self.port), "--kv-pin-timeout", str(PIN_TIMEOUT)]
        self.proc = subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def metric(self, name: str, labels: str = "") -> float:
        """The sum of a metric's samples whose labels contain `labels` (0: none yet)."""
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
        lines = text.splitlines()
        return sum(
            float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name + "{") and labels in x
        )

    def wait_metric(self, name: str, want: float, labels: str = "", timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while (value := self.metric(name, labels)) != want:
            assert time.monotonic() < deadline, f"{name} stayed {value}, not {want}"
            time.sleep(0.1)


class Frontend:
    """A DisaggClient over a kv-routed WorkerClient, on an event loop thread of its own."""

    def __init__(self, folder: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client: DisaggClient = self.call(self._start(folder))

    async def _start(self, folder: Path) -> DisaggClient:
        self.runtime = DistributedRuntime(f"file://{folder}")
        workers = await WorkerClient(self.runtime, "kv").start()
        return await DisaggClient(workers, self.runtime, "kv").start()

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generate(self, request: EngineRequest, threshold: int) -> list[int]:
        self.client.max_local_prefill_length = threshold

        async def collect() -> list[int]:
            out = []
            async for item in self.client.generate(MODEL, request):
                out += item.new_token_ids
            return out

        return self.call(collect())

    def prefills(self, where: str) -> float:
        return sum(
            s.value
            for m in self.client.prefills.collect()
            for s in m.samples
            if s.name.endswith("_total") and s.labels["where"] == where
        )

    def close(self) -> None:
        async def stop() -> None:
            await self.client.close()
            await self.runtime.close()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def start_cluster(folder: Path, workers: list[Worker]) -> Frontend:
    """A frontend once every worker has registered (the prefill worker first)."""
    frontend = Frontend(folder)
    deadline = time.monotonic() + 120
    while not (
        frontend.client.prefill_endpoint.instances()
        and len(frontend.client.workers.endpoint.instances()) == len(workers) - 1
    ):
        assert all(w.proc.poll() is None for w in workers), "a worker exited"
        assert time.monotonic() < deadline, "the workers did not register"
        time.sleep(0.1)
    return frontend


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request, llama_dir, tmp_path_factory):
    backend, _, device = request.param.partition(":")
    folder = tmp_path_factory.mktemp("disagg")
    device = device or ("cuda" if backend == "cuda_ipc" else "cpu")
    prefill = Worker(llama_dir, folder, "prefill", backend, device)
    decode = Worker(llama_dir, folder, "decode", backend, device)
    frontend = start_cluster(folder, [prefill, decode])
    yield prefill, decode, frontend
    frontend.close()
    for w in (prefill, decode):
        w.proc.kill()
        w.proc.wait()


@pytest.fixture(scope="module")
def reference(llama_dir, cluster):
    """An aggregated engine on the workers' device."""
    device = cluster[0].device
    memory = {"kv_cache_memory_bytes": GPU_KV_BYTES} if device == "cuda" else {}
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device=device, **memory))

    def run(request: EngineRequest) -> list[int]:
        engine.add_request(request)
        out: list[int] = []
        while engine.has_unfinished_requests():
            out += [t for o in engine.step() for t in o.new_token_ids]
        return out

    return run


def request_for(
    rid: str, length: int, seed: int | None = None, max_tokens: int = 10
) -> EngineRequest:
    prompt = [(i * 29 + length) % 370 + 3 for i in range(length)]
    sp = SamplingParams(
        temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=max_tokens, ignore_eos=True
    )
    return EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp)


def test_remote_prefill_matches_aggregated(cluster, reference, request):
    prefill, decode, frontend = cluster
    backend = request.node.callspec.params["cluster"].partition(":")[0]
    for i, (length, seed) in enumerate([(7, None), (83, None), (200, None), (90, 5)]):
        req = request_for(f"same-{i}", length, seed)
        remote = frontend.prefills("remote")
        assert frontend.generate(req, threshold=0) == reference(req)
        assert frontend.prefills("remote") == remote + 1
    decode.wait_metric(
        "shoal_kv_transfers_total", 4, f'backend="{backend}",model="{MODEL}",outcome="ok"'
    )
    prefill.wait_metric("shoal_kv_pinned_blocks", 0)
    # the pins went because the decode worker read the blocks (a NIXL READ's notification)
    assert prefill.metric("shoal_kv_pinned_releases_total", 'reason="pulled"') == 4


def test_only_missing_blocks_travel(cluster, reference):
    _, decode, frontend = cluster
    full = request_for("part", 160)  # 10 blocks
    head = EngineRequest(
        request_id="part-head", prompt_token_ids=full.prompt_token_ids[:70], sampling=full.sampling
    )
    frontend.generate(head, threshold=10_000)  # local: the decode worker caches 4 blocks
    pulled = decode.metric("shoal_kv_transfer_blocks_total")
    cached = decode.metric("shoal_kv_transfer_cached_blocks_total")
    assert frontend.generate(full, threshold=0) == reference(full)
    assert decode.metric("shoal_kv_transfer_blocks_total") == pulled + 6
    assert decode.metric("shoal_kv_transfer_cached_blocks_total") == cached + 4


def test_threshold_switches_local_and_remote(cluster, reference):
    _, _, frontend = cluster
    local, remote = frontend.prefills("local"), frontend.prefills("remote")
    short, long = request_for("short", 40), request_for("long", 120)
    assert frontend.generate(short, threshold=64) == reference(short)
    assert frontend.generate(long, threshold=64) == reference(long)
    assert (frontend.prefills("local"), frontend.prefills("remote")) == (local + 1, remote + 1)
    again = request_for("long-again", 120)
    assert frontend.generate(again, threshold=200) == reference(again)
    assert frontend.prefills("local") == local + 2


def test_abandoned_prefill_unpins(cluster):
    prefill, _, frontend = cluster
    timeouts = prefill.metric("shoal_kv_pinned_releases_total", 'reason="timeout"')

    async def first_then_leave() -> None:
        stream = frontend.client.generate(MODEL, request_for("gone", 150))
        await anext(stream)
        await stream.aclose()  # the client disconnects before any decode worker pulls

    frontend.client.max_local_prefill_length = 0
    frontend.call(first_then_leave())
    prefill.wait_metric("shoal_kv_pinned_blocks", 0)
    assert prefill.metric("shoal_kv_pinned_releases_total", 'reason="released"') >= 1
    # a prefill whose decode side never comes (a dead decode worker) is unpinned on time
    instance = frontend.client.prefill_endpoint.instances()[0]
    first = frontend.call(frontend.client._prefill(instance, request_for("orphan", 150)))
    assert first.kv_transfer is not None
    prefill.wait_metric("shoal_kv_pinned_blocks", 10)
    prefill.wait_metric("shoal_kv_pinned_blocks", 0, timeout=PIN_TIMEOUT + 10)
    assert prefill.metric("shoal_kv_pinned_releases_total", 'reason="timeout"') == timeouts + 1


def test_prefill_worker_dies_before_the_pull(cluster, reference):
    prefill, decode, frontend = cluster
    req = request_for("killed", 130, seed=3)
    frontend.client.max_local_prefill_length = 0

    async def kill_after_first_token() -> list[int]:
        out = []
        async for item in frontend.client.generate(MODEL, req):
            if not out:
                prefill.proc.kill()
                await asyncio.to_thread(prefill.proc.wait)
            out += item.new_token_ids
        return out

    fallbacks = decode.metric("shoal_kv_transfer_local_prefills_total")
    assert frontend.call(kill_after_first_token()) == reference(req)
    assert decode.metric("shoal_kv_transfer_local_prefills_total") == fallbacks + 1
