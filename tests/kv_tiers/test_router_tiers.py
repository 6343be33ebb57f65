"""The router's view of lower tiers: the index follows CPU/DISK events, and the KV router
prefers a GPU hit to a host-tier hit, and a host-tier hit to a miss."""

from __future__ import annotations

from shoal.kv_hash import route_hashes
from shoal.protocol import BlockRemoved, BlockStored, EngineRequest, InstanceRecord, SamplingParams
from shoal.router.indexer import KvIndexer
from shoal.router.kv_router import KvRouter

PROMPT = list(range(100, 164))  # 4 blocks of 16
HASHES = route_hashes(PROMPT, 16).tolist()


def stored(first: int, last: int, medium: str) -> BlockStored:
    """Blocks first..last-1 of PROMPT stored in `medium` (named by the router's hashes)."""
    return BlockStored(
        block_hashes=HASHES[first:last],
        parent_block_hash=HASHES[first - 1] if first else None,
        token_ids=PROMPT[first * 16 : last * 16],
        block_size=16,
        medium=medium,
    )


def test_index_follows_lower_tiers_and_walks_across_them():
    index = KvIndexer()
    # w1: blocks 0-1 on the GPU, 2-3 in host memory (block 2's parent is a GPU block)
    index.apply_batch("w1", [stored(0, 2, "GPU"), stored(2, 4, "CPU")])
    # w2: all four offloaded, then block 0 evicted from the GPU only: still all in a tier
    index.apply_batch("w2", [stored(0, 4, "GPU"), stored(0, 4, "CPU")])
    index.apply("w2", BlockRemoved(block_hashes=HASHES[:1], medium="GPU"))
    # w3: block 0 in host memory, block 1 moved down to disk
    index.apply_batch("w3", [stored(0, 2, "CPU")])
    index.apply_batch(
        "w3", [BlockRemoved(block_hashes=HASHES[1:2], medium="CPU"), stored(1, 2, "DISK")]
    )
    gpu = index.overlaps(HASHES)
    assert gpu == {"w1": 2}  # w2's GPU blocks 1-3 are not a prefix
    assert index.tiered_overlaps(HASHES, gpu) == {"w1": 4, "w2": 4, "w3": 2}
    assert index.num_blocks("w2") == 3 and index.lower.num_blocks("w2") == 4
    index.apply("w2", BlockRemoved(block_hashes=HASHES[:1], medium="CPU"))
    assert "w2" not in index.tiered_overlaps(HASHES, index.overlaps(HASHES))
    index.clear("w1")
    assert index.lower.num_blocks("w1") == 0
    index.remove_worker("w3")
    assert "w3" not in index.lower.workers()


def route(router: KvRouter, workers: list[str], rid: str) -> str:
    records = [InstanceRecord(instance_id=w, endpoint="e", address="tcp://x") for w in workers]
    request = EngineRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=SamplingParams())
    chosen = router.select(records, request).instance_id
    router.finished(rid)
    return chosen


def test_router_prices_a_host_hit_between_a_gpu_hit_and_a_miss():
    router = KvRouter(None, replica_sync=False, seed=0)
    router.indexer.apply_batch("gpu", [stored(0, 4, "GPU")])
    router.indexer.apply_batch("host", [stored(0, 4, "CPU")])
    router.indexer.apply_batch("disk", [stored(0, 2, "CPU"), stored(2, 4, "DISK")])
    for i in range(5):
        assert route(router, ["miss", "host", "gpu"], f"a{i}") == "gpu"
        assert route(router, ["miss", "host"], f"b{i}") == "host"
        assert route(router, ["disk", "miss"], f"c{i}") == "disk"
    # half the prefix on the GPU beats all of it in host memory only below credit 0.5
    router.indexer.apply_batch("half", [stored(0, 2, "GPU")])
    assert route(router, ["half", "host"], "d") == "host"
    cheap = KvRouter(None, replica_sync=False, seed=0, lower_tier_credit=0.25)
    cheap.indexer.apply_batch("half", [stored(0, 2, "GPU")])
    cheap.indexer.apply_batch("host", [stored(0, 4, "CPU")])
    assert route(cheap, ["half", "host"], "e") == "half"
    # with no credit, a host-tier hit is worth nothing: it ties with a miss
    blind = KvRouter(None, replica_sync=False, seed=0, lower_tier_credit=0.0)
    blind.indexer.apply_batch("host", [stored(0, 4, "CPU")])
    picks = {route(blind, ["miss", "host"], f"f{i}") for i in range(40)}
    assert picks == {"miss", "host"}
