"""Linear layers: y = x W^T (+ b), whole or sharded across tensor-parallel ranks.

Few-row products on the GPU (decode at small batch, which only streams the weight) run the
skinny Triton GEMM; cuBLAS otherwise. A sharded layer fills its slice of the weight from
a checkpoint tensor through `load_weight`, reading only that slice (a safetensors slice
or a tensor: anything indexable by rows and columns).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import triton_kernels
from shoal.layers.parallel import TPGroup, head_shards

SKINNY_MAX_ROWS = 16  # shoal.kernels.skinny_gemm.MAX_ROWS (that module needs triton)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b), by the skinny GEMM where it pays."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and x.stride(1) == 1:
        return triton_kernels("skinny_gemm").skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """y_r = x W_r^T (+ b_r): this rank's rows of the output, no communication.

    The weight stacks checkpoint tensors (q/k/v, gate/up); `segments` holds, for each, the
    (first row, row count) this rank takes from it.
    """

    def __init__(self, in_features: int, segments: list[tuple[int, int]], bias: bool) -> None:
        super().__init__(in_features, sum(size for _, size in segments), bias=bias)
        self.segments = segments
        self.num_shards = len(segments)

    def load_weight(self, name: str, shard: int | None, source) -> None:
        """Copy this rank's rows of checkpoint tensor `shard` into weight or bias `name`."""
        shard = shard or 0
        start, size = self.segments[shard]
        offset = sum(n for _, n in self.segments[:shard])
        _copy(getattr(self, name).data.narrow(0, offset, size), source[start : start + size])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Checkpoint tensors of the given row counts (gate, up), each split evenly."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, [tp.split(n) for n in sizes], bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections of this rank's heads (see head_shards for the KV heads)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        tp: TPGroup,
    ) -> None:
        heads, kv_heads, first_kv = head_shards(num_heads, num_kv_heads, tp)
        q = (tp.rank * heads * head_dim, heads * head_dim)
        kv = (first_kv * head_dim, kv_heads * head_dim)
        super().__init__(hidden_size, [q, kv, kv], bias)
        self.num_heads, self.num_kv_heads = heads, kv_heads


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T (+ b): this rank's columns of W, then an all-reduce.

    The input is already split (this rank's heads, or its slice of the MLP); the bias is
    added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        self.first, local = tp.split(in_features)
        super().__init__(local, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight, None))
        return y if self.bias is None else y + self.bias

    def load_weight(self, name: str, shard: int | None, source) -> None:
        if name == "bias":
            _copy(self.bias.data, source[:])
        else:
            _copy(self.weight.data, source[:, self.first : self.first + self.in_features])


def _copy(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)
