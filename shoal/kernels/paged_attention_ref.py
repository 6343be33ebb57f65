"""Pure-torch paged attention: the CPU path and the reference the GPU kernels are checked against.

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim];
a token at slot s lives in block s // block_size at offset s % block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [T, kv_heads, head_dim] of T new tokens at their slots."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    query: [T, heads, head_dim], the new tokens of all sequences back to back; sequence i
    has query_lens[i] new tokens, which are the last ones of its seq_lens[i] tokens.
    Returns [T, heads, head_dim].
    """
    block_size = kv_cache.shape[2]
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks]
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
        q = query[start : start + q_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1).to(q.dtype),
            v.transpose(0, 1).to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out
