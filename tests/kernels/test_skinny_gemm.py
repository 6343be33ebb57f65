"""The skinny (few-row) Triton GEMM against torch.nn.functional.linear.

Natively on a GPU; in Triton's CPU interpreter elsewhere.
"""

import pytest
import torch
from kernel_setup import DEVICE, DTYPES

pytest.importorskip("triton")

from shoal.kernels.skinny_gemm import skinny_gemm


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.1).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])  # 1: the GEMV kernel; more: tensor cores
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear_with_ragged_edges(dtype, rows, bias):
    k, n = 1100, 75  # neither a multiple of the blocks: the masks matter
    x, w = rand(rows, k, dtype=dtype, seed=1), rand(n, k, dtype=dtype, seed=2)
    b = rand(n, dtype=dtype, seed=3) if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float() if bias else None)
    out = skinny_gemm(x, w, b)
    assert out.shape == (rows, n) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_strided_rows_and_limits():
    x = rand(4, 2 * 64, dtype=torch.float32, seed=4)[:, :64]  # row stride 128
    w = rand(32, 64, dtype=torch.float32, seed=5)
    torch.testing.assert_close(skinny_gemm(x, w), x @ w.T, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_gemm(rand(17, 64, dtype=torch.float32, seed=6), w)
    with pytest.raises(ValueError, match="contiguous along K"):
        skinny_gemm(x, w.T.contiguous().T)
