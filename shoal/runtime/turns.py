"""A gate that lets a burst of work into the event loop a few items per turn.

The loop runs, in each turn, every callback that was ready when the turn began, and reads
its sockets only between turns. When many requests arrive together (a burst of clients, or
a benchmark opening 256 streams at once), every request's handler is ready in the same turn
and each runs its whole synchronous part (parse, tokenize, route, send) before the loop
reads a socket again: the first tokens of the burst's earliest requests, back from the
engine long before, wait until the last request has been sent. Passing the handlers through
a TurnGate lets `per_turn` of them go on in each turn and the rest in the turns after, in
the order they came, so the loop takes in responses (and new requests) between every
`per_turn` requests. A request that finds the gate open and nobody waiting goes on at once.
"""

from __future__ import annotations

import asyncio
from collections import deque


class TurnGate:
    """At most `per_turn` callers of `enter` go on in one turn of the loop; the others
    wait for later turns, first come first served. One loop only.

    The count of callers let on is reset in the turn after the one in which it reached
    `per_turn` (a callback then, not one per caller): an open gate costs a caller nothing
    but a comparison."""

    def __init__(self, per_turn: int) -> None:
        if per_turn < 1:
            raise ValueError(f"per_turn must be at least 1 (got {per_turn})")
        self.per_turn = per_turn
        self._passed = 0  # callers let on since the count was last reset
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._reset_scheduled = False

    async def enter(self) -> None:
        """Return at once if the gate is open and nobody waits, else in a later turn."""
        if self._passed < self.per_turn and not self._waiting:
            self._passed += 1
            if self._passed == self.per_turn:
                self._schedule_reset()  # closed for the rest of this turn
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self._schedule_reset()
        await future

    def _schedule_reset(self) -> None:
        if not self._reset_scheduled:
            self._reset_scheduled = True
            asyncio.get_running_loop().call_soon(self._reset)

    def _reset(self) -> None:
        """A later turn: up to per_turn waiters go on (a cancelled one is skipped)."""
        self._reset_scheduled = False
        self._passed = 0
        waiting = self._waiting
        while waiting and self._passed < self.per_turn:
            future = waiting.popleft()
            if not future.done():
                future.set_result(None)
                self._passed += 1
        if waiting or self._passed == self.per_turn:
            self._schedule_reset()
