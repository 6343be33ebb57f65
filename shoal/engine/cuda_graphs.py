"""CUDA graphs for decode batches: one graph per batch size of a ladder, padded at replay.

Inputs live in static buffers the graphs read; a replay copies the batch into them,
pads the rest (slot -1: nothing written; seq_len 0: attention skipped) and replays the
smallest graph that holds the batch.
"""

from __future__ import annotations

import logging
import time

import torch

from shoal.layers.attention import AttentionMetadata
from shoal.models.config import ModelConfig

log = logging.getLogger(__name__)


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)]
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        device: torch.device,
        max_num_seqs: int,
        max_blocks: int,
        workspace,
    ) -> None:
        self.model = model
        self.sizes = batch_size_ladder(max_num_seqs)
        self.max_size = self.sizes[-1]
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=cfg.dtype, device=device)
        self.workspace = workspace
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def fits(self, num_seqs: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.max_size

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start[: size + 1],
            max_query_len=1,
            query_lens_host=[1] * size,
            seq_lens_host=[0] * size,
            decode_workspace=self.workspace,
        )

    def _run(self, size: int) -> None:
        self.hidden[:size] = self.model(
            self.input_ids[:size], self.positions[:size], self._meta(size)
        )

    @torch.inference_mode()
    def capture(self) -> float:
        t0 = time.perf_counter()
        pool = None
        self.seq_lens.fill_(1)
        self.slots.fill_(-1)
        for size in reversed(self.sizes):
            self._run(size)  # warm-up: compiles kernels for this shape
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.seq_lens.zero_()
        elapsed = time.perf_counter() - t0
        log.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.1fs",
            len(self.sizes),
            self.max_size,
            elapsed,
        )
        return elapsed

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Run a decode batch (device tensors, one token per sequence) through its graph."""
        num = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num)
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(positions)
        self.slots[:num].copy_(slots)
        self.block_tables[:num, : block_table.shape[1]].copy_(block_table)
        self.seq_lens[:num].copy_(seq_lens)
        if size > num:
            self.slots[num:size].fill_(-1)
            self.seq_lens[num:size].zero_()
        self.graphs[size].replay()
        return self.hidden[:num]
