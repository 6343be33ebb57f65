"""Requests waiting for a worker that is not busy: first come, first served, woken by load.

When every worker is over the busy threshold (shoal.router.selector.busy), a request waits
in a FIFO queue instead of polling. Whoever sees a worker's load fall (a request finished,
a load report arrived, a worker joined) calls BusyQueue.wake, and the request at the head
tries to route again; when it routes, the next one tries at once, so a worker that frees
room for several requests takes them in arrival order. A request that arrives while others
wait goes behind them rather than taking the room they wait for. A waiting request costs
nothing between wake-ups.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class AllWorkersBusy(Exception):
    """Every candidate worker is over the busy threshold."""


class _Waiter:
    __slots__ = ("future",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[None] = loop.create_future()


class BusyQueue:
    """The requests waiting for a non-busy worker, in arrival order (one event loop's)."""

    def __init__(self) -> None:
        self._waiters: deque[_Waiter] = deque()

    def __len__(self) -> int:
        """Requests waiting now."""
        return len(self._waiters)

    def wake(self) -> None:
        """A worker's load may have fallen: let the request at the head try again."""
        if self._waiters:
            future = self._waiters[0].future
            if not future.done():
                future.set_result(None)

    async def route(self, attempt: Callable[[], T], timeout: float) -> T:
        """What `attempt()` returns once it no longer raises AllWorkersBusy, trying when no
        request that came earlier still waits; AllWorkersBusy after `timeout` seconds.

        Any other exception of `attempt` ends the wait and propagates.
        """
        busy = AllWorkersBusy("all workers are busy")
        if not self._waiters:
            try:
                return attempt()
            except AllWorkersBusy as e:
                busy = e
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        me = _Waiter(loop)
        self._waiters.append(me)
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        await me.future
                except TimeoutError:
                    raise busy from None
                try:
                    return attempt()
                except AllWorkersBusy as e:
                    busy = e
                    me.future = loop.create_future()
        finally:
            head = self._waiters[0] is me
            self._waiters.remove(me)
            if head:
                self.wake()
