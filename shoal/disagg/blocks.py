"""KV block payloads: a [layers, 2, blocks, block_size, heads, head_dim] tensor cut into
frames of whole blocks, and joined again on the receiving side."""

from __future__ import annotations

import numpy as np
import torch

from shoal.protocol import KVBlocksChunk, KVLayout

CHUNK_BYTES = 64 * 2**20  # most payload bytes in one frame (at least one block)


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype a layout names."""
    dtype = getattr(torch, layout.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV dtype {layout.dtype!r}")
    return dtype


def block_bytes(layout: KVLayout) -> int:
    """Bytes of one block in one layer's K or V."""
    item = torch.empty(0, dtype=torch_dtype(layout)).element_size()
    return layout.block_size * layout.num_kv_heads * layout.head_dim * item


def blocks_per_chunk(layout: KVLayout, chunk_bytes: int = CHUNK_BYTES) -> int:
    """How many blocks fit in one frame of chunk_bytes (one at least)."""
    return max(1, chunk_bytes // (2 * layout.num_layers * block_bytes(layout)))


def to_chunk(first_block: int, data: torch.Tensor) -> KVBlocksChunk:
    """One frame of blocks read from the cache (a host tensor in the layout's shape)."""
    raw = data.contiguous().view(torch.uint8).numpy().reshape(-1)  # bytes in C order, no copy
    return KVBlocksChunk(first_block=first_block, num_blocks=data.shape[2], data=memoryview(raw))


class BlockAssembler:
    """Joins the frames of blocks first..first+count of a transfer into one host tensor."""

    def __init__(self, layout: KVLayout, first: int, count: int) -> None:
        self.layout, self.first, self.count = layout, first, count
        self._per_block = block_bytes(layout)
        self._buf = np.empty((layout.num_layers, 2, count, self._per_block), dtype=np.uint8)
        self._filled = np.zeros(count, dtype=bool)

    def add(self, chunk: KVBlocksChunk) -> None:
        """Place one frame; ValueError if it lies outside the transfer or has the wrong size."""
        start = chunk.first_block - self.first
        end = start + chunk.num_blocks
        if not 0 <= start <= end <= self.count:
            raise ValueError(f"blocks {chunk.first_block}+{chunk.num_blocks} out of range")
        shape = (self.layout.num_layers, 2, chunk.num_blocks, self._per_block)
        if len(chunk.data) != int(np.prod(shape)):
            raise ValueError(f"frame of {len(chunk.data)} bytes for {chunk.num_blocks} blocks")
        self._buf[:, :, start:end] = np.frombuffer(chunk.data, dtype=np.uint8).reshape(shape)
        self._filled[start:end] = True

    def tensor(self) -> torch.Tensor:
        """The joined blocks; ValueError if some never arrived."""
        if not self._filled.all():
            missing = int((~self._filled).sum())
            raise ValueError(f"{missing} of {self.count} blocks never arrived")
        lay = self.layout
        flat = torch.from_numpy(self._buf).view(torch_dtype(lay))
        return flat.view(lay.num_layers, 2, self.count, lay.block_size, lay.num_kv_heads, -1)
