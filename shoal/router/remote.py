"""`--router-mode remote`: a frontend that asks the KV router service (`shoal router`).

The frontend hashes the prompt (the part of a decision that grows with the prompt, done in
every frontend at once) and sends the hashes with the workers it may use; the service
answers with one of them. The request's first token and its end are published as a router
replica's LoadDeltas, which the service follows (shoal.router.service). With several
services for the same workers, every frontend asks the one with the lowest instance id,
and moves to the next when that one leaves.
"""

from __future__ import annotations

import secrets

from shoal.protocol import EngineRequest, InstanceRecord, LoadDelta, RouteRequest, RouteResponse
from shoal.router.busy import AllWorkersBusy
from shoal.router.policies import Policy
from shoal.router.prompt_hashes import block_size_of, prompt_hashes
from shoal.router.replica_sync import ReplicaSync
from shoal.router.service import service_endpoint
from shoal.runtime.distributed import DistributedRuntime
from shoal.runtime.endpoint_client import EndpointClient

ANSWER_TIMEOUT = 10.0  # seconds an answer may take beyond the request's busy wait


class RouterUnavailable(Exception):
    """No router service answers for these workers, or it could not place the request."""


class RemoteRouter(Policy):
    remote = True

    def __init__(
        self,
        runtime: DistributedRuntime,
        *,
        sync_host: str = "127.0.0.1",
        sync_advertise_host: str | None = None,
    ) -> None:
        """sync_host: where this frontend publishes its requests' first tokens and ends
        (the service dials `sync_advertise_host` if given)."""
        self.runtime = runtime
        self.replica_id = secrets.token_hex(8)
        self._sync = ReplicaSync(
            runtime,
            None,
            self.replica_id,
            host=sync_host,
            advertise_host=sync_advertise_host,
            follow=False,
        )
        self._services: EndpointClient[RouteResponse] | None = None
        self._open: set[str] = set()  # requests routed and not finished

    async def start(self, endpoint: EndpointClient) -> None:
        self._services = await self.runtime.client(
            service_endpoint(endpoint.endpoint), RouteResponse
        )
        await self._sync.start(endpoint.endpoint)

    async def close(self) -> None:
        await self._sync.close()

    def select(
        self, instances: list[InstanceRecord], request: EngineRequest, prepared: object = None
    ) -> InstanceRecord:
        raise TypeError("the remote router decides over the network: await route()")

    async def route(
        self, instances: list[InstanceRecord], request: EngineRequest, busy_wait: float
    ) -> InstanceRecord:
        """The instance the router service picks among `instances`; AllWorkersBusy if they
        all stay busy for `busy_wait` seconds, RouterUnavailable if no service answers."""
        services = self._services.instances()
        if not services:
            raise RouterUnavailable(
                f"no KV router service (`shoal router`) serves {self._services.endpoint}"
            )
        service = min(services, key=lambda s: s.instance_id)
        block_size = block_size_of(instances, 16)
        hashes = prompt_hashes(request, block_size)
        query = RouteRequest(
            self.replica_id,
            request.request_id,
            len(request.prompt_token_ids),
            block_size,
            hashes.astype("<u8", copy=False).tobytes(),
            [i.instance_id for i in instances],
            busy_wait,
        )
        try:
            stream = self._services.generate(
                service, query, next_timeout=busy_wait + ANSWER_TIMEOUT
            )
            async with stream:
                answer = await anext(aiter(stream), None)
        except Exception as e:
            raise RouterUnavailable(
                f"KV router service {service.instance_id} failed: {e or type(e).__name__}"
            ) from e
        if answer is None:
            raise RouterUnavailable(f"KV router service {service.instance_id} sent no answer")
        if answer.busy:
            raise AllWorkersBusy(answer.error)
        chosen = next((i for i in instances if i.instance_id == answer.instance_id), None)
        if chosen is None:
            raise RouterUnavailable(answer.error or "the KV router service chose no worker")
        self._open.add(request.request_id)
        return chosen

    def first_token(self, request_id: str) -> None:
        if request_id in self._open:
            self._sync.publish(LoadDelta(self.replica_id, LoadDelta.FIRST_TOKEN, request_id))

    def finished(self, request_id: str) -> None:
        if request_id in self._open:
            self._open.discard(request_id)
            self._sync.publish(LoadDelta(self.replica_id, LoadDelta.FINISHED, request_id))
