"""Router replicas share their routing decisions: two replicas hold one replica's load picture."""

from __future__ import annotations

import asyncio
import random
import time

from shoal.kv_hash import route_hashes
from shoal.protocol import (
    GENERATE_ENDPOINT,
    EngineOutput,
    EngineRequest,
    InstanceRecord,
    LoadDelta,
    ModelCard,
    SamplingParams,
)
from shoal.router.kv_router import KvRouter
from shoal.router.load import LoadTracker
from shoal.router.replica_sync import PeerLoads
from shoal.router.selector import KvRouterConfig
from shoal.runtime import DistributedRuntime
from shoal.runtime.discovery import MemoryDiscovery, MemoryRegistry

ROUTED, FIRST_TOKEN, FINISHED = LoadDelta.ROUTED, LoadDelta.FIRST_TOKEN, LoadDelta.FINISHED

BLOCK = 16
WORKERS = 4
CARD = ModelCard(
    model_name="m", tokenizer="t", context_length=1 << 16, kv_block_size=BLOCK, num_kv_blocks=4096
)


async def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def burst(n: int, seed: int = 7, prefix: str = "r") -> list[EngineRequest]:
    """Requests with unrelated prompts of spread lengths (no two cost the same by chance)."""
    rng = random.Random(seed)
    return [
        EngineRequest(
            request_id=f"{prefix}{i}",
            prompt_token_ids=[rng.randrange(4, 30000) for _ in range(rng.randrange(40, 3000))],
            sampling=SamplingParams(max_tokens=8),
        )
        for i in range(n)
    ]


def picture(router: KvRouter, workers: list[str]) -> list[tuple[int, float, int]]:
    """Each worker's (queued, prefill blocks, decode blocks), sorted: the load picture up to
    the workers' names (equal pictures route the next request alike, up to those names)."""
    load = router.load
    return sorted(
        (load.queued(w), round(load.prefill_blocks(w), 6), load.decode_blocks(w)) for w in workers
    )


async def start_workers(runtime: DistributedRuntime) -> list[str]:
    """Worker records in discovery (the routers only read them: nothing is sent to them)."""
    names = [f"w{i}" for i in range(WORKERS)]
    for i, name in enumerate(names):
        record = InstanceRecord(
            instance_id=name,
            endpoint=GENERATE_ENDPOINT,
            address=f"tcp://127.0.0.1:{1 + i}",
            card=CARD,
        )
        await runtime.discovery.register(record)
    return names


async def start_router(runtime: DistributedRuntime, **options) -> tuple[KvRouter, object]:
    client = await runtime.client(GENERATE_ENDPOINT, EngineOutput)
    await client.wait_for_instances(WORKERS)
    router = KvRouter(runtime, seed=0, **options)
    await router.start(client)
    return router, client


async def hear_each_other(a: KvRouter, b: KvRouter) -> None:
    """Wait until each replica follows the other and its subscription delivers (ZMQ's
    subscriptions take a moment to reach a publisher): probes are FINISHED deltas of an
    unknown request, which change no load."""
    for x, y in ((a, b), (b, a)):
        await wait_for(lambda x=x, y=y: y.replica_id in x._sync.peer_ids())
        while y.peers.last_seq(x.replica_id) is None:
            x.share(LoadDelta(x.replica_id, FINISHED, "probe"))
            await asyncio.sleep(0.02)


def test_two_synced_replicas_hold_the_load_picture_of_one():
    async def main() -> None:
        discovery = MemoryDiscovery(MemoryRegistry())
        async with (
            DistributedRuntime(discovery) as rt_a,
            DistributedRuntime(discovery) as rt_b,
            DistributedRuntime(discovery) as rt_one,
            DistributedRuntime(discovery) as rt_c,
            DistributedRuntime(discovery) as rt_d,
        ):
            workers = await start_workers(rt_a)
            # no guesses at unheard decisions: this test is of what the replicas hear
            a, client = await start_router(rt_a, sync_window=0)
            b, _ = await start_router(rt_b, sync_window=0)
            one, _ = await start_router(rt_one, replica_sync=False)
            c, _ = await start_router(rt_c, replica_sync=False)  # replicas without sync
            d, _ = await start_router(rt_d, replica_sync=False)
            await hear_each_other(a, b)
            instances = client.instances()
            requests = burst(40)

            for i, request in enumerate(requests):
                one.select(instances, request)
                mine, other = (a, b) if i % 2 == 0 else (b, a)
                mine.select(instances, request)
                key = (mine.replica_id, request.request_id)
                await wait_for(lambda other=other, key=key: key in other.load)
                (c if i % 2 == 0 else d).select(instances, request)
            expected = picture(one, workers)
            assert sum(q for q, _, _ in expected) == len(requests)
            assert picture(a, workers) == expected
            assert picture(b, workers) == expected
            # Unsynced, each replica sees only its half of the requests.
            assert sum(q for q, _, _ in picture(c, workers)) == len(requests) // 2
            assert picture(c, workers) != expected

            # First tokens and ends, each heard by the replica that routed the request.
            for i, request in enumerate(requests):
                rid = request.request_id
                mine = a if i % 2 == 0 else b
                if i % 3:
                    one.first_token(rid)
                    mine.first_token(rid)
                if i % 4 == 1:
                    one.finished(rid)
                    mine.finished(rid)
            expected = picture(one, workers)
            await wait_for(lambda: picture(a, workers) == picture(b, workers) == expected)
            assert picture(a, workers) == expected

            # The next requests go where the single replica would send them.
            for request in burst(12, seed=8, prefix="next"):
                choice = one.select(instances, request).instance_id
                assert a.select(instances, request).instance_id == choice
                one.finished(request.request_id)
                a.finished(request.request_id)

            # A replica that leaves takes its requests out of the others' pictures.
            b_routed = b.peers.num_requests(a.replica_id)
            assert a.peers.num_requests(b.replica_id) > 0 and b_routed > 0
            await b.close()
            await wait_for(lambda: a.peers.num_requests(b.replica_id) == 0)
            queued_by_a = sum(1 for i in range(len(requests)) if i % 2 == 0 and i % 3 == 0)
            assert sum(a.load.queued(w) for w in workers) == queued_by_a
            for router in (a, one, c, d):
                await router.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_decision_counts_the_deltas_that_arrived_while_the_loop_was_busy():
    """A frontend's loop parses and tokenizes a request before routing it, without polling
    its sockets. The decision still counts every delta its peer announced meanwhile: it
    reads the ones waiting on its subscription first."""

    async def main() -> None:
        discovery = MemoryDiscovery(MemoryRegistry())
        async with DistributedRuntime(discovery) as rt_a, DistributedRuntime(discovery) as rt_b:
            await start_workers(rt_a)
            a, client = await start_router(rt_a, sync_window=0)
            b, _ = await start_router(rt_b, sync_window=0)
            await hear_each_other(a, b)
            instances = client.instances()
            first, second = burst(2, seed=9)
            taken = b.select(instances, first).instance_id
            time.sleep(0.2)  # other work on a's loop: b's delta reaches a's socket, unread
            assert (b.replica_id, first.request_id) not in a.load
            assert a.select(instances, second).instance_id != taken
            assert (b.replica_id, first.request_id) in a.load
            for router in (a, b):
                await router.close()

    asyncio.run(asyncio.wait_for(main(), 60))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def guessing_router(
    peers: int, sync_window: float = 0.002, config: KvRouterConfig | None = None
) -> tuple[KvRouter, list, Clock]:
    """A router (no sockets) that has heard from `peers` other replicas, sharing into a list,
    on a clock the test moves."""
    router = KvRouter(None, config, replica_sync=False, seed=0, sync_window=sync_window)
    sent: list[LoadDelta] = []
    router.share = sent.append
    for p in range(peers):
        router.peers.apply(LoadDelta(f"peer{p}", ROUTED, "probe", "w1", 0, 0))
        router.peers.apply(LoadDelta(f"peer{p}", FINISHED, "probe"))
    router.clock = clock = Clock()
    return router, sent, clock


def cached_prefix_requests(n: int, cached_on: KvRouter, worker: str) -> list[EngineRequest]:
    """Requests of 130 blocks whose first 128 are cached on `worker` (the clear pick)."""
    rng = random.Random(5)
    prefix = [rng.randrange(4, 30000) for _ in range(128 * BLOCK)]
    cached_on.indexer.store(worker, route_hashes(prefix, BLOCK).tolist())
    return [
        EngineRequest(
            request_id=f"g{i}",
            prompt_token_ids=prefix + [rng.randrange(4, 30000) for _ in range(2 * BLOCK)],
            sampling=SamplingParams(max_tokens=8),
        )
        for i in range(n)
    ]


def test_a_replica_counts_its_peers_unheard_decisions_for_the_sync_window():
    router, sent, clock = guessing_router(peers=2)
    instances = [
        InstanceRecord(instance_id=f"w{i}", endpoint=GENERATE_ENDPOINT, address=f"a{i}", card=CARD)
        for i in range(WORKERS)
    ]
    requests = cached_prefix_requests(3, router, "w0")
    load = router.load

    def on_w0() -> tuple[int, float, int]:
        return load.queued("w0"), load.prefill_blocks("w0"), load.decode_blocks("w0")

    assert router.select(instances, requests[0]).instance_id == "w0"
    # its own request (2 blocks to prefill) and one like it by each of the 2 peers
    assert on_w0() == (3, 6, 6)
    assert [(d.kind, d.request_id, d.blocks) for d in sent] == [(ROUTED, "g0", 2)]  # own only
    clock.now = 0.001
    assert router.select(instances, requests[1]).instance_id == "w0"
    assert on_w0() == (6, 12, 12)
    clock.now = 0.0025  # g0's guess is over, g1's is not
    assert router.select(instances, requests[2]).instance_id == "w0"
    assert on_w0() == (3 + 2 + 2, 14, 14)
    assert [d.request_id for d in sent] == ["g0", "g1", "g2"]
    clock.now = 1.0
    router.finished("g0")  # g0 ends; the guesses' window is over too
    assert on_w0() == (2, 4, 4)

    unguessing, _, _ = guessing_router(peers=2, sync_window=0)
    requests = cached_prefix_requests(1, unguessing, "w0")
    unguessing.select(instances, requests[0])
    assert unguessing.load.queued("w0") == 1
    alone, _, _ = guessing_router(peers=0)
    requests = cached_prefix_requests(1, alone, "w0")
    alone.select(instances, requests[0])
    assert alone.load.queued("w0") == 1


def test_replicas_deciding_at_once_spread_a_burst_as_one_router_would():
    """Four replicas with one picture (four idle workers, each other heard from) each route
    a request before hearing of the others': each takes the pick of its place among them,
    so the four land on four workers, and each guesses the other three on the rest."""
    routers = [KvRouter(None, replica_sync=False, seed=i, sync_window=10.0) for i in range(WORKERS)]
    for router in routers:
        router.share = lambda delta: None
        for peer in routers:
            if peer is not router:
                router.peers.apply(LoadDelta(peer.replica_id, ROUTED, "probe", "w1", 0, 0))
                router.peers.apply(LoadDelta(peer.replica_id, FINISHED, "probe"))
    instances = [
        InstanceRecord(instance_id=f"w{i}", endpoint=GENERATE_ENDPOINT, address=f"a{i}", card=CARD)
        for i in range(WORKERS)
    ]
    prompt = list(range(4, 4 + 20 * BLOCK))
    picks = [
        router.select(
            instances,
            EngineRequest(
                request_id=f"b{i}", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=8)
            ),
        ).instance_id
        for i, router in enumerate(routers)
    ]
    assert sorted(picks) == [f"w{i}" for i in range(WORKERS)]
    for router in routers:  # its own request and its guesses: one request on each worker
        assert [router.load.queued(f"w{i}") for i in range(WORKERS)] == [1] * WORKERS


def test_a_tied_pick_is_guessed_for_each_peer_with_its_chance():
    """Above temperature 0 (picks drawn, not spread): four idle workers tie, and a peer with
    the same picture picks the same one a quarter of the time, so 3 peers add 0.75 requests
    a decision on average, not 3."""
    router, _, clock = guessing_router(peers=3, config=KvRouterConfig(temperature=0.1))
    instances = [
        InstanceRecord(instance_id=f"w{i}", endpoint=GENERATE_ENDPOINT, address=f"a{i}", card=CARD)
        for i in range(WORKERS)
    ]
    guessed = []
    for i, request in enumerate(burst(400, seed=3, prefix="t")):
        clock.now = i  # each decision's guess is over before the next
        worker = router.select(instances, request).instance_id
        guessed.append(router.load.queued(worker) - 1)
        router.finished(request.request_id)
    assert set(guessed) <= {0, 1, 2, 3}
    assert 0.6 < sum(guessed) / len(guessed) < 0.9


def test_peer_loads_fold_deltas_and_drop_a_peer_after_a_gap():
    load = LoadTracker(block_size=16)
    peers = PeerLoads(load)
    peers.apply(LoadDelta("p", ROUTED, "x", "w0", 10, 160), seq=1)
    peers.apply(LoadDelta("p", ROUTED, "y", "w1", 4, 32), seq=2)
    assert (load.queued("w0"), load.prefill_blocks("w0"), load.decode_blocks("w0")) == (1, 10, 10)
    peers.apply(LoadDelta("p", FIRST_TOKEN, "x"), seq=3)
    assert (load.queued("w0"), load.prefill_blocks("w0"), load.decode_blocks("w0")) == (0, 0, 10)
    peers.apply(LoadDelta("q", ROUTED, "x", "w0", 3, 48), seq=1)  # another peer, same id
    assert (load.queued("w0"), load.decode_blocks("w0")) == (1, 13)
    peers.apply(LoadDelta("p", FINISHED, "x"), seq=4)
    assert (load.queued("w0"), load.decode_blocks("w0")) == (1, 3)
    # p's delta 5 is lost: what p had in flight (y) is dropped; what follows counts.
    peers.apply(LoadDelta("p", ROUTED, "z", "w1", 2, 0), seq=6)
    assert load.decode_blocks("w1") == 2 and peers.num_requests("p") == 1
    assert peers.last_seq("p") == 6
    peers.forget("q")
    assert (load.queued("w0"), load.decode_blocks("w0")) == (0, 0)
