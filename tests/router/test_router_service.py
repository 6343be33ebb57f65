"""The KV router service: frontends that ask it route as one router would."""

from __future__ import annotations

import asyncio

import pytest

from shoal.protocol import GENERATE_ENDPOINT, EngineOutput, LoadDelta
from shoal.router.busy import AllWorkersBusy
from shoal.router.load import LoadTracker
from shoal.router.remote import RemoteRouter, RouterUnavailable
from shoal.router.replica_sync import PeerLoads
from shoal.router.selector import KvRouterConfig
from shoal.router.service import RouterService
from shoal.runtime import DistributedRuntime
from shoal.runtime.discovery import MemoryDiscovery, MemoryRegistry
from tests.router.test_replica_sync import (
    WORKERS,
    burst,
    picture,
    start_router,
    start_workers,
    wait_for,
)

FINISHED = LoadDelta.FINISHED


async def start_frontend(runtime: DistributedRuntime) -> tuple[RemoteRouter, object]:
    client = await runtime.client(GENERATE_ENDPOINT, EngineOutput)
    await client.wait_for_instances(WORKERS)
    frontend = RemoteRouter(runtime)
    await frontend.start(client)
    return frontend, client


async def connect(service: RouterService, frontend: RemoteRouter) -> None:
    """Wait until the frontend finds the service and the service hears the frontend's
    deltas (probes: FINISHED deltas of an unknown request, which change no load)."""
    await wait_for(lambda: frontend._services.instances())
    await wait_for(lambda: frontend.replica_id in service.sync.peer_ids())
    while service.router.peers.last_seq(frontend.replica_id) is None:
        frontend._sync.publish(LoadDelta(frontend.replica_id, FINISHED, "probe"))
        await asyncio.sleep(0.02)


async def connected_frontends(
    service: RouterService, *runtimes: DistributedRuntime
) -> tuple[list[RemoteRouter], object]:
    """A frontend on each runtime, each connected to the service, and the first's client."""
    started = [await start_frontend(runtime) for runtime in runtimes]
    for frontend, _ in started:
        await connect(service, frontend)
    return [frontend for frontend, _ in started], started[0][1]


def test_frontends_asking_the_service_route_as_one_router():
    async def main() -> None:
        discovery = MemoryDiscovery(MemoryRegistry())
        async with (
            DistributedRuntime(discovery) as rt_service,
            DistributedRuntime(discovery) as rt_a,
            DistributedRuntime(discovery) as rt_b,
            DistributedRuntime(discovery) as rt_one,
        ):
            workers = await start_workers(rt_service)
            service = await RouterService(rt_service, GENERATE_ENDPOINT, seed=0).start()
            one, client = await start_router(rt_one, replica_sync=False)
            (a, b), _ = await connected_frontends(service, rt_a, rt_b)
            instances = client.instances()
            requests = burst(40)

            for i, request in enumerate(requests):
                expected = one.select(instances, request).instance_id
                frontend = a if i % 2 == 0 else b
                chosen = await frontend.route(instances, request, busy_wait=1.0)
                assert chosen.instance_id == expected
            assert picture(service.router, workers) == picture(one, workers)
            assert sum(q for q, _, _ in picture(service.router, workers)) == len(requests)

            # First tokens and ends come back as each frontend's deltas.
            for i, request in enumerate(requests):
                rid = request.request_id
                frontend = a if i % 2 == 0 else b
                if i % 3:
                    one.first_token(rid)
                    frontend.first_token(rid)
                if i % 4 == 1:
                    one.finished(rid)
                    frontend.finished(rid)
            expected = picture(one, workers)
            await wait_for(lambda: picture(service.router, workers) == expected)

            # The next requests go where the single router would send them. (An end travels
            # on the event plane, a request on the request plane: the next request may
            # overtake the last one's end, so each end is awaited.)
            for request in burst(12, seed=8, prefix="next"):
                choice = one.select(instances, request).instance_id
                assert (await a.route(instances, request, 1.0)).instance_id == choice
                one.finished(request.request_id)
                a.finished(request.request_id)
                await wait_for(lambda: picture(service.router, workers) == picture(one, workers))

            # A frontend that leaves takes its requests out of the service's picture.
            assert service.router.peers.num_requests(b.replica_id) > 0
            await b.close()
            await wait_for(lambda: service.router.peers.num_requests(b.replica_id) == 0)
            queued_by_a = sum(1 for i in range(len(requests)) if i % 2 == 0 and i % 3 == 0)
            assert sum(service.router.load.queued(w) for w in workers) == queued_by_a
            for router in (a, one):
                await router.close()
            await service.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_requests_wait_in_the_service_for_a_worker_to_free_up():
    async def main() -> None:
        discovery = MemoryDiscovery(MemoryRegistry())
        async with (
            DistributedRuntime(discovery) as rt_service,
            DistributedRuntime(discovery) as rt_a,
            DistributedRuntime(discovery) as rt_b,
        ):
            await start_workers(rt_service)
            config = KvRouterConfig(busy_threshold=1e-4)  # one request makes a worker busy
            service = await RouterService(rt_service, GENERATE_ENDPOINT, kv_config=config).start()
            (a, b), client = await connected_frontends(service, rt_a, rt_b)
            instances = client.instances()
            first = burst(WORKERS, seed=3)
            held = {}
            for request in first:
                held[(await a.route(instances, request, 0.0)).instance_id] = request
            assert len(held) == WORKERS  # each worker took one and is now busy

            late = burst(1, seed=4, prefix="late")[0]
            with pytest.raises(AllWorkersBusy):
                await b.route(instances, late, busy_wait=0.2)

            waiting = asyncio.create_task(b.route(instances, late, busy_wait=10.0))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            freed = next(iter(held))
            a.finished(held[freed].request_id)  # its end reaches the service as a delta
            chosen = await asyncio.wait_for(waiting, 10)
            assert chosen.instance_id == freed
            for router in (a, b):
                await router.close()
            await service.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_without_a_service_routing_fails_with_a_clear_error():
    async def main() -> None:
        discovery = MemoryDiscovery(MemoryRegistry())
        async with DistributedRuntime(discovery) as runtime:
            await start_workers(runtime)
            frontend, client = await start_frontend(runtime)
            with pytest.raises(RouterUnavailable, match="shoal router"):
                await frontend.route(client.instances(), burst(1)[0], busy_wait=0.0)
            with pytest.raises(TypeError):
                frontend.select(client.instances(), burst(1)[0])
            await frontend.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_requests_routed_for_a_peer_before_its_first_heard_delta_are_dropped():
    load = LoadTracker(block_size=16)
    peers = PeerLoads(load)
    peers.apply(LoadDelta("f", LoadDelta.ROUTED, "x", "w0", 4, 64))  # the service's own count
    peers.apply(LoadDelta("f", LoadDelta.ROUTED, "y", "w0", 2, 32))
    assert load.queued("w0") == 2
    peers.apply(LoadDelta("f", FINISHED, "y"), seq=3)  # deltas 1 and 2 were missed
    assert load.queued("w0") == 0 and peers.num_requests("f") == 0
    peers.apply(LoadDelta("f", LoadDelta.ROUTED, "z", "w1", 1, 16))
    peers.apply(LoadDelta("f", FINISHED, "z"), seq=4)
    assert load.queued("w1") == 0
    # A peer heard from its first delta on keeps what was routed for it.
    peers.apply(LoadDelta("g", LoadDelta.ROUTED, "x", "w2", 1, 16))
    peers.apply(LoadDelta("g", LoadDelta.FIRST_TOKEN, "x"), seq=1)
    assert peers.num_requests("g") == 1 and load.decode_blocks("w2") == 1
