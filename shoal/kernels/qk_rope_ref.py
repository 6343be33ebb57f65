"""Pure-torch q/k handling before attention: the CPU path and the reference of
shoal/kernels/qk_rope.py, composed of the reference ops (RMSNorm's float32 norm, the
rotary embedding's rotation, the paged KV store).
"""

from __future__ import annotations

from typing import Protocol

import torch

from shoal.kernels.paged_attention_ref import write_kv_cache_ref


class NormReference(Protocol):
    """A norm's pure-torch form (shoal.layers.norm.RMSNorm)."""

    def reference(self, x: torch.Tensor) -> torch.Tensor: ...


class RotaryReference(Protocol):
    """A rotary embedding's pure-torch form (shoal.layers.rotary.RotaryEmbedding)."""

    def reference(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


def qk_rope_store_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    rotary: RotaryReference,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: NormReference | None = None,
    k_norm: NormReference | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm (when given) and rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim],
    store k and v at slot_mapping [T]; returns the new (q, k)."""
    if q_norm is not None and k_norm is not None:
        q, k = q_norm.reference(q), k_norm.reference(k)
    q, k = rotary.reference(positions, q), rotary.reference(positions, k)
    write_kv_cache_ref(k, v, kv_cache, slot_mapping)
    return q, k
