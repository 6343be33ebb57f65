"""A KV block's shards across tensor-parallel ranks (each holds some KV heads), and their
bytes on a follower's command pipe.

Blocks travel in read_blocks' layout, [layers, 2, blocks, block_size, heads, head_dim]; a
rank's shard is its heads' slice of it (KV heads replicated over ranks appear once whole).
"""

from __future__ import annotations

import torch

from shoal.layers.parallel import TPGroup, head_shards
from shoal.models.config import ModelConfig


def rank_heads(cfg: ModelConfig, rank: int, size: int) -> slice:
    """The KV heads `rank` of `size` holds, as a slice of the model's KV heads."""
    _, local, first = head_shards(cfg.num_heads, cfg.num_kv_heads, TPGroup(rank, size))
    return slice(first, first + local)


def split_heads(data: torch.Tensor, cfg: ModelConfig, size: int) -> list[torch.Tensor]:
    """Every rank's shard of whole blocks, rank 0 first."""
    return [data[..., rank_heads(cfg, rank, size), :] for rank in range(size)]


def join_heads(shards: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Whole blocks from every rank's shard (rank 0 first)."""
    first = shards[0]
    whole = first.new_empty((*first.shape[:-2], cfg.num_kv_heads, cfg.head_dim))
    for rank, shard in enumerate(shards):
        whole[..., rank_heads(cfg, rank, len(shards)), :] = shard
    return whole


def to_bytes(data: torch.Tensor) -> bytes:
    return data.contiguous().view(torch.uint8).numpy().tobytes()


def from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
