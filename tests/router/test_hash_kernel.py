"""The KV router's compiled prompt hash against kv_hash.route_hashes, which workers and the
router's event translators use: they must agree bit for bit, or routing finds no prefix."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest

from shoal import kv_hash
from shoal.protocol import EngineRequest, SamplingParams
from shoal.router import hash_kernel
from shoal.router.prompt_hashes import prompt_hashes


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 15, 16, 17, 32])
def test_the_compiled_hash_is_kv_hash_route_hashes(block_size):
    """Every token id range (0 to 2**32 - 1), lengths short of a block to many blocks with a
    partial last one, with and without an extra key, tokens as a list, a packed u32 array
    (read in place) and a numpy array."""
    rng = random.Random(block_size)
    for length in (0, 1, block_size - 1, block_size, 7 * block_size + 3, 2000):
        tokens = [rng.choice((0, 2**32 - 1, rng.randrange(2**32))) for _ in range(length)]
        for extra in (b"", kv_hash.extra_key(3), kv_hash.extra_key(None, ["image-hash"])):
            expected = kv_hash.route_hashes(tokens, block_size, extra)
            for form in (tokens, array("I", tokens), np.array(tokens, np.int64)):
                got = hash_kernel.route_hashes(form, block_size, extra)
                assert got.dtype == np.uint64
                assert got.tolist() == expected.tolist()


def test_a_prompts_hashes_are_the_same_either_way():
    request = EngineRequest(
        request_id="r",
        prompt_token_ids=[random.Random(1).randrange(150_000) for _ in range(4099)],
        sampling=SamplingParams(max_tokens=1),
        lora_id=2,
    )
    compiled = prompt_hashes(request, 16, hash_kernel.route_hashes)
    assert len(compiled) == 256
    assert compiled.tolist() == prompt_hashes(request, 16).tolist()
