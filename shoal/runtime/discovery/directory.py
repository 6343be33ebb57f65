"""Discovery through a directory shared by the processes of one host.

Each registration is a file `root/namespace/component/endpoint/<instance_id>.json` holding the
InstanceRecord as JSON; its modification time is the lease's expiry (wall clock), pushed
forward every ttl/3 by the owner. A process killed with SIGKILL stops pushing, so readers stop
seeing its instance after at most `ttl` seconds. Watchers poll the directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from shoal.protocol import InstanceRecord
from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.discovery.base import (
    DEFAULT_LEASE_TTL,
    Discovery,
    InstanceEvent,
    decode_record,
    diff,
    instance_path,
)

log = logging.getLogger(__name__)


def _write(path: Path, data: bytes, ttl: float) -> None:
    """Atomically write a registration file whose mtime is its expiry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    expiry = time.time() + ttl
    os.utime(tmp, (expiry, expiry))
    os.replace(tmp, path)


def _renew(path: Path, data: bytes, ttl: float) -> None:
    expiry = time.time() + ttl
    try:
        os.utime(path, (expiry, expiry))
    except FileNotFoundError:  # a reader reaped it while this process was stalled
        _write(path, data, ttl)


class DirectoryDiscovery(Discovery):
    """Discovery for several processes on one host, through files under `root`."""

    def __init__(
        self, root: str | os.PathLike[str], *, poll_interval: float = 0.1, reap_after: float = 30.0
    ) -> None:
        self.root = Path(root)
        self.poll_interval = poll_interval
        self.reap_after = reap_after
        self._own: dict[Path, asyncio.Task[None]] = {}

    def _path(self, record: InstanceRecord) -> Path:
        return self.root / f"{instance_path(record)}.json"

    async def register(self, record: InstanceRecord, ttl: float = DEFAULT_LEASE_TTL) -> None:
        path = self._path(record)
        data = msgspec.json.encode(record)
        await asyncio.to_thread(_write, path, data, ttl)
        old = self._own.pop(path, None)
        if old is not None:
            old.cancel()
        self._own[path] = asyncio.create_task(self._keep_alive(path, data, ttl))

    async def _keep_alive(self, path: Path, data: bytes, ttl: float) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                await asyncio.to_thread(_renew, path, data, ttl)
            except OSError as exc:
                log.warning("cannot renew registration %s: %s", path, exc)

    async def unregister(self, record: InstanceRecord) -> None:
        await self._release(self._path(record))

    async def _release(self, path: Path) -> None:
        task = self._own.pop(path, None)
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(path.unlink, missing_ok=True)

    async def list(self, endpoint: str | EndpointAddress) -> list[InstanceRecord]:
        folder = self.root / EndpointAddress.parse(endpoint).path
        return list((await asyncio.to_thread(self._scan, folder, {})).values())

    async def watch(self, endpoint: str | EndpointAddress) -> AsyncIterator[InstanceEvent]:
        folder = self.root / EndpointAddress.parse(endpoint).path
        known: dict[str, InstanceRecord] = {}
        cache: dict[str, tuple[int, InstanceRecord]] = {}
        while True:
            current = await asyncio.to_thread(self._scan, folder, cache)
            for event in diff(known, current):
                yield event
            await asyncio.sleep(self.poll_interval)

    def _scan(
        self, folder: Path, cache: dict[str, tuple[int, InstanceRecord]]
    ) -> dict[str, InstanceRecord]:
        """Live records in `folder` by instance id; `cache` keeps decoded files by inode."""
        now = time.time()
        live: dict[str, InstanceRecord] = {}
        seen: set[str] = set()
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            entries = []
        for entry in entries:
            name = entry.name
            if name.startswith(".") or not name.endswith(".json"):
                continue
            try:
                stat = entry.stat()
                if stat.st_mtime <= now:
                    if stat.st_mtime < now - self.reap_after:
                        os.unlink(entry.path)
                    continue
                cached = cache.get(name)
                if cached is None or cached[0] != stat.st_ino:
                    cached = cache[name] = (
                        stat.st_ino,
                        decode_record(Path(entry.path).read_bytes()),
                    )
            except FileNotFoundError:
                continue
            except msgspec.DecodeError as exc:
                log.warning("ignoring unreadable registration %s: %s", entry.path, exc)
                continue
            seen.add(name)
            live[cached[1].instance_id] = cached[1]
        for name in [n for n in cache if n not in seen]:
            del cache[name]
        return live

    async def close(self) -> None:
        for path in list(self._own):
            await self._release(path)
