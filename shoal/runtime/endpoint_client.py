"""The caller's view of one endpoint: its live instances (from discovery) and streams to them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from shoal.protocol import InstanceRecord
from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.discovery.base import Discovery, InstanceEvent
from shoal.runtime.errors import NoInstancesError
from shoal.runtime.request_client import RequestClient, ResponseStream

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_REMOVAL_PROBE = 1.0


class EndpointClient(Generic[T]):
    """Follows the instances of `endpoint` and streams requests to the one a caller picks.

    When discovery drops an instance, its streams get `removal_probe` seconds to show the
    worker is still alive (a draining worker is); otherwise they fail with WorkerLostError.
    """

    def __init__(
        self,
        discovery: Discovery,
        requests: RequestClient,
        endpoint: str | EndpointAddress,
        response_type: type[T],
        *,
        removal_probe: float = DEFAULT_REMOVAL_PROBE,
    ) -> None:
        self.endpoint = EndpointAddress.parse(endpoint)
        self._name = str(self.endpoint)
        self._discovery = discovery
        self._requests = requests
        self._response_type = response_type
        self._removal_probe = removal_probe
        self._instances: dict[str, InstanceRecord] = {}
        self._listeners: list[Callable[[InstanceEvent], None]] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> EndpointClient[T]:
        """Start following discovery (idempotent); returns self."""
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"endpoint-client {self._name}")
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def __aenter__(self) -> EndpointClient[T]:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def instances(self) -> list[InstanceRecord]:
        """The instances known now."""
        return list(self._instances.values())

    def instance(self, instance_id: str) -> InstanceRecord | None:
        return self._instances.get(instance_id)

    def add_listener(self, callback: Callable[[InstanceEvent], None]) -> None:
        """Call `callback(event)` for each instance known now (as added), then on every change."""
        for record in list(self._instances.values()):
            callback(InstanceEvent("added", record))
        self._listeners.append(callback)

    async def wait_for_instances(
        self, count: int = 1, timeout: float = 10.0
    ) -> list[InstanceRecord]:
        """Wait until at least `count` instances are known; NoInstancesError after `timeout`."""
        try:
            async with asyncio.timeout(timeout):
                while len(self._instances) < count:
                    await self._changed.wait()
        except TimeoutError:
            raise NoInstancesError(
                f"{len(self._instances)} of {count} instances of {self._name} after {timeout}s"
            ) from None
        return self.instances()

    def generate(
        self,
        instance: InstanceRecord | str,
        request: Any,
        *,
        next_timeout: float | None = None,
        owned: bool = True,
    ) -> ResponseStream[T]:
        """Stream `request` to `instance` (a record or a known instance id).

        next_timeout: seconds each response may take; past it the stream is cancelled and
        raises StreamTimeoutError (a WorkerLostError: the request may move elsewhere).
        owned: the stream belongs to the task that first reads it (see ResponseStream).
        """
        if isinstance(instance, str):
            record = self._instances.get(instance)
            if record is None:
                raise NoInstancesError(f"no instance {instance} of {self._name}")
        else:
            record = instance
        return self._requests.stream(
            record.address,
            self._name,
            request,
            self._response_type,
            next_timeout=next_timeout,
            owned=owned,
        )

    async def _follow(self) -> None:
        try:
            async with contextlib.aclosing(self._discovery.watch(self.endpoint)) as events:
                async for event in events:
                    self._apply(event)
        except Exception:
            log.exception("discovery watch of %s failed", self._name)
            raise

    def _apply(self, event: InstanceEvent) -> None:
        record = event.instance
        if event.kind == "added":
            self._instances[record.instance_id] = record
        elif self._instances.pop(record.instance_id, None) is not None:
            self._requests.probe(record.address, self._removal_probe)
        for callback in self._listeners:
            try:
                callback(event)
            except Exception:
                log.exception("instance listener of %s failed", self._name)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
