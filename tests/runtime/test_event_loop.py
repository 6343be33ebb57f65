"""event_loop.run: the loop a server runs on, woken every keep_warm_ms while it serves."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import pytest

from shoal.runtime import event_loop


def _wake_ups(keep_warm_ms: float, idle_s: float = 0.1) -> int:
    """How often asyncio's loop returned from its selector while main slept idle_s."""

    async def main() -> int:
        selector = asyncio.get_running_loop()._selector
        select = selector.select
        calls = [0]

        def counted(timeout=None):
            calls[0] += 1
            return select(timeout)

        selector.select = counted
        await asyncio.sleep(idle_s)
        return calls[0]

    work = main() if not keep_warm_ms else event_loop._kept_warm(main(), keep_warm_ms / 1e3)
    return asyncio.run(work)


def test_the_loop_wakes_every_keep_warm_ms_while_idle():
    assert _wake_ups(0.0) <= 3  # one sleep: the loop blocks until its timer
    assert _wake_ups(1.0) >= 40  # 100 ms at one wake-up a millisecond (timers run late)


def test_the_timer_backs_off_while_the_process_is_busy(monkeypatch):
    """While the process's threads use a core (its CPU time advancing as fast as the wall
    clock), the timer wakes only every BUSY_RECHECK_S; once idle, every millisecond again."""
    monkeypatch.setattr(event_loop, "process_time", time.monotonic)
    busy = _wake_ups(1.0, idle_s=0.2)
    monkeypatch.setattr(event_loop, "process_time", lambda: 0.0)
    idle = _wake_ups(1.0, idle_s=0.2)
    # 10 ms of 1 ms ticks before the first judgement, then one tick every 20 ms (a tick is
    # about two selector returns), against one tick a millisecond while idle
    assert busy <= 60
    assert idle >= 3 * busy


def test_a_thread_using_a_core_counts_as_busy():
    """The process's CPU time counts every thread: one hashing (which releases the GIL, so
    the loop could wake as often as it liked) keeps the timer backed off."""
    stop = threading.Event()
    block = bytes(1 << 20)

    def burn() -> None:
        while not stop.is_set():
            hashlib.sha256(block).digest()

    burner = threading.Thread(target=burn)
    burner.start()
    try:
        busy = _wake_ups(1.0, idle_s=0.2)
    finally:
        stop.set()
        burner.join()
    assert busy <= 100  # one tick a millisecond would be about 360


def test_run_returns_main_and_stops_the_timer_with_it():
    async def main() -> str:
        await asyncio.sleep(0.01)
        return "done"

    started = time.monotonic()
    assert event_loop.run(main(), keep_warm_ms=1.0) == "done"
    assert time.monotonic() - started < 5  # the timer task did not keep the loop running
    assert event_loop.run(main()) == "done"


def test_a_negative_interval_is_refused():
    main = asyncio.sleep(0)
    with pytest.raises(ValueError, match="keep_warm_ms"):
        event_loop.run(main, keep_warm_ms=-1.0)
    main.close()
