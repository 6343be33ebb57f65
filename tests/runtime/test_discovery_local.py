"""Local discovery: in-process, and a directory shared by real worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from runtime_helpers import reap, run, spawn, wait_until

from shoal.protocol import InstanceRecord, ModelCard
from shoal.runtime import DirectoryDiscovery, Discovery, InstanceEvent, MemoryDiscovery
from shoal.runtime.discovery import MemoryRegistry

ENDPOINT = "test.worker.generate"
CARD = ModelCard(
    model_name="tiny",
    tokenizer="/models/tiny",
    context_length=2048,
    kv_block_size=16,
    num_kv_blocks=512,
)


def record(instance_id: str, endpoint: str = ENDPOINT) -> InstanceRecord:
    return InstanceRecord(
        instance_id=instance_id,
        endpoint=endpoint,
        address=f"tcp://127.0.0.1:{5000 + len(instance_id)}",
        card=CARD,
        extra={"kv_events": "tcp://127.0.0.1:6000"},
    )


class Watcher:
    """Collects a discovery watch's events in the background."""

    def __init__(self, discovery: Discovery, endpoint: str = ENDPOINT) -> None:
        self.events: list[tuple[float, InstanceEvent]] = []
        self._watch: AsyncIterator[InstanceEvent] = discovery.watch(endpoint)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for event in self._watch:
            self.events.append((time.monotonic(), event))

    def seen(self, kind: str, instance_id: str) -> float | None:
        """When the watch reported `kind` for `instance_id`, or None."""
        for at, event in self.events:
            if event.kind == kind and event.instance.instance_id == instance_id:
                return at
        return None

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._watch.aclose()


async def check_backend(handle: Callable[[], Discovery]) -> None:
    """Handles on one backend: registration, watch, re-registration, unregister, close."""
    a, b, observer = handle(), handle(), handle()
    watcher = Watcher(observer)  # its own handle: b's watch may end with b.close() below
    await a.register(record("one"), ttl=5)
    await b.register(record("two"), ttl=5)
    await a.register(record("other", endpoint="test.other.generate"), ttl=5)
    assert sorted(r.instance_id for r in await b.list(ENDPOINT)) == ["one", "two"]
    assert [r for r in await b.list(ENDPOINT) if r.instance_id == "one"] == [record("one")]
    await wait_until(lambda: watcher.seen("added", "one") and watcher.seen("added", "two"), 5)

    changed = InstanceRecord(instance_id="one", endpoint=ENDPOINT, address="tcp://127.0.0.1:1")
    await a.register(changed, ttl=5)  # a changed record is reported as added again
    await wait_until(lambda: any(e.instance == changed for _, e in watcher.events), 5)

    await a.unregister(changed)
    await wait_until(lambda: watcher.seen("removed", "one"), 5)
    assert [r.instance_id for r in await a.list(ENDPOINT)] == ["two"]
    await b.close()  # unregisters what b registered, nothing else
    await wait_until(lambda: watcher.seen("removed", "two"), 5)
    assert [r.instance_id for r in await a.list("test.other.generate")] == ["other"]
    assert all(e.instance.endpoint == ENDPOINT for _, e in watcher.events)
    await watcher.close()
    await observer.close()
    await a.close()
    async with handle() as c:
        assert await c.list("test.other.generate") == []


def test_memory_discovery() -> None:
    registry = MemoryRegistry()
    run(check_backend(lambda: MemoryDiscovery(registry)))


def test_directory_discovery_in_process(tmp_path: Path) -> None:
    run(check_backend(lambda: DirectoryDiscovery(tmp_path, poll_interval=0.05)))


def test_directory_lease_expires_without_renewal_and_is_reaped(tmp_path: Path) -> None:
    async def main() -> None:
        owner = DirectoryDiscovery(tmp_path)
        reader = DirectoryDiscovery(tmp_path, reap_after=0.5)
        await owner.register(record("stale"), ttl=0.6)
        await asyncio.sleep(1.0)
        assert [r.instance_id for r in await reader.list(ENDPOINT)] == ["stale"]  # renewed
        for task in owner._own.values():  # the owner stalls: no more renewals
            task.cancel()
        gone = await wait_until(lambda: _empty(reader), timeout=3)
        assert gone < 1.0
        files = list((tmp_path / "test/worker/generate").glob("*.json"))
        assert len(files) == 1  # expired but not yet reaped
        await asyncio.sleep(0.6)
        await reader.list(ENDPOINT)
        assert list((tmp_path / "test/worker/generate").glob("*.json")) == []

    run(main())


async def _empty(discovery: Discovery) -> bool:
    return not await discovery.list(ENDPOINT)


def test_directory_discovery_across_processes(tmp_path: Path) -> None:
    async def main() -> None:
        url = f"file://{tmp_path}"
        discovery = DirectoryDiscovery(tmp_path, poll_interval=0.05)
        watcher = Watcher(discovery)
        (killed, a), (stopped, b) = await asyncio.gather(
            spawn("serve", url, ENDPOINT, "1.0", "0"), spawn("serve", url, ENDPOINT, "1.0", "0")
        )
        try:
            listed = {r.instance_id: r for r in await discovery.list(ENDPOINT)}
            assert set(listed) == {a["instance_id"], b["instance_id"]}
            assert listed[a["instance_id"]].address == a["address"]
            assert listed[a["instance_id"]].card == CARD
            assert listed[a["instance_id"]].extra == {"kv_events": "tcp://127.0.0.1:1"}
            await wait_until(lambda: watcher.seen("added", b["instance_id"]), 2)

            await asyncio.sleep(1.5)  # longer than the TTL: the leases are being renewed
            assert len(await discovery.list(ENDPOINT)) == 2

            killed.kill()  # SIGKILL: no chance to unregister
            at_kill = time.monotonic()
            assert a["instance_id"] in {r.instance_id for r in await discovery.list(ENDPOINT)}
            await wait_until(lambda: watcher.seen("removed", a["instance_id"]), 3)
            lag = watcher.seen("removed", a["instance_id"]) - at_kill
            assert 0.4 < lag < 1.6, f"removed {lag:.2f}s after the kill, TTL is 1s"

            stopped.send_signal(signal.SIGTERM)  # graceful: unregisters at once
            at_term = time.monotonic()
            await wait_until(lambda: watcher.seen("removed", b["instance_id"]), 3)
            assert watcher.seen("removed", b["instance_id"]) - at_term < 0.6
            assert await stopped.wait() == 0
            assert await discovery.list(ENDPOINT) == []
        finally:
            await reap(killed)
            await reap(stopped)
            await watcher.close()

    run(main())
