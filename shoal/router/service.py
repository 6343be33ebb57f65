"""The KV router as a service of its own (`shoal router`): one decision point for many frontends.

Router replicas inside each frontend share the load they add (shoal.router.replica_sync),
but decisions taken within the same millisecond by different frontends cannot see each
other. The service is the other way to run several frontends: one KvRouter, in a process of
its own, follows the workers' KV events and load reports, and every frontend whose
`--router-mode` is `remote` asks it where each request goes (ROUTE endpoint, a
RouteRequest carrying the prompt's route hashes, which the frontend computes). Its picture
of in-flight work is that of a single router; the frontends' event loops carry no KV index.

The service counts each request under (frontend, request id). A frontend publishes the
request's first token and end as a router replica does (LoadDelta on its own event-plane
publisher, registered beside the workers' endpoint); the service follows those
publishers, and drops a frontend's requests when it leaves or when deltas were lost.
While every candidate is busy, a request waits in the service's own FIFO, so requests of
all frontends take freed room in arrival order.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator

import numpy as np

from shoal.protocol import EngineOutput, RouteRequest, RouteResponse
from shoal.router.busy import AllWorkersBusy, BusyQueue
from shoal.router.kv_router import KvRouter
from shoal.router.replica_sync import ReplicaSync
from shoal.router.selector import KvRouterConfig
from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.distributed import DistributedRuntime, ServedEndpoint
from shoal.runtime.endpoint_client import EndpointClient

log = logging.getLogger(__name__)


def service_endpoint(workers: EndpointAddress | str) -> EndpointAddress:
    """Where the router service of the workers at `workers` serves (beside the replicas'
    publishers, shoal.router.replica_sync.replicas_endpoint)."""
    workers = EndpointAddress.parse(workers)
    return EndpointAddress(
        workers.namespace, f"{workers.component}-router", f"{workers.endpoint}-route"
    )


class RouterService:
    """A KvRouter serving routing decisions to frontends over the request plane."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        workers: EndpointAddress | str,
        kv_config: KvRouterConfig | None = None,
        **router_options,
    ) -> None:
        """kv_config and router_options (use_kv_events, metrics, seed, lower_tier_credit):
        the KvRouter's, as make_router takes them; it shares no load as a replica: the
        service counts each decision as the asking frontend's."""
        self.runtime = runtime
        self.router = KvRouter(runtime, kv_config, replica_sync=False, **router_options)
        self.workers = EndpointAddress.parse(workers)
        self.busy = BusyQueue()
        self.sync = ReplicaSync(runtime, self.router.peers, secrets.token_hex(8), publish=False)
        self._client: EndpointClient[EngineOutput] | None = None
        self._served: ServedEndpoint | None = None

    async def start(self) -> RouterService:
        """Follow the workers and the frontends, then serve ROUTE."""
        self._client = await self.runtime.client(self.workers, EngineOutput)
        self.router.watch_load(self.busy.wake)
        await self.router.start(self._client)
        await self.sync.start(self.workers)
        self._served = await self.runtime.serve_endpoint(
            service_endpoint(self.workers), self.route, RouteRequest
        )
        log.info(
            "KV router service for %s serving %s at %s",
            self.workers,
            self._served.record.endpoint,
            self._served.record.address,
        )
        return self

    async def close(self) -> None:
        if self._served is not None:
            await self._served.stop()
        await self.sync.close()
        await self.router.close()

    async def route(self, request: RouteRequest) -> AsyncIterator[RouteResponse]:
        """The ROUTE endpoint: one RouteResponse naming the worker, or why there is none."""
        if request.block_size != self.router.load.block_size:
            yield RouteResponse(
                error=f"prompt hashed in blocks of {request.block_size} tokens; the workers' "
                f"blocks hold {self.router.load.block_size}"
            )
            return
        hashes = np.frombuffer(request.block_hashes, "<u8")
        offered = request.candidates

        def attempt() -> str:
            known = [w for w in offered if self._client.instance(w) is not None]
            if not known:
                raise LookupError(f"none of the {len(offered)} workers offered is known here")
            self.sync.catch_up()  # the frontends' first tokens and ends that came meanwhile
            return self.router.place(
                known, hashes, request.prompt_tokens, request.request_id, request.replica_id
            )

        try:
            worker = await self.busy.route(attempt, request.busy_wait)
        except AllWorkersBusy as e:
            yield RouteResponse(error=str(e), busy=True)
            return
        except LookupError as e:
            yield RouteResponse(error=str(e))
            return
        yield RouteResponse(instance_id=worker)


async def serve_router(
    runtime: DistributedRuntime, workers: str, stop: asyncio.Event, **router_options
) -> None:
    """Run a RouterService until `stop` is set."""
    service = await RouterService(runtime, workers, **router_options).start()
    try:
        await stop.wait()
    finally:
        await service.close()
