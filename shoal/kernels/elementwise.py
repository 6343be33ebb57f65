"""Fused Triton kernels for the per-token layers: RMSNorm (+ residual add), SiLU-and-mul
(the rotary embedding is fused with the KV store: shoal/kernels/qk_rope.py). Each replaces
a chain of small PyTorch ops (and their launches) with one kernel; the PyTorch versions in
shoal/layers are their references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x,
    residual,
    weight,
    out,
    res_out,
    stride_x,
    stride_r,
    stride_o,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        v = v + tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(res_out + row * stride_r + cols, v, mask=mask)
    v32 = v.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v32 * v32, 0) / n + eps)
    normed = (v32 * rstd).to(v.dtype)
    w = tl.load(weight + cols, mask=mask)
    tl.store(out + row * stride_o + cols, (w * normed).to(out.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * x / rms(x) over the last dim; with a residual, also returns x + residual.

    Rounds like the reference: the sum is taken in x's dtype, the norm in float32 and cast
    back before the weight multiplies.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, shape[-1]) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else x2
    n = shape[-1]
    _rmsnorm_kernel[(x2.shape[0],)](
        x2,
        res2,
        weight,
        out,
        res_out,
        x2.stride(0),
        res2.stride(0),
        out.stride(0),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(n),
        num_warps=4 if n <= 4096 else 8,
    )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_mul_kernel(gate_up, out, stride_in, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(gate_up + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * stride_in + n + cols, mask=mask, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(out + row * stride_out + cols, silu * u, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dimension."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    n = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
        rows, out, rows.stride(0), out.stride(0), n, BLOCK=block
    )
    return out.view(*gate_up.shape[:-1], n)
