"""Run one engine as a worker: serve `generate` over the request plane until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable

from shoal.engine.async_llm import AsyncLLM
from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import GENERATE_ENDPOINT, EngineOutput, EngineRequest, ModelCard
from shoal.runtime.distributed import DistributedRuntime
from shoal.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.engine = engine
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
    engine = AsyncLLM(await asyncio.to_thread(make_engine), metrics.update)
    metrics.update(engine.engine)
    if metrics_port is not None:
        metrics.serve(metrics_port, host)
    worker = Worker(engine, served_model_name)
    runtime = DistributedRuntime(discovery, host=host, port=port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    served = await runtime.serve_endpoint(
        GENERATE_ENDPOINT, worker.generate, EngineRequest, card=worker.card
    )
    log.info(
        "worker %s serving %s at %s", runtime.instance_id, served_model_name, served.record.address
    )
    try:
        await stop.wait()
        log.info("worker %s draining (up to %.0fs)", runtime.instance_id, drain_timeout)
        await served.stop(drain_timeout)
    finally:
        await runtime.close()
        engine.shutdown()
