"""EngineClient over the distributed runtime: route each request to a worker process, and
move it to another worker (request migration) when its worker dies, breaks or stalls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

import msgspec

from shoal.frontend.engine_client import NoWorkerAvailable, QueueFull, WorkerFailed
from shoal.frontend.worker_log import WorkerLog
from shoal.protocol import (
    GENERATE_ENDPOINT,
    EngineOutput,
    EngineRequest,
    InstanceRecord,
    ModelCard,
    pack_token_ids,
)
from shoal.router import make_router
from shoal.router.busy import AllWorkersBusy, BusyQueue
from shoal.router.remote import RouterUnavailable
from shoal.runtime.discovery.base import InstanceEvent
from shoal.runtime.distributed import DistributedRuntime
from shoal.runtime.endpoint_client import EndpointClient
from shoal.runtime.errors import (
    BadRequestError,
    RuntimePlaneError,
    StreamTimeoutError,
    WorkerLostError,
)
from shoal.runtime.request_client import ResponseStream

log = logging.getLogger(__name__)

# seconds a worker whose connection closed gets no new request, unless discovery drops or
# re-announces it sooner (by then a dead worker's lease has run out; a live one is tried again)
LOST_HOLD = 10.0
MIGRATION_LIMIT = 3  # Dynamo's --migration-limit default
NEXT_TOKEN_TIMEOUT = 120.0  # seconds; generous, since a long prefill is legitimate
QUEUED_BATCHES = 4  # per request: a reader that is this far ahead waits (backpressure)
_END = object()


class NextTokenTimeout(Exception):
    """A worker sent nothing for a request within the next-token deadline."""


class _Leg:
    """One engine request on one worker: every sequence of the client's request, or (after a
    migration) one sequence continued from where it stopped."""

    __slots__ = ("indices", "instance", "open", "reader", "request", "started", "stream")

    def __init__(self, request: EngineRequest, indices: list[int], instance) -> None:
        self.request = request
        self.indices = indices  # the client's sequence index of the leg's sequence j
        self.instance = instance
        self.open = len(indices)  # sequences not finished yet
        self.started = False  # an output arrived
        self.stream: ResponseStream[EngineOutput] | None = None
        self.reader: asyncio.Task | None = None  # None: the caller reads the stream itself


class WorkerClient:
    """Follows the workers of the generate endpoint and streams requests to them.

    A worker that fails before sending anything is set aside and the request goes to another
    one; one whose connection closed gets no new request until discovery drops or
    re-announces it (LOST_HOLD seconds at most). One that fails mid-stream (lost, a stream
    ending without a finish, a handler error, or nothing sent for `next_token_timeout`
    seconds) has its unfinished sequences moved to another worker with the prompt plus the
    tokens they already produced, at most `migration_limit` times per request; the caller's
    stream goes on without a gap.

    A request on one worker (the usual case) is read straight from its request-plane stream
    by whichever task iterates the outputs. Once a migration splits a request over several
    workers, each stream is read by a task of its own into a bounded queue (which keeps the
    request plane's backpressure). Either way every output that has arrived is taken at
    once, and the outputs of one sequence taken together are merged into one.
    """

    def __init__(
        self,
        runtime: DistributedRuntime,
        mode: str = "round-robin",
        *,
        busy_wait: float = 5.0,
        migration_limit: int = MIGRATION_LIMIT,
        next_token_timeout: float = NEXT_TOKEN_TIMEOUT,
        **router_options,
    ) -> None:
        """mode and router_options: see shoal.router.make_router; busy_wait: seconds a
        request waits while every worker is busy before QueueFull (HTTP 429);
        migration_limit: migrations per request (0: none); next_token_timeout: seconds a
        request waits for its worker's next output before it migrates."""
        if migration_limit < 0:
            raise ValueError(f"migration_limit must be non-negative (got {migration_limit})")
        if next_token_timeout <= 0:
            raise ValueError(f"next_token_timeout must be positive (got {next_token_timeout})")
        self.runtime = runtime
        self.policy = make_router(mode, runtime, **router_options)
        self.busy_wait = busy_wait
        self.migration_limit = migration_limit
        self.next_token_timeout = next_token_timeout
        self.endpoint: EndpointClient[EngineOutput] | None = None
        self.cards: dict[str, ModelCard] = {}  # every model a worker has served, by name
        self.lost: dict[str, float] = {}  # instance id -> when its connection was lost
        self.busy = BusyQueue()  # requests waiting while every worker is busy

    async def start(self) -> WorkerClient:
        self.endpoint = await self.runtime.client(GENERATE_ENDPOINT, EngineOutput)
        self.endpoint.add_listener(self._remember)
        self.endpoint.add_listener(WorkerLog())
        self.policy.watch_load(self.busy.wake)
        await self.policy.start(self.endpoint)
        return self

    async def close(self) -> None:
        await self.policy.close()

    def _remember(self, event: InstanceEvent) -> None:
        self.lost.pop(event.instance.instance_id, None)
        card = event.instance.card
        if event.kind == "added" and card is not None:
            self.cards[card.model_name] = card
            self.busy.wake()

    def models(self) -> dict[str, ModelCard]:
        """Every model some worker has served: one whose workers are all gone now is still
        known, so its requests get 503 (NoWorkerAvailable) rather than 404."""
        return dict(self.cards)

    def live_models(self) -> list[str]:
        """The models at least one registered worker serves now (lost or not)."""
        return sorted({i.card.model_name for i in self.endpoint.instances() if i.card})

    async def generate(
        self, model: str, request: EngineRequest, prepared: object = None
    ) -> AsyncGenerator[EngineOutput, None]:
        """The request's outputs, from the worker the policy picks (and on, if it fails).
        prepared: what the policy's `prepare` gave for this request, if the caller has it."""
        rid = request.request_id
        tokens: list[list[int]] = [[] for _ in range(request.sampling.n)]
        queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUED_BATCHES)
        legs: set[_Leg] = set()
        tried: set[str] = set()
        finished: set[int] = set()  # the client's sequences that have finished
        migrations = 0
        yielded = False  # the caller has an output: failures end as WorkerFailed now
        cached = 0  # the first worker's prefix-cache hit, reported for the whole request
        try:
            first = list(range(len(tokens)))
            await self._open(model, request, first, tried, queue, legs, True, prepared)
            while legs:
                leg = next(iter(legs)) if len(legs) == 1 else None
                if leg is not None and leg.reader is None:
                    item = await self._next(leg)
                else:
                    leg, item = await queue.get()
                    if leg not in legs:
                        continue  # a leg dropped already
                if type(item) is list:
                    for out in _coalesce(item):
                        if out.error is not None:
                            raise ValueError(out.error)
                        if not leg.started:
                            leg.started = True
                            self.policy.first_token(leg.request.request_id)
                        index = leg.indices[out.index]
                        tokens[index] += out.new_token_ids
                        if leg.request is request:
                            cached = out.num_cached_tokens
                        else:
                            out.request_id, out.index, out.num_cached_tokens = rid, index, cached
                            out.num_prompt_tokens = len(request.prompt_token_ids)
                        if out.finished:
                            leg.open -= 1
                            finished.add(index)
                        yielded = True
                        yield out
                    continue
                await self._drop(leg, legs)
                if item is _END and not leg.open:
                    continue
                error = item if item is not _END else WorkerFailed("the stream ended early")
                tried.add(leg.instance.instance_id)
                if isinstance(error, WorkerLostError):
                    self.lost[leg.instance.instance_id] = time.monotonic()
                if not _movable(error):
                    raise _failure(error)
                fresh = not leg.started and leg.request is request
                if not fresh:
                    migrations += 1
                    if migrations > self.migration_limit:
                        raise WorkerFailed(
                            f"{_reason(error)}; migration limit ({self.migration_limit}) reached"
                        )
                log.warning(
                    "request %s: worker %s failed (%s); %s",
                    rid,
                    leg.instance.instance_id,
                    _reason(error),
                    "retrying" if fresh else f"migration {migrations}",
                )
                try:
                    moved = _continuations(request, leg, tokens, finished, migrations, yielded)
                    alone = not legs and len(moved) == 1
                    for new, indices in moved:
                        await self._open(model, new, indices, tried, queue, legs, alone)
                except NoWorkerAvailable as e:
                    if yielded:
                        raise WorkerFailed(f"{_reason(error)}; {e}") from e
                    raise
        finally:
            for leg in list(legs):
                await self._drop(leg, legs)

    async def _open(
        self,
        model: str,
        request: EngineRequest,
        indices: list[int],
        tried: set[str],
        queue: asyncio.Queue,
        legs: set[_Leg],
        alone: bool,
        prepared: object = None,
    ) -> None:
        """Route `request` as a new leg; unless it is to be the only one, a task reads it."""
        instance = await self._route(model, request, tried, prepared)
        leg = _Leg(request, indices, instance)
        legs.add(leg)
        if not alone:
            leg.reader = asyncio.create_task(self._read(leg, queue))

    async def _drop(self, leg: _Leg, legs: set[_Leg]) -> None:
        """Stop reading a leg (the worker aborts what is left) and tell the policy."""
        legs.discard(leg)
        if leg.reader is not None:
            leg.reader.cancel()
            await asyncio.gather(leg.reader, return_exceptions=True)
        if leg.stream is not None:
            leg.stream.cancel()
        self.policy.finished(leg.request.request_id)

    async def _route(
        self, model: str, request: EngineRequest, tried: set[str], prepared: object = None
    ):
        """The policy's pick among the untried workers of `model`; while all are busy the
        request waits its turn (self.busy, or the router service's queue for a remote
        policy) for up to busy_wait seconds. prepared: the policy's `prepare` of the
        request (made here if None)."""

        def candidates() -> list[InstanceRecord]:
            now = time.monotonic()
            instances = [
                i
                for i in self.endpoint.instances()
                if i.card
                and i.card.model_name == model
                and i.instance_id not in tried
                and now - self.lost.get(i.instance_id, -LOST_HOLD) >= LOST_HOLD
            ]
            if not instances:
                raise NoWorkerAvailable(f"no worker serves model {model!r} right now")
            return instances

        try:
            if self.policy.remote:  # the router service waits, for every frontend at once
                return await self.policy.route(candidates(), request, self.busy_wait)
            if prepared is None:
                prepared = self.policy.prepare(candidates(), request)
            return await self.busy.route(
                lambda: self.policy.select(candidates(), request, prepared), self.busy_wait
            )
        except AllWorkersBusy as e:
            raise QueueFull(f"{e} for {self.busy_wait:g}s") from None
        except RouterUnavailable as e:
            raise NoWorkerAvailable(str(e)) from None

    async def _next(self, leg: _Leg) -> list[EngineOutput] | BaseException | object:
        """The leg's outputs that have arrived (waiting for one), else _END or its error."""
        limit = self.next_token_timeout
        try:
            if leg.stream is None:
                leg.stream = self.endpoint.generate(
                    leg.instance, leg.request, next_timeout=limit, owned=False
                )
            return await leg.stream.batch()
        except StopAsyncIteration:
            return _END
        except StreamTimeoutError:
            return NextTokenTimeout(f"no output from the worker for {limit:g}s")
        except Exception as e:
            return e

    async def _read(self, leg: _Leg, queue: asyncio.Queue) -> None:
        """A leg's reading task: its outputs onto `queue` until _END or its error; waiting
        for the queue does not count against the next-token deadline."""
        while True:
            item = await self._next(leg)
            await queue.put((leg, item))
            if type(item) is not list:
                return


def _coalesce(outs: list[EngineOutput]) -> list[EngineOutput]:
    """Outputs that arrived together, one per sequence: a stream the frontend has fallen
    behind on moves on in fewer, longer chunks (as vLLM's do) rather than token by token.
    Errors are left as they came."""
    if len(outs) == 1:
        return outs
    merged: dict[int, EngineOutput] = {}
    for out in outs:
        if out.error is not None:
            return outs
        into = merged.setdefault(out.index, out)
        if into is out:
            continue
        into.new_token_ids += out.new_token_ids
        if out.new_logprobs is not None:
            into.new_logprobs = (into.new_logprobs or []) + out.new_logprobs
        if into.prompt_logprobs is None:
            into.prompt_logprobs = out.prompt_logprobs
        into.finish_reason, into.stop_reason = out.finish_reason, out.stop_reason
        into.kv_transfer = out.kv_transfer or into.kv_transfer
    return list(merged.values())


def _continuations(
    request: EngineRequest,
    leg: _Leg,
    tokens: list[list[int]],
    finished: set[int],
    migration: int,
    yielded: bool,
) -> list[tuple[EngineRequest, list[int]]]:
    """The engine requests (with the client's sequence indices) that take over a failed
    leg's unfinished sequences: the leg's own request if nothing of it arrived, else one
    request per sequence continuing it."""
    if not leg.started:
        return [(leg.request, leg.indices)]
    return [
        (_continuation(request, i, tokens[i], migration, yielded), [i])
        for i in leg.indices
        if i not in finished
    ]


def _continuation(
    request: EngineRequest, index: int, done: list[int], migration: int, yielded: bool
) -> EngineRequest:
    """Sequence `index` of `request` as a request of its own that goes on after `done`."""
    sp = request.sampling
    sampling = msgspec.structs.replace(
        sp,
        n=1,
        seed=None if sp.seed is None else sp.seed + index,  # as the engine seeds sequence i
        max_tokens=None if sp.max_tokens is None else sp.max_tokens - len(done),
        min_tokens=max(0, sp.min_tokens - len(done)),
        prompt_logprobs=None if yielded else sp.prompt_logprobs,  # sent with the first output
    )
    return msgspec.structs.replace(
        request,
        request_id=f"{request.request_id}~{migration}.{index}",
        prompt_token_ids=request.prompt_token_ids + pack_token_ids(done),
        sampling=sampling,
        num_output_tokens_before=len(done),
    )


def _movable(error: BaseException) -> bool:
    """Whether another worker may take over after `error` (the worker's fault, not the
    request's)."""
    if isinstance(error, BadRequestError):
        return False
    return isinstance(error, RuntimePlaneError | NextTokenTimeout | WorkerFailed)


def _reason(error: BaseException) -> str:
    return str(error) or type(error).__name__


def _failure(error: BaseException) -> Exception:
    if isinstance(error, WorkerFailed):
        return error
    return WorkerFailed(_reason(error))
