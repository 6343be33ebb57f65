"""Model runner: turns a scheduled batch into flat tensors, runs the model, samples.

Sequences are concatenated (no padding); every token gets its position and its cache
slot; each sequence its block table. Only sequences whose scheduled chunk reaches their
last known token are sampled. On CUDA, pure-decode batches replay captured CUDA graphs and
batches with prompt tokens (up to the top of piecewise_graphs.token_count_ladder: at most
MAX_TOKENS, less for a model whose layers outlast their launches) replay piecewise ones,
with attention run eagerly between the pieces.

The runner keeps its own copy of the block table. On rank 0 it turns the scheduler's
output into a StepPlan (block ids that changed included), sends it to the other
tensor-parallel ranks, and runs it like they do; only rank 0 samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from shoal.engine.cuda_graphs import DecodeGraphs
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.parallel.plan import RunnerBlockTable, StepPlan
from shoal.engine.piecewise_graphs import PiecewiseGraphs
from shoal.engine.request import Request
from shoal.engine.sampler import SampledTokens, Sampler, logprob_pieces, token_logprobs
from shoal.engine.scheduler import SchedulerOutput
from shoal.engine.transfer import to_device, to_host
from shoal.layers.attention import AttentionMetadata
from shoal.layers.parallel import TPGroup, head_shards
from shoal.models.config import ModelConfig
from shoal.protocol import TokenLogprob


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request_id -> new token, for the sequences that were sampled
    logprobs: dict[str, TokenLogprob]
    prompt_logprobs: dict[str, list[TokenLogprob | None]]


@dataclass
class StepHandle:
    """A launched step: its draws being copied to the host, and what to read them with."""

    request_ids: list[str] = field(default_factory=list)  # of the sampled rows, in order
    draw: SampledTokens | None = None  # host tensors (pinned on CUDA)
    ready: torch.cuda.Event | None = None  # recorded after the copies to the host
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)


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


def kv_bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp: TPGroup | None = None
) -> int:
    """Bytes of one KV block on one rank (which holds its share of the KV heads)."""
    _, kv_heads, _ = head_shards(cfg.num_heads, cfg.num_kv_heads, tp or TPGroup())
    return 2 * cfg.num_layers * block_size * kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        generator: torch.Generator | None = None,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
        enforce_eager: bool = False,
        kv: KVCacheManager | None = None,
        max_num_batched_tokens: int = 8192,
        tp: TPGroup | None = None,
        followers=None,
    ) -> None:
        """kv: the scheduler's KV manager (rank 0), whose block table the runner follows;
        followers: what sends each step's plan to the other ranks (ExecutorFollowers)."""
        self.model = model
        self.cfg = cfg
        self.kv = kv
        self.tp = tp or TPGroup()
        self.followers = followers
        self.device = device
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.table = RunnerBlockTable()
        self.sampler = Sampler(generator)
        self.staging = InputStaging(device)
        heads = model.attention_layers()[0]
        shape = (2, num_blocks, block_size, heads.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(cfg.num_layers)
        ]
        for layer, cache in zip(model.attention_layers(), self.kv_caches, strict=True):
            layer.kv_cache = cache
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: PiecewiseGraphs | None = None
        self.decode_workspace = None
        # the last launch's draws on the device, and each sampled request's row in them
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self._last_handle: StepHandle | None = None
        if device.type == "cuda":
            from shoal.kernels.paged_attention import DecodeWorkspace

            max_blocks = -(-max_model_len // self.block_size)
            self.decode_workspace = DecodeWorkspace(
                max_num_seqs, heads.num_heads, cfg.head_dim, max_splits=16, device=device
            )
            if not enforce_eager:
                self.graphs = DecodeGraphs(
                    model, device, max_num_seqs, max_blocks, self.decode_workspace
                )
                self.mixed_graphs = PiecewiseGraphs(
                    model, device, max_num_batched_tokens, max_blocks
                )

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A host copy of these blocks' KV: [layers, 2, blocks, block_size, heads, head_dim]."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        out = torch.stack([cache.index_select(1, index) for cache in self.kv_caches])
        return out.cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Overwrite these blocks' KV with `data` (read_blocks' layout, any device)."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        data = data.to(self.device, non_blocking=True)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, index, data[layer])

    def capture_graphs(self, profile: bool = False) -> float:
        """Capture the decode and the piecewise CUDA graphs, then load the LM head's
        kernels; returns the seconds spent capturing (0 when graphs are off). profile: for
        the memory profile, which leaves out the whole graphs of a prompt alone (they share
        the pieces' memory pool and add ~15 MB to it, 8 KV blocks of Qwen3-0.6B, not worth
        a second capture's start-up time) and the kernels."""
        if self.graphs is None or self.mixed_graphs is None:
            return 0.0
        seconds = self.graphs.capture() + self.mixed_graphs.capture(whole=not profile)
        if not profile:
            self._load_logit_kernels()
        return seconds

    @torch.inference_mode()
    def _load_logit_kernels(self) -> None:
        """Run the LM head at every row count a step may sample (1 to max_num_seqs).

        CUDA loads a kernel when it is first launched, and the load waits for the device
        to finish the work queued before it. The LM head's GEMM kernel depends on the row
        count, so a step sampling a count not seen before held the host in the LM head
        until the step in flight had ended, and the device then waited for the host: in a
        fresh worker's first burst of 16,384-token steps (Qwen3-0.6B, H200) the LM head
        held the host 20-33 ms a step and the steps took 43-50 ms instead of 35-39 ms
        (docs/gpu.md). Every rank runs it (the LM head gathers across them).

        The counts go from the largest down, so each step's logits fit in the block the
        caching allocator kept from the one before; going up, every count asked it for a
        block larger than any it held, and the pool kept them all (1.4 GiB on Qwen3-0.6B,
        beyond the memory the KV cache was sized to leave)."""
        hidden = torch.zeros(
            self.max_num_seqs, self.cfg.hidden_size, dtype=self.cfg.dtype, device=self.device
        )
        for rows in range(self.max_num_seqs, 0, -1):
            self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)

    def _plan(self, sched: SchedulerOutput) -> tuple[StepPlan, np.ndarray, list]:
        """The step's plan, the indices of the sequences it samples, and the prompt-logprob
        work: (request, first row in the logits, first position, count) each."""
        reqs, counts = sched.requests, sched.num_new_tokens
        num_seqs = len(reqs)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, num_seqs)
        n = np.asarray(counts, dtype=np.int64)
        rows = self.kv.table_rows(reqs)
        source = self.kv.block_table
        width = int(source.lengths[rows].max())
        self.table.reserve(int(rows.max()) + 1, width)
        changed = self.table.changes(rows, source.table[rows, :width])
        total = int(n.sum())
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(n, out=query_start[1:])
        if total == num_seqs:  # decode: one token each
            input_ids = np.fromiter((r.all_token_ids[-1] for r in reqs), np.int64, total)
        else:
            input_ids = np.zeros(total, dtype=np.int64)  # a pending token stays 0 until patched
            for r, c, begin in zip(reqs, counts, query_start[:-1].tolist(), strict=True):
                known = r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + c]
                input_ids[begin : begin + len(known)] = known
        # sequences whose chunk reaches their last known or pending token are sampled
        num_tokens = np.fromiter(
            (r.num_tokens + r.num_placeholders for r in reqs), np.int64, num_seqs
        )
        sampled = np.flatnonzero(starts + n == num_tokens)
        sample_rows = query_start[sampled + 1] - 1
        prompt_rows: list[int] = []  # flat indices whose logits score the next prompt token
        prompt_lp: list[tuple[Request, int, int, int]] = []
        for i, req in enumerate(reqs):
            if req.wants_prompt_logprobs and req.num_computed_tokens < req.num_prompt_tokens - 1:
                start, offset = req.num_computed_tokens, int(query_start[i])
                count = min(int(starts[i] + n[i]), req.num_prompt_tokens - 1) - start
                prompt_lp.append((req, len(prompt_rows), start, count))
                prompt_rows += range(offset, offset + count)
        every_row = not prompt_rows and len(sample_rows) == total
        dst, src = self._placeholder_rows(reqs, query_start)
        plan = StepPlan(
            input_ids,
            starts,
            n,
            rows,
            width,
            *changed,
            None if every_row else np.asarray(prompt_rows + sample_rows.tolist(), np.int64),
            len(sampled),
            dst,
            src,
        )
        return plan, sampled, prompt_lp

    def _batch(self, plan: StepPlan) -> BatchInputs:
        """The flat batch of a plan, read from the runner's own block table."""
        starts, n, rows, bs = plan.starts, plan.counts, plan.rows, self.block_size
        num_seqs, total = len(n), len(plan.input_ids)
        if total == num_seqs:  # decode: one token each
            query_start = np.arange(num_seqs + 1, dtype=np.int32)
            positions = starts
            token_rows = rows
        else:
            query_start = np.zeros(num_seqs + 1, dtype=np.int32)
            np.cumsum(n, out=query_start[1:])
            seq_index = np.repeat(np.arange(num_seqs), n)
            positions = np.arange(total, dtype=np.int64) + np.repeat(starts - query_start[:-1], n)
            token_rows = rows[seq_index]
        table = self.table.ids
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        ends = starts + n
        return BatchInputs(
            plan.input_ids,
            positions,
            slots,
            table[rows, : plan.width],
            ends.astype(np.int32),
            query_start,
            n.tolist(),
            ends.tolist(),
        )

    def _forward(self, batch: BatchInputs, patch=None) -> torch.Tensor:
        """The model's hidden states; `patch` may rewrite the input ids once on the device."""
        num_seqs = len(batch.query_lens)
        is_decode = batch.input_ids.shape[0] == num_seqs
        if is_decode and self.graphs is not None and self.graphs.fits(num_seqs):
            return self.graphs.replay(
                batch.input_ids,
                batch.positions,
                batch.slots,
                batch.block_table,
                batch.seq_lens,
                patch,
            )
        arrays = [
            batch.input_ids,
            batch.positions,
            batch.slots,
            batch.block_table,
            batch.seq_lens,
            batch.query_start,
        ]
        num_decodes = 0  # a mixed batch's leading sequences with one new token
        if not is_decode and self.decode_workspace is not None:
            num_decodes = int(np.argmax(np.diff(batch.query_start) != 1))
            if num_decodes:
                arrays.append(batch.query_start[num_decodes:] - num_decodes)
        input_ids, positions, slots, block_table, seq_lens, query_start, *rest = (
            self.staging.to_device(*arrays)
        )
        if patch is not None:
            patch(input_ids)
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
        if num_decodes:
            meta.cut(num_decodes, rest[0], self.decode_workspace)
        mixed = self.mixed_graphs
        if not is_decode and mixed is not None and mixed.fits(len(batch.input_ids)):
            return mixed.run(input_ids, positions, slots, meta)
        return self.model(input_ids, positions, meta)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run a plan's forward pass on this rank: the logits of its rows (rank 0), else None.

        A follower rank then takes the draws that rank 0 shares (async scheduling patches
        them into the next step's input ids on the device).
        """
        self.table.apply(plan)
        batch = self._batch(plan)
        hidden = self._forward(batch, self._placeholder_patch(plan))
        if plan.logit_rows is None:
            selected = hidden  # every token is a sampled sequence's last (decode)
        else:
            selected = hidden[to_device(plan.logit_rows.tolist(), torch.int64, self.device)]
        logits = self.model.compute_logits(selected)
        if self.tp.rank > 0 and plan.num_sampled:
            empty = torch.empty(plan.num_sampled, dtype=torch.int64, device=self.device)
            self._last_tokens = self.tp.broadcast(empty)
        return logits

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Queue the batch's forward pass and sampling on the device; wait for nothing.

        A sequence whose next input is still being sampled by the previous launch (a
        placeholder) gets that token on the device, from the previous launch's draws.
        Prompt logprobs are the exception: they are computed here, waiting for the device.
        Only rank 0 samples: the sampling state (seeds, penalties' history, grammars) lives
        with the scheduler, and the other ranks need only the tokens, which reach them in
        the next plan or, still on the device, by a broadcast of the draws.
        """
        plan, sampled, prompt_lp = self._plan(sched)
        if self.followers is not None:
            self.followers.send_step(plan)
        logits = self.execute(plan)
        reqs = sched.requests
        num_prompt_rows = 0 if plan.logit_rows is None else len(plan.logit_rows) - len(sampled)

        handle = StepHandle()
        for req, row, first_pos, count in prompt_lp:
            lp = torch.log_softmax(logits[row : row + count].float(), dim=-1)
            targets = req.all_token_ids[first_pos + 1 : first_pos + 1 + count]
            num_top = req.sampling.prompt_logprobs
            pieces = logprob_pieces(lp, to_device(targets, torch.int64, self.device), num_top)
            handle.prompt_logprobs[req.request_id] = token_logprobs(
                targets, *(t.tolist() for t in pieces), [num_top] * count
            )
        sample_reqs = [reqs[i] for i in sampled.tolist()]
        self._catch_up_grammars(sample_reqs)
        self._last_rows = {r.request_id: j for j, r in enumerate(sample_reqs)}
        if sample_reqs:
            draw = self.sampler(logits[num_prompt_rows:], sample_reqs)
            self._last_tokens = self.tp.broadcast(draw.token_ids)
            handle.request_ids = list(self._last_rows)
            handle.draw = draw.map(to_host)
            if self.device.type == "cuda":
                handle.ready = torch.cuda.Event()
                handle.ready.record()
        self._last_handle = handle
        return handle

    def _catch_up_grammars(self, reqs: list[Request]) -> None:
        """Give each constrained sequence's grammar the token the previous launch is sampling
        for it, so its mask is right without waiting for that step's outputs: the wait here
        is for the previous step's draws only, while this step's forward pass runs."""
        behind = [
            r
            for r in reqs
            if r.grammar is not None and r.num_placeholders > r.grammar.ahead and not r.grammar.done
        ]
        if not behind:
            return
        last = self._last_handle
        if last.ready is not None:
            last.ready.synchronize()
        tokens = last.draw.token_ids
        for r in behind:
            r.grammar.accept_ahead(int(tokens[self._last_rows[r.request_id]]))

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step's draws and return them."""
        out = RunnerOutput({}, {}, handle.prompt_logprobs)
        if handle.draw is None:
            return out
        if handle.ready is not None:
            handle.ready.synchronize()
        tokens = handle.draw.token_ids.tolist()
        out.sampled = dict(zip(handle.request_ids, tokens, strict=True))
        for row, lp in handle.draw.logprobs(tokens).items():
            out.logprobs[handle.request_ids[row]] = lp
        return out

    def _placeholder_rows(
        self, reqs: list[Request], query_start: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The flat rows whose input is a pending token, and its row in the last draws."""
        pending = [i for i, r in enumerate(reqs) if r.num_placeholders]
        if not pending:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        dst = query_start[np.asarray(pending) + 1] - 1
        src = np.fromiter((self._last_rows[reqs[i].request_id] for i in pending), np.int64)
        return dst.astype(np.int64), src

    def _placeholder_patch(self, plan: StepPlan):
        """A function that writes the pending tokens into the device's input ids, or None."""
        if not len(plan.patch_dst):
            return None
        dst = to_device(plan.patch_dst.tolist(), torch.int64, self.device)
        src = to_device(plan.patch_src.tolist(), torch.int64, self.device)
        tokens = self._last_tokens

        def patch(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, dst, tokens.index_select(0, src))

        return patch
