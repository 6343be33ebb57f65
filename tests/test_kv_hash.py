"""The block hash: chained, full blocks only, sensitive to content, position and extra key."""

import random

import xxhash

from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request
from shoal.kv_hash import HASH_SEED, extra_key, hash_block, hash_blocks
from shoal.protocol import SamplingParams
from shoal.router.indexer import KvIndexer


def test_chained_definition():
    tokens = list(range(10))
    h0 = xxhash.xxh3_64_intdigest(
        b"".join(t.to_bytes(4, "little") for t in range(4)), seed=HASH_SEED
    )
    assert hash_blocks(tokens, 4) == [h0, hash_block(h0, [4, 5, 6, 7])]


def test_prefix_property_and_sensitivity():
    a = hash_blocks(list(range(32)), 8)
    b = hash_blocks(list(range(24)) + [0] * 8, 8)
    assert a[:3] == b[:3] and a[3] != b[3]
    assert hash_blocks([1, 2, 3, 4], 2) != hash_blocks([3, 4, 1, 2], 2)
    assert hash_blocks([1, 2], 2, extra_key(lora_id=1)) != hash_blocks([1, 2], 2)
    assert extra_key() == b""


def test_incremental_equals_whole():
    tokens = list(range(100, 150))
    first = hash_blocks(tokens[:16], 8)
    rest = hash_blocks(tokens, 8, parent=first[-1], start=16)
    assert first + rest == hash_blocks(tokens, 8)


def reference(tokens, block_size, extra=b"", parent=None):
    """The contract written out block by block: xxh3_64(parent as 8 LE bytes + LE u32 token
    ids + extra key), seeded, over full blocks only."""
    hashes = []
    for begin in range(0, len(tokens) - block_size + 1, block_size):
        data = b"" if parent is None else parent.to_bytes(8, "little")
        data += b"".join(t.to_bytes(4, "little") for t in tokens[begin : begin + block_size])
        parent = xxhash.xxh3_64_intdigest(data + extra, seed=HASH_SEED)
        hashes.append(parent)
    return hashes


def test_random_prompts_match_the_contract_written_out():
    rng = random.Random(5)
    for _ in range(60):
        size = rng.choice([1, 2, 16, 32])
        tokens = [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 300))]
        extra = rng.choice([b"", extra_key(lora_id=3), extra_key(mm_hashes=["ab", "cd"])])
        parent = rng.choice([None, 0, rng.randrange(1 << 64)])
        start = rng.randrange(0, len(tokens) + 1)
        assert hash_blocks(tokens, size, extra) == reference(tokens, size, extra)
        assert hash_blocks(tokens, size, extra, parent, start) == reference(
            tokens[start:], size, extra, parent
        )


def test_the_engine_and_the_router_agree_on_every_block():
    rng = random.Random(6)
    prompt = [rng.randrange(4, 50_000) for _ in range(16 * 9 + 7)]
    request = Request(
        "r", prompt, SamplingParams(), frozenset(), 8, extra_key=extra_key(2), lora_id=2
    )
    kv = KVCacheManager(num_blocks=32, block_size=16)
    computed, hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - hit_tokens, computed)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    router = KvIndexer()
    router.apply_batch("w", kv.take_events())  # the router re-hashes the events' token ids
    mine = hash_blocks(prompt, 16, extra_key(lora_id=2))
    assert request.block_hashes == mine
    assert router.overlaps(mine) == {"w": 9}
