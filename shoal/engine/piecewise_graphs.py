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

A prompt alone in its step (the common case at low load: one request arrives at an idle
engine) replays instead one graph of the whole forward pass, attention included, up to
WHOLE_MAX_TOKENS tokens: its metadata sits in buffers of the graph's own, and the prefill
kernel, launched over the padded count, reads the real query length from them and leaves
the padding's tiles at once. The eager attention calls cost the host ~60 us each on the
H100 host, and a small model's prompt step is bound by them (Qwen3-0.6B, 128 tokens: 3.2 ms
of launches for 3.2 ms of device time).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left

import torch

from shoal.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

MAX_TOKENS = 16384  # larger batches run eagerly
WHOLE_MAX_TOKENS = 1024  # a prompt alone up to this many tokens replays one whole graph
# A step whose layers each do more matmul work than this keeps the device busy longer than
# the host takes to launch a layer's ~20 kernels eagerly (~1 ms), so replaying it gains
# nothing and its padding costs: Llama-3.1-8B (0.44 GFLOP a token a layer) ran 16k-token
# prefill steps 1.4% slower replayed than eagerly on the H200, while Qwen3-0.6B's (0.03)
# were bound by their launches in the worker (docs/serving.md).
LAYER_FLOPS_WORTH_REPLAYING = 1e12


def token_count_ladder(max_tokens: int, layer_params: int = 0) -> list[int]:
    """Padded token counts to capture: steps of 64 to 1024, then eight steps to each
    doubling (128 to 2048, 256 to 4096, ...), so padding stays under an eighth; up to
    max_tokens, MAX_TOKENS and, given a layer's parameter count, the first count at which
    the layer's matmuls reach LAYER_FLOPS_WORTH_REPLAYING."""
    cap = min(max_tokens, MAX_TOKENS)
    sizes, step = list(range(64, 1025, 64)), 128
    while sizes[-1] < cap:
        sizes += range(sizes[-1] + step, 2 * sizes[-1] + 1, step)
        step *= 2
    sizes = [s for s in sizes if s < cap] + [cap]
    if layer_params:
        sizes = sizes[: bisect_left(sizes, LAYER_FLOPS_WORTH_REPLAYING / (2 * layer_params)) + 1]
    return sizes


class PiecewiseGraphs:
    def __init__(
        self, model: torch.nn.Module, device: torch.device, max_tokens: int, max_blocks: int
    ) -> None:
        """model: a decoder exposing `model.model.head/between/tail` and its attention
        layers; max_tokens: the largest batch (in tokens) the engine schedules; max_blocks:
        the most KV blocks one sequence holds."""
        self.decoder = model.model
        self.attention = model.attention_layers()
        layer_params = sum(p.numel() for p in self.decoder.layers[0].parameters())
        self.sizes = token_count_ladder(max_tokens, layer_params)
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
        # a prompt alone: its attention metadata, read by the whole graphs' attention. The
        # capture runs each size's pass as one prompt of that many tokens, which may be
        # longer than a sequence's blocks hold (max_model_len under WHOLE_MAX_TOKENS): the
        # table is wide enough for it at any block size (a block holds a token at least)
        width = max(max_blocks, min(self.sizes[-1], WHOLE_MAX_TOKENS))
        self.block_table = torch.zeros(1, width, dtype=torch.int32, device=device)
        self.seq_len = torch.zeros(1, dtype=torch.int32, device=device)
        self.query_start = torch.zeros(2, dtype=torch.int32, device=device)
        self.whole: dict[int, torch.cuda.CUDAGraph] = {}

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

    def _alone(self, size: int) -> AttentionMetadata:
        """The metadata of a prompt alone, padded to `size` tokens, in the whole graphs'
        buffers (the kernel's grid covers `size` queries; the buffers say how many are real)."""
        return AttentionMetadata(
            slot_mapping=self.slots[:size],
            block_tables=self.block_table,
            seq_lens=self.seq_len,
            query_start_loc=self.query_start,
            max_query_len=size,
            query_lens_host=[size],
            seq_lens_host=[size],
        )

    def _whole(self, size: int) -> None:
        """The whole forward pass of a prompt alone, attention included, on `size` rows."""
        meta = self._alone(size)
        q = self.q[:size]
        attn = self.attn[:size].view(q.shape)
        for index, attention in enumerate(self.attention):
            self._piece(index, size)
            attention(q, meta, out=attn)
        self._piece(len(self.attention), size)

    @torch.inference_mode()
    def capture(self, whole: bool = True) -> float:
        """Capture every piece at every size and, with `whole`, the whole pass of a prompt
        alone up to WHOLE_MAX_TOKENS (largest first, in one memory pool)."""
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
            if whole and size <= WHOLE_MAX_TOKENS:
                # captured over a prompt of `size` tokens whose block table is all block 0
                # (read only: the slots are -1, so nothing is written there)
                self.query_start[1] = size
                self.seq_len.fill_(size)
                self._whole(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._whole(size)
                pool = graph.pool()
                self.whole[size] = graph
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        log.info(
            "captured %d piecewise CUDA graphs (%d pieces, 64..%d tokens) and %d whole ones "
            "in %.1fs",
            pieces * len(self.sizes),
            pieces,
            self.sizes[-1],
            len(self.whole),
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
        """The hidden states of a flat batch (device tensors): a prompt alone replays its
        whole graph; otherwise the pieces replay around attention run eagerly."""
        num = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num)
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(positions)
        self.slots[:num].copy_(slots)
        self.slots[num:size].fill_(-1)
        whole = self.whole.get(size)
        if whole is not None and len(meta.query_lens_host) == 1:
            self.block_table[:, : meta.block_tables.shape[1]].copy_(meta.block_tables)
            self.seq_len.copy_(meta.seq_lens)
            self.query_start.copy_(meta.query_start_loc)
            whole.replay()
            return self.hidden[:num]
        graphs = self.graphs[size]
        graphs[0].replay()
        q = self.q[:num]
        attn = self.attn[:num].view(q.shape)
        for attention, graph in zip(self.attention, graphs[1:], strict=True):
            attention(q, meta, out=attn)
            graph.replay()
        return self.hidden[:num]
