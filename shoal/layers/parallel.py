"""Tensor parallelism as the layers see it: this rank's place in the group and its collectives.

A model built with `TPGroup()` (one rank) runs no collective at all. The engine builds the
group (gloo on CPU, NCCL on GPUs) and hands it to the model; see shoal/engine/parallel/.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # the torch.distributed process group of the activations

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x joined along the last dimension, on rank 0; None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x

    def split(self, total: int) -> tuple[int, int]:
        """This rank's (start, size) of `total` rows split evenly; raises if it does not divide."""
        if total % self.size:
            raise ValueError(f"{total} does not divide across {self.size} tensor-parallel ranks")
        size = total // self.size
        return self.rank * size, size


def head_shards(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int, int]:
    """This rank's attention heads: (its query heads, its KV heads, its first KV head).

    Query heads split evenly. KV heads split evenly when there are at least as many as
    ranks; with fewer (MQA included) each rank holds the one KV head its query heads use,
    replicated on the tp / num_kv_heads ranks that share it.
    """
    if num_heads % tp.size:
        raise ValueError(
            f"tensor_parallel_size {tp.size} does not divide num_attention_heads {num_heads}"
        )
    if num_kv_heads >= tp.size:
        if num_kv_heads % tp.size:
            raise ValueError(
                f"tensor_parallel_size {tp.size} does not divide num_key_value_heads {num_kv_heads}"
            )
        local = num_kv_heads // tp.size
        return num_heads // tp.size, local, tp.rank * local
    if tp.size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp.size} is not a multiple of "
            f"num_key_value_heads {num_kv_heads}"
        )
    return num_heads // tp.size, 1, tp.rank // (tp.size // num_kv_heads)
