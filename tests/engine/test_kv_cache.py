"""Block pool and KV cache manager: LRU eviction, O(1) hit removal, events, leaks."""

from shoal.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from shoal.engine.block_table import BlockTable
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request
from shoal.kv_hash import hash_blocks
from shoal.protocol import AllBlocksCleared, BlockRemoved, BlockStored, SamplingParams


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
    kv = KVCacheManager(num_blocks=4, block_size=2, record_events=True)
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
    kv = KVCacheManager(num_blocks=8, block_size=2, record_events=True)
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


def test_events_are_kept_only_when_asked_for():
    """An engine nobody takes events from (offline) keeps none: they would pile up."""
    quiet, recording = KVCacheManager(8, 2), KVCacheManager(8, 2, record_events=True)
    for kv in (quiet, recording):
        req = make_request("a", [1, 2, 3, 4, 5])
        run_prefill(kv, req)
        kv.free(req)
        assert kv.reset_prefix_cache()
    assert quiet.take_events() == []
    assert [type(e) for e in recording.take_events()] == [BlockStored, AllBlocksCleared]


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4, True, 2)
    (block,) = pool.allocate(1)
    assert not pool.reset_prefix_cache()
    pool.free([block])
    assert pool.reset_prefix_cache()


def test_block_table_grows_and_clears_freed_rows():
    table = BlockTable(num_rows=2, width=2)
    rows = [table.add_row() for _ in range(3)]
    assert rows == [0, 1, 2] and table.table.shape[0] == 4
    table.append(rows[2], [7, 8])
    table.append(rows[2], [9])
    assert table.table.shape[1] >= 3 and table.table[2, :3].tolist() == [7, 8, 9]
    table.free_row(rows[2])
    assert not table.table.any() and table.lengths[2] == 0
    assert table.add_row() == rows[2]


def test_block_table_rows_follow_allocation_and_free():
    kv = KVCacheManager(num_blocks=16, block_size=2, enable_caching=True)
    a, b = make_request("a", [1, 2, 3, 4, 5]), make_request("b", [1, 2, 3, 4, 6, 7])
    run_prefill(kv, a)
    run_prefill(kv, b)  # two prefix-cache hits, then blocks of its own
    for req in (a, b):
        req.append_token(9)
        assert kv.allocate_slots(req, 1)
    rows = kv.table_rows([a, b])
    for req, row in zip((a, b), rows.tolist(), strict=True):
        ids = kv.block_ids(req)
        assert kv.block_table.table[row, : len(ids)].tolist() == ids
        assert kv.block_table.lengths[row] == len(ids)
    kv.free(a)
    assert not kv.block_table.table[rows[0]].any() and "a" not in kv.rows


def test_blocks_freed_since_the_last_launch_are_not_settled():
    pool = BlockPool(4, enable_caching=True, block_size=4)
    early, late = pool.allocate(1), pool.allocate(1)
    pool.free(early)
    pool.launches += 1  # a step launched: `late` may be in it, `early` cannot be
    pool.free(late)
    assert pool.settled(early) and not pool.settled(late)
    assert not pool.settled(early + late)
    pool.launches += 1
    assert pool.settled(early + late)


def test_a_failed_allocation_leaves_the_request_holding_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert "a" not in kv.req_blocks and "a" not in kv.rows
