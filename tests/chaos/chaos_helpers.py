"""Real mocker worker processes for the chaos tests, and the ways to reach and hurt them.

As a script: `python chaos_helpers.py MODEL_DIR DISCOVERY_DIR METRICS_PORT [BREAK_FILE]` runs
shoal's worker (serve_worker) over a MockEngine. With BREAK_FILE, every engine step raises
once that file exists: the fault that kills an engine loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from shoal.protocol import GENERATE_ENDPOINT, EngineOutput, EngineRequest, SamplingParams
from shoal.runtime import DistributedRuntime, EndpointClient
from shoal.runtime.discovery import DirectoryDiscovery

REPO = Path(__file__).resolve().parents[2]
SPEEDUP = 1.0  # decode steps of several ms (the 8B timing model): streams last seconds


def request(rid: str, max_tokens: int = 20, **sampling: object) -> EngineRequest:
    """A mocker request: a 32-token prompt, `max_tokens` tokens out, EOS ignored."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return EngineRequest(request_id=rid, prompt_token_ids=list(range(5, 37)), sampling=sp)


def registered(folder: Path) -> list[str]:
    """Addresses of the generate instances registered under the discovery `folder`."""

    async def scan() -> list[str]:
        discovery = DirectoryDiscovery(folder)
        try:
            return [r.address for r in await discovery.list(GENERATE_ENDPOINT)]
        finally:
            await discovery.close()

    return asyncio.run(scan())


class Worker:
    """A mocker worker process registered in a file:// discovery folder."""

    def __init__(
        self, model: Path, folder: Path, metrics_port: int, break_file: Path | None = None
    ) -> None:
        argv = [sys.executable, __file__, str(model), str(folder), str(metrics_port)]
        argv += [str(break_file)] if break_file else []
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.folder = folder
        self.metrics = f"http://127.0.0.1:{metrics_port}"
        self.log_path = folder.with_name(folder.name + "-worker.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stderr=log)
        deadline = time.monotonic() + 60
        while not registered(folder):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"worker did not start: {self.log()[-2000:]}")
            time.sleep(0.2)
        self.address = registered(folder)[0]

    def log(self) -> str:
        """What the worker wrote to stderr so far (its log)."""
        return self.log_path.read_text(errors="replace")

    def health(self) -> int:
        return httpx.get(f"{self.metrics}/health", timeout=5).status_code

    def gauge(self, name: str) -> float:
        """The value of a worker gauge from /metrics."""
        for line in httpx.get(f"{self.metrics}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


async def client(folder: Path) -> tuple[DistributedRuntime, EndpointClient[EngineOutput]]:
    """A runtime following `folder` and its client of the generate endpoint (one instance)."""
    runtime = DistributedRuntime(DirectoryDiscovery(folder, poll_interval=0.05))
    endpoint = await runtime.client(GENERATE_ENDPOINT, EngineOutput)
    await endpoint.wait_for_instances(1, timeout=10)
    return runtime, endpoint


async def collect(endpoint: EndpointClient[EngineOutput], req: EngineRequest) -> list[EngineOutput]:
    """Every output of one request to the endpoint's first instance."""
    (instance, *_) = endpoint.instances()
    async with endpoint.generate(instance, req) as stream:
        return [out async for out in stream]


def _serve(model: str, folder: str, metrics_port: int, break_file: str | None) -> None:
    import logging

    from shoal.engine.config import EngineConfig
    from shoal.mocker.engine import MockEngine
    from shoal.worker.worker import serve_worker

    class BreakableEngine(MockEngine):
        def step(self) -> list[EngineOutput]:
            if break_file is not None and os.path.exists(break_file):
                raise RuntimeError("injected engine fault")
            return super().step()

    def make_engine() -> MockEngine:
        config = EngineConfig(model=model, device="cpu", num_gpu_blocks=4096)
        return BreakableEngine(config, speedup=SPEEDUP)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(
        serve_worker(
            make_engine, "mock", f"file://{folder}", metrics_port=metrics_port, drain_timeout=5
        )
    )


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
