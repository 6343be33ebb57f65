"""Batched sampling: penalties, grammars, temperature, top-k / top-p / min-p, seeds, logprobs.

Logprobs are those of the model's raw distribution (before penalties and temperature),
as vLLM reports by default. Sampling draws token = argmax(p / q) with q ~ Exp(1), which is
an exact draw from p; a seeded request draws its q from its own generator, so its tokens
do not depend on what else is in the batch. A row with a grammar (structured outputs) has
every token its grammar forbids masked to -inf before anything is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.engine.request import Request
from shoal.engine.transfer import to_device
from shoal.protocol import TokenLogprob


@dataclass
class SampledTokens:
    """One step's draws, still on the device.

    token_ids[i] belongs to the sampler's requests[i]. For the rows whose request wants
    logprobs (logprob_rows, with logprob_tops top entries each) it also holds the chosen
    token's raw logprob and rank and the top max(logprob_tops) logprobs and their ids.
    """

    token_ids: torch.Tensor  # [B] int64
    logprob_rows: list[int]
    logprob_tops: list[int]
    chosen: torch.Tensor | None = None  # [R] float32
    ranks: torch.Tensor | None = None  # [R] int64
    top_values: torch.Tensor | None = None  # [R, K] float32
    top_ids: torch.Tensor | None = None  # [R, K] int64

    def logprobs(self, token_ids: list[int]) -> dict[int, TokenLogprob]:
        """Row -> TokenLogprob, from host copies of the fields (see ModelRunner.collect)."""
        if not self.logprob_rows:
            return {}
        chosen = [token_ids[row] for row in self.logprob_rows]
        pieces = (t.tolist() for t in (self.chosen, self.ranks, self.top_values, self.top_ids))
        entries = token_logprobs(chosen, *pieces, self.logprob_tops)
        return dict(zip(self.logprob_rows, entries, strict=True))

    def map(self, fn) -> SampledTokens:
        """The same draws with every tensor passed through fn (e.g. a copy to the host)."""
        tensors = ("token_ids", "chosen", "ranks", "top_values", "top_ids")
        values = {name: getattr(self, name) for name in tensors}
        return SampledTokens(
            logprob_rows=self.logprob_rows,
            logprob_tops=self.logprob_tops,
            **{name: None if t is None else fn(t) for name, t in values.items()},
        )


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self._grammar_mask = None  # a GrammarMask, built at the first constrained row

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampledTokens:
        """Sample one token per row of logits [B, vocab]; row i belongs to requests[i].

        Nothing here waits for the device unless a request needs its token history
        (penalties) or brings its own seed.
        """
        if all(r.argmax_only for r in requests):
            # float32 holds every bf16/fp16 value exactly, so no float copy is needed first
            return SampledTokens(logits.argmax(dim=-1), [], [])
        logits = logits.float()
        rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[rows], dim=-1) if rows else None
        logits = self._apply_penalties(logits, requests)
        logits = self._mask_early_stops(logits, requests)
        self._mask_grammars(logits, requests)
        tokens = self._sample(logits, requests)
        draw = SampledTokens(tokens, rows, [requests[i].sampling.logprobs for i in rows])
        if raw_logprobs is not None:
            index = to_device(rows, torch.int64, logits.device)
            draw.chosen, draw.ranks, draw.top_values, draw.top_ids = logprob_pieces(
                raw_logprobs, tokens[index], max(draw.logprob_tops)
            )
        return draw

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.needs_token_history]
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
                stops = to_device(list(r.stop_token_ids), torch.int64, logits.device)
                logits[i].index_fill_(0, stops, float("-inf"))
        return logits

    def _mask_grammars(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Forbid, in each constrained row, the tokens its grammar does not allow next."""
        # a grammar already complete belongs to a sequence that stops on its pending token:
        # the token sampled here is discarded
        rows = [i for i, r in enumerate(requests) if r.grammar is not None and not r.grammar.done]
        if not rows:
            return
        if self._grammar_mask is None:
            from shoal.engine.structured import GrammarMask

            self._grammar_mask = GrammarMask()
        self._grammar_mask.apply(logits, rows, [requests[i].grammar for i in rows])

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if not random_rows:
            return greedy
        idx = to_device(random_rows, torch.int64, logits.device)
        params = [requests[i].sampling for i in random_rows]
        probs = filtered_probs(
            logits[idx],
            temperature=to_device([p.temperature for p in params], logits.dtype, logits.device),
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
        )
        q = torch.empty_like(probs)
        seeded = [
            (row, requests[i])
            for row, i in enumerate(random_rows)
            if requests[i].generator is not None
        ]
        if len(seeded) < len(random_rows):
            q.exponential_(generator=self.generator)  # one launch for every unseeded row
        for row, request in seeded:
            gen = request.generator
            if request.draws_to_skip:
                skip_draws(gen, request.draws_to_skip, probs.shape[1])
                request.draws_to_skip = 0
            draw = torch.empty(probs.shape[1], pin_memory=q.is_cuda).exponential_(generator=gen)
            q[row] = draw.to(q.device, non_blocking=True)
        greedy[idx] = (probs / q).argmax(dim=-1)
        return greedy


def skip_draws(generator: torch.Generator, steps: int, vocab: int) -> None:
    """Move a seeded request's generator past `steps` tokens' draws (one Exp(1) per vocab
    entry each, as _sample draws them), so a migrated request continues its random stream."""
    buffer = torch.empty(vocab)
    for _ in range(steps):
        buffer.exponential_(generator=generator)


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
        k = to_device([k if 0 < k < vocab else vocab for k in top_k], torch.int64, logits.device)
        drop = ranks[None, :] >= k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = to_device(top_p, logits.dtype, logits.device)
        drop |= mass_before >= p[:, None]
        logits = torch.full_like(logits, float("-inf")).scatter(
            1, order, sorted_logits.masked_fill(drop, float("-inf"))
        )
    probs = logits.softmax(dim=-1)
    if any(m > 0 for m in min_p):
        m = to_device(min_p, probs.dtype, logits.device)
        threshold = m[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def logprob_pieces(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logprobs [R, V]: token_ids[r]'s logprob and rank, and the num_top highest
    logprobs with their ids; all on the device."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen.squeeze(1), ranks, top_values, top_ids


def token_logprobs(
    token_ids: list[int],
    chosen: list[float],
    ranks: list[int],
    top_values: list[list[float]],
    top_ids: list[list[int]],
    num_tops: list[int],
) -> list[TokenLogprob]:
    """TokenLogprobs from host copies of logprob_pieces: each row's chosen token, then its
    own num_tops[r] most likely tokens."""
    return [
        TokenLogprob([t, *ids[:k]], [c, *values[:k]], [r, *range(1, k + 1)])
        for t, c, r, values, ids, k in zip(
            token_ids, chosen, ranks, top_values, top_ids, num_tops, strict=True
        )
    ]
