"""A long prompt's route hashes are computed in a thread and routed on exactly as inline ones."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
from prometheus_client import CollectorRegistry

from shoal.kv_hash import hash_blocks, route_hashes
from shoal.protocol import BlockStored, EngineRequest, InstanceRecord, ModelCard, SamplingParams
from shoal.router import prompt_hashes as module
from shoal.router.kv_router import KvRouter
from shoal.router.metrics import RouterMetrics
from shoal.router.prompt_hashes import HASH_IN_THREAD_TOKENS, prompt_hashes_off_loop

BLOCK = 16
CARD = ModelCard(
    model_name="m", tokenizer="", context_length=1 << 20, kv_block_size=BLOCK, num_kv_blocks=1 << 16
)
INSTANCES = [
    InstanceRecord(instance_id=f"w{i}", endpoint="e", address=f"w{i}", card=CARD) for i in range(4)
]


def request(length: int, lora_id: int | None = None) -> EngineRequest:
    rng = random.Random(length)
    return EngineRequest(
        request_id=f"r{length}",
        prompt_token_ids=[rng.randrange(4, 50_000) for _ in range(length)],
        sampling=SamplingParams(max_tokens=1),
        lora_id=lora_id,
    )


def hashing_threads(monkeypatch) -> list[int]:
    """The threads that hash prompts from now on."""
    threads: list[int] = []
    hash_ = module.route_hashes

    def recording(*args):
        threads.append(threading.get_ident())
        return hash_(*args)

    monkeypatch.setattr(module, "route_hashes", recording)
    return threads


def test_long_prompts_are_hashed_in_a_thread_short_ones_inline(monkeypatch):
    threads = hashing_threads(monkeypatch)
    long, short = request(HASH_IN_THREAD_TOKENS), request(HASH_IN_THREAD_TOKENS - 1)
    hashed = [asyncio.run(prompt_hashes_off_loop(r, BLOCK)) for r in (long, short)]
    assert threads[0] != threading.get_ident()
    assert threads[1] == threading.get_ident()
    for r, hashes in zip((long, short), hashed, strict=True):
        assert np.array_equal(hashes, route_hashes(r.prompt_token_ids, BLOCK))
        assert len(hashes) == len(r.prompt_token_ids) // BLOCK


def test_prepared_hashes_route_as_inline_ones():
    """A worker holding the prompt's first half wins with hashes prepared off the loop (LoRA
    in the key: a request under an adapter the cache was not filled with finds nothing)."""
    registry = CollectorRegistry()
    router = KvRouter(None, metrics=RouterMetrics(registry), seed=0, replica_sync=False)
    asked = request(2 * HASH_IN_THREAD_TOKENS)
    half = asked.prompt_token_ids[:HASH_IN_THREAD_TOKENS]
    hashes = hash_blocks(half, BLOCK)
    router.indexer.apply(
        "w2",
        BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=half,
            block_size=BLOCK,
            lora_id=None,
        ),
    )
    prepared = asyncio.run(router.prepare(INSTANCES, asked))
    assert router.select(INSTANCES, asked, prepared).instance_id == "w2"
    router.finished(asked.request_id)
    assert router.select(INSTANCES, asked).instance_id == "w2"
    router.finished(asked.request_id)
    adapted = request(2 * HASH_IN_THREAD_TOKENS, lora_id=3)
    prepared = asyncio.run(router.prepare(INSTANCES, adapted))
    assert router.indexer.overlaps(prepared) == {}
    assert registry.get_sample_value("shoal_router_hash_seconds_count") == 3
