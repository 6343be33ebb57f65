"""Piecewise CUDA graphs for batches with prompt tokens: every kernel but attention replayed.

A batch that mixes prompt chunks with decodes has a different shape at every step, so the
decode graphs (one per batch size, attention inside) do not fit it, and run eagerly its
forward pass costs a kernel launch per operation: on a small model the host spends longer
launching than the device computing (Qwen3-0.6B, a prompt beside 255 decodes, ~950 tokens:
17 ms of launches on the H100 host, 6 ms replayed). Here the forward pass is cut at each
layer's attention (the model's head / between / tail); each piece is captured once per
padded token count of a ladder, and a step replays the pieces of the smallest count that
holds it, running only the attention kernels eagerly, on the batch's real tokens, between
them. Padding tokens have slot -1 (their k and v are not written) and their rows are never
read.
"""

from __future__ import annotations

import logging
import time

import torch

from shoal.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

MAX_TOKENS = 2048  # larger batches run eagerly: the device is the limit there, not launches


def token_count_ladder(max_tokens: int) -> list[int]:
    """Padded token counts to capture: steps of 64 to 1024, of 128 to 2048."""
    cap = min(max_tokens, MAX_TOKENS)
    sizes = [*range(64, 1025, 64), *range(1152, MAX_TOKENS + 1, 128)]
    return [s for s in sizes if s < cap] + [cap]


class PiecewiseGraphs:
    def __init__(self, model: torch.nn.Module, device: torch.device, max_tokens: int) -> None:
        """model: a decoder exposing `model.model.head/between/tail` and its attention
        layers; max_tokens: the largest batch (in tokens) the engine schedules."""
        self.decoder = model.model
        self.attention = model.attention_layers()
        self.sizes = token_count_ladder(max_tokens)
        n = self.sizes[-1]
        first = self.attention[0]
        heads, head_dim = first.num_heads, first.head_dim
        hidden = self.decoder.embed_tokens.weight.shape[1]
        dtype = self.decoder.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.q = torch.zeros(n, heads, head_dim, dtype=dtype, device=device)
        self.attn = torch.zeros(n, heads * head_dim, dtype=dtype, device=device)
        self.residual = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def fits(self, num_tokens: int) -> bool:
        return bool(self.graphs) and num_tokens <= self.sizes[-1]

    def _piece(self, index: int, size: int) -> None:
        """Piece `index` of the forward pass on the first `size` rows of the buffers."""
        ids, positions, slots = self.input_ids[:size], self.positions[:size], self.slots[:size]
        attn, residual = self.attn[:size], self.residual[:size]
        if index == len(self.attention):
            self.hidden[:size].copy_(self.decoder.tail(attn, residual))
            return
        if index == 0:
            q, new_residual = self.decoder.head(ids, positions, slots)
        else:
            q, new_residual = self.decoder.between(index, attn, residual, positions, slots)
        self.q[:size].copy_(q)
        self.residual[:size].copy_(new_residual)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every piece at every size (largest first, in one memory pool)."""
        t0 = time.perf_counter()
        pieces, pool = len(self.attention) + 1, None
        for size in reversed(self.sizes):
            for index in range(pieces):
                self._piece(index, size)  # warm-up: compiles kernels for this shape
            graphs = []
            for index in range(pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(index, size)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[size] = graphs
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        log.info(
            "captured %d piecewise CUDA graphs (%d pieces, 64..%d tokens) in %.1fs",
            pieces * len(self.sizes),
            pieces,
            self.sizes[-1],
            elapsed,
        )
        return elapsed

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The hidden states of a flat batch (device tensors), attention run eagerly."""
        num = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num)
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(positions)
        self.slots[:num].copy_(slots)
        self.slots[num:size].fill_(-1)
        graphs = self.graphs[size]
        graphs[0].replay()
        q = self.q[:num]
        attn = self.attn[:num].view(q.shape)
        for attention, graph in zip(self.attention, graphs[1:], strict=True):
            attention(q, meta, out=attn)
            graph.replay()
        return self.hidden[:num]
