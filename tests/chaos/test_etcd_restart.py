"""etcd restarts under load: `shoal serve` over a real etcd with two mocker workers keeps
every stream and answers every request while etcd is down and after it restarts with its
data; after a restart with its data lost, the workers are back in discovery within a
second or so and no stream is lost."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
from mock_serve import MODEL, MockServe, run_streams
from runtime_helpers import EtcdServer, etcd_binary

from shoal.protocol import GENERATE_ENDPOINT
from shoal.runtime.discovery import make_discovery


def registered(url: str) -> int:
    """Generate instances etcd holds now."""

    async def count() -> int:
        discovery = make_discovery(url)
        try:
            return len(await discovery.list(GENERATE_ENDPOINT))
        finally:
            await discovery.close()

    return asyncio.run(count())


class Traffic:
    """Short completions, one after another on a thread, until stopped; their answers."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[httpx.Response] = []
        self.running = True
        self.thread = threading.Thread(target=self._send)
        self.thread.start()

    def _send(self) -> None:
        body = {"model": MODEL, "prompt": "The river", "max_tokens": 2}
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while self.running:
                self.answers.append(http.post("/v1/completions", json=body))

    def stop(self) -> list[httpx.Response]:
        self.running = False
        self.thread.join(timeout=60)
        return self.answers


def test_etcd_restarts_fail_no_request(mock_model_dir: Path, tmp_path: Path) -> None:
    etcd = EtcdServer(etcd_binary(), tmp_path)
    etcd.start()
    flags = ("--speedup", "0.25")
    serve = MockServe(mock_model_dir, tmp_path, *flags, workers=2, discovery=etcd.discovery_url)
    try:
        serve.wait_for_workers(2)
        for lose_data in (False, True):

            def restart(lose_data: bool = lose_data) -> None:
                etcd.stop()
                time.sleep(1.0)  # down for a while, requests going on
                if lose_data:
                    etcd.wipe()
                etcd.start()
                back = time.monotonic() + 1.5  # the workers retry their keep-alives
                while registered(etcd.discovery_url) != 2:
                    assert time.monotonic() < back, "the workers did not register again"
                    time.sleep(0.05)

            traffic = Traffic(serve.url)
            streams = run_streams(serve.url, 12, 150, fault=restart)
            answers = traffic.stop()
            assert all(s.complete(150) for s in streams), [vars(s) for s in streams]
            assert len(answers) > 10
            refused = [a for a in answers if a.status_code != 200]
            if lose_data:  # the frontend may drop the workers until they register again
                assert all(a.status_code == 503 and "retry-after" in a.headers for a in refused)
            else:
                assert not refused, [a.text for a in refused]
        after = run_streams(serve.url, 12, 20)
        assert all(s.complete(20) for s in after), [vars(s) for s in after]
        assert serve.proc.poll() is None
        assert serve.workers_seen() == 2, serve.log()[-3000:]
        assert not serve.lines("httpx"), "a log line per etcd call at --log-level info"
    finally:
        serve.stop()
        etcd.stop()
