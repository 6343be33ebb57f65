"""Disaggregated prefill/decode from the frontend (docs/disagg.md): an EngineClient that
sends a long prompt to a prefill worker first, streams the first token it samples, then has
a decode worker (chosen by the WorkerClient it wraps) pull the prompt's KV and go on.

Conditional disaggregation: a prompt goes to a prefill worker only if its length less what
the best decode worker already caches (the decode router's predicted overlap) exceeds
`max_local_prefill_length` and some prefill worker is not busy; otherwise the decode worker
prefills it. A prefill that fails before its first token falls back to that local path, so
the request is not lost and its output does not change.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry, Counter

from shoal.flags import Flag, FlagGroup
from shoal.frontend.worker_client import WorkerClient, _continuation
from shoal.protocol import (
    KV_BLOCKS_ENDPOINT,
    PREFILL_ENDPOINT,
    EngineOutput,
    EngineRequest,
    InstanceRecord,
    KVBlocksChunk,
    KVBlocksRequest,
    KVTransferParams,
    ModelCard,
)
from shoal.router import make_router
from shoal.router.cli import router_options
from shoal.router.kv_router import AllWorkersBusy, KvRouter
from shoal.runtime.distributed import DistributedRuntime
from shoal.runtime.endpoint_client import EndpointClient

log = logging.getLogger(__name__)

MAX_LOCAL_PREFILL_LENGTH = 1000  # tokens; Dynamo's default
PREFILL_TIMEOUT = 120.0  # seconds a prefill worker may take for its first token
RELEASE_TIMEOUT = 5.0  # seconds an unpin request may take

DISAGG = FlagGroup(
    "disaggregation",
    (
        Flag(
            "max-local-prefill-length",
            "with prefill workers present: a prompt whose length, less what the chosen decode "
            "worker already caches, is at most this many tokens is prefilled by the decode "
            "worker itself; longer ones go to a prefill worker first",
            int,
            MAX_LOCAL_PREFILL_LENGTH,
        ),
    ),
    about="How the frontend splits requests between prefill and decode workers "
    "(docs/disagg.md). Without prefill workers every request is served aggregated.",
)


class DisaggClient:
    """EngineClient over a WorkerClient (the decode and aggregated workers) and the
    prefill workers of PREFILL_ENDPOINT, routed by their own policy."""

    def __init__(
        self,
        workers: WorkerClient,
        runtime: DistributedRuntime,
        mode: str = "round-robin",
        *,
        max_local_prefill_length: int = MAX_LOCAL_PREFILL_LENGTH,
        registry: CollectorRegistry | None = None,
        prefill_timeout: float = PREFILL_TIMEOUT,
        **router_options,
    ) -> None:
        """mode and router_options: the prefill pool's routing (see make_router; its
        router has a registry of its own and shares no load with other frontends)."""
        if max_local_prefill_length < 0:
            raise ValueError(
                f"max_local_prefill_length must be non-negative (got {max_local_prefill_length})"
            )
        self.workers = workers
        self.runtime = runtime
        router_options.pop("replica_sync", None)
        self.prefill_policy = make_router(mode, runtime, replica_sync=False, **router_options)
        self.max_local_prefill_length = max_local_prefill_length
        self.prefill_timeout = prefill_timeout
        self.prefill_endpoint: EndpointClient[EngineOutput] | None = None
        self.prefills = Counter(
            "shoal_disagg_prefills",
            "requests by where their prompt was prefilled (remote: a prefill worker; local: "
            "the decode worker) and why",
            ["where", "reason"],
            registry=registry or CollectorRegistry(),
        )
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> DisaggClient:
        self.prefill_endpoint = await self.runtime.client(PREFILL_ENDPOINT, EngineOutput)
        await self.prefill_policy.start(self.prefill_endpoint)
        return self

    async def close(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.prefill_policy.close()
        await self.workers.close()

    def models(self) -> dict[str, ModelCard]:
        return self.workers.models()

    def live_models(self) -> list[str]:
        return self.workers.live_models()

    def generate(self, model: str, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """The request's outputs: the workers' own stream when it stays local (no extra layer
        per token), else a remote prefill followed by the decode worker's stream."""
        instance, reason, hashes = self._plan(model, request)
        if instance is None:
            self.prefills.labels("local", reason).inc()
            return self.workers.generate(model, request, hashes)
        return self._remote(model, request, instance, hashes)

    async def _remote(
        self,
        model: str,
        request: EngineRequest,
        instance: InstanceRecord,
        hashes: np.ndarray | None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """`hashes`: the plan's route hashes of the prompt, for the local fallback's route."""
        first = await self._prefill(instance, request)
        where, reason = ("remote", "remote") if first is not None else ("local", "prefill_failed")
        self.prefills.labels(where, reason).inc()
        if first is None:
            async for out in self.workers.generate(model, request, hashes):
                yield out
            return
        params = first.kv_transfer
        first.kv_transfer = None
        started = False  # a decode worker has answered: it pulled or gave up the blocks
        try:
            yield first
            if first.finished:
                return
            decode = msgspec.structs.replace(
                _continuation(request, 0, first.new_token_ids, 0, True), kv_transfer=params
            )
            async for out in self.workers.generate(model, decode):
                started = True
                out.request_id = request.request_id
                out.num_prompt_tokens = first.num_prompt_tokens
                out.num_cached_tokens = first.num_cached_tokens
                yield out
        finally:
            if not started:
                self._release(params)

    def _plan(
        self, model: str, request: EngineRequest
    ) -> tuple[InstanceRecord | None, str, np.ndarray | None]:
        """The prefill worker for this request, or None and why it stays local; and the
        prompt's route hashes if the decode router made them (a local request's route
        takes them instead of hashing again; so does the prefill router where both pools
        have one block size)."""
        sp = request.sampling
        if sp.n != 1 or sp.prompt_logprobs is not None or sp.max_tokens == 1:
            return None, "ineligible", None
        instances = _serving(self.prefill_endpoint.instances(), model)
        if not instances:
            return None, "no_prefill_worker", None
        hashes = None  # the prompt's route hashes for the decode pool, if its router keeps any
        shared = None  # the same, when the prefill pool's blocks are the same size
        decode = self.workers.policy
        cached = 0
        if isinstance(decode, KvRouter):  # the most leading blocks a decode worker caches
            pool = _serving(self.workers.endpoint.instances(), model)
            if pool:
                hashes = decode.prepare(pool, request)  # timed in its hash metric
                block_size = pool[0].card.kv_block_size
                cached = max(decode.overlaps(hashes).values(), default=0) * block_size
                if block_size == instances[0].card.kv_block_size:
                    shared = hashes
        if len(request.prompt_token_ids) - cached <= self.max_local_prefill_length:
            return None, "short", hashes
        try:
            prefill = _prefill_request(request)  # the same prompt and adapter: the same hashes
            return self.prefill_policy.select(instances, prefill, shared), "remote", hashes
        except AllWorkersBusy:
            return None, "prefill_busy", hashes

    async def _prefill(self, instance: InstanceRecord, request: EngineRequest):
        """The prefill worker's one output (the first token, transfer parameters with it
        unless it finished the request), as an output of `request`; None if it failed."""
        prefill = _prefill_request(request)
        last = None
        try:
            stream = self.prefill_endpoint.generate(
                instance, prefill, next_timeout=self.prefill_timeout
            )
            async with stream:
                async for out in stream:
                    self.prefill_policy.first_token(prefill.request_id)
                    last = out
        except Exception as e:
            log.warning(
                "request %s: prefill worker %s failed (%s); prefilling on the decode worker",
                request.request_id,
                instance.instance_id,
                e,
            )
            last = None
        finally:
            self.prefill_policy.finished(prefill.request_id)
        if last is None or last.error is not None or not last.new_token_ids:
            return None
        if last.finish_reason == "length" and last.kv_transfer is None:
            return None  # finished for the prefill's max_tokens 1, but nothing was pinned
        last.request_id = request.request_id
        if last.finish_reason == "length":
            last.finish_reason = None
        return last

    def _release(self, params: KVTransferParams | None) -> None:
        """Have the prefill worker unpin blocks no decode worker will pull (in the background)."""
        if params is None or not params.address:
            return
        task = asyncio.ensure_future(self._unpin(params))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unpin(self, params: KVTransferParams) -> None:
        request = KVBlocksRequest(request_id=params.request_id, num_blocks=0)
        stream = self.runtime.requests.stream(
            params.address, KV_BLOCKS_ENDPOINT, request, KVBlocksChunk, next_timeout=RELEASE_TIMEOUT
        )
        with contextlib.suppress(Exception):
            async with stream:
                async for _ in stream:
                    pass


async def disaggregated(
    workers: WorkerClient,
    runtime: DistributedRuntime,
    args: argparse.Namespace,
    registry: CollectorRegistry | None = None,
) -> DisaggClient:
    """A started DisaggClient over a started WorkerClient, configured by the frontend's
    flags (its routing flags route the prefill pool too; with `remote`, the frontend's own
    kv router does)."""
    options = router_options(args)
    options.pop("busy_wait")
    mode = options.pop("mode")
    if mode == "remote":  # the router service routes the decode pool; this one, the prefills
        mode = "kv"
    client = DisaggClient(
        workers,
        runtime,
        mode,
        max_local_prefill_length=args.max_local_prefill_length,
        registry=registry,
        **options,
    )
    return await client.start()


def _serving(instances: list[InstanceRecord], model: str) -> list[InstanceRecord]:
    """The instances whose card says they serve `model`."""
    return [i for i in instances if i.card is not None and i.card.model_name == model]


def _prefill_request(request: EngineRequest) -> EngineRequest:
    """What a prefill worker runs: the prompt, one token sampled as the request would."""
    sp = request.sampling
    return msgspec.structs.replace(
        request,
        request_id=f"{request.request_id}~p",
        sampling=msgspec.structs.replace(sp, max_tokens=1, min_tokens=min(sp.min_tokens, 1)),
        kv_transfer=KVTransferParams(do_remote_decode=True),
    )
