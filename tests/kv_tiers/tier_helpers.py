"""A multi-turn conversation on the tiny Llama whose earlier turns are pushed out of a small
GPU pool between turns, and checks that every tier ends consistent."""

from __future__ import annotations

import numpy as np

from shoal import LLM, SamplingParams
from shoal.engine.kv_offload import OffloadManager

BLOCK = 16
# one block of the tiny Llama's KV (2 layers, K and V, 16 tokens, 2 heads of 16, float32)
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
SMALL_POOL = 24  # GPU blocks: a filler prompt between turns evicts the conversation
TURN_TOKENS = 48
REPLY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FILLER = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def gib(blocks: int) -> float:
    """A tier size in GiB holding `blocks` blocks (and half a block to spare for rounding)."""
    return (blocks + 0.5) * BLOCK_BYTES / 2**30


def engine(model_dir, num_gpu_blocks: int = SMALL_POOL, **tiers) -> LLM:
    return LLM(str(model_dir), num_gpu_blocks=num_gpu_blocks, block_size=BLOCK, **tiers)


def conversation(
    llm: LLM,
    turns: int = 4,
    seed: int = 0,
    between=None,
    turn_tokens: int = TURN_TOKENS,
    reply: SamplingParams = REPLY,
):
    """Each turn's greedy reply and the prompt tokens it found cached. A 376-token filler
    runs after each turn (filling a small pool: the conversation is evicted from it);
    `between(turn, history)` runs after that."""
    rng = np.random.default_rng(seed)
    history: list[int] = []
    replies, cached = [], []
    for turn in range(turns):
        history = history + rng.integers(5, 384, turn_tokens).tolist()
        out = llm.generate([history], reply)[0]
        replies.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)
        history = history + out.outputs[0].token_ids
        llm.generate([rng.integers(5, 384, 376).tolist()], FILLER)
        if between is not None:
            between(turn, history)
    return replies, cached


def assert_tiers_settled(llm: LLM) -> None:
    """No request, no GPU block held, no copy pending, tiers within capacity and disjoint."""
    kv = llm.engine.kv
    offload: OffloadManager = kv.offload
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not (offload.queue or offload.saves or offload.loads)
    assert offload.queue_depth == 0
    host = offload.host
    assert len(host) <= host.capacity
    assert all(e.ready and e.pins == 0 for e in host.entries.values())
    assert len({e.slot for e in host.entries.values()}) == len(host)
    if offload.disk is not None:
        assert len(offload.disk) <= offload.disk.capacity
        assert not set(host.entries) & set(offload.disk.entries)
