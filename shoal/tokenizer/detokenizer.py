"""Incremental detokenization with stop strings, for streaming text out token by token.

Text is released only once it is final: never half a UTF-8 character (DecodeStream waits
for the bytes to complete) and never the first characters of what may become a stop string.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all decoded text (cut at a stop string once one is found)
        self.emitted = 0  # characters of text already returned
        self.stop_reason: str | None = None

    def add_tokens(self, token_ids: list[int], final: bool = False) -> str:
        """Decode new tokens; return the newly final text. Sets stop_reason on a stop string."""
        if self.stop_reason is not None:
            return ""
        searched_from = len(self.text)
        for token_id in token_ids:
            piece = self.stream.step(self.tokenizer, token_id)
            if piece:
                self.text += piece
        if self.stop and self._find_stop(searched_from):
            final = True
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        new = self.text[self.emitted : end]
        self.emitted = end
        return new

    def _find_stop(self, searched_from: int) -> bool:
        begin = max(0, searched_from - self.holdback)
        best = None
        for stop in self.stop:
            at = self.text.find(stop, begin)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.stop_reason = stop
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        self.emitted = min(self.emitted, len(self.text))
        return True
