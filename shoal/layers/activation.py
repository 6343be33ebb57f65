"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels import triton_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, where gate_up = [gate | up] on the last dimension."""
    if gate_up.is_cuda:
        return triton_kernels("elementwise").silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
