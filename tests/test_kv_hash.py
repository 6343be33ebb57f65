"""The block hash: chained, full blocks only, sensitive to content, position and extra key."""

import random

import numpy as np
import xxhash

from shoal import kv_hash
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request
from shoal.kv_hash import (
    HASH_SEED,
    ROUTE_ROOT,
    extra_key,
    hash_block,
    hash_blocks,
    route_extra,
    route_hash_runs,
    route_hashes,
)
from shoal.protocol import SamplingParams, pack_token_ids
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


def test_the_router_finds_the_engines_blocks_by_its_own_hash():
    rng = random.Random(6)
    prompt = [rng.randrange(4, 50_000) for _ in range(16 * 9 + 7)]
    request = Request(
        "r", prompt, SamplingParams(), frozenset(), 8, extra_key=extra_key(2), lora_id=2
    )
    kv = KVCacheManager(num_blocks=32, block_size=16, record_events=True)
    computed, hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - hit_tokens, computed)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    assert request.block_hashes == hash_blocks(prompt, 16, extra_key(lora_id=2))
    router = KvIndexer()
    router.apply_batch("w", kv.take_events())  # the router re-hashes the events' token ids
    assert router.overlaps(route_hashes(prompt, 16, extra_key(lora_id=2))) == {"w": 9}
    assert router.overlaps(route_hashes(prompt, 16)) == {}  # another extra key: other blocks


M64 = (1 << 64) - 1


def route_reference(tokens, block_size, extra=b"", parent=None):
    """The router's hash written out block by block in Python ints: each block's tokens
    paired into 64-bit words (two little-endian u32s; one token a word for an odd block
    size), each word times its key, xor-shifted and summed, the extra key's xxh3 xored in,
    splitmix64's finaliser; then r_i = r_{i-1} * P + c_i."""
    words_per_block = block_size // 2 if block_size % 2 == 0 else block_size
    keys = kv_hash._splitmix64(HASH_SEED, words_per_block).tolist()
    e = xxhash.xxh3_64_intdigest(extra, seed=HASH_SEED) if extra else 0
    r = ROUTE_ROOT if parent is None else parent
    out = []
    for begin in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[begin : begin + block_size]
        if block_size % 2 == 0:
            words = [block[i] | block[i + 1] << 32 for i in range(0, block_size, 2)]
        else:
            words = block
        c = 0
        for w, k in zip(words, keys, strict=True):
            x = w * k & M64
            c = (c + (x ^ x >> 32)) & M64
        c ^= e
        c ^= c >> 30
        c = c * 0xBF58476D1CE4E5B9 & M64
        c ^= c >> 27
        c = c * 0x94D049BB133111EB & M64
        c ^= c >> 31
        r = (r * 0x9E3779B97F4A7C15 + c) & M64
        out.append(r)
    return out


def test_route_hashes_match_their_definition_written_out():
    rng = random.Random(8)
    for _ in range(60):
        size = rng.choice([1, 2, 3, 16, 32])
        tokens = [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 300))]
        extra = rng.choice([b"", extra_key(lora_id=3), extra_key(mm_hashes=["ab", "cd"])])
        parent = rng.choice([None, 0, rng.randrange(1 << 64)])
        want = route_reference(tokens, size, extra, parent)
        assert route_hashes(tokens, size, extra, parent).tolist() == want
        packed = pack_token_ids(tokens)  # a request's prompt, read in place
        assert route_hashes(packed, size, extra, parent).tolist() == want
    # a prompt longer than one pass (kv_hash hashes _CHUNK_BLOCKS blocks a pass)
    blocks = 2 * kv_hash._CHUNK_BLOCKS + 3
    tokens = [rng.randrange(1 << 32) for _ in range(2 * blocks)]
    assert route_hashes(tokens, 2).tolist() == route_reference(tokens, 2)


def test_route_hash_runs_chain_each_run_from_its_parent():
    rng = random.Random(9)
    tokens = [rng.randrange(50_000) for _ in range(16 * 40)]
    whole = route_hashes(tokens, 16).tolist()
    # runs: blocks 0-9 from the root, 10-24 continuing them, 3-7 of another prefix under lora
    other = [rng.randrange(50_000) for _ in range(16 * 8)]
    other_hashes = route_hashes(other, 16, extra_key(4)).tolist()
    lengths = np.array([10, 15, 5])
    got = route_hash_runs(
        tokens[: 25 * 16] + other[3 * 16 : 8 * 16],
        16,
        np.array([ROUTE_ROOT, whole[9], other_hashes[2]], np.uint64),
        lengths,
        np.array([0, 0, route_extra(extra_key(4))], np.uint64),
    ).tolist()
    assert got == whole[:25] + other_hashes[3:8]
    assert route_hashes(tokens[: 16 * 3 + 5], 16).tolist() == whole[:3]  # full blocks only
    assert route_hashes([], 16).tolist() == []
