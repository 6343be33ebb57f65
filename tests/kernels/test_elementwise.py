"""Fused Triton kernels (RMSNorm, SiLU-and-mul) against the PyTorch layers.

Natively on a GPU; in Triton's CPU interpreter elsewhere.
"""

import pytest
import torch
from kernel_setup import DEVICE, DTYPES, GPU

pytest.importorskip("triton")

from shoal.kernels import elementwise
from shoal.layers.activation import silu_and_mul
from shoal.layers.norm import RMSNorm


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 96, 1024])
def test_rmsnorm_with_and_without_residual(dtype, dim):
    norm = RMSNorm(dim, eps=1e-6)
    norm.weight.data = rand(dim, dtype=torch.float32, seed=1).cpu().to(dtype)
    x, res = rand(7, dim, dtype=dtype, seed=2), rand(7, dim, dtype=dtype, seed=3)
    ref = norm.to(DEVICE).reference(x.clone())
    out = elementwise.rmsnorm(x, norm.weight, 1e-6)
    tol = 0 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, atol=tol + 1e-5, rtol=tol + 1e-5)
    out, new_res = elementwise.rmsnorm(x, norm.weight, 1e-6, residual=res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, norm.reference(x + res), atol=tol + 1e-5, rtol=tol + 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = rand(5, 2 * 1500, dtype=dtype, seed=5)
    gate, up = x.float().chunk(2, -1)
    ref = (torch.nn.functional.silu(gate) * up).to(dtype)
    torch.testing.assert_close(elementwise.silu_and_mul(x), ref, atol=2e-2, rtol=2e-2)
    if not GPU:
        torch.testing.assert_close(silu_and_mul(x), ref, atol=2e-2, rtol=2e-2)
