"""Incremental detokenization with stop strings, for streaming text out token by token.

Text is released only once it is final: never half a UTF-8 character (DecodeStream waits
for the bytes to complete) and never the first characters of what may become a stop string.
Only the text not yet released is kept (at most the stop-string holdback between calls), so
each call costs the length of its new text, however long the output grows.
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
        self.pending = ""  # decoded text not yet returned: what may begin a stop string
        self.stop_reason: str | None = None

    def add_tokens(self, token_ids: list[int], final: bool = False) -> str:
        """Decode new tokens; return the newly final text. Sets stop_reason on a stop string."""
        if self.stop_reason is not None:
            return ""
        step, tokenizer = self.stream.step, self.tokenizer
        if len(token_ids) == 1:  # a step's one token, the usual case
            new = step(tokenizer, token_ids[0]) or ""
        else:
            new = "".join(filter(None, [step(tokenizer, token_id) for token_id in token_ids]))
        if not new and not final:
            return ""
        if not self.stop:  # no holdback: all of it is final
            return new
        text = self.pending + new
        cut = self._find_stop(text)
        if cut is not None:
            text, final = text[:cut], True
        keep = 0 if final else min(self.holdback, len(text))
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _find_stop(self, text: str) -> int | None:
        """Where `text` ends once cut at its first stop string (None: none in it); sets
        stop_reason. Text released earlier holds no stop string's start (the holdback)."""
        best = None
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.stop_reason = stop
        return at + len(stop) if self.include_stop else at
