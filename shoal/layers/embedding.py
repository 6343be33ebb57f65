"""Token embedding and LM head, their vocabulary split across tensor-parallel ranks.

Each rank holds ceil(vocab / tp) rows (the last rank's tail is zero padding). A token's
embedding comes from the rank that holds its row (the others add zeros in the all-reduce);
each rank scores its rows and rank 0 gathers the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.linear import linear
from shoal.layers.parallel import TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.rows = -(-vocab_size // tp.size)
        self.first = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def load_weight(self, name: str, shard: int | None, source) -> None:
        """This rank's rows of the checkpoint's [vocab, dim] matrix; padding rows zero."""
        count = max(0, min(self.rows, self.vocab_size - self.first))
        rows = source[self.first : self.first + count]
        if rows.shape[1:] != self.weight.shape[1:]:
            raise ValueError(f"shape {tuple(rows.shape)}, expected rows of {self.weight.shape[1]}")
        self.weight.data[:count].copy_(rows)
        self.weight.data[count:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h E^T over this rank's vocabulary rows, gathered on rank 0."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of every vocabulary entry on rank 0; None on the other ranks."""
        logits = self.tp.gather(linear(hidden, self.weight, None))
        return None if logits is None else logits[..., : self.vocab_size]
