"""The prefill side: serve a finished prefill's pinned KV blocks to the decode worker that
pulls them, and unpin them once pulled, or after a timeout if nobody comes.

Blocks leave as request-plane frames (host) or are read by the decode worker through an
exporter's registered memory (NIXL, CUDA IPC); a NIXL READ's completion notification
unpins them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from shoal.disagg.blocks import blocks_per_chunk, to_chunk
from shoal.disagg.metrics import DisaggMetrics
from shoal.engine.async_llm import AsyncLLM
from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import (
    KVAgentInfo,
    KVAgentRequest,
    KVBlocksChunk,
    KVBlocksRequest,
    KVTransferParams,
)

log = logging.getLogger(__name__)

PIN_TIMEOUT = 30.0  # seconds a prefill's blocks wait for a decode worker
NOTIFY_POLL = 0.002  # seconds between checks for READ notifications while blocks are pinned


class KVExporter(Protocol):
    name: str

    async def info(self) -> KVAgentInfo:
        """What a decode worker needs to read this worker's KV memory."""
        ...

    async def close(self) -> None:
        """Give the memory back."""
        ...


class KVSource:
    def __init__(
        self,
        engine: AsyncLLM,
        metrics: DisaggMetrics | None = None,
        pin_timeout: float = PIN_TIMEOUT,
        chunk_blocks: int | None = None,
        exporters: list[KVExporter] | None = None,
    ) -> None:
        """chunk_blocks: blocks per frame (default: as many as fit in blocks.CHUNK_BYTES);
        exporters: the backends besides host that decode workers may read with, best first."""
        self.engine = engine
        self.exporters = {e.name: e for e in exporters or []}
        self.backends = [*self.exporters, "host"]  # offered in every transfer, best first
        self._notifying = [e for e in self.exporters.values() if hasattr(e, "notified")]
        self._poller: asyncio.Task | None = None
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
        params.worker_id, params.address = self.worker_id, self.address
        params.backends = list(self.backends)
        loop = asyncio.get_running_loop()
        self._timers[rid] = loop.call_later(self.pin_timeout, self._expire, rid)
        if self._notifying and (self._poller is None or self._poller.done()):
            self._poller = asyncio.ensure_future(self._poll_notifications())

    async def _poll_notifications(self) -> None:
        """Unpin the blocks whose READ a decode worker reports done, while any are pinned."""
        while self._timers:
            await asyncio.sleep(NOTIFY_POLL)
            for exporter in self._notifying:
                try:
                    done = await exporter.notified()
                except Exception as e:
                    log.warning("reading %s notifications failed: %s", exporter.name, e)
                    continue
                for rid in done:
                    if rid in self._timers:
                        await self.release(rid, "pulled")

    async def kv_agent(self, request: KVAgentRequest) -> AsyncIterator[KVAgentInfo]:
        """The `kv_agent` endpoint: how to read this worker's KV memory with a backend."""
        exporter = self.exporters.get(request.backend)
        if exporter is None:
            raise ValueError(f"KV transfer backend {request.backend!r} not offered here")
        yield await exporter.info()

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
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for exporter in self.exporters.values():
            await exporter.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
