"""Copying a prompt's KV blocks out of a worker's cache into one transfer tensor with as few
large copies as the block ids allow.

Each layer's cache is [2 (K, V), num_blocks, block_size, kv_heads, head_dim] in C order, so
a run of consecutive block ids in one layer's K (or V) is one contiguous region, and so is
its place in the transfer tensor [layers, 2, count, ...]. When the runs are few (a prompt
prefilled into fresh blocks is usually one run), each run of each layer's K and V is one
`copy_`, which on a GPU is one device-to-device memcpy. When they are many, a memcpy per run
would cost more in launches than it moves, so each layer takes one gather kernel instead,
over 8-byte words where the block's bytes allow (fewer, wider elements to index). Every
copy is queued on the current stream: the caller synchronizes once.
"""

from __future__ import annotations

import torch

from shoal.disagg.regions import block_runs

# Most copies one transfer may take as one memcpy per run (2 x layers x runs); above it
# each layer is gathered by one kernel. 256 copies are 4 runs of a 32-layer model, about a
# millisecond of launches: a prompt in fresh blocks takes the memcpy path.
MAX_RUN_COPIES = 256


def gather_blocks(
    caches: list[torch.Tensor],
    block_ids: list[int],
    out: torch.Tensor,
    max_run_copies: int = MAX_RUN_COPIES,
) -> None:
    """Copy blocks `block_ids` of every layer's cache into `out` [layers, 2, len(block_ids),
    ...], one copy per run of consecutive ids when 2 x layers x runs <= max_run_copies,
    otherwise one gather per layer."""
    if out.shape[0] != len(caches) or out.shape[2] != len(block_ids):
        raise ValueError(f"out {tuple(out.shape)} does not hold {len(block_ids)} blocks")
    if not block_ids:
        return
    runs = block_runs(block_ids)
    if 2 * len(caches) * len(runs) <= max_run_copies:
        for layer, cache in enumerate(caches):
            for half in (0, 1):
                dst, src = out[layer, half], cache[half]
                for pos, first, length in runs:
                    dst[pos : pos + length].copy_(src[first : first + length])
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
