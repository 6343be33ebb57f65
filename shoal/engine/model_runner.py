"""Model runner: turns a scheduled batch into flat tensors, runs the model, samples.

Sequences are concatenated (no padding); every token gets its position and its cache
slot; each sequence its block table. Only sequences whose scheduled chunk reaches their
last known token are sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        kv: KVCacheManager,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.sampler = Sampler(generator)
        shape = (2, kv.num_blocks, kv.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(cfg.num_layers)
        ]
        for layer, cache in zip(model.attention_layers(), self.kv_caches, strict=True):
            layer.kv_cache = cache

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, slots, tables = [], [], [], []
        query_lens, seq_lens = [], []
        sample_rows: list[int] = []  # flat index of the last token of each sampled sequence
        sample_reqs: list[Request] = []
        prompt_rows: list[int] = []  # flat indices whose logits score the next prompt token
        prompt_lp: list[tuple[Request, int, int, int]] = []  # req, first row, first pos, count
        offset = 0
        for req, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            end = start + n
            block_ids = self.kv.block_ids(req)
            input_ids += req.all_token_ids[start:end]
            positions += range(start, end)
            slots += [
                block_ids[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
            tables.append(block_ids)
            query_lens.append(n)
            seq_lens.append(end)
            if req.wants_prompt_logprobs and start < req.num_prompt_tokens - 1:
                count = min(end, req.num_prompt_tokens - 1) - start
                prompt_lp.append((req, len(prompt_rows), start, count))
                prompt_rows += range(offset, offset + count)
            if end == req.num_tokens:
                sample_reqs.append(req)
                sample_rows.append(offset + n - 1)
            offset += n

        width = max(len(t) for t in tables)
        block_tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=self.device
        )
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=block_tables,
            query_lens=query_lens,
            seq_lens=seq_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, meta)
        rows = torch.tensor(prompt_rows + sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[rows]).float()

        out = RunnerOutput({}, {}, {})
        for req, row, first_pos, count in prompt_lp:
            lp = torch.log_softmax(logits[row : row + count], dim=-1)
            targets = req.all_token_ids[first_pos + 1 : first_pos + 1 + count]
            out.prompt_logprobs[req.request_id] = [
                top_logprobs(lp[j], t, req.sampling.prompt_logprobs) for j, t in enumerate(targets)
            ]
        if sample_reqs:
            result = self.sampler(logits[len(prompt_rows) :], sample_reqs)
            for req, tok, lp in zip(sample_reqs, result.token_ids, result.logprobs, strict=True):
                out.sampled[req.request_id] = tok
                if lp is not None:
                    out.logprobs[req.request_id] = lp
        return out
