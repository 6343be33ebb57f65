"""The per-step token bitmask: filled for the constrained rows only (on a worker thread, so
the engine thread goes on with other work meanwhile), then applied to their logits."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from shoal.engine.structured.grammar import RequestGrammar

BITS = 32  # tokens per bitmask word
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

    def __init__(self, max_threads: int | str = "auto") -> None:
        self._fill = xgr.BatchGrammarMatcher(max_threads)  # auto: half the hardware threads
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last host-to-device copy of _host
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def start(self, grammars: list[RequestGrammar], vocab: int, pin: bool) -> Future:
        """Begin filling the host bitmask of `grammars` (one row each) on the worker thread;
        the future's result is that bitmask. The matchers must not advance until it is done."""
        if self._copied is not None:
            self._copied.synchronize()  # the buffer is still being read by the last copy
        bitmask = self._bitmask(len(grammars), vocab, pin)
        matchers = [g.matcher for g in grammars]
        return self._worker.submit(self._fill_rows, matchers, bitmask)

    @torch.inference_mode()  # the buffer is made in the engine's inference mode
    def _fill_rows(self, matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor):
        self._fill.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def _bitmask(self, rows: int, vocab: int, pin: bool) -> torch.Tensor:
        width = -(-vocab // BITS)
        host = self._host
        if host is None or host.shape[0] < rows or host.shape[1] != width:
            host = torch.empty((max(rows, 8), width), dtype=torch.int32, pin_memory=pin)
            self._host = host
        return host[:rows]

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """Mask logits[rows[k]] with row k of a filled bitmask, in place."""
        vocab = logits.shape[1]
        if not logits.is_cuda:
            index = torch.tensor(rows, dtype=torch.int64)
            sub = logits.index_select(0, index)
            apply_token_bitmask(sub, bitmask)
            logits.index_copy_(0, index, sub)
            return
        device_mask = bitmask.to(logits.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        if len(rows) == logits.shape[0]:
            xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=vocab)
            return
        index = torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(
            logits.device, non_blocking=True
        )
        sub = logits.index_select(0, index)
        xgr.apply_token_bitmask_inplace(sub, device_mask, vocab_size=vocab)
        logits.index_copy_(0, index, sub)
