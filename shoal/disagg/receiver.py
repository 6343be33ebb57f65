"""The decode side: before a request with transfer parameters reaches the engine, pull the
prompt blocks this engine does not cache yet and stage them for it."""

from __future__ import annotations

import asyncio
import logging
import time

from shoal.disagg.metrics import DisaggMetrics
from shoal.disagg.transport import Transports
from shoal.engine.async_llm import AsyncLLM
from shoal.protocol import EngineRequest, KVLayout, KVTransferParams

log = logging.getLogger(__name__)

PULL_TIMEOUT = 60.0  # seconds a whole pull may take before the request prefills here
RELEASE_TIMEOUT = 5.0  # seconds an unpin request may take


class KVReceiver:
    def __init__(
        self,
        engine: AsyncLLM,
        transports: Transports,
        layout: KVLayout,
        metrics: DisaggMetrics | None = None,
        timeout: float = PULL_TIMEOUT,
    ) -> None:
        self.engine = engine
        self.transports = transports
        self.layout = layout
        self.metrics = metrics
        self.timeout = timeout
        self._releases: set[asyncio.Task] = set()  # unpin requests under way

    async def receive(self, request: EngineRequest) -> bool:
        """Stage the request's transferred KV in the engine; False (and the request will
        prefill here) if the transfer is unusable or fails. Cancelling drops what was staged."""
        params = request.kv_transfer
        rid = request.request_id
        if params is None or params.layout != self.layout:
            log.warning("request %s: KV layout %s differs from this worker's", rid, params)
            return await self._give_up(request)
        prompt = request.prompt_token_ids[: params.num_tokens]
        transport = self.transports.choose(params)
        t0 = time.perf_counter()
        try:
            have = await self.engine.call(
                lambda e: e.num_cached_prefix_blocks(prompt, request.lora_id)
            )
            data = await asyncio.wait_for(transport.pull(params, have), self.timeout)
            await self.engine.call(lambda e: e.stage_kv(rid, have, data))
        except asyncio.CancelledError:
            task = asyncio.ensure_future(self.engine.call(lambda e: e.abort(rid)))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise
        except Exception as e:
            log.warning(
                "request %s: KV pull from %s over %s failed (%s: %s); prefilling here",
                rid,
                params.worker_id,
                transport.name,
                type(e).__name__,
                e,
            )
            if self.metrics is not None:
                self.metrics.transfer(transport.name, False, 0, 0, 0, 0.0)
            return await self._give_up(request)
        if self.metrics is not None:
            nbytes = data.numel() * data.element_size()
            seconds = time.perf_counter() - t0
            self.metrics.transfer(transport.name, True, data.shape[2], have, nbytes, seconds)
        return True

    async def _give_up(self, request: EngineRequest) -> bool:
        """Prefill here; tell the prefill worker it may unpin (in the background)."""
        if self.metrics is not None:
            self.metrics.local_fallbacks.labels(self.metrics.model).inc()
        params = request.kv_transfer
        if params is not None and params.address:
            task = asyncio.ensure_future(self._release(request.request_id, params))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        return False

    async def _release(self, rid: str, params: KVTransferParams) -> None:
        try:
            await asyncio.wait_for(self.transports.release(params), RELEASE_TIMEOUT)
        except Exception as e:
            log.info("request %s: release at the prefill worker failed: %s", rid, e)
