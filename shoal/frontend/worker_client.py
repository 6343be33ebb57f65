"""EngineClient over the distributed runtime: route each request to a worker process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from shoal.frontend.engine_client import NoWorkerAvailable, WorkerFailed
from shoal.protocol import GENERATE_ENDPOINT, EngineOutput, EngineRequest, ModelCard
from shoal.router.policies import make_policy
from shoal.runtime.distributed import DistributedRuntime
from shoal.runtime.endpoint_client import EndpointClient
from shoal.runtime.errors import OverloadedError, RemoteError, WorkerLostError

LOST_WORKER_PAUSE = 30.0  # seconds a worker that dropped a stream gets no new requests
_END = object()


class WorkerClient:
    """Follows the workers of the generate endpoint and streams requests to them.

    A worker that fails before sending anything is set aside and the request goes to another
    one, so a crashed worker costs no request that had not started; one that fails mid-stream
    ends that request with WorkerFailed.

    Each request-plane stream is read by a task of its own (a stream belongs to the task that
    reads it), so callers may read the outputs from any task; the bounded queue between them
    keeps the request plane's backpressure.
    """

    def __init__(self, runtime: DistributedRuntime, router_mode: str = "round-robin") -> None:
        self.runtime = runtime
        self.policy = make_policy(router_mode, lambda i: runtime.requests.num_streams(i.address))
        self.endpoint: EndpointClient[EngineOutput] | None = None
        self.lost: dict[str, float] = {}  # instance id -> when it failed

    async def start(self) -> WorkerClient:
        self.endpoint = await self.runtime.client(GENERATE_ENDPOINT, EngineOutput)
        return self

    def models(self) -> dict[str, ModelCard]:
        return {i.card.model_name: i.card for i in self._healthy() if i.card}

    def _healthy(self):
        now = time.monotonic()
        return [
            i
            for i in self.endpoint.instances()
            if now - self.lost.get(i.instance_id, -LOST_WORKER_PAUSE) >= LOST_WORKER_PAUSE
        ]

    async def generate(
        self, model: str, request: EngineRequest
    ) -> AsyncGenerator[EngineOutput, None]:
        tried: set[str] = set()
        while True:
            instances = [
                i
                for i in self._healthy()
                if i.card and i.card.model_name == model and i.instance_id not in tried
            ]
            if not instances:
                raise NoWorkerAvailable(f"no worker serves model {model!r} right now")
            instance = self.policy.select(instances, request)
            tried.add(instance.instance_id)
            queue: asyncio.Queue = asyncio.Queue(maxsize=64)
            reader = asyncio.create_task(self._read(instance, request, queue))
            started = False
            try:
                while (out := await queue.get()) is not _END:
                    if isinstance(out, Exception):
                        raise out
                    if out.error is not None:
                        raise ValueError(out.error)
                    started = True
                    yield out
                return
            except OverloadedError as e:
                if started:
                    raise WorkerFailed(str(e)) from e
            except WorkerLostError as e:
                self.lost[instance.instance_id] = time.monotonic()
                if started:
                    raise WorkerFailed(str(e)) from e
            except RemoteError as e:
                raise WorkerFailed(str(e)) from e
            finally:
                reader.cancel()  # the stream's reading task ends: the worker aborts the request
                await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, instance, request: EngineRequest, queue: asyncio.Queue) -> None:
        try:
            async with self.endpoint.generate(instance, request) as stream:
                async for out in stream:
                    await queue.put(out)
            await queue.put(_END)
        except Exception as e:
            await queue.put(e)
