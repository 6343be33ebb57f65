"""Run one engine as a worker: serve `generate` over the request plane until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable

from shoal.engine.async_llm import AsyncLLM
from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import (
    GENERATE_ENDPOINT,
    KV_STATE_ENDPOINT,
    EngineOutput,
    EngineRequest,
    KVStateDump,
    KVStateRequest,
    ModelCard,
)
from shoal.runtime.distributed import DistributedRuntime
from shoal.worker.kv_publisher import KVPublisher
from shoal.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

LOAD_INTERVAL = 0.2  # seconds between load reports


class Worker:
    def __init__(self, engine: AsyncLLM, served_model_name: str, publisher: KVPublisher) -> None:
        self.engine = engine
        self.publisher = publisher
        core = engine.engine
        self.card = ModelCard(
            model_name=served_model_name,
            tokenizer=str(core.config.tokenizer or core.model_dir),
            context_length=core.max_model_len,
            kv_block_size=core.kv.block_size,
            num_kv_blocks=core.kv.num_blocks,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """The endpoint handler; a request the engine refuses ends with its error message."""
        try:
            async for out in self.engine.generate(request):
                yield out
        except ValueError as e:
            yield EngineOutput(request_id=request.request_id, finish_reason="error", error=str(e))

    async def kv_state(self, request: KVStateRequest) -> AsyncIterator[KVStateDump]:
        """The resync endpoint: one dump of every block the engine caches."""
        dump = await self.engine.call(self.publisher.dump)
        log.info(
            "KV state dump for a router (%s): %d blocks at seq %d",
            request.reason,
            len(dump.block_hashes),
            dump.seq,
        )
        yield dump

    async def report_load(self, interval: float = LOAD_INTERVAL) -> None:
        """Publish the engine's load every `interval` seconds, busy or idle."""
        while True:
            await self.engine.call(self.publisher.publish_load)
            await asyncio.sleep(interval)


async def serve_worker(
    make_engine: Callable[[], LLMEngine],
    served_model_name: str,
    discovery: str | None,
    host: str = "127.0.0.1",
    port: int = 0,
    drain_timeout: float = 30.0,
    metrics_port: int | None = None,
) -> None:
    """Start the engine, register, serve until SIGTERM/SIGINT, then drain and exit."""
    loop = asyncio.get_running_loop()
    metrics = WorkerMetrics(served_model_name)
    runtime = DistributedRuntime(discovery, host=host, port=port)
    publisher = KVPublisher(runtime.instance_id, host)

    def on_step(core: LLMEngine) -> None:
        publisher.publish_events(core)
        metrics.update(core)

    engine = AsyncLLM(await asyncio.to_thread(make_engine), on_step)
    metrics.update(engine.engine)
    if metrics_port is not None:
        metrics.serve(metrics_port, host)
    worker = Worker(engine, served_model_name, publisher)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reporter = asyncio.create_task(worker.report_load())
    await runtime.serve_endpoint(KV_STATE_ENDPOINT, worker.kv_state, KVStateRequest)
    served = await runtime.serve_endpoint(
        GENERATE_ENDPOINT,
        worker.generate,
        EngineRequest,
        card=worker.card,
        extra={"kv_events": publisher.address},
    )
    log.info(
        "worker %s serving %s at %s, KV events at %s",
        runtime.instance_id,
        served_model_name,
        served.record.address,
        publisher.address,
    )
    try:
        await stop.wait()
        log.info("worker %s draining (up to %.0fs)", runtime.instance_id, drain_timeout)
        await served.stop(drain_timeout)
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
        await runtime.close()
        engine.shutdown()
        publisher.close()
