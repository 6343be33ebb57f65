"""Paged attention layer: the new queries attend over the layer's KV cache.

The new tokens' K/V are already in the cache (stored with the rotary embedding, see
shoal/kernels/qk_rope.py). On CUDA it runs the Triton kernels (decode batches through the
split-KV decode kernel); elsewhere the pure-torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shoal.kernels import triton_kernels
from shoal.kernels.paged_attention_ref import paged_attention_ref


@dataclass
class AttentionMetadata:
    """Where the tokens of a flat batch go and what each of its sequences attends to."""

    slot_mapping: torch.Tensor  # [T] cache slot of every new token (-1: padding)
    block_tables: torch.Tensor  # [B, max_blocks] int32 block ids of every sequence
    seq_lens: torch.Tensor  # [B] int32 context length per sequence, new tokens included
    query_start_loc: torch.Tensor  # [B + 1] int32 offsets of each sequence's new tokens
    max_query_len: int
    query_lens_host: list[int]  # host copies, for the reference path
    seq_lens_host: list[int]
    decode_workspace: object | None = None  # DecodeWorkspace when decode batches use it
    # A mixed batch's leading sequences with one new token (decodes), which the decode kernel
    # runs, and the query offsets of the sequences after them (from 0), which the prefill
    # kernel runs; 0 and None: the prefill kernel runs them all.
    num_decodes: int = 0
    prefill_query_start: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.kv_cache = torch.empty(0)  # bound by the model runner

    def forward(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads * head_dim]."""
        if q.is_cuda:
            return self._forward_triton(q, meta).flatten(1)
        out = paged_attention_ref(
            q,
            self.kv_cache,
            meta.block_tables,
            meta.query_lens_host,
            meta.seq_lens_host,
            self.scale,
        )
        return out.flatten(1)

    def _forward_triton(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        kernels = triton_kernels("paged_attention")
        if meta.max_query_len == 1 and meta.decode_workspace is not None:
            return kernels.decode_attention(
                q,
                self.kv_cache,
                meta.block_tables,
                meta.seq_lens,
                self.scale,
                meta.decode_workspace,
            )
        split = meta.num_decodes
        if split == 0 or meta.decode_workspace is None:
            return kernels.prefill_attention(
                q,
                self.kv_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                meta.max_query_len,
                self.scale,
            )
        out = torch.empty_like(q)
        kernels.decode_attention(
            q[:split],
            self.kv_cache,
            meta.block_tables[:split],
            meta.seq_lens[:split],
            self.scale,
            meta.decode_workspace,
            out=out[:split],
        )
        kernels.prefill_attention(
            q[split:],
            self.kv_cache,
            meta.block_tables[split:],
            meta.seq_lens[split:],
            meta.prefill_query_start,
            meta.max_query_len,
            self.scale,
            out=out[split:],
        )
        return out
