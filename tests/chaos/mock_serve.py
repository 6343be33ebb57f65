"""`shoal serve --engine mocker` as an operator runs it, and client streams against it.

The serve process is the frontend; its workers are its child processes, so a signal to
`proc` hurts the frontend alone and one to a pid of `worker_pids()` a worker alone. Every
process logs to the one stderr, kept in a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from ports import free_port

MODEL = "m"
JOINED = re.compile(r"shoal\.frontend\.workers worker (?:joined|left): .*\((\d+) workers\)")


class MockServe:
    """A `shoal serve` of mocker workers with `flags`, its environment plus `env`."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        *flags: str,
        workers: int = 1,
        discovery: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.discovery = discovery or f"file://{workdir / 'discovery'}"
        self.log_path = workdir / "serve.log"
        argv = [sys.executable, "-m", "shoal", "serve", "--model", str(model)]
        argv += ["--engine", "mocker", "--served-model-name", MODEL, "--workers", str(workers)]
        argv += ["--port", str(self.port), "--discovery", self.discovery]
        argv += ["--shutdown-timeout", "5", *flags]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT
            )

    def log(self) -> str:
        """Everything the frontend and its workers logged so far."""
        return self.log_path.read_text(errors="replace")

    def lines(self, pattern: str) -> list[str]:
        """Log lines matching the regular expression `pattern`."""
        return [line for line in self.log().splitlines() if re.search(pattern, line)]

    def workers_seen(self) -> int:
        """How many workers the frontend says it has, by its last joined/left line."""
        counts = JOINED.findall(self.log())
        return int(counts[-1]) if counts else 0

    def worker_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def wait_for_workers(self, count: int, timeout: float = 60) -> MockServe:
        """Until the frontend has `count` workers and answers /health (fails on serve's exit)."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"shoal serve exited: {self.log()[-3000:]}"
            if self.workers_seen() == count and self.healthy():
                return self
            assert time.monotonic() < deadline, f"no {count} workers: {self.log()[-3000:]}"
            time.sleep(0.1)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, url: str, series: str) -> float:
        """The value of one Prometheus series (name and labels, as printed) at `url`."""
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def complete(self, max_tokens: int = 5) -> httpx.Response:
        body = {"model": MODEL, "prompt": "The river", "max_tokens": max_tokens}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=30)

    def stop(self) -> None:
        """SIGTERM (continuing a stopped frontend first); kill whatever is left."""
        pids = self.worker_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Stream:
    """One client's streamed completion as the client saw it."""

    def __init__(self) -> None:
        self.chunks = 0
        self.text = ""
        self.finish: str | None = None
        self.error: dict | None = None
        self.completion_tokens: int | None = None

    def take(self, event: dict) -> None:
        if "error" in event:
            self.error = event["error"]
        if event.get("usage"):
            self.completion_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            self.chunks += 1
            self.text += choice["text"]
            self.finish = choice.get("finish_reason") or self.finish

    def complete(self, max_tokens: int) -> bool:
        """Whether it ended as an undisturbed stream does: every token, no error."""
        return (
            self.error is None and self.finish == "length" and self.completion_tokens == max_tokens
        )


async def stream_one(http: httpx.AsyncClient, i: int, max_tokens: int, into: Stream) -> None:
    body = {
        "model": MODEL,
        "prompt": f"Stream {i} follows river {i * 7} to the sea",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                into.take(json.loads(line[6:]))


def run_streams(
    url: str, count: int, max_tokens: int, fault: Callable[[], object] | None = None
) -> list[Stream]:
    """`count` concurrent streams; once each has two chunks (or ended), `fault()` runs in a
    thread while the streams go on being read. Returns them once all ended (90 s at most)."""

    async def main() -> list[Stream]:
        streams = [Stream() for _ in range(count)]
        limits = httpx.Limits(max_connections=count + 8)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
            tasks = [
                asyncio.create_task(stream_one(http, i, max_tokens, s))
                for i, s in enumerate(streams)
            ]
            if fault is not None:
                pairs = list(zip(streams, tasks, strict=True))
                async with asyncio.timeout(60):
                    while any(s.chunks < 2 and not t.done() for s, t in pairs):
                        await asyncio.sleep(0.01)
                await asyncio.to_thread(fault)
            await asyncio.wait_for(asyncio.gather(*tasks), 90)
        return streams

    return asyncio.run(main())
