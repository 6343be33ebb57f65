"""Helpers for the runtime tests: asyncio runner, worker subprocesses, a real etcd server."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
from ports import free_port

from shoal.protocol import EngineOutput, EngineRequest
from shoal.runtime import RequestServer

ENDPOINT = "test.worker.generate"
WORKER = Path(__file__).with_name("worker_proc.py")
REPO = Path(__file__).resolve().parents[2]


class RawPlane:
    """A bare request-plane connection that speaks the wire format itself (the magic, the
    frame count, each frame's length, the frames), for tests that craft messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, address: str) -> RawPlane:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        return cls(*await asyncio.open_connection(host, int(port)))

    async def send_multipart(self, frames: list[bytes]) -> None:
        lengths = struct.pack(f"<{len(frames)}I", *map(len, frames))
        self.writer.write(b"\xb5\x01" + struct.pack("<H", len(frames)) + lengths + b"".join(frames))
        await self.writer.drain()

    async def recv_multipart(self) -> list[bytes]:
        magic, count = struct.unpack("<2sH", await self.reader.readexactly(4))
        assert magic == b"\xb5\x01", magic
        lengths = struct.unpack(f"<{count}I", await self.reader.readexactly(4 * count))
        return [await self.reader.readexactly(n) for n in lengths]

    def close(self) -> None:
        self.writer.close()


def run(coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    """Run a test coroutine on a fresh event loop, failing it after `timeout` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def spawn_env() -> dict[str, str]:
    """The environment of a worker_proc.py subprocess (the repository on its path)."""
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def spawn_argv(*args: str) -> list[str]:
    """The command line of worker_proc.py with `args`."""
    return [sys.executable, str(WORKER), *args]


async def spawn(*args: str, ready_timeout: float = 60.0) -> tuple[asyncio.subprocess.Process, dict]:
    """Start worker_proc.py with `args`; returns the process and its READY info."""
    proc = await asyncio.create_subprocess_exec(
        *spawn_argv(*args), stdout=asyncio.subprocess.PIPE, env=spawn_env()
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(ready_timeout):
            while True:
                line = await proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"worker {args} exited with {await proc.wait()}")
                if line.startswith(b"READY "):
                    return proc, json.loads(line[6:])
    except BaseException:
        await reap(proc)
        raise


async def reap(proc: asyncio.subprocess.Process) -> None:
    """Kill a worker if it still runs (continuing it first if stopped) and wait for it."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    await proc.wait()


async def wait_until(predicate: Any, timeout: float, interval: float = 0.02) -> float:
    """Poll `predicate` (sync or async) until true; returns the seconds it took."""
    start = time.monotonic()
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def etcd_binary() -> str:
    """Path of the etcd server, installing Debian's etcd-server if it is missing."""
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("etcd is not installed and apt-get (as root) is not available to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "etcd-server"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        result = subprocess.run(install, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot install etcd-server: {result.stderr.strip()[-300:]}")
    if not os.path.exists("/usr/bin/etcd"):
        pytest.skip("etcd-server installed but /usr/bin/etcd is missing")
    return "/usr/bin/etcd"


class EtcdServer:
    """A real single-member etcd on loopback, with a temp data dir; restartable."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.discovery_url = f"etcd://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.workdir / "etcd.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--name=test",
                f"--data-dir={self.workdir / 'data'}",
                f"--listen-client-urls={self.url}",
                f"--advertise-client-urls={self.url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                # short raft ticks so that etcd accepts 1-second lease TTLs
                "--heartbeat-interval=10",
                "--election-timeout=50",
            ],
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited: {(self.workdir / 'etcd.log').read_text()[-2000:]}"
                )
            try:
                if httpx.post(f"{self.url}/v3/kv/range", json={"key": "AA=="}).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("etcd did not become ready in 20s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def wipe(self) -> None:
        shutil.rmtree(self.workdir / "data", ignore_errors=True)


async def count_up(req: EngineRequest) -> AsyncIterator[EngineOutput]:
    """Yields one output per token, the last one finished."""
    n = req.sampling.max_tokens or 1
    for i in range(n):
        yield EngineOutput(
            request_id=req.request_id,
            new_token_ids=[i],
            finish_reason="length" if i == n - 1 else None,
        )


async def serving(handler=count_up, **kwargs) -> RequestServer:
    server = RequestServer(**kwargs)
    await server.start()
    server.add_endpoint(ENDPOINT, handler, EngineRequest)
    return server
