"""Requests waiting for a non-busy worker go in arrival order, woken by load, without polling.

A real WorkerClient with the real KV router over an in-process runtime and gated workers:
with busy_threshold 0.01 a worker holding any request is busy (one block of 64), so one
request runs per worker and the rest wait until a finish frees one.
"""

from __future__ import annotations

import asyncio
import time

from shoal.frontend.worker_client import WorkerClient
from shoal.protocol import GENERATE_ENDPOINT, EngineOutput, EngineRequest, ModelCard, SamplingParams
from shoal.router.selector import KvRouterConfig
from shoal.runtime import DistributedRuntime, MemoryDiscovery
from shoal.runtime.discovery import MemoryRegistry

MODEL = "gated"
CARD = ModelCard(
    model_name=MODEL, tokenizer="-", context_length=4096, kv_block_size=16, num_kv_blocks=64
)
ONE_AT_A_TIME = KvRouterConfig(busy_threshold=0.01)


class Gates:
    """Workers that answer a request only when the test opens its gate."""

    def __init__(self) -> None:
        self.routed: list[str] = []  # request ids, in the order the router placed them
        self.started: list[str] = []  # request ids, in the order the workers got them
        self.gates: dict[str, asyncio.Event] = {}

    def gate(self, rid: str) -> asyncio.Event:
        return self.gates.setdefault(rid, asyncio.Event())

    async def handler(self, req: EngineRequest):
        self.started.append(req.request_id)
        await self.gate(req.request_id).wait()
        yield EngineOutput(request_id=req.request_id, new_token_ids=[7], finish_reason="length")


def request(rid: str) -> EngineRequest:
    sampling = SamplingParams(max_tokens=1)
    return EngineRequest(request_id=rid, prompt_token_ids=[3, 1, 4, 1, 5], sampling=sampling)


async def complete(client: WorkerClient, rid: str) -> list[int]:
    return [t async for out in client.generate(MODEL, request(rid)) for t in out.new_token_ids]


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def with_client(gates: Gates, body, workers: int, busy_wait: float = 30.0):
    discovery = MemoryDiscovery(MemoryRegistry())
    runtimes = [DistributedRuntime(discovery, instance_id=f"w{i}") for i in range(workers)]
    frontend = DistributedRuntime(discovery)
    client = None
    try:
        for rt in runtimes:
            await rt.serve_endpoint(GENERATE_ENDPOINT, gates.handler, EngineRequest, card=CARD)
        client = await WorkerClient(
            frontend, "kv", kv_config=ONE_AT_A_TIME, busy_wait=busy_wait, replica_sync=False
        ).start()
        await client.endpoint.wait_for_instances(workers, timeout=10)
        select = client.policy.select

        def recording(instances, req, prepared=None):
            chosen = select(instances, req, prepared)
            gates.routed.append(req.request_id)
            return chosen

        client.policy.select = recording
        return await body(client)
    finally:
        if client is not None:
            await client.close()
        await frontend.close()
        for rt in runtimes:
            await rt.close()


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_waiting_requests_are_served_in_arrival_order():
    gates = Gates()
    waiting = [f"q{i}" for i in range(6)]

    async def body(client):
        tasks = [asyncio.create_task(complete(client, r)) for r in ("a", "b")]
        await until(lambda: len(gates.started) == 2)
        for n, rid in enumerate(waiting, 1):  # one at a time, so their arrival order is known
            tasks.append(asyncio.create_task(complete(client, rid)))
            await until(lambda n=n: len(client.busy) == n)
        # Release in an order unrelated to arrival; each finish lets the head of the queue in.
        for rid in ("b", "a", *waiting):
            gates.gate(rid).set()
            await asyncio.sleep(0)
        outputs = await asyncio.gather(*tasks)
        metrics = client.policy.metrics
        return outputs, count(metrics.hash_seconds), metrics.busy_rejections._value.get()

    outputs, hashed, refused = run(with_client(gates, body, workers=2))
    assert outputs == [[7]] * 8
    assert gates.routed == ["a", "b", *waiting]
    assert refused >= 1 and hashed == 8  # a refused request placed again is not hashed again


def count(histogram) -> float:
    """How many observations a prometheus Histogram holds."""
    samples = histogram.collect()[0].samples
    return next(s.value for s in samples if s.name.endswith("_count"))


def test_a_newcomer_does_not_overtake_a_waiting_request():
    gates = Gates()

    async def body(client):
        first = asyncio.create_task(complete(client, "first"))
        await until(lambda: gates.started == ["first"])
        early = asyncio.create_task(complete(client, "early"))
        await until(lambda: len(client.busy) == 1)
        gates.gate("first").set()
        late = asyncio.create_task(complete(client, "late"))  # arrives as the worker frees up
        await until(lambda: len(gates.started) == 2)
        gates.gate("early").set()
        gates.gate("late").set()
        return await asyncio.gather(first, early, late)

    assert run(with_client(gates, body, workers=1)) == [[7]] * 3
    assert gates.routed == gates.started == ["first", "early", "late"]


def test_a_waiting_request_costs_nothing_until_woken():
    gates = Gates()

    async def body(client):
        rejections = client.policy.metrics.busy_rejections
        first = asyncio.create_task(complete(client, "first"))
        await until(lambda: gates.started == ["first"])
        before = rejections._value.get()
        waiter = asyncio.create_task(complete(client, "waiter"))
        await until(lambda: len(client.busy) == 1)
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(1.0)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        tries = rejections._value.get() - before  # routing attempts refused meanwhile
        gates.gate("first").set()
        released = time.monotonic()
        await until(lambda: len(gates.started) == 2)
        woken_after = time.monotonic() - released
        gates.gate("waiter").set()
        await asyncio.gather(first, waiter)
        return tries, cpu, wall, woken_after

    tries, cpu, wall, woken_after = run(with_client(gates, body, workers=1))
    assert tries == 1  # one refusal on arrival; polling every 20 ms would make ~50
    assert cpu < 0.25 * wall  # the process sat idle while the request waited
    assert woken_after < 2.0  # the finish woke it (generous: a loaded 2-core machine)


def test_the_wait_ends_in_queue_full_and_frees_its_place():
    gates = Gates()

    async def body(client):
        first = asyncio.create_task(complete(client, "first"))
        await until(lambda: gates.started == ["first"])
        start = time.monotonic()
        try:
            await complete(client, "refused")
        except Exception as e:
            error, took = e, time.monotonic() - start
        assert len(client.busy) == 0
        gates.gate("first").set()
        await first
        gates.gate("after").set()
        return error, took, await complete(client, "after")

    error, took, after = run(with_client(gates, body, workers=1, busy_wait=0.3))
    assert type(error).__name__ == "QueueFull" and "busy threshold for 0.3s" in str(error)
    assert 0.3 <= took < 10
    assert after == [7] and gates.started == ["first", "after"]
