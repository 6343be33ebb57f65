"""Block pool and KV cache manager: LRU eviction, O(1) hit removal, events, leaks."""

from shoal.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request
from shoal.kv_hash import hash_blocks
from shoal.protocol import BlockRemoved, BlockStored, SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), frozenset(), 4)


def run_prefill(kv: KVCacheManager, req: Request) -> None:
    hits, cached = kv.get_computed_blocks(req)
    req.num_computed_tokens = 0
    assert kv.allocate_slots(req, req.num_tokens - cached, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)


def test_free_queue_order_and_middle_removal():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2] and len(q) == 4


def test_prefix_hit_reuses_blocks_and_counts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(10, 22)))  # 3 full blocks
    run_prefill(kv, a)
    b = make_request("b", [*range(10, 22), 99, 98])
    hits, cached = kv.get_computed_blocks(b)
    assert cached == 12
    assert [h.block_id for h in hits] == kv.block_ids(a)
    assert kv.stats.hits == 12 and kv.stats.queries == 12 + 14


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    run_prefill(kv, make_request("a", list(range(8))))
    _, cached = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert cached == 4


def test_lru_eviction_order_and_removed_events():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    first, second = make_request("a", [1, 2, 3, 4]), make_request("b", [5, 6, 7, 8])
    for req in (first, second):
        run_prefill(kv, req)
        kv.free(req)
    kv.take_events()
    # a's blocks were freed first, so they are evicted first, its tail block before its head
    newcomer = make_request("c", [9, 9, 9, 9])
    assert kv.allocate_slots(newcomer, 4)
    evicted = [e.block_hashes[0] for e in kv.take_events() if isinstance(e, BlockRemoved)]
    assert evicted == list(reversed(hash_blocks([1, 2, 3, 4], 2)))
    _, cached = kv.get_computed_blocks(make_request("d", [5, 6, 7, 8, 0]))
    assert cached == 4


def test_hit_on_free_block_takes_it_off_the_free_queue():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    run_prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request("b", [1, 2, 3, 4, 5])
    run_prefill(kv, b)
    assert kv.num_free_blocks == 1
    assert kv.block_ids(b)[:2] == [blk.block_id for blk in kv.pool.blocks if blk.ref_cnt][:2]


def test_stored_events_chain_parent_hashes():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    req = make_request("a", [1, 2, 3, 4, 5])
    run_prefill(kv, req)
    (event,) = kv.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == hash_blocks([1, 2, 3, 4], 2)
    assert event.parent_block_hash is None and event.token_ids == [1, 2, 3, 4]
    req.append_token(6)
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 0)
    kv.cache_blocks(req)
    (event,) = kv.take_events()
    assert event.parent_block_hash == hash_blocks([1, 2, 3, 4], 2)[-1]
    assert event.token_ids == [5, 6]


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4, True, 2)
    (block,) = pool.allocate(1)
    assert not pool.reset_prefix_cache()
    pool.free([block])
    assert pool.reset_prefix_cache()
