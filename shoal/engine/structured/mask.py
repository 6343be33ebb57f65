"""The per-step token bitmask: filled for the constrained rows only, applied to their logits."""

from __future__ import annotations

import torch
import xgrammar as xgr

from shoal.engine.structured.grammar import RequestGrammar

BITS = 32  # tokens per bitmask word
# Rows from which the fill spreads over xgrammar's threads. On the H100 host (16 CPUs,
# Qwen's 152k vocabulary) waking the threads cost ~3 ms a step: one thread filled 64 rows
# in 0.33 ms where 4 or 8 took 2.2-2.7; at 256 rows the threaded fill gave the faster steps.
THREADED_FROM = 128
_shifts: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits [R, V] to -inf where bitmask [R, ceil(V / 32)] (int32, bit j of word w is
    token 32w + j) has a 0; pure torch, on any device."""
    shifts = _shifts.get(bitmask.device)
    if shifts is None:
        shifts = _shifts[bitmask.device] = torch.arange(
            BITS, dtype=torch.int32, device=bitmask.device
        )
    rows, vocab = logits.shape
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(rows, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


class GrammarMask:
    """Fills one step's bitmask for its constrained rows (in xgrammar's threads) and masks
    those rows of the logits; unconstrained rows are not touched."""

    def __init__(self, max_threads: int | str = "auto", threaded_from: int = THREADED_FROM) -> None:
        self._serial = xgr.BatchGrammarMatcher(1)
        self._threaded = xgr.BatchGrammarMatcher(max_threads)  # auto: half the hardware threads
        self._threaded_from = threaded_from
        self._host: torch.Tensor | None = None

    def _bitmask(self, rows: int, vocab: int, pin: bool) -> torch.Tensor:
        width = -(-vocab // BITS)
        host = self._host
        if host is None or host.shape[0] < rows or host.shape[1] != width:
            host = torch.empty((max(rows, 8), width), dtype=torch.int32, pin_memory=pin)
            self._host = host
        return host[:rows]

    def apply(self, logits: torch.Tensor, rows: list[int], grammars: list[RequestGrammar]) -> None:
        """Mask logits[rows[k]] with grammars[k]'s allowed next tokens, in place."""
        vocab = logits.shape[1]
        bitmask = self._bitmask(len(rows), vocab, logits.is_cuda)
        fill = self._threaded if len(rows) >= self._threaded_from else self._serial
        fill.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
        if not logits.is_cuda:
            index = torch.tensor(rows, dtype=torch.int64)
            sub = logits.index_select(0, index)
            apply_token_bitmask(sub, bitmask)
            logits.index_copy_(0, index, sub)
            return
        device_mask = bitmask.to(logits.device, non_blocking=True)
        if len(rows) == logits.shape[0]:
            xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=vocab)
            return
        index = torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(
            logits.device, non_blocking=True
        )
        sub = logits.index_select(0, index)
        xgr.apply_token_bitmask_inplace(sub, device_mask, vocab_size=vocab)
        logits.index_copy_(0, index, sub)
