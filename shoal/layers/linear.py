"""Linear layer: y = x W^T (+ b), with few-row products on the GPU by a Triton GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import triton_kernels

SKINNY_MAX_ROWS = 16  # shoal.kernels.skinny_gemm.MAX_ROWS (that module needs triton)


class Linear(nn.Linear):
    """nn.Linear whose products of at most 16 rows (decode at small batch, which only
    streams the weight) run the skinny Triton GEMM on CUDA; cuBLAS otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and x.stride(1) == 1:
            return triton_kernels("skinny_gemm").skinny_gemm(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
