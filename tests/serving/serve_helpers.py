"""Start and stop a real `shoal serve` for the serving tests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ports import free_port

from shoal.protocol import GENERATE_ENDPOINT
from shoal.runtime.discovery import DirectoryDiscovery


def instances(folder: Path) -> int:
    async def count() -> int:
        discovery = DirectoryDiscovery(str(folder))
        try:
            return len(await discovery.list(GENERATE_ENDPOINT))
        finally:
            await discovery.close()

    return asyncio.run(count())


def worker_pids(serve_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(serve_pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def start_serve(
    model: Path, folder: Path, workers: int, extra_args: list[str] | None = None
) -> tuple[subprocess.Popen, str, Path]:
    """`shoal serve` of the tiny model as "tiny", once healthy with all its workers;
    extra_args are more `shoal serve` flags."""
    port = free_port()
    argv = [sys.executable, "-m", "shoal", "serve", "--model", str(model)]
    argv += ["--workers", str(workers), "--port", str(port), "--discovery", f"file://{folder}"]
    argv += ["--device", "cpu", "--served-model-name", "tiny", "--shutdown-timeout", "5"]
    argv += extra_args or []
    proc = subprocess.Popen(argv, env={**os.environ, "SHOAL_DRAIN_TIMEOUT": "5"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health").status_code == 200 and instances(folder) == workers:
                return proc, base, folder
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "shoal serve exited during start-up"
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"shoal serve did not become healthy with {workers} workers")


def stop_serve(proc: subprocess.Popen) -> None:
    """SIGTERM: the server drains, stops its workers and exits with status 0."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not worker_pids(proc.pid)
