"""Tensor parallelism and the KV cache around the model (CPU, gloo, two processes): each
rank sizes its own KV pool, the lower KV tiers hold every rank's shard of a block, and KV
transfer moves every rank's shard; outputs equal a single rank's."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from tier_helpers import FILLER, conversation
from transfer_helpers import decode, prefill, run, tokens, transfer

from shoal import LLM, SamplingParams
from shoal.engine.config import EngineConfig
from shoal.engine.kv_offload import MEDIUM_CPU, MEDIUM_DISK
from shoal.engine.kv_offload.shard import rank_disk_path
from shoal.engine.llm_engine import LLMEngine, fewest_kv_blocks
from shoal.engine.model_runner import kv_bytes_per_block
from shoal.engine.parallel.executor import Followers
from shoal.kv_hash import hash_blocks
from shoal.layers.parallel import TPGroup
from shoal.models.config import ModelConfig
from shoal.protocol import EngineRequest

BLOCK = 16
# one block of the tiny Llama's KV on one of two ranks (2 layers, K and V, 16 tokens, one of
# its two KV heads of 16, float32)
SHARD_BYTES = 2 * 2 * BLOCK * 1 * 16 * 4
REPLY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# three turns of 40 new tokens, each evicted from a 24-block pool by the filler after it
TURNS = {"turns": 3, "turn_tokens": 40, "reply": REPLY}


def gib(blocks: int) -> float:
    """A tier size in GiB holding `blocks` blocks of a rank's shard (and half to spare)."""
    return (blocks + 0.5) * SHARD_BYTES / 2**30


def test_tiers_hold_every_ranks_shard_and_onboard_it(llama_dir, tmp_path):
    """A host tier of 24 blocks over a disk tier: turns come back from both, on both ranks,
    with a single rank's output. A block whose shard rank 1 cannot read (its disk file cut
    short) is a miss on every rank: the prefix is onboarded up to it, the rest recomputed."""
    settings = dict(device="cpu", block_size=BLOCK, num_gpu_blocks=24)
    big = LLM(str(llama_dir), **{**settings, "num_gpu_blocks": 256})
    replies, big_cached = conversation(big, **TURNS)
    follower_dir = Path(rank_disk_path(str(tmp_path), 1))

    def damage(turn: int, history: list[int]) -> None:
        if turn != 1:
            return
        shard = follower_dir / f"{hash_blocks(history, BLOCK)[1]:016x}.kvblock"
        deadline = time.monotonic() + 30
        while not shard.exists():  # rank 1 writes it in the background
            assert time.monotonic() < deadline, "rank 1 did not write its shard"
            time.sleep(0.02)
        shard.write_bytes(shard.read_bytes()[:10])

    with LLM(
        str(llama_dir),
        tensor_parallel_size=2,
        kv_offload_cpu_gb=gib(24),
        kv_offload_disk_path=str(tmp_path),
        kv_offload_disk_gb=gib(200),
        **settings,
    ) as llm:
        got, cached = conversation(llm, between=damage, **TURNS)
        offload = llm.engine.kv.offload
        host, disk = offload.stats[MEDIUM_CPU], offload.stats[MEDIUM_DISK]
    assert got == replies
    assert big_cached[0] == cached[0] == 0
    assert cached[1] == big_cached[1] >= 2 * BLOCK  # from the host tier
    assert 0 < cached[2] < big_cached[2]  # up to the block rank 1 could not read
    assert host.hits > 0 and disk.hits > 0 and disk.misses == 1
    assert (host.hits + disk.hits) * BLOCK == sum(cached)


def test_kv_transfer_moves_every_ranks_shard(llama_dir):
    """A TP=2 prefill's KV, read in the host backend's one-block frames (both ranks' heads
    joined), continues on a TP=1 engine and, split again, on the TP=2 engine itself with
    its cache cleared but for the first block: a single rank's output."""
    config = EngineConfig(model=str(llama_dir), device="cpu", kv_cache_memory_bytes=2**22)
    single = LLMEngine(config)
    pair = LLMEngine(dataclasses.replace(config, tensor_parallel_size=2))
    try:
        assert pair.kv_blocks_by_rank == [2**22 // SHARD_BYTES] * 2  # rank 1 measured its own
        prompt = [(i * 37) % 370 + 3 for i in range(40)]
        reference = EngineRequest(request_id="ref", prompt_token_ids=prompt, sampling=REPLY)
        expected = tokens(run(single, reference))
        first, params = prefill(pair, "a", prompt, REPLY)
        data = transfer(pair, params, 0, per_chunk=1)  # the host backend's frames, a block each
        assert params.layout.num_kv_heads == data.shape[4] == 2  # both ranks' heads
        _, own = prefill(single, "b", prompt, REPLY)
        torch.testing.assert_close(data, single.read_kv_blocks("b", 0, len(own.block_ids)))
        assert decode(single, "a", prompt, first, REPLY, params, 0, data) == expected
        pair.release_kv("a")
        assert pair.reset_prefix_cache()
        run(
            pair,
            EngineRequest(request_id="c", prompt_token_ids=prompt[: BLOCK + 1], sampling=FILLER),
        )
        assert pair.num_cached_prefix_blocks(prompt) == 1
        assert decode(pair, "a2", prompt, first, REPLY, params, 1, data[:, :, 1:]) == expected
        assert pair.num_kv_injected == 1 and pair.num_kv_inject_fallbacks == 0
    finally:
        pair.shutdown()


def test_the_rank_with_the_least_room_sets_the_pool(llama_dir):
    """A follower that has room for fewer blocks than rank 0 sizes every rank's pool."""
    cfg = ModelConfig.from_dir(llama_dir)
    per_block = kv_bytes_per_block(cfg, BLOCK, cfg.dtype, TPGroup(0, 2))
    assert per_block == SHARD_BYTES
    ours = EngineConfig(
        model=str(llama_dir), device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=2**20
    )
    theirs = dataclasses.replace(ours, kv_cache_memory_bytes=2**18)
    followers = Followers(theirs, torch.device("cpu"))
    try:
        followers.wait_ready()
        counts = [ours.kv_cache_memory_bytes // per_block, *followers.measure_kv_blocks()]
    finally:
        followers.close()
    assert counts == [2**20 // per_block, 2**18 // per_block]
    assert fewest_kv_blocks(counts, per_block) == 2**18 // per_block
    assert fewest_kv_blocks(counts[::-1], per_block) == 2**18 // per_block
