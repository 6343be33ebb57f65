"""The frontend logs workers joining and leaving, from real discovery events."""

from __future__ import annotations

import asyncio
import logging
import time

from shoal.frontend.worker_log import WorkerLog
from shoal.protocol import EngineOutput, EngineRequest, ModelCard
from shoal.runtime import DistributedRuntime, MemoryDiscovery
from shoal.runtime.discovery import MemoryRegistry

ENDPOINT = "shoal.backend.generate"
CARD = ModelCard(
    model_name="tiny", tokenizer="/t", context_length=64, kv_block_size=16, num_kv_blocks=8
)


async def nothing(request: EngineRequest):
    yield EngineOutput(request_id=request.request_id, new_token_ids=[0], finish_reason="length")


async def wait_until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shoal.frontend.workers"]


def test_worker_joined_and_left_lines(caplog):
    async def main() -> None:
        discovery = MemoryDiscovery(MemoryRegistry())
        frontend = DistributedRuntime(discovery)
        first = DistributedRuntime(discovery, instance_id="worker-1")
        second = DistributedRuntime(discovery, instance_id="worker-2")
        served = await first.serve_endpoint(ENDPOINT, nothing, EngineRequest, card=CARD)
        client = await frontend.client(ENDPOINT, EngineOutput)
        await client.wait_for_instances(1, timeout=5)
        client.add_listener(WorkerLog())  # a worker known before the listener: joined too
        await second.serve_endpoint(ENDPOINT, nothing, EngineRequest, card=CARD)
        await wait_until(lambda: len(lines(caplog)) >= 2, 5)
        await served.stop()
        await wait_until(lambda: len(lines(caplog)) >= 3, 5)
        for runtime in (frontend, first, second):
            await runtime.close()

    with caplog.at_level(logging.INFO, logger="shoal.frontend.workers"):
        asyncio.run(main())
    joined_1, joined_2, left_1 = lines(caplog)[:3]
    assert joined_1.startswith("worker joined: worker-1 model=tiny address=tcp://")
    assert joined_1.endswith("(1 workers)")
    assert joined_2.startswith("worker joined: worker-2 model=tiny") and "(2 workers)" in joined_2
    assert left_1.startswith("worker left: worker-1 model=tiny") and "(1 workers)" in left_1
