"""Fused Triton kernels (RMSNorm, SiLU-and-mul) against the PyTorch layers.

Natively on a GPU; in Triton's CPU interpreter elsewhere.
"""

import pytest
import torch
from kernel_setup import DEVICE, DTYPES

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


def silu_mul_closed_form(x: torch.Tensor) -> torch.Tensor:
    """gate / (1 + exp(-gate)) * up in float64, from the definition of SiLU."""
    gate, up = x.double().chunk(2, -1)
    return gate * (1.0 / (1.0 + torch.exp(-gate))) * up


# silu(g) at a few points, worked out by hand: g / (1 + e^-g)
KNOWN_SILU = {
    0.0: 0.0,
    1.0: 0.7310585786300049,
    -1.0: -0.2689414213699951,
    2.0: 1.7615941559557649,
    -20.0: -4.1223072e-08,
    20.0: 19.999999958776927,
}


def silu_tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def implementations() -> list:
    """The Triton kernel, and the layer (its CPU path where there is no GPU)."""
    return [elementwise.silu_and_mul, silu_and_mul]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", implementations(), ids=["triton", "layer"])
def test_silu_and_mul_known_values(dtype, fn):
    gates = torch.tensor(list(KNOWN_SILU), dtype=torch.float64)
    expected = torch.tensor(list(KNOWN_SILU.values()), dtype=torch.float64)
    # up = 1 gives silu(gate); up = -3 scales it
    ups = torch.stack([torch.ones(6), -3 * torch.ones(6)])
    x = torch.cat([torch.stack([gates, gates]), ups], 1)
    out = fn(x.to(dtype).to(DEVICE)).double().cpu()
    torch.testing.assert_close(out, torch.stack([expected, -3 * expected]), **silu_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", implementations(), ids=["triton", "layer"])
def test_silu_and_mul_matches_closed_form(dtype, fn):
    x = rand(5, 2 * 1500, dtype=dtype, seed=5) * 4
    ref = silu_mul_closed_form(x.cpu())
    out = fn(x).double().cpu()
    torch.testing.assert_close(out, ref, **silu_tolerance(dtype))
