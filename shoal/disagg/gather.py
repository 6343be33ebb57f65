"""Copying a prompt's KV blocks out of a worker's cache into one transfer tensor: one gather
kernel per layer over the block ids, reading each block's bytes as 8-byte words where its
size allows (fewer, wider elements to index). Every copy is queued on the current stream:
the caller synchronizes once.

Each layer's cache is [2 (K, V), num_blocks, block_size, kv_heads, head_dim] in C order, so
a run of consecutive ids is also one contiguous region, and one memcpy per run was tried
first. On the H100 (benchmarks/disagg_bench.py --copy-only, Llama-3.1-8B blocks, 2026-11-24)
64 such memcpys cost about 1.8 ms whatever their size: 72-75 GB/s at 1k tokens and 282-289
at 4k, where the gather moved 111-185 and 418-456; at 16k both reached 935-1,005 GB/s, and
on scattered ids the memcpys fell to 1.8 GB/s. So every transfer takes the gather.
"""

from __future__ import annotations

import torch


def gather_blocks(caches: list[torch.Tensor], block_ids: list[int], out: torch.Tensor) -> None:
    """Copy blocks `block_ids` of every layer's cache into `out` [layers, 2, len(block_ids),
    ...], one gather per layer."""
    if out.shape[0] != len(caches) or out.shape[2] != len(block_ids):
        raise ValueError(f"out {tuple(out.shape)} does not hold {len(block_ids)} blocks")
    if not block_ids:
        return
    num_blocks = caches[0].shape[1]
    index = torch.tensor(block_ids, dtype=torch.int64).to(caches[0].device, non_blocking=True)
    for layer, cache in enumerate(caches):
        src = _words(cache.view(2, num_blocks, -1))
        dst = _words(out[layer].view(2, len(block_ids), -1))
        torch.index_select(src, 1, index, out=dst)


def _words(blocks: torch.Tensor) -> torch.Tensor:
    """The same bytes as 8-byte elements where the rows allow it."""
    row_bytes = blocks.shape[-1] * blocks.element_size()
    if row_bytes % 8 or blocks.element_size() >= 8:
        return blocks
    return blocks.view(torch.int64)
