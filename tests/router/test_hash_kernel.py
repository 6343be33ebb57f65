"""The KV router's compiled hashes against kv_hash's, which workers use (for prompts and
their own KV events): they must agree bit for bit, or routing finds no prefix."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest

from shoal import kv_hash
from shoal.protocol import BlockStored, EngineRequest, SamplingParams
from shoal.route_events import EventTranslator
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


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_the_compiled_runs_are_kv_hash_route_hash_runs(block_size):
    """Runs of blocks laid end to end, each from its own parent (the root or any 64-bit
    value), with and without extra keys per run, one run to many, some of one block."""
    rng = random.Random(100 + block_size)
    for runs in (1, 2, 7):
        lengths = np.array([rng.choice((1, 2, 5)) for _ in range(runs)])
        tokens = [rng.randrange(2**32) for _ in range(int(lengths.sum()) * block_size)]
        parents = np.array(
            [rng.choice((kv_hash.ROUTE_ROOT, 2**64 - 1, rng.randrange(2**64))) for _ in lengths],
            np.uint64,
        )
        for extras in (None, np.array([rng.randrange(2**64) for _ in lengths], np.uint64)):
            expected = kv_hash.route_hash_runs(tokens, block_size, parents, lengths, extras)
            got = hash_kernel.route_hash_runs(tokens, block_size, parents, lengths, extras)
            assert got.dtype == np.uint64
            assert got.tolist() == expected.tolist()
    empty = hash_kernel.route_hash_runs([], block_size, np.zeros(0, np.uint64), np.zeros(0, int))
    assert empty.tolist() == []


def test_a_router_translates_vllm_events_as_a_worker_does():
    """The router's translators (compiled hash) and a shoal worker's (numpy) name the same
    stored blocks the same router hashes."""
    rng = random.Random(7)
    tokens = [rng.randrange(150_000) for _ in range(16 * 6)]
    events = [
        BlockStored([11, 12, 13], None, tokens[:48], 16, None, "GPU"),
        BlockStored([14, 15], 13, tokens[48:80], 16, 5, "GPU"),
        BlockStored([16], 15, tokens[80:], 16, None, "CPU"),
    ]
    numpy_side = EventTranslator("w").translate(events)
    compiled = EventTranslator("w", hash_kernel.route_hash_runs).translate(events)
    assert compiled == numpy_side
    assert [len(c.keys) for c in compiled] == [3, 2, 1]
