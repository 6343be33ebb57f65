"""Model runner: turns a scheduled batch into flat tensors, runs the model, samples.

Sequences are concatenated (no padding); every token gets its position and its cache
slot; each sequence its block table. Only sequences whose scheduled chunk reaches their
last known token are sampled. On CUDA, pure-decode batches replay captured CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from shoal.engine.cuda_graphs import DecodeGraphs
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request
from shoal.engine.sampler import Sampler, top_logprobs
from shoal.engine.scheduler import SchedulerOutput
from shoal.layers.attention import AttentionMetadata
from shoal.models.config import ModelConfig
from shoal.protocol import TokenLogprob


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request_id -> new token, for the sequences that were sampled
    logprobs: dict[str, TokenLogprob]
    prompt_logprobs: dict[str, list[TokenLogprob | None]]


@dataclass
class BatchInputs:
    """Host-side description of one flat batch."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T]
    block_table: np.ndarray  # [B, width] int32
    seq_lens: np.ndarray  # [B] int32
    query_start: np.ndarray  # [B + 1] int32
    query_lens: list[int]
    seq_lens_host: list[int]


class InputStaging:
    """Moves a step's input arrays to the device with one asynchronous copy.

    The arrays are packed into one pinned host buffer, copied into one device buffer, and
    returned as views of it. The pinned buffer is rewritten only after the previous step's
    copy out of it is done. On CPU the arrays become tensors without a copy.
    """

    ALIGN = 64  # bytes between the starts of packed arrays
    DTYPES: ClassVar = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.empty(0, dtype=torch.uint8)
        self.buffer = torch.empty(0, dtype=torch.uint8, device=device)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if self.copied is None:
            return [torch.from_numpy(a) for a in arrays]
        offsets, size = [], 0
        for a in arrays:
            offsets.append(size)
            size += -(-a.nbytes // self.ALIGN) * self.ALIGN
        if size > self.host.numel():
            self.host = torch.empty(2 * size, dtype=torch.uint8, pin_memory=True)
            self.buffer = torch.empty(2 * size, dtype=torch.uint8, device=self.device)
        else:
            self.copied.synchronize()
        host = self.host.numpy()
        for a, start in zip(arrays, offsets, strict=True):
            np.copyto(host[start : start + a.nbytes].view(a.dtype).reshape(a.shape), a)
        self.buffer[:size].copy_(self.host[:size], non_blocking=True)
        self.copied.record()
        return [
            self.buffer[start : start + a.nbytes].view(self.DTYPES[a.dtype]).view(a.shape)
            for a, start in zip(arrays, offsets, strict=True)
        ]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


@torch.inference_mode()
def run_profile_step(
    model: torch.nn.Module, cfg: ModelConfig, num_tokens: int, block_size: int, device
) -> None:
    """One forward of a num_tokens prompt through a scratch cache, to measure peak memory."""
    blocks = -(-num_tokens // block_size)
    shape = (2, blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    layers = model.attention_layers()
    for layer in layers:
        layer.kv_cache = torch.empty(shape, dtype=cfg.dtype, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens,
        query_lens_host=[num_tokens],
        seq_lens_host=[num_tokens],
    )
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), meta)
    model.compute_logits(hidden[-256:]).float().softmax(-1)
    for layer in layers:
        layer.kv_cache = torch.empty(0)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        kv: KVCacheManager,
        device: torch.device,
        generator: torch.Generator | None = None,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.sampler = Sampler(generator)
        self.staging = InputStaging(device)
        shape = (2, kv.num_blocks, kv.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(cfg.num_layers)
        ]
        for layer, cache in zip(model.attention_layers(), self.kv_caches, strict=True):
            layer.kv_cache = cache
        self.graphs: DecodeGraphs | None = None
        self.decode_workspace = None
        if device.type == "cuda":
            from shoal.kernels.paged_attention import DecodeWorkspace

            max_blocks = -(-max_model_len // self.block_size)
            self.decode_workspace = DecodeWorkspace(
                max_num_seqs, cfg.num_heads, cfg.head_dim, max_splits=16, device=device
            )
            if not enforce_eager:
                self.graphs = DecodeGraphs(
                    model, device, max_num_seqs, max_blocks, self.decode_workspace
                )

    def capture_graphs(self) -> float:
        """Capture the decode CUDA graphs; returns seconds spent (0 when graphs are off)."""
        return self.graphs.capture() if self.graphs is not None else 0.0

    def _prepare(self, sched: SchedulerOutput) -> BatchInputs:
        reqs, counts = sched.requests, sched.num_new_tokens
        num_seqs, bs = len(reqs), self.block_size
        starts = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, num_seqs)
        n = np.asarray(counts, dtype=np.int64)
        rows = self.kv.table_rows(reqs)
        table = self.kv.block_table
        total = int(n.sum())
        if total == num_seqs:  # decode: one token each
            query_start = np.arange(num_seqs + 1, dtype=np.int32)
            positions = starts
            token_rows = rows
            input_ids = np.fromiter((r.all_token_ids[-1] for r in reqs), np.int64, total)
        else:
            query_start = np.zeros(num_seqs + 1, dtype=np.int32)
            np.cumsum(n, out=query_start[1:])
            seq_index = np.repeat(np.arange(num_seqs), n)
            positions = np.arange(total, dtype=np.int64) + np.repeat(starts - query_start[:-1], n)
            token_rows = rows[seq_index]
            input_ids = np.fromiter(
                (
                    t
                    for r, c in zip(reqs, counts, strict=True)
                    for t in r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + c]
                ),
                np.int64,
                total,
            )
        slots = table.table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        width = int(table.lengths[rows].max())
        ends = starts + n
        return BatchInputs(
            input_ids,
            positions,
            slots,
            table.table[rows, :width],
            ends.astype(np.int32),
            query_start,
            list(counts),
            ends.tolist(),
        )

    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        num_seqs = len(batch.query_lens)
        is_decode = batch.input_ids.shape[0] == num_seqs
        if is_decode and self.graphs is not None and self.graphs.fits(num_seqs):
            return self.graphs.replay(
                batch.input_ids, batch.positions, batch.slots, batch.block_table, batch.seq_lens
            )
        input_ids, positions, slots, block_table, seq_lens, query_start = self.staging.to_device(
            batch.input_ids,
            batch.positions,
            batch.slots,
            batch.block_table,
            batch.seq_lens,
            batch.query_start,
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=block_table,
            seq_lens=seq_lens,
            query_start_loc=query_start,
            max_query_len=max(batch.query_lens),
            query_lens_host=batch.query_lens,
            seq_lens_host=batch.seq_lens_host,
            decode_workspace=self.decode_workspace if is_decode else None,
        )
        return self.model(input_ids, positions, meta)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        batch = self._prepare(sched)
        reqs = sched.requests
        # sequences whose chunk reaches their last known token are sampled, at that token
        num_tokens = np.fromiter((len(r.all_token_ids) for r in reqs), np.int64, len(reqs))
        sampled = np.flatnonzero(batch.seq_lens == num_tokens)
        sample_rows = batch.query_start[sampled + 1] - 1
        prompt_rows: list[int] = []  # flat indices whose logits score the next prompt token
        prompt_lp: list[tuple[Request, int, int, int]] = []  # req, first row, first pos, count
        for i, req in enumerate(reqs):
            if req.wants_prompt_logprobs and req.num_computed_tokens < req.num_prompt_tokens - 1:
                start, offset = req.num_computed_tokens, int(batch.query_start[i])
                count = min(batch.seq_lens_host[i], req.num_prompt_tokens - 1) - start
                prompt_lp.append((req, len(prompt_rows), start, count))
                prompt_rows += range(offset, offset + count)

        hidden = self._forward(batch)
        if not prompt_rows and len(sample_rows) == hidden.shape[0]:
            selected = hidden  # every token is a sampled sequence's last (decode)
        else:
            rows = torch.tensor(prompt_rows + sample_rows.tolist(), dtype=torch.int64)
            selected = hidden[rows.to(self.device)]
        logits = self.model.compute_logits(selected)

        out = RunnerOutput({}, {}, {})
        for req, row, first_pos, count in prompt_lp:
            lp = torch.log_softmax(logits[row : row + count].float(), dim=-1)
            targets = req.all_token_ids[first_pos + 1 : first_pos + 1 + count]
            out.prompt_logprobs[req.request_id] = [
                top_logprobs(lp[j], t, req.sampling.prompt_logprobs) for j, t in enumerate(targets)
            ]
        if len(sampled):
            sample_reqs = [reqs[i] for i in sampled.tolist()]
            result = self.sampler(logits[len(prompt_rows) :], sample_reqs)
            ids = [r.request_id for r in sample_reqs]
            out.sampled = dict(zip(ids, result.token_ids, strict=True))
            for req, lp in zip(sample_reqs, result.logprobs, strict=True):
                if lp is not None:
                    out.logprobs[req.request_id] = lp
        return out
