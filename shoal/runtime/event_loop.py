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

With `spin_ms` > 0 the loop also polls without sleeping while a `spin()` holds it, for at
most spin_ms after the latest (the request plane's client holds it from opening a stream to
the stream's first response), so the first response finds the loop awake instead of
waking it. Only for a process whose loop is the
one thread at work: a polling loop takes the GIL back as soon as it lets it go, so another
thread of the process waits the switch interval to run (a worker's engine thread would, on
each step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from time import monotonic, process_time
from typing import Any, TypeVar

T = TypeVar("T")

KEEP_WARM_MS = 1.0  # the default wake-up interval of a server's event loop
SPIN_MS = 0.0  # the default time a frontend's loop polls without sleeping after a request
BUSY_CPU_SHARE = 0.5  # a process whose threads use this much of a core keeps warm by itself
BUSY_RECHECK_S = 0.02  # how often a busy process looks whether it has gone idle
_LOAD_WINDOW_S = 0.01  # the span over which the process's CPU use is judged
# A server's threads hand the GIL over at most this far apart while one waits for it (the
# interpreter's default is 5 ms): the worker's engine thread and its loop at each step's
# hand-off, the frontend's loop and the threads that tokenize long prompts, a router's loop
# and the thread applying its KV events (shoal.router.event_thread).
GIL_SWITCH_INTERVAL_S = 0.0005


def run(main: Coroutine[Any, Any, T], keep_warm_ms: float = 0.0, spin_ms: float = 0.0) -> T:
    """asyncio.run(main), on uvloop when available (its callbacks, timers and socket writes
    cost a fraction of the pure-Python loop's: the token-streaming path is made of them);
    with keep_warm_ms > 0 the loop wakes at least that often while main runs; with
    spin_ms > 0 it polls without sleeping while `spin()` holds it (at most spin_ms)."""
    if keep_warm_ms < 0:
        raise ValueError(f"keep_warm_ms must not be negative (got {keep_warm_ms})")
    if spin_ms < 0:
        raise ValueError(f"spin_ms must not be negative (got {spin_ms})")
    if keep_warm_ms:
        main = _kept_warm(main, keep_warm_ms / 1e3)
    if spin_ms:
        main = _spinning(main, spin_ms / 1e3)
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


class _Spinner:
    """Keeps its loop polling without sleeping while anything holds it, for at most hold_s
    after the latest hold began."""

    def __init__(self, loop: asyncio.AbstractEventLoop, hold_s: float) -> None:
        self._loop = loop
        self._hold_s = hold_s
        self._holds = 0
        self._until = 0.0
        self._task: asyncio.Task[None] | None = None

    def hold(self) -> None:
        self._holds += 1
        self._until = self._loop.time() + self._hold_s
        if self._task is None:
            self._task = self._loop.create_task(self._spin())

    def release(self) -> None:
        self._holds = max(0, self._holds - 1)

    async def _spin(self) -> None:
        try:
            while self._holds and self._loop.time() < self._until:
                await asyncio.sleep(0)  # a ready task: the loop's next poll does not block
        finally:
            self._task = None
            self._holds = 0  # holds older than hold_s lapse with the spin

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


_spinner: _Spinner | None = None  # the running loop's, while `run` runs it with spin_ms


def spin() -> None:
    """Hold the running loop polling without sleeping until `unspin()` (at most its spin_ms
    from now); nothing on a loop run without spin_ms."""
    if _spinner is not None:
        _spinner.hold()


def unspin() -> None:
    """Release one `spin()` hold."""
    if _spinner is not None:
        _spinner.release()


async def _spinning(main: Coroutine[Any, Any, T], hold_s: float) -> T:
    """main, with a spinner on the running loop for `spin()` to hold while it runs."""
    global _spinner
    spinner = _spinner = _Spinner(asyncio.get_running_loop(), hold_s)
    try:
        return await main
    finally:
        _spinner = None
        spinner.stop()


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
