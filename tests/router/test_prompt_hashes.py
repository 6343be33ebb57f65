"""The KV router's prompt hashes from `prepare` route exactly as the ones select computes."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from shoal.kv_hash import hash_blocks
from shoal.protocol import BlockStored, EngineRequest, InstanceRecord, ModelCard, SamplingParams
from shoal.router.kv_router import KvRouter
from shoal.router.metrics import RouterMetrics

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


def test_prepared_hashes_route_as_inline_ones():
    """A worker holding the prompt's first half wins with prepared hashes as without (LoRA
    in the key: a request under an adapter the cache was not filled with finds nothing)."""
    registry = CollectorRegistry()
    router = KvRouter(None, metrics=RouterMetrics(registry), seed=0, replica_sync=False)
    asked = request(2048)
    half = asked.prompt_token_ids[:1024]
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
    prepared = router.prepare(INSTANCES, asked)
    assert router.select(INSTANCES, asked, prepared).instance_id == "w2"
    router.finished(asked.request_id)
    assert router.select(INSTANCES, asked).instance_id == "w2"
    router.finished(asked.request_id)
    adapted = request(2048, lora_id=3)
    prepared = router.prepare(INSTANCES, adapted)
    assert router.indexer.overlaps(prepared) == {}
    assert registry.get_sample_value("shoal_router_hash_seconds_count") == 3
