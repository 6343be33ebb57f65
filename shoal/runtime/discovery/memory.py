"""In-process discovery: one registry per process, shared by every MemoryDiscovery in it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from shoal.protocol import InstanceRecord
from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.discovery.base import DEFAULT_LEASE_TTL, Discovery, InstanceEvent


class MemoryRegistry:
    """The store behind MemoryDiscovery: records and watchers per endpoint (one event loop)."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, InstanceRecord]] = {}
        self.watchers: dict[str, set[asyncio.Queue[InstanceEvent]]] = {}

    def put(self, record: InstanceRecord) -> None:
        instances = self.records.setdefault(record.endpoint, {})
        if instances.get(record.instance_id) != record:
            instances[record.instance_id] = record
            self._notify(record.endpoint, InstanceEvent("added", record))

    def delete(self, record: InstanceRecord) -> None:
        gone = self.records.get(record.endpoint, {}).pop(record.instance_id, None)
        if gone is not None:
            self._notify(record.endpoint, InstanceEvent("removed", gone))

    def _notify(self, endpoint: str, event: InstanceEvent) -> None:
        for queue in self.watchers.get(endpoint, ()):
            queue.put_nowait(event)


PROCESS_REGISTRY = MemoryRegistry()


class MemoryDiscovery(Discovery):
    """Discovery within one process; leases are moot, as the registry dies with its owners."""

    def __init__(self, registry: MemoryRegistry | None = None) -> None:
        self._registry = registry or PROCESS_REGISTRY
        self._own: dict[tuple[str, str], InstanceRecord] = {}

    async def register(self, record: InstanceRecord, ttl: float = DEFAULT_LEASE_TTL) -> None:
        EndpointAddress.parse(record.endpoint)
        self._own[(record.endpoint, record.instance_id)] = record
        self._registry.put(record)

    async def unregister(self, record: InstanceRecord) -> None:
        if self._own.pop((record.endpoint, record.instance_id), None) is not None:
            self._registry.delete(record)

    async def list(self, endpoint: str | EndpointAddress) -> list[InstanceRecord]:
        name = str(EndpointAddress.parse(endpoint))
        return list(self._registry.records.get(name, {}).values())

    async def watch(self, endpoint: str | EndpointAddress) -> AsyncIterator[InstanceEvent]:
        name = str(EndpointAddress.parse(endpoint))
        queue: asyncio.Queue[InstanceEvent] = asyncio.Queue()
        watchers = self._registry.watchers.setdefault(name, set())
        watchers.add(queue)
        try:
            for record in list(self._registry.records.get(name, {}).values()):
                yield InstanceEvent("added", record)
            while True:
                yield await queue.get()
        finally:
            watchers.discard(queue)

    async def close(self) -> None:
        for record in list(self._own.values()):
            await self.unregister(record)
