"""The prefill side: serve a finished prefill's pinned KV blocks to the decode worker that
pulls them, and unpin them once pulled, or after a timeout if nobody comes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from shoal.disagg.blocks import blocks_per_chunk, to_chunk
from shoal.disagg.metrics import DisaggMetrics
from shoal.engine.async_llm import AsyncLLM
from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import KVBlocksChunk, KVBlocksRequest, KVTransferParams

log = logging.getLogger(__name__)

PIN_TIMEOUT = 30.0  # seconds a prefill's blocks wait for a decode worker


class KVSource:
    def __init__(
        self,
        engine: AsyncLLM,
        metrics: DisaggMetrics | None = None,
        pin_timeout: float = PIN_TIMEOUT,
        chunk_blocks: int | None = None,
    ) -> None:
        """chunk_blocks: blocks per frame (default: as many as fit in blocks.CHUNK_BYTES)."""
        self.engine = engine
        self.metrics = metrics
        self.pin_timeout = pin_timeout
        self.chunk_blocks = chunk_blocks
        self.worker_id = ""  # this worker's instance id and request-plane address,
        self.address = ""  # set once it serves
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task] = set()

    def pinned(self, params: KVTransferParams) -> None:
        """A prefill finished with its blocks pinned: say where they are, start its timeout
        (in the event loop, before the output leaves)."""
        rid = params.request_id
        params.worker_id, params.address, params.backends = self.worker_id, self.address, ["host"]
        loop = asyncio.get_running_loop()
        self._timers[rid] = loop.call_later(self.pin_timeout, self._expire, rid)

    def _expire(self, request_id: str) -> None:
        self._timers.pop(request_id, None)
        task = asyncio.ensure_future(self.release(request_id, "timeout"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def release(self, request_id: str, reason: str) -> int:
        """Unpin a prefill's blocks; how many were pinned (0 if already released)."""
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        freed = await self.engine.call(lambda e: e.release_kv(request_id))
        if freed:
            log.info("request %s: %d pinned KV blocks released (%s)", request_id, freed, reason)
            if self.metrics is not None:
                self.metrics.released.labels(self.metrics.model, reason).inc()
        return freed

    async def kv_blocks(self, request: KVBlocksRequest) -> AsyncIterator[KVBlocksChunk]:
        """The `kv_blocks` endpoint: the asked blocks in frames, then unpin if asked."""
        rid = request.request_id
        if request.num_blocks == 0:
            if request.release:
                await self.release(rid, "released")
            return
        params = await self.engine.call(lambda e: e.pinned.get(rid))
        if params is None:
            raise ValueError(f"no KV blocks pinned for request {rid!r}")
        total = len(params.block_ids)
        end = total if request.num_blocks is None else request.first_block + request.num_blocks
        if not 0 <= request.first_block <= end <= total:
            raise ValueError(f"blocks {request.first_block}..{end} of {total} asked")
        per_chunk = self.chunk_blocks or blocks_per_chunk(params.layout)
        for start in range(request.first_block, end, per_chunk):
            count = min(per_chunk, end - start)
            data = await self.engine.call(lambda e, s=start, n=count: e.read_kv_blocks(rid, s, n))
            yield to_chunk(start, data)
        if request.release:
            await self.release(rid, "pulled")

    def update(self, core: LLMEngine) -> None:
        """Refresh the pinned-blocks gauge (in the engine thread)."""
        if self.metrics is not None:
            self.metrics.pinned_blocks.labels(self.metrics.model).set(core.kv.num_pinned_blocks)

    async def close(self) -> None:
        """Stop the timers (the engine frees everything as it shuts down)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
