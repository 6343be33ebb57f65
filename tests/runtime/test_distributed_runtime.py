"""DistributedRuntime: serving, discovering and streaming end to end, and removal handling."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from runtime_helpers import reap, run, spawn, wait_until

from shoal.protocol import EngineOutput, EngineRequest, ModelCard, SamplingParams
from shoal.runtime import (
    DirectoryDiscovery,
    DistributedRuntime,
    InstanceEvent,
    MemoryDiscovery,
    NoInstancesError,
    WorkerLostError,
)
from shoal.runtime.discovery import MemoryRegistry

ENDPOINT = "shoal.backend.generate"
CARD = ModelCard(
    model_name="tiny",
    tokenizer="/models/tiny",
    context_length=4096,
    kv_block_size=16,
    num_kv_blocks=100,
)


def request(rid: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=rid, prompt_token_ids=[1], sampling=SamplingParams(max_tokens=max_tokens)
    )


async def slow_tokens(req: EngineRequest) -> AsyncIterator[EngineOutput]:
    n = req.sampling.max_tokens or 1
    for i in range(n):
        await asyncio.sleep(0.01)
        yield EngineOutput(
            request_id=req.request_id,
            new_token_ids=[i],
            finish_reason="length" if i == n - 1 else None,
        )


def test_serve_discover_generate_and_stop() -> None:
    async def main() -> None:
        discovery = MemoryDiscovery(MemoryRegistry())
        worker = DistributedRuntime(discovery, instance_id="worker-1")
        frontend = DistributedRuntime(discovery)
        served = await worker.serve_endpoint(
            ENDPOINT,
            slow_tokens,
            EngineRequest,
            card=CARD,
            extra={"kv_events": "tcp://127.0.0.1:9"},
        )
        client = await frontend.client(ENDPOINT, EngineOutput)
        events: list[InstanceEvent] = []
        client.add_listener(events.append)
        (instance,) = await client.wait_for_instances(1, timeout=5)
        assert instance == served.record
        assert instance.instance_id == "worker-1" and instance.address == worker.server.address
        assert instance.card == CARD and instance.extra == {"kv_events": "tcp://127.0.0.1:9"}
        assert client.instance("worker-1") == instance and client.instance("nope") is None

        by_id = [o.new_token_ids[0] async for o in client.generate("worker-1", request("a", 5))]
        by_record = [o.new_token_ids[0] async for o in client.generate(instance, request("b", 3))]
        assert by_id == [0, 1, 2, 3, 4] and by_record == [0, 1, 2]
        with pytest.raises(NoInstancesError):
            client.generate("worker-2", request("c", 1))
        with pytest.raises(NoInstancesError):
            await client.wait_for_instances(2, timeout=0.2)

        await served.stop()
        await wait_until(lambda: not client.instances(), 2)
        assert [(e.kind, e.instance) for e in events] == [
            ("added", served.record),
            ("removed", served.record),
        ]
        await frontend.close()
        await worker.close()

    run(main())


def test_draining_worker_keeps_its_streams_after_leaving_discovery() -> None:
    async def main() -> None:
        discovery = MemoryDiscovery(MemoryRegistry())
        async with (
            DistributedRuntime(discovery) as worker,
            DistributedRuntime(discovery, removal_probe=0.2) as frontend,
        ):
            served = await worker.serve_endpoint(ENDPOINT, slow_tokens, EngineRequest)
            client = await frontend.client(ENDPOINT, EngineOutput)
            (instance,) = await client.wait_for_instances(1, timeout=5)
            stream = client.generate(instance, request("drain", 80))
            await anext(stream)
            stopping = asyncio.create_task(served.stop(drain_timeout=5))
            await wait_until(lambda: not client.instances(), 2)  # gone from discovery
            rest = [o async for o in stream]  # yet the live worker finishes the request
            assert len(rest) == 79 and rest[-1].finish_reason == "length"
            await stopping

    run(main())


def test_hung_worker_leaving_discovery_fails_its_streams(tmp_path: Path) -> None:
    async def main() -> None:
        proc, info = await spawn("serve", f"file://{tmp_path}", ENDPOINT, "1.0", "0.01")
        discovery = DirectoryDiscovery(tmp_path, poll_interval=0.05)
        # silence alone would take 30 s: only the discovery removal can end the stream
        frontend = DistributedRuntime(discovery, dead_after=30, removal_probe=0.3)
        try:
            client = await frontend.client(ENDPOINT, EngineOutput)
            (instance,) = await client.wait_for_instances(1, timeout=5)
            assert instance.instance_id == info["instance_id"]
            stream = client.generate(instance, request("hang", 100_000))
            await anext(stream)
            proc.send_signal(signal.SIGSTOP)  # its lease file stops being renewed
            stopped = time.monotonic()
            with pytest.raises(WorkerLostError, match="removed from discovery"):
                async for _ in stream:
                    pass
            elapsed = time.monotonic() - stopped
            assert 0.5 < elapsed < 3.0, elapsed  # TTL (1 s) + poll + probe (0.3 s)
        finally:
            await reap(proc)
            await frontend.close()

    run(main())
