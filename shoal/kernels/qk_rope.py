"""Fused per-layer q/k handling before attention, one Triton kernel per layer:

    q, k = RMSNorm_head(q), RMSNorm_head(k)    (Qwen3 only: per-head norms)
    q, k = RoPE(q, k)                           (NeoX "rotate half" layout)
    cache[slot] = k, v                          (slot < 0: padding, nothing stored)

It replaces two norms, two rotary kernels and the KV store. One program handles one head
of one token: programs 0..heads-1 of a token rotate its query heads in place, the others
rotate one KV head each and store it, with its V head, in the paged cache
[2, num_blocks, block_size, kv_heads, head_dim]. The rotated K is not written back: the
attention kernels read K from the cache.

pure-torch reference: shoal/kernels/qk_rope_ref.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rotate(head, weight, c, s, i, mask, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """The two rotated halves (float32) of one head at `head`, RMS-normed first if HAS_NORM."""
    x1 = tl.load(head + i, mask=mask, other=0.0)
    x2 = tl.load(head + HALF + i, mask=mask, other=0.0)
    if HAS_NORM:  # rounds like RMSNorm: norm in float32, cast back, then the weight
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / (2 * HALF) + eps)
        w1 = tl.load(weight + i, mask=mask, other=0.0)
        w2 = tl.load(weight + HALF + i, mask=mask, other=0.0)
        x1 = (w1 * (a * rstd).to(x1.dtype)).to(x1.dtype)
        x2 = (w2 * (b * rstd).to(x2.dtype)).to(x2.dtype)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    return a * c - b * s, b * c + a * s


@triton.jit
def _qk_rope_store_kernel(
    q,
    k,
    v,
    cache,
    q_weight,
    k_weight,
    cos,
    sin,
    positions,
    slots,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c,
    half_cache,  # elements between the K and the V half of the cache
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    pos = tl.load(positions + t)
    c = tl.load(cos + pos * stride_c + i, mask=mask, other=0.0)
    s = tl.load(sin + pos * stride_c + i, mask=mask, other=0.0)
    if h < NUM_HEADS:
        head = q + t * stride_qt + h * stride_qh
        a, b = _norm_rotate(head, q_weight, c, s, i, mask, eps, HALF, HAS_NORM)
        tl.store(head + i, a.to(q.dtype.element_ty), mask=mask)
        tl.store(head + HALF + i, b.to(q.dtype.element_ty), mask=mask)
    else:
        kv_head = h - NUM_HEADS
        slot = tl.load(slots + t).to(tl.int64)
        if slot < 0:
            return
        head = k + t * stride_kt + kv_head * stride_kh
        a, b = _norm_rotate(head, k_weight, c, s, i, mask, eps, HALF, HAS_NORM)
        dst = cache + (slot * NUM_KV_HEADS + kv_head) * (2 * HALF)
        dtype = cache.dtype.element_ty
        tl.store(dst + i, a.to(k.dtype.element_ty).to(dtype), mask=mask)
        tl.store(dst + HALF + i, b.to(k.dtype.element_ty).to(dtype), mask=mask)
        v_head = v + t * stride_vt + kv_head * stride_vh
        v1 = tl.load(v_head + i, mask=mask)
        v2 = tl.load(v_head + HALF + i, mask=mask)
        tl.store(dst + half_cache + i, v1.to(dtype), mask=mask)
        tl.store(dst + half_cache + HALF + i, v2.to(dtype), mask=mask)


def qk_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """Norm (when weights are given) and rotate q [T, heads, head_dim] in place; norm and
    rotate k [T, kv_heads, head_dim] and store it with v into kv_cache at slot_mapping [T].

    cos, sin: [max_position, head_dim // 2] tables indexed by positions [T].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    has_norm = q_weight is not None
    _qk_rope_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        q,
        k,
        v,
        kv_cache,
        q_weight if has_norm else q,
        k_weight if has_norm else k,
        cos,
        sin,
        positions,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        kv_cache[0].numel(),
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        HAS_NORM=has_norm,
        BLOCK=triton.next_power_of_2(head_dim // 2),
        num_warps=1 if head_dim <= 128 else 2,
    )
