"""etcd discovery against a real etcd server on loopback (Debian's etcd-server)."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
from runtime_helpers import (
    EtcdServer,
    etcd_binary,
    reap,
    run,
    spawn,
    spawn_argv,
    spawn_env,
    wait_until,
)
from test_discovery_local import ENDPOINT, Watcher, check_backend

from shoal.protocol import EngineOutput, EngineRequest, SamplingParams
from shoal.runtime import DistributedRuntime, EtcdDiscovery


def test_etcd_backend_contract(etcd: EtcdServer) -> None:
    prefix = f"contract-{time.monotonic_ns()}/"
    run(check_backend(lambda: EtcdDiscovery(etcd.url, prefix=prefix)))


def test_registration_is_visible_to_another_client(etcd: EtcdServer) -> None:
    async def main() -> None:
        proc, info = await spawn("serve", etcd.discovery_url, ENDPOINT, "2", "0")
        other = EtcdDiscovery(etcd.url)
        try:
            records = await other.list(ENDPOINT)
            assert [(r.instance_id, r.address) for r in records] == [
                (info["instance_id"], info["address"])
            ]
            assert records[0].card is not None and records[0].card.num_kv_blocks == 512
        finally:
            await reap(proc)
            await other.close()

    run(main())


def test_killed_worker_disappears_when_its_lease_expires(etcd: EtcdServer) -> None:
    async def main() -> None:
        other = EtcdDiscovery(etcd.url)
        watcher = Watcher(other)
        proc, info = await spawn("serve", etcd.discovery_url, ENDPOINT, "1", "0")
        try:
            await wait_until(lambda: watcher.seen("added", info["instance_id"]), 2)
            await asyncio.sleep(1.5)  # past the TTL: the keep-alive holds it
            assert info["instance_id"] in {r.instance_id for r in await other.list(ENDPOINT)}
            proc.kill()
            at_kill = time.monotonic()
            await wait_until(lambda: watcher.seen("removed", info["instance_id"]), 5)
            lag = watcher.seen("removed", info["instance_id"]) - at_kill
            assert 0.3 < lag < 3.0, f"removed {lag:.2f}s after the kill, TTL is 1s"
            assert info["instance_id"] not in {r.instance_id for r in await other.list(ENDPOINT)}
        finally:
            await reap(proc)
            await watcher.close()
            await other.close()

    run(main())


def test_watch_sees_a_new_worker_within_a_second(etcd: EtcdServer) -> None:
    async def main() -> None:
        other = EtcdDiscovery(etcd.url)
        watcher = Watcher(other)
        await asyncio.sleep(0.2)  # the watch is established
        proc, info = await spawn("serve", etcd.discovery_url, ENDPOINT, "2", "0")
        ready_at = time.monotonic()  # the worker's put has returned by now
        try:
            await wait_until(lambda: watcher.seen("added", info["instance_id"]), 1.0)
            assert watcher.seen("added", info["instance_id"]) - ready_at < 1.0
            proc.terminate()  # graceful: the lease is revoked, the watch sees it at once
            at_term = time.monotonic()
            await wait_until(lambda: watcher.seen("removed", info["instance_id"]), 1.0)
            assert watcher.seen("removed", info["instance_id"]) - at_term < 1.0
        finally:
            await reap(proc)
            await watcher.close()
            await other.close()

    run(main())


def test_worker_registers_again_after_etcd_restarts(private_etcd: EtcdServer) -> None:
    async def main() -> None:
        other = EtcdDiscovery(private_etcd.url)
        watcher = Watcher(other)
        proc, info = await spawn("serve", private_etcd.discovery_url, ENDPOINT, "1", "0")
        instance = info["instance_id"]
        try:
            await wait_until(lambda: watcher.seen("added", instance), 2)
            first_lease = await lease_of(private_etcd, instance)
            assert first_lease is not None

            # restart keeping the data: the lease survives and the keep-alive resumes
            await asyncio.to_thread(private_etcd.stop)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(private_etcd.start)
            await asyncio.sleep(2.5)  # longer than the TTL
            assert await lease_of(private_etcd, instance) == first_lease

            # restart with the data lost: the keep-alive finds no lease, grants one, puts again
            await asyncio.to_thread(private_etcd.stop)
            await asyncio.to_thread(private_etcd.wipe)
            await asyncio.to_thread(private_etcd.start)
            took = await wait_until(lambda: lease_of(private_etcd, instance), 5)
            assert took < 2.0, f"re-registered {took:.2f}s after the restart"
            assert await lease_of(private_etcd, instance) != first_lease
            # the watcher that lived through both restarts knows the instance
            await asyncio.sleep(0.5)
            last = [e.kind for _, e in watcher.events if e.instance.instance_id == instance][-1]
            assert last == "added"
            assert [r.instance_id for r in await other.list(ENDPOINT)] == [instance]
        finally:
            await reap(proc)
            await watcher.close()
            await other.close()

    run(main())


async def lease_of(server: EtcdServer, instance_id: str) -> str | None:
    """The lease id the instance's key is attached to in etcd, read with a plain HTTP client."""
    key = f"shoal/instances/{ENDPOINT.replace('.', '/')}/{instance_id}".encode()
    async with httpx.AsyncClient() as http:
        reply = (
            await http.post(
                f"{server.url}/v3/kv/range", json={"key": base64.b64encode(key).decode()}
            )
        ).json()
    kvs = reply.get("kvs", [])
    return kvs[0].get("lease") if kvs else None


def test_runtime_over_etcd_streams_to_a_discovered_worker(etcd: EtcdServer) -> None:
    async def main() -> None:
        proc, info = await spawn("serve", etcd.discovery_url, ENDPOINT, "2", "0.001")
        try:
            async with DistributedRuntime(etcd.discovery_url) as runtime:
                client = await runtime.client(ENDPOINT, EngineOutput)
                (instance,) = await client.wait_for_instances(1, timeout=5)
                assert instance.instance_id == info["instance_id"]
                request = EngineRequest(
                    request_id="e2e",
                    prompt_token_ids=[5, 6],
                    sampling=SamplingParams(max_tokens=20),
                )
                outs = [o async for o in client.generate(instance.instance_id, request)]
                assert [o.new_token_ids[0] for o in outs] == list(range(20))
                assert outs[-1].finish_reason == "length"
        finally:
            await reap(proc)

    run(main())


def test_worker_started_while_etcd_is_down_registers_when_it_comes_up(tmp_path) -> None:
    async def main() -> None:
        etcd = EtcdServer(etcd_binary(), tmp_path)  # not started yet
        proc = await asyncio.create_subprocess_exec(
            *spawn_argv("serve", etcd.discovery_url, ENDPOINT, "2", "0"),
            stdout=asyncio.subprocess.PIPE,
            env=spawn_env(),
        )
        other: EtcdDiscovery | None = None
        try:
            await asyncio.sleep(2.0)  # it retries meanwhile instead of exiting
            assert proc.returncode is None
            await asyncio.to_thread(etcd.start)
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
            assert line.startswith(b"READY ")
            other = EtcdDiscovery(etcd.url)
            assert len(await other.list(ENDPOINT)) == 1
        finally:
            await reap(proc)
            if other is not None:
                await other.close()
            etcd.stop()

    run(main())
