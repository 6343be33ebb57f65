"""A worker's KV dump rebuilds in a fresh router index exactly what following every event
built: in vLLM's format (CachedBlocks: the blocks its engine's events leave cached, given
back as BlockStored events with their tokens) and in shoal's (the router hashes the
worker's translator holds); and a shoal worker's events index what the engine's do."""

from __future__ import annotations

import random

import pytest

from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request
from shoal.kv_hash import extra_key, route_hashes
from shoal.protocol import BlockRemoved, BlockStored, RouteHashesStored, SamplingParams
from shoal.route_events import EventTranslator, as_route_events
from shoal.router.indexer import KvIndexer
from shoal.worker.kv_publisher import CachedBlocks, KVPublisher

BLOCK = 4


def serve(kv: KVCacheManager, request: Request, output: int) -> None:
    """Prefill and decode `output` tokens, caching every full block, then free."""
    computed, hit_tokens = kv.get_computed_blocks(request)
    if not kv.allocate_slots(request, request.num_tokens - hit_tokens, computed):
        return
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    for token in range(output):
        request.append_token(token + 7)
        if not kv.allocate_slots(request, 1):
            break
        request.num_computed_tokens += 1
        kv.cache_blocks(request)
    kv.free(request)


def engine_batches(seed: int):
    """The KV event batches of an engine with a small cache (it evicts) serving 200 requests
    over shared prefixes, some with a LoRA adapter, its prefix cache reset twice; and the
    engine's KV cache at the end."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, 500) for _ in range(BLOCK * rng.randint(1, 6))] for _ in range(8)]
    kv = KVCacheManager(num_blocks=48, block_size=BLOCK, record_events=True)  # small: evicts
    batches = []
    for i in range(200):
        lora = rng.choice([None, None, 3])
        prompt = rng.choice(prefixes) + [rng.randrange(4, 500) for _ in range(rng.randint(1, 9))]
        request = Request(
            f"r{i}",
            prompt,
            SamplingParams(),
            frozenset(),
            8,
            extra_key=extra_key(lora) if lora else b"",
            lora_id=lora,
        )
        serve(kv, request, rng.randint(0, 6))
        batches.append(kv.take_events())
        if i % 70 == 69:
            kv.reset_prefix_cache()  # AllBlocksCleared
            batches.append(kv.take_events())
    return batches, kv


@pytest.mark.parametrize("seed", range(3))
def test_a_dump_rebuilds_what_the_events_built(seed):
    batches, kv = engine_batches(seed)
    cached, followed = CachedBlocks(), KvIndexer()
    for events in batches:
        cached.apply(events)
        followed.apply_batch("w", events)
    assert len(cached) == len(kv.cached_block_hashes()) > 10
    dump = cached.as_events()
    assert all(type(e) is BlockStored for e in dump)
    assert sum(len(e.block_hashes) for e in dump) == len(cached)
    rebuilt = KvIndexer()
    rebuilt.load_dump("w", dump)
    assert set(rebuilt.blocks("w")) == set(followed.blocks("w"))
    # the rebuilt index reads the engine's names: removing every block empties it
    rebuilt.apply("w", BlockRemoved(block_hashes=kv.cached_block_hashes()))
    assert rebuilt.num_blocks("w") == 0


@pytest.mark.parametrize("seed", range(3))
def test_a_dump_over_a_stale_view_of_the_worker_ends_where_following_did(seed):
    """A resync after a gap: the index followed the first half of the batches, the dump
    covers them all; only the difference is applied (KvIndexer.load_dump)."""
    batches, _ = engine_batches(seed)
    cached, followed, stale = CachedBlocks(), KvIndexer(), KvIndexer()
    for i, events in enumerate(batches):
        cached.apply(events)
        followed.apply_batch("w", events)
        if i < len(batches) // 2:
            stale.apply_batch("w", events)
    assert set(stale.blocks("w")) != set(followed.blocks("w"))
    stale.load_dump("w", cached.as_events())
    held = set(followed.blocks("w"))
    assert set(stale.blocks("w")) == held  # the translator's map
    assert stale.num_blocks("w") == followed.num_blocks("w")
    # and the masks a lookup reads: every held block, and no other
    assert stale.num_distinct_blocks() == len(held)
    assert all(stale.overlaps([h]) == {"w": 1} for h in held)


def test_a_parent_cached_again_after_its_child_comes_first_in_the_dump():
    tokens = list(range(100, 112))  # three blocks of 4
    cached = CachedBlocks()
    cached.apply(
        [
            BlockStored(
                block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=tokens, block_size=BLOCK
            ),
            BlockRemoved(block_hashes=[1]),  # the first block evicted, its children kept
            BlockStored(
                block_hashes=[1], parent_block_hash=None, token_ids=tokens[:4], block_size=BLOCK
            ),
        ]
    )
    dump = cached.as_events()
    assert [e.block_hashes for e in dump] == [[1], [2, 3]]
    index = KvIndexer()
    index.load_dump("w", dump)
    assert index.overlaps(route_hashes(tokens, BLOCK)) == {"w": 3}


@pytest.mark.parametrize("seed", range(3))
def test_a_shoal_worker_publishes_what_the_router_would_have_translated(seed):
    batches, kv = engine_batches(seed)
    translator, followed, published = EventTranslator(), KvIndexer(), KvIndexer()
    for events in batches:
        followed.apply_batch("w", events)
        published.apply_batch("w", as_route_events(translator.translate(events)))
        assert published.num_blocks("w") == followed.num_blocks("w")
    held = set(followed.blocks("w"))
    assert len(held) == len(set(kv.cached_block_hashes())) > 10
    assert set(published.blocks("w")) == held
    publisher = KVPublisher("w")  # the default format: shoal's
    try:
        for events in batches:
            publisher.publish_events(events)
        assert publisher.num_cached == len(kv.cached_block_hashes())
        dump = publisher.dump(BLOCK)
    finally:
        publisher.close()
    assert [type(e) for e in dump.events] == [RouteHashesStored]  # GPU only: no lower tiers
    rebuilt = KvIndexer()
    rebuilt.load_dump("w", dump.events)
    assert set(rebuilt.blocks("w")) == held


def test_a_publisher_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="'sglang'"):
        KVPublisher("w", events_format="sglang")
