"""CUDA graphs for decode batches: one graph per batch size of a ladder, padded at replay.

The graphs read their inputs from views at fixed offsets of one device buffer. A replay
writes the batch into a pinned host mirror of that buffer, pads the rest (slot -1: nothing
written; seq_len 0: attention skipped), copies the mirror to the device with one
asynchronous copy and replays the smallest graph that holds the batch: no other copies.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from shoal.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)]
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


def _carve(
    buffer: torch.Tensor, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]
) -> dict[str, torch.Tensor]:
    """Views of a byte buffer, one per (name, dtype, shape) of the layout, back to back."""
    views, offset = {}, 0
    for name, dtype, shape in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        views[name] = buffer[offset : offset + nbytes].view(dtype).view(shape)
        offset += nbytes
    return views


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        max_num_seqs: int,
        max_blocks: int,
        workspace,
    ) -> None:
        self.model = model
        self.sizes = batch_size_ladder(max_num_seqs)
        self.max_size = self.sizes[-1]
        n = self.max_size
        # (name, dtype, shape); the block table goes last so a replay copies only its rows
        layout = [
            ("input_ids", torch.int64, (n,)),
            ("positions", torch.int64, (n,)),
            ("slots", torch.int64, (n,)),
            ("seq_lens", torch.int32, (n,)),
            ("block_tables", torch.int32, (n, max_blocks)),
        ]
        self.row_bytes = max_blocks * 4
        self.table_offset = sum(n * dtype.itemsize for _, dtype, _ in layout[:-1])
        size = self.table_offset + n * self.row_bytes
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
        self.copied = torch.cuda.Event()
        device_views, host_views = _carve(self.buffer, layout), _carve(self.host, layout)
        self.input_ids, self.positions, self.slots, self.seq_lens, self.block_tables = (
            device_views.values()
        )
        self.host_views = {name: view.numpy() for name, view in host_views.items()}
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.workspace = workspace
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states, [size, hidden]

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

    def _run(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self._meta(size))

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
                self.outputs[size] = self._run(size)
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
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        patch=None,
    ) -> torch.Tensor:
        """Run a decode batch (host arrays, one token per sequence) through its graph;
        `patch`, if given, rewrites the input ids on the device before the replay."""
        num = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num)
        self.copied.synchronize()  # the previous replay's copy out of the mirror is done
        host = self.host_views
        host["input_ids"][:num] = input_ids
        host["positions"][:num] = positions
        host["slots"][:num] = slots
        host["slots"][num:size] = -1
        host["seq_lens"][:num] = seq_lens
        host["seq_lens"][num:size] = 0
        host["block_tables"][:num, : block_table.shape[1]] = block_table
        end = self.table_offset + size * self.row_bytes
        self.buffer[:end].copy_(self.host[:end], non_blocking=True)
        self.copied.record()
        if patch is not None:
            patch(self.input_ids[:num])
        self.graphs[size].replay()
        return self.outputs[size][:num]
