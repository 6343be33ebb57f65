"""The block hash: chained, full blocks only, sensitive to content, position and extra key."""

import xxhash

from shoal.kv_hash import HASH_SEED, extra_key, hash_block, hash_blocks


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
