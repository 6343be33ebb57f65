"""EngineClient over the distributed runtime: route each request to a worker process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from shoal.frontend.engine_client import NoWorkerAvailable, WorkerFailed
from shoal.protocol import GENERATE_ENDPOINT, EngineOutput, EngineRequest, ModelCard
from shoal.router import make_router
from shoal.router.kv_router import AllWorkersBusy
from shoal.runtime.distributed import DistributedRuntime
from shoal.runtime.endpoint_client import EndpointClient
from shoal.runtime.errors import OverloadedError, RemoteError, WorkerLostError

LOST_WORKER_PAUSE = 30.0  # seconds a worker that dropped a stream gets no new requests
BUSY_POLL = 0.02  # seconds between routing attempts while every worker is busy
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

    def __init__(
        self,
        runtime: DistributedRuntime,
        mode: str = "round-robin",
        *,
        busy_wait: float = 5.0,
        **router_options,
    ) -> None:
        """mode and router_options: see shoal.router.make_router; busy_wait: seconds a
        request waits while every worker is busy before NoWorkerAvailable (HTTP 503)."""
        self.runtime = runtime
        self.policy = make_router(mode, runtime, **router_options)
        self.busy_wait = busy_wait
        self.endpoint: EndpointClient[EngineOutput] | None = None
        self.lost: dict[str, float] = {}  # instance id -> when it failed

    async def start(self) -> WorkerClient:
        self.endpoint = await self.runtime.client(GENERATE_ENDPOINT, EngineOutput)
        await self.policy.start(self.endpoint)
        return self

    async def close(self) -> None:
        await self.policy.close()

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
            instance = await self._route(model, request, tried)
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
                    if not started:
                        started = True
                        self.policy.first_token(request.request_id)
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
                self.policy.finished(request.request_id)

    async def _route(self, model: str, request: EngineRequest, tried: set[str]):
        """The policy's pick among healthy untried workers of `model`, waiting while all
        are busy (up to busy_wait)."""
        deadline = time.monotonic() + self.busy_wait
        while True:
            instances = [
                i
                for i in self._healthy()
                if i.card and i.card.model_name == model and i.instance_id not in tried
            ]
            if not instances:
                raise NoWorkerAvailable(f"no worker serves model {model!r} right now")
            try:
                return self.policy.select(instances, request)
            except AllWorkersBusy as e:
                if time.monotonic() >= deadline:
                    raise NoWorkerAvailable(f"{e} for {self.busy_wait:g}s") from None
            await asyncio.sleep(BUSY_POLL)

    async def _read(self, instance, request: EngineRequest, queue: asyncio.Queue) -> None:
        try:
            async with self.endpoint.generate(instance, request) as stream:
                async for out in stream:
                    await queue.put(out)
            await queue.put(_END)
        except Exception as e:
            await queue.put(e)
