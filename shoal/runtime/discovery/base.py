"""The discovery interface: who serves which endpoint, with leases and watches."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import msgspec

from shoal.protocol import InstanceRecord
from shoal.runtime.addressing import EndpointAddress

# every backend stores a registration as the JSON of its InstanceRecord
decode_record = msgspec.json.Decoder(InstanceRecord).decode

DEFAULT_LEASE_TTL = 10.0


@dataclass(frozen=True, slots=True)
class InstanceEvent:
    """An instance appeared (or changed its record: `added` again) or disappeared."""

    kind: Literal["added", "removed"]
    instance: InstanceRecord


def instance_path(record: InstanceRecord) -> str:
    """`namespace/component/endpoint/instance_id`, the record's key below a backend's root."""
    return f"{EndpointAddress.parse(record.endpoint).path}/{record.instance_id}"


def diff(
    known: dict[str, InstanceRecord], current: dict[str, InstanceRecord]
) -> list[InstanceEvent]:
    """Events turning `known` into `current` (both keyed by instance id); updates `known`."""
    events = [InstanceEvent("removed", known.pop(key)) for key in list(known) if key not in current]
    for key, record in current.items():
        if known.get(key) != record:
            known[key] = record
            events.append(InstanceEvent("added", record))
    return events


class Discovery(abc.ABC):
    """Registers this process's instances under a lease and finds everyone's.

    A registration lives while its owner keeps the lease alive (backends do that in the
    background); an owner that dies stops renewing, and its instance disappears once the
    lease's TTL runs out.
    """

    @abc.abstractmethod
    async def register(self, record: InstanceRecord, ttl: float = DEFAULT_LEASE_TTL) -> None:
        """Publish `record` under a lease of `ttl` seconds, kept alive until unregister."""

    @abc.abstractmethod
    async def unregister(self, record: InstanceRecord) -> None:
        """Withdraw a record this object registered (others see it removed at once)."""

    @abc.abstractmethod
    async def list(self, endpoint: str | EndpointAddress) -> list[InstanceRecord]:
        """The live instances of `endpoint`."""

    @abc.abstractmethod
    def watch(self, endpoint: str | EndpointAddress) -> AsyncIterator[InstanceEvent]:
        """`added` for every live instance of `endpoint`, then each change as it happens."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Unregister everything this object registered and stop its background work."""

    async def __aenter__(self) -> Discovery:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
