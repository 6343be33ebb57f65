"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeds and logprobs.

Logprobs are those of the model's raw distribution (before penalties and temperature),
as vLLM reports by default. Sampling draws token = argmax(p / q) with q ~ Exp(1), which is
an exact draw from p; a seeded request draws its q from its own generator, so its tokens
do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.engine.request import Request
from shoal.protocol import TokenLogprob


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token per row of logits [B, vocab]; row i belongs to requests[i]."""
        if all(r.argmax_only for r in requests):
            # float32 holds every bf16/fp16 value exactly, so no float copy is needed first
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, requests)
        logits = self._mask_early_stops(logits, requests)
        tokens = self._sample(logits, requests)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, r in enumerate(requests):
                if r.sampling.logprobs is not None:
                    logprobs[i] = top_logprobs(raw_logprobs[i], token_list[i], r.sampling.logprobs)
        return SamplerOutput(token_list, logprobs)

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [
            i
            for i, r in enumerate(requests)
            if r.sampling.repetition_penalty != 1.0
            or r.sampling.presence_penalty
            or r.sampling.frequency_penalty
        ]
        for i in rows:
            s = requests[i].sampling
            row = logits[i]
            if s.repetition_penalty != 1.0:
                seen = torch.tensor(requests[i].all_token_ids, device=logits.device).unique()
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty
                )
            if s.presence_penalty or s.frequency_penalty:
                out = torch.tensor(
                    requests[i].output_token_ids, dtype=torch.long, device=logits.device
                )
                counts = torch.bincount(out, minlength=row.numel()).to(row.dtype)
                row -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0)
        return logits

    def _mask_early_stops(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Forbid stop tokens until a request has min_tokens outputs."""
        for i, r in enumerate(requests):
            if r.num_output_tokens < r.sampling.min_tokens and r.stop_token_ids:
                logits[i, list(r.stop_token_ids)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if not random_rows:
            return greedy
        idx = torch.tensor(random_rows, device=logits.device)
        params = [requests[i].sampling for i in random_rows]
        probs = filtered_probs(
            logits[idx],
            temperature=torch.tensor([p.temperature for p in params], device=logits.device),
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
        )
        q = torch.empty_like(probs)
        for row, i in enumerate(random_rows):
            gen = requests[i].generator
            if gen is not None:
                q[row] = torch.empty(probs.shape[1]).exponential_(generator=gen).to(q.device)
            else:
                q[row].exponential_(generator=self.generator)
        greedy[idx] = (probs / q).argmax(dim=-1)
        return greedy


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
) -> torch.Tensor:
    """Softmax of logits / temperature restricted to each row's top-k, top-p and min-p set."""
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        drop = ranks[None, :] >= k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype)
        drop |= mass_before >= p[:, None]
        logits = torch.full_like(logits, float("-inf")).scatter(
            1, order, sorted_logits.masked_fill(drop, float("-inf"))
        )
    probs = logits.softmax(dim=-1)
    if any(m > 0 for m in min_p):
        m = torch.tensor(min_p, device=logits.device, dtype=probs.dtype)
        threshold = m[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def top_logprobs(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """The chosen token's logprob and rank, followed by the num_top most likely tokens."""
    chosen = logprobs[token_id]
    rank = int((logprobs > chosen).sum()) + 1
    ids, lps, ranks = [token_id], [float(chosen)], [rank]
    if num_top:
        values, indices = logprobs.topk(num_top)
        ids += indices.tolist()
        lps += values.tolist()
        ranks += list(range(1, num_top + 1))
    return TokenLogprob(ids, lps, ranks)
