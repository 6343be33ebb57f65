"""Paged attention layer: stores the new K/V in the layer's cache, then attends over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shoal.kernels.paged_attention_ref import paged_attention_ref, write_kv_cache_ref


@dataclass
class AttentionMetadata:
    """Where the tokens of a flat batch go and what each of its sequences attends to."""

    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    block_tables: torch.Tensor  # [B, max_blocks] block ids of every sequence
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence, new tokens included


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.kv_cache = torch.empty(0)  # bound by the model runner

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        write_kv_cache_ref(k, v, self.kv_cache, meta.slot_mapping)
        out = paged_attention_ref(
            q, self.kv_cache, meta.block_tables, meta.query_lens, meta.seq_lens, self.scale
        )
        return out.flatten(1)
