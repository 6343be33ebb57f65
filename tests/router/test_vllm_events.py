"""The router follows KV events encoded exactly as vLLM 0.10/0.11 encodes them.

The structs below mirror vllm/distributed/kv_events.py of those versions (array-like msgspec
structs tagged by class name, vLLM's field order), the engine's block hashes are vLLM-like
values unrelated to kv_hash (random 64-bit ints, or 32-byte digests), and the batches go out
framed as vLLM's ZmqEventPublisher frames them: topic, sequence number from 0 as 8 bytes
big-endian, msgpack payload.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq

from shoal.kv_hash import route_hashes
from shoal.protocol import (
    GENERATE_ENDPOINT,
    KV_EVENTS_TOPIC,
    KV_STATE_ENDPOINT,
    EngineOutput,
    EngineRequest,
    KVStateDump,
    KVStateRequest,
    ModelCard,
    SamplingParams,
)
from shoal.protocol import BlockStored as ShoalBlockStored
from shoal.protocol import KVEventBatch as ShoalKVEventBatch
from shoal.router.kv_router import KvRouter
from shoal.runtime import DistributedRuntime
from shoal.runtime.discovery import MemoryDiscovery, MemoryRegistry

BLOCK = 16


# ---- vLLM's wire types (v0.10/v0.11), as vLLM declares them ------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class VllmPublisher:
    """vLLM's framing on a socket that also reports subscriptions (XPUB sends as PUB does)."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self.encoder = msgspec.msgpack.Encoder()

    async def wait_for_subscriber(self, topic: bytes, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(0) and self.sock.recv() == b"\x01" + topic:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no subscription arrived")

    def publish(self, *events: KVCacheEvent) -> None:
        payload = self.encoder.encode(KVEventBatch(ts=time.time(), events=list(events)))
        self.sock.send_multipart((KV_EVENTS_TOPIC.encode(), self.seq.to_bytes(8, "big"), payload))
        self.seq += 1


def engine_hashes(kind: str, count: int, rng: random.Random) -> list[int | bytes]:
    if kind == "int":
        return [rng.getrandbits(64) for _ in range(count)]
    return [hashlib.sha256(rng.randbytes(8)).digest() for _ in range(count)]


async def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# ---- tests ---------------------------------------------------------------------------------


def test_shoal_batches_decode_as_vllm_batches_and_back():
    shoal_batch = ShoalKVEventBatch(
        ts=12.5,
        events=[
            ShoalBlockStored(
                block_hashes=[11, 12], parent_block_hash=None, token_ids=[1] * 8, block_size=4
            )
        ],
    )
    payload = msgspec.msgpack.encode(shoal_batch)
    as_vllm = msgspec.msgpack.decode(payload, type=KVEventBatch)
    assert as_vllm.ts == 12.5 and as_vllm.data_parallel_rank is None
    assert as_vllm.events == [BlockStored([11, 12], None, [1] * 8, 4, None, "GPU")]

    vllm_batch = KVEventBatch(
        ts=3.0,
        events=[BlockRemoved([b"\x01" * 32], "GPU"), AllBlocksCleared()],
        data_parallel_rank=1,
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(vllm_batch), type=ShoalKVEventBatch)
    assert back.ts == 3.0 and back.data_parallel_rank == 1
    assert [type(e).__name__ for e in back.events] == ["BlockRemoved", "AllBlocksCleared"]
    assert back.events[0].block_hashes == [b"\x01" * 32]


@pytest.mark.parametrize("hash_kind", ["int", "bytes"])
def test_router_indexes_a_vllm_workers_events(hash_kind):
    rng = random.Random(13)
    prompt = [rng.randrange(1, 32000) for _ in range(6 * BLOCK + 5)]
    names = engine_hashes(hash_kind, 6, rng)  # the engine's names for the prompt's 6 blocks
    mine = route_hashes(prompt, BLOCK)  # the router's

    async def dump(request: KVStateRequest) -> AsyncIterator[KVStateDump]:
        # The worker's state before its first batch: none sent (vLLM numbers from 0).
        yield KVStateDump(worker_id="vllm-0", seq=-1, block_size=BLOCK, events=[])

    async def generate(request: EngineRequest) -> AsyncIterator[EngineOutput]:
        raise AssertionError("the test only routes")
        yield

    async def main() -> None:
        discovery = MemoryDiscovery(MemoryRegistry())
        pub = VllmPublisher()
        async with (
            DistributedRuntime(discovery, instance_id="vllm-0") as worker,
            DistributedRuntime(discovery) as frontend,
        ):
            client = await frontend.client(GENERATE_ENDPOINT, EngineOutput)
            router = KvRouter(frontend, seed=0)
            await router.start(client)
            card = ModelCard(
                model_name="m",
                tokenizer="t",
                context_length=4096,
                kv_block_size=BLOCK,
                num_kv_blocks=1000,
            )
            await worker.serve_endpoint(KV_STATE_ENDPOINT, dump, KVStateRequest)
            await worker.serve_endpoint(
                GENERATE_ENDPOINT,
                generate,
                EngineRequest,
                card=card,
                extra={"kv_events": pub.address},
            )
            await client.wait_for_instances(1)
            await pub.wait_for_subscriber(KV_EVENTS_TOPIC.encode())
            await wait_for(lambda: router._feeds["vllm-0"].resync is None)

            pub.publish(BlockStored(names[:4], None, prompt[: 4 * BLOCK], BLOCK, None, "GPU"))
            pub.publish(
                BlockStored(names[4:], names[3], prompt[4 * BLOCK : 6 * BLOCK], BLOCK, None, "GPU")
            )
            await wait_for(lambda: router.overlaps(mine) == {"vllm-0": 6})

            request = EngineRequest(
                request_id="r", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1)
            )
            assert router.select(client.instances(), request).instance_id == "vllm-0"
            assert router.metrics.cached_blocks._value.get() == 6
            router.finished("r")
            other = route_hashes([prompt[0] + 1, *prompt[1:]], BLOCK)
            assert router.overlaps(other) == {}

            pub.publish(BlockRemoved([names[4]], "GPU"))
            await wait_for(lambda: router.overlaps(mine) == {"vllm-0": 4})
            pub.publish(BlockRemoved([names[0]], "CPU"))  # another tier: the GPU copy stays
            pub.publish(BlockRemoved([names[3]], "GPU"))
            await wait_for(lambda: router.overlaps(mine) == {"vllm-0": 3})
            pub.publish(AllBlocksCleared())
            await wait_for(lambda: router.overlaps(mine) == {})
            assert router.indexer.num_blocks("vllm-0") == 0
            await router.close()
        pub.sock.close()

    asyncio.run(asyncio.wait_for(main(), 60))
