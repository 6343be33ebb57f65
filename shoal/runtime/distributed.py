"""DistributedRuntime: one per process; serves this process's endpoints and reaches others'."""

from __future__ import annotations

import secrets
from typing import Any, TypeVar

from shoal.protocol import InstanceRecord, ModelCard
from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.discovery import DEFAULT_LEASE_TTL, Discovery, make_discovery
from shoal.runtime.endpoint_client import DEFAULT_REMOVAL_PROBE, EndpointClient
from shoal.runtime.request_client import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_WINDOW,
    RequestClient,
)
from shoal.runtime.request_server import (
    DEFAULT_DEAD_AFTER,
    DEFAULT_MAX_STREAMS,
    Handler,
    PushHandler,
    RequestServer,
)

T = TypeVar("T")


class ServedEndpoint:
    """An endpoint this process serves, registered in discovery under `record`."""

    def __init__(self, runtime: DistributedRuntime, record: InstanceRecord) -> None:
        self._runtime = runtime
        self.record = record

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Withdraw from discovery, then let open streams finish for up to drain_timeout."""
        await self._runtime._stop_serving(self, drain_timeout)


class DistributedRuntime:
    """Ties discovery to the request plane for one process.

    `discovery` is a Discovery, or a URL for make_discovery (None: $SHOAL_DISCOVERY or
    in-process). The request server binds `host:port` (port 0 picks one) on the first
    serve_endpoint; `advertise_host` is the host others dial, when it differs from `host`.
    A peer on the request plane counts as dead when its connection closes, when discovery
    drops it and it misses a probe (`removal_probe` seconds), or after `dead_after` seconds
    of total silence. `plane_secret`, if set, signs and checks every request-plane message
    (and is what this process's event publishers and subscribers should use).
    """

    def __init__(
        self,
        discovery: Discovery | str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        instance_id: str | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        window: int = DEFAULT_WINDOW,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        dead_after: float = DEFAULT_DEAD_AFTER,
        max_streams: int = DEFAULT_MAX_STREAMS,
        removal_probe: float = DEFAULT_REMOVAL_PROBE,
        plane_secret: str | None = None,
    ) -> None:
        self._owns_discovery = not isinstance(discovery, Discovery)
        self.discovery = (
            discovery if isinstance(discovery, Discovery) else make_discovery(discovery)
        )
        self.instance_id = instance_id or secrets.token_hex(8)
        self.lease_ttl = lease_ttl
        self.plane_secret = plane_secret
        self.requests = RequestClient(
            window=window,
            heartbeat_interval=heartbeat_interval,
            dead_after=dead_after,
            secret=plane_secret,
        )
        self.server = RequestServer(
            host,
            port,
            advertise_host=advertise_host,
            max_streams=max_streams,
            dead_after=dead_after,
            secret=plane_secret,
        )
        self._removal_probe = removal_probe
        self._served: dict[str, ServedEndpoint] = {}
        self._clients: list[EndpointClient[Any]] = []

    async def serve_endpoint(
        self,
        endpoint: str | EndpointAddress,
        handler: Handler | PushHandler,
        request_type: Any,
        *,
        push: bool = False,
        card: ModelCard | None = None,
        extra: dict[str, str] | None = None,
    ) -> ServedEndpoint:
        """Serve `handler` on `endpoint` and register this instance (with `card`, `extra`);
        `push`: the handler sends into a StreamSink (see RequestServer.add_endpoint)."""
        name = str(EndpointAddress.parse(endpoint))
        address = await self.server.start()
        self.server.add_endpoint(name, handler, request_type, push=push)
        record = InstanceRecord(
            instance_id=self.instance_id,
            endpoint=name,
            address=address,
            card=card,
            extra=dict(extra or {}),
        )
        try:
            await self.discovery.register(record, self.lease_ttl)
        except BaseException:
            await self.server.remove_endpoint(name)
            raise
        served = self._served[name] = ServedEndpoint(self, record)
        return served

    async def _stop_serving(self, served: ServedEndpoint, drain_timeout: float) -> None:
        name = served.record.endpoint
        if self._served.get(name) is not served:
            return
        del self._served[name]
        await self.discovery.unregister(served.record)
        await self.server.remove_endpoint(name, drain_timeout)

    async def client(
        self, endpoint: str | EndpointAddress, response_type: type[T]
    ) -> EndpointClient[T]:
        """A started EndpointClient for `endpoint`, closed with the runtime."""
        client = EndpointClient(
            self.discovery,
            self.requests,
            endpoint,
            response_type,
            removal_probe=self._removal_probe,
        )
        self._clients.append(client)
        return await client.start()

    async def close(self, drain_timeout: float = 0.0) -> None:
        """Unregister and stop serving (draining up to drain_timeout), close every client."""
        for served in list(self._served.values()):
            await self.discovery.unregister(served.record)
        self._served.clear()
        await self.server.stop(drain_timeout)
        for client in self._clients:
            await client.close()
        self._clients.clear()
        await self.requests.close()
        if self._owns_discovery:
            await self.discovery.close()

    async def __aenter__(self) -> DistributedRuntime:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
