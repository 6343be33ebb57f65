"""Where KV blocks lie in memory: (address, length, device) descriptors for a one-sided
read of whole blocks, merged into one descriptor per run of consecutive block ids.

A prefill worker's cache is one region per layer, [2 (K, V), num_blocks, block_size,
num_kv_heads, head_dim] in C order, so block b of layer l's K (or V) is `block_bytes`
contiguous bytes. A decode worker reads into a staging tensor [layers, 2, count, ...]
(KVLayout's transfer shape), where the blocks of one layer's K (or V) are contiguous too.
"""

from __future__ import annotations

import numpy as np

from shoal.disagg.blocks import block_bytes
from shoal.protocol import KVLayout


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in block_ids, first block id, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((pos, block, 1))
    return runs


def read_descriptors(
    layout: KVLayout,
    remote_addresses: list[int],
    remote_num_blocks: int,
    block_ids: list[int],
    local_address: int,
    device_id: int = 0,
    local_device_id: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """(remote, local) Nx3 uint64 arrays of (address, bytes, device): the blocks `block_ids`
    of every layer's K and V in the remote regions, and where each lands in a staging tensor
    at `local_address` holding len(block_ids) blocks in the transfer shape."""
    if len(remote_addresses) != layout.num_layers:
        raise ValueError(f"{len(remote_addresses)} regions for {layout.num_layers} layers")
    if any(not 0 <= b < remote_num_blocks for b in block_ids):
        raise ValueError(f"block ids outside the remote pool of {remote_num_blocks} blocks")
    size = block_bytes(layout)
    count = len(block_ids)
    runs = np.array(block_runs(block_ids), dtype=np.uint64).reshape(-1, 3)
    halves = np.arange(2 * layout.num_layers, dtype=np.uint64)  # (layer, K or V) in order
    bases = np.asarray(remote_addresses, dtype=np.uint64).repeat(2)
    half_offset = (halves % 2) * np.uint64(remote_num_blocks * size)
    remote = bases[:, None] + half_offset[:, None] + runs[None, :, 1] * np.uint64(size)
    local = (
        np.uint64(local_address)
        + halves[:, None] * np.uint64(count * size)
        + runs[None, :, 0] * np.uint64(size)
    )
    lengths = np.broadcast_to(runs[None, :, 2] * np.uint64(size), remote.shape)

    def table(addresses: np.ndarray, device: int) -> np.ndarray:
        out = np.empty((addresses.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addresses.ravel(), lengths.ravel(), device
        return out

    return table(remote, device_id), table(local, local_device_id)
