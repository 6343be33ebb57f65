"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from shoal.kernels import triton_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The pure-torch norm (the CPU path, and the kernels' reference)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        if x.is_cuda:
            return triton_kernels("elementwise").rmsnorm(x, self.weight, self.eps, residual)
        if residual is None:
            return self.reference(x)
        x = x + residual
        return self.reference(x), x
