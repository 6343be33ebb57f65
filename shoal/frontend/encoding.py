"""Where a prompt is tokenized: on the event loop, or in a thread while tokenizing there
would hold the loop too long or too often.

The tokenizer lets go of the GIL (TextTokenizer.encode), so prompts tokenized in threads
run on other cores, several at once, while the loop streams. A thread costs each request a
hop, though: 0.2-0.3 ms of TTFT at low load (the executor's thread wakes from idle; dev VM)
and, at full load, a turn of the busy loop before the ids are taken back. So a text goes to
a thread when it is long (LARGE_TEXT characters: milliseconds of tokenizing), or when it is
not short and tokenizing has lately taken more than BUSY_SHARE of a core: the loop would
then spend that share of its time tokenizing, and one frontend would stop where that fills
its core (2,300-token prompts on an H200 host: about 230 requests a second inline, twice
that with them tokenized in threads; docs/routing.md, "Live shared-prefix").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from shoal.frontend.tokenizer_pool import ModelTokenizer

LARGE_TEXT = 16_384  # characters: always tokenized (or a chat template rendered) in a thread
SHORT_TEXT = 512  # characters: always tokenized on the loop
BUSY_SHARE = 0.25  # of a core: above it, texts longer than SHORT_TEXT go to threads
WINDOW_S = 0.1  # the span over which the share is measured
MIN_SPAN_S = 0.01  # the shortest span the window still open is judged over


class TokenizeShare:
    """The share of a core that tokenizing took (inline or in threads: every encode's own
    duration counts): over the latest window of at least `window_s`, or over the window
    still open once that is higher, so a burst after an idle spell shows within
    milliseconds instead of when its first window closes (`min_span_s` keeps the first
    encodes of a window from reading as a full core)."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        min_span_s: float = MIN_SPAN_S,
    ) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.clock = clock
        self.share = 0.0
        self._start = clock()
        self._spent = 0.0

    def add(self, seconds: float) -> None:
        """Count an encode that took `seconds`."""
        self._roll(self.clock())
        self._spent += seconds

    def current(self) -> float:
        """The share, with a window that has run out closed first (idle time lowers it)."""
        now = self.clock()
        self._roll(now)
        return max(self.share, self._spent / max(now - self._start, self.min_span_s))

    def _roll(self, now: float) -> None:
        """Close the open window if it has lasted `window_s`, and open the next."""
        elapsed = now - self._start
        if elapsed >= self.window_s:
            self.share = self._spent / elapsed
            self._start, self._spent = now, 0.0


_share = TokenizeShare()


def _timed_encode(tok: ModelTokenizer, text: str, special: bool) -> tuple[list[int], float]:
    start = time.perf_counter()
    ids = tok.text.encode(text, special)
    return ids, time.perf_counter() - start


async def encode_prompt(tok: ModelTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The text's token ids, tokenized inline or in a thread (see the module docstring)."""
    size = len(text)
    if size > LARGE_TEXT or (size > SHORT_TEXT and _share.current() > BUSY_SHARE):
        ids, seconds = await asyncio.to_thread(_timed_encode, tok, text, add_special_tokens)
    else:
        ids, seconds = _timed_encode(tok, text, add_special_tokens)
    _share.add(seconds)
    return ids
