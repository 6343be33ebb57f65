"""The event loop every shoal server runs on: uvloop where it is installed, else asyncio's,
woken at least every `keep_warm_ms` so that the CPU it runs on stays out of deep idle.

A thread that sleeps a few milliseconds lets its CPU fall into deep idle; on a virtual
machine, where idle means the vCPU halts and the host runs other work, the thread then runs
its first hundred microseconds 5-10 times slower once woken (the dev VM: a 6 us request
parse took 11-13 us after sleeps of up to 1 ms, 62-120 us after sleeps of 2-20 ms). At low
load every hand-off of a request meets a sleeping process: the frontend between tokens, the
worker's loop during a step. A timer that wakes the loop every millisecond keeps its CPU
from going that deep, for about 2% of a core (docs/serving.md, "Keeping the CPU warm").
At high load the process's own work keeps its CPUs warm, and the timer backs off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from time import monotonic, process_time
from typing import Any, TypeVar

T = TypeVar("T")

KEEP_WARM_MS = 1.0  # the default wake-up interval of a server's event loop
BUSY_CPU_SHARE = 0.5  # a process whose threads use this much of a core keeps warm by itself
BUSY_RECHECK_S = 0.02  # how often a busy process looks whether it has gone idle
_LOAD_WINDOW_S = 0.01  # the span over which the process's CPU use is judged
# A server's threads hand the GIL over at most this far apart while one waits for it (the
# interpreter's default is 5 ms): the worker's engine thread and its loop at each step's
# hand-off, the frontend's loop and the threads that tokenize long prompts, a router's loop
# and the thread applying its KV events (shoal.router.event_thread).
GIL_SWITCH_INTERVAL_S = 0.0005


def run(main: Coroutine[Any, Any, T], keep_warm_ms: float = 0.0) -> T:
    """asyncio.run(main), on uvloop when available (its callbacks, timers and socket writes
    cost a fraction of the pure-Python loop's: the token-streaming path is made of them);
    with keep_warm_ms > 0 the loop wakes at least that often while main runs."""
    if keep_warm_ms < 0:
        raise ValueError(f"keep_warm_ms must not be negative (got {keep_warm_ms})")
    if keep_warm_ms:
        main = _kept_warm(main, keep_warm_ms / 1e3)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def _kept_warm(main: Coroutine[Any, Any, T], interval_s: float) -> T:
    """main, with a timer task waking the loop every interval_s until it ends."""
    ticker = asyncio.ensure_future(_tick(interval_s))
    try:
        return await main
    finally:
        ticker.cancel()


class CpuLoad:
    """Whether this process's threads use BUSY_CPU_SHARE of a core or more, judged over
    windows of at least _LOAD_WINDOW_S: a look within a window repeats the last answer."""

    def __init__(self) -> None:
        self._since, self._used = monotonic(), process_time()
        self._busy = False

    def busy(self) -> bool:
        now = monotonic()
        if now - self._since >= _LOAD_WINDOW_S:
            used = process_time()
            self._busy = used - self._used >= BUSY_CPU_SHARE * (now - self._since)
            self._since, self._used = now, used
        return self._busy


async def _tick(interval_s: float) -> None:
    """Wake the loop every interval_s while the process is mostly idle, and only every
    BUSY_RECHECK_S while its threads use at least BUSY_CPU_SHARE of a core: its CPUs are
    warm then without the timer, and each wake-up would make a busy engine thread hand the
    GIL over (an H200 host at full load: 2% of the output rate)."""
    busy_sleep_s = max(interval_s, BUSY_RECHECK_S)
    load = CpuLoad()
    while True:
        await asyncio.sleep(busy_sleep_s if load.busy() else interval_s)
