"""The KV router over real shoal engine worker processes (tiny model, CPU, file discovery)."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.frontend.engine_client import NoWorkerAvailable
from shoal.frontend.worker_client import WorkerClient
from shoal.kv_hash import route_hashes
from shoal.protocol import EngineRequest, SamplingParams
from shoal.router.indexer import KvIndexer
from shoal.router.kv_router import KvRouter
from shoal.router.selector import KvRouterConfig
from shoal.runtime.distributed import DistributedRuntime

BLOCK = 16
MODEL = "tiny"


@pytest.fixture(scope="module")
def workers(llama_dir: Path, tmp_path_factory):
    """Two `shoal worker` processes registered in a discovery folder, one publishing KV
    events in shoal's format (the default), the other in vLLM's."""
    folder = tmp_path_factory.mktemp("discovery")
    argv = [sys.executable, "-m", "shoal", "worker", "--model", str(llama_dir)]
    argv += ["--device", "cpu", "--discovery", f"file://{folder}", "--served-model-name", MODEL]
    argv += ["--block-size", str(BLOCK), "--drain-timeout", "1"]
    procs = [subprocess.Popen(argv), subprocess.Popen([*argv, "--kv-events-format", "vllm"])]
    yield folder, procs
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


def run(coro):
    return asyncio.run(coro)


def blocks_of(router: KvRouter, worker: str) -> set[int]:
    """The router hashes the router's index has `worker` holding (read under its lock, as
    the event thread writes the index meanwhile)."""
    with router.index_lock:
        return set(router.indexer.blocks(worker))


async def open_client(folder: Path, count: int = 2, **options) -> WorkerClient:
    runtime = DistributedRuntime(f"file://{folder}")
    client = await WorkerClient(runtime, "kv", **options).start()
    await client.endpoint.wait_for_instances(count, timeout=60)
    router: KvRouter = client.policy
    await wait_for(lambda: all(f.resync is None for f in router._feeds.values()))
    return client


async def close_client(client: WorkerClient) -> None:
    await client.close()
    await client.runtime.close()


async def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def generate(client: WorkerClient, rid: str, prompt: list[int], max_tokens: int = 2):
    request = EngineRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    outs = [out async for out in client.generate(MODEL, request)]
    return outs[0].num_cached_tokens, sum(len(o.new_token_ids) for o in outs)


def routed_to(client: WorkerClient) -> list[str]:
    """Record the worker each later request is routed to."""
    chosen: list[str] = []
    select = client.policy.select

    def recording(instances, request, prepared=None):
        record = select(instances, request, prepared)
        chosen.append(record.instance_id)
        return record

    client.policy.select = recording
    return chosen


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 384) for _ in range(length)]


def test_requests_follow_their_cached_prefix(workers):
    folder, _ = workers

    async def main():
        client = await open_client(folder)
        router: KvRouter = client.policy
        chosen = routed_to(client)
        try:
            shared = prompt_of(1, 4 * BLOCK)
            await generate(client, "first", [*shared, 5])
            holder = chosen[0]
            hashes = route_hashes(shared, BLOCK)
            # The engine's BlockStored hashes are the router's hashes of the same token ids.
            await wait_for(lambda: router.overlaps(hashes).get(holder) == 4)
            assert router.overlaps(hashes) == {holder: 4}
            for i in range(6):
                cached, _ = await generate(client, f"follow-{i}", shared + prompt_of(10 + i, 9))
                assert cached == 4 * BLOCK
            assert chosen[1:] == [holder] * 6
            # A request with an unseen prefix costs the same on both: either may take it,
            # and the hit-rate counters saw 6 x 4 hits out of 4 + 6 x 4 + the new blocks.
            m = router.metrics
            assert m.cached_blocks._value.get() == 24
        finally:
            await close_client(client)

    run(main())


def test_a_prefix_cached_on_either_worker_is_followed(workers):
    """Whichever format a worker publishes its KV events in, the index follows its cache."""
    folder, _ = workers

    async def main():
        client = await open_client(folder)
        router: KvRouter = client.policy
        select = client.policy.select
        try:
            records = await client.endpoint.wait_for_instances(2)
            for n, record in enumerate(records):
                worker = record.instance_id
                shared = prompt_of(40 + n, 3 * BLOCK)
                client.policy.select = lambda instances, request, prepared=None, w=worker: next(
                    i for i in instances if i.instance_id == w
                )
                await generate(client, f"pinned-{n}", [*shared, 5])
                client.policy.select = select
                hashes = route_hashes(shared, BLOCK)
                await wait_for(lambda h=hashes, w=worker: router.overlaps(h).get(w) == 3)
                chosen = routed_to(client)
                cached, _ = await generate(client, f"follows-{n}", [*shared, 6, 7])
                assert chosen == [worker] and cached == 3 * BLOCK
                client.policy.select = select
            # only the vLLM-format worker's events are translated by the router
            translated = [r.instance_id in router.indexer._translators for r in records]
            assert sorted(translated) == [False, True]
        finally:
            client.policy.select = select
            await close_client(client)

    run(main())


def test_approximate_mode_remembers_where_it_sent_prefixes(workers):
    folder, _ = workers

    async def main():
        client = await open_client(folder, use_kv_events=False)
        chosen = routed_to(client)
        try:
            shared = prompt_of(2, 3 * BLOCK)
            for i in range(5):
                cached, _ = await generate(client, f"approx-{i}", shared + prompt_of(20 + i, 7))
                assert cached == (0 if i == 0 else 3 * BLOCK)
            assert len(set(chosen)) == 1
            assert client.policy.overlaps(route_hashes(shared, BLOCK)) == {chosen[0]: 3}
        finally:
            await close_client(client)

    run(main())


def test_busy_workers_are_skipped_then_refused(workers):
    folder, _ = workers

    async def main():
        config = KvRouterConfig(busy_threshold=1e-6)  # any block in use makes a worker busy
        client = await open_client(folder, kv_config=config, busy_wait=0.1)
        chosen = routed_to(client)
        shared = prompt_of(3, 2 * BLOCK)
        try:
            long_one = asyncio.create_task(generate(client, "long-1", shared, max_tokens=900))
            await wait_for(lambda: len(chosen) == 1)
            # The holder of `shared` is busy: the next request goes to the other worker.
            second = asyncio.create_task(generate(client, "long-2", shared, max_tokens=900))
            await wait_for(lambda: len(chosen) == 2)
            assert chosen[1] != chosen[0]
            with pytest.raises(NoWorkerAvailable, match="busy"):
                await generate(client, "refused", shared)
            assert not long_one.done() and not second.done()
        finally:
            long_one.cancel()
            second.cancel()
            await asyncio.gather(long_one, second, return_exceptions=True)
            await close_client(client)

    run(main())


def test_a_gap_in_event_numbers_triggers_a_resync(workers):
    """On each worker (one publishing shoal's events, the other vLLM's): a lost batch shows
    as a gap at the next one, and the dump the router fetches puts the lost blocks back."""
    folder, _ = workers

    async def main():
        client = await open_client(folder)
        router: KvRouter = client.policy
        select = client.policy.select
        dropped = []
        on_batch = router.events._on_batch

        def lossy(feed, seq, batch):  # lose the first batch that arrives while armed
            if not dropped:
                dropped.append(seq)
                return
            on_batch(feed, seq, batch)

        router.events._on_batch = lossy
        dumped = set()
        try:
            for n, record in enumerate(await client.endpoint.wait_for_instances(2)):
                worker = record.instance_id
                client.policy.select = lambda instances, request, prepared=None, w=worker: next(
                    i for i in instances if i.instance_id == w
                )
                lost_prompt = prompt_of(60 + n, 5 * BLOCK)
                dropped.clear()
                await generate(client, f"lost-{n}", lost_prompt)
                await wait_for(lambda: dropped)
                lost = route_hashes(lost_prompt, BLOCK)
                assert router.overlaps(lost) == {}
                # The next batch from that worker shows the gap; the router fetches a dump.
                before = router.metrics.resyncs.labels("gap")._value.get()
                await generate(client, f"after-{n}", prompt_of(70 + n, 5 * BLOCK))
                await wait_for(
                    lambda b=before: router.metrics.resyncs.labels("gap")._value.get() > b
                )
                feed = router._feeds[worker]
                await wait_for(lambda f=feed: f.resync is None)
                truth = await router._fetch_dump(feed.record, "test")
                dumped.add(frozenset(type(e).__name__ for e in truth.events))
                rebuilt = KvIndexer()  # the dump's blocks, as the router applies them
                rebuilt.load_dump(worker, truth.events)
                assert rebuilt.num_blocks(worker) >= 10
                await wait_for(lambda w=worker, r=rebuilt: blocks_of(router, w) >= r.blocks(w))
                assert router.overlaps(lost) == {worker: 5}
            # a dump in each format: router hashes, and BlockStored events with tokens
            assert dumped == {frozenset({"RouteHashesStored"}), frozenset({"BlockStored"})}
        finally:
            client.policy.select = select
            await close_client(client)

    run(main())


def test_a_dead_worker_is_dropped_from_the_index(workers):
    """(Runs last: it kills one of the module's workers.)"""
    folder, procs = workers

    async def main():
        client = await open_client(folder)
        router: KvRouter = client.policy
        try:
            for i in range(40):  # until both workers cache something
                await generate(client, f"spread-{i}", prompt_of(100 + i, 3 * BLOCK))
                if all(router.indexer.num_blocks(w) for w in router._feeds):
                    break
            await wait_for(lambda: all(router.indexer.num_blocks(w) for w in router._feeds))
            before = set(router._feeds)
            procs[1].send_signal(signal.SIGKILL)
            await wait_for(lambda: len(router._feeds) == 1, timeout=30)
            (victim,) = before - set(router._feeds)
            await wait_for(lambda: victim not in router.indexer.workers())  # the event thread
            assert router.indexer.num_blocks(victim) == 0
            _, n = await generate(client, "survivor", prompt_of(100, 3 * BLOCK))
            assert n == 2
        finally:
            await close_client(client)

    run(main())
