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
    # A mixed batch cut in two: its leading sequences with one new token (decodes, run by
    # the decode kernel) and the sequences after them (the prefill kernel), each described
    # from its own first token. None: the prefill kernel runs the whole batch.
    split: tuple[AttentionMetadata, AttentionMetadata] | None = None

    def cut(
        self, num_decodes: int, prefill_query_start: torch.Tensor, workspace: object | None
    ) -> None:
        """Set `split` at `num_decodes` (prefill_query_start: query_start_loc of the
        sequences after them, from 0; workspace: the decode kernel's DecodeWorkspace)."""
        d = num_decodes
        decodes = AttentionMetadata(
            slot_mapping=self.slot_mapping[:d],
            block_tables=self.block_tables[:d],
            seq_lens=self.seq_lens[:d],
            query_start_loc=self.query_start_loc[: d + 1],
            max_query_len=1,
            query_lens_host=self.query_lens_host[:d],
            seq_lens_host=self.seq_lens_host[:d],
            decode_workspace=workspace,
        )
        rest = AttentionMetadata(
            slot_mapping=self.slot_mapping[d:],
            block_tables=self.block_tables[d:],
            seq_lens=self.seq_lens[d:],
            query_start_loc=prefill_query_start,
            max_query_len=self.max_query_len,
            query_lens_host=self.query_lens_host[d:],
            seq_lens_host=self.seq_lens_host[d:],
        )
        self.split = (decodes, rest)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.kv_cache = torch.empty(0)  # bound by the model runner

    def forward(
        self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads * head_dim] (written into `out`, [T, heads,
        head_dim], if given)."""
        if q.is_cuda:
            return self._forward_triton(q, meta, out).flatten(1)
        result = paged_attention_ref(
            q,
            self.kv_cache,
            meta.block_tables,
            meta.query_lens_host,
            meta.seq_lens_host,
            self.scale,
        )
        if out is not None:
            result = out.copy_(result)
        return result.flatten(1)

    def _forward_triton(
        self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None
    ) -> torch.Tensor:
        kernels = triton_kernels("paged_attention")
        if meta.max_query_len == 1 and meta.decode_workspace is not None:
            return kernels.decode_attention(
                q,
                self.kv_cache,
                meta.block_tables,
                meta.seq_lens,
                self.scale,
                meta.decode_workspace,
                out=out,
            )
        if meta.split is None:
            return kernels.prefill_attention(
                q,
                self.kv_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                meta.max_query_len,
                self.scale,
                out=out,
            )
        decodes, rest = meta.split
        out = torch.empty_like(q) if out is None else out
        d = len(decodes.query_lens_host)
        self._forward_triton(q[:d], decodes, out[:d])
        self._forward_triton(q[d:], rest, out[d:])
        return out
