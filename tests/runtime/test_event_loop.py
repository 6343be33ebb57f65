"""event_loop.run: the loop a server runs on, woken every keep_warm_ms while it serves, and
polling without sleeping for spin_ms after each spin()."""

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
    with pytest.raises(ValueError, match="spin_ms"):
        event_loop.run(main, spin_ms=-1.0)
    main.close()


def _selector_timeouts(
    spin_ms: float, holds_at_ms: tuple[float, ...], release_at_ms: float | None = None
) -> list[tuple[float, float]]:
    """(ms since start, timeout) of each of asyncio's selector calls while main, run with
    spin_ms, calls spin() at each of holds_at_ms (and unspin() as often at release_at_ms),
    then sleeps until 60 ms."""

    async def main() -> list[tuple[float, float]]:
        loop = asyncio.get_running_loop()
        selector = loop._selector
        select = selector.select
        start = loop.time()
        calls = []

        def recorded(timeout=None):
            calls.append((1e3 * (loop.time() - start), timeout))
            return select(timeout)

        async def sleep_until(at_ms: float) -> None:
            await asyncio.sleep(max(0.0, start + at_ms / 1e3 - loop.time()))

        selector.select = recorded
        for at_ms in holds_at_ms:
            await sleep_until(at_ms)
            event_loop.spin()
        if release_at_ms is not None:
            await sleep_until(release_at_ms)
            for _ in holds_at_ms:
                event_loop.unspin()
        await sleep_until(60.0)
        return calls

    work = main() if not spin_ms else event_loop._spinning(main(), spin_ms / 1e3)
    return asyncio.run(work)


def _polls_and_blocks(calls: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """When the selector was polled (timeout 0) and when it blocked, in ms, before 59 ms
    (from 60 ms asyncio.run winds down, polling as it goes)."""
    polls = [at for at, timeout in calls if timeout == 0 and at < 59]
    blocks = [at for at, timeout in calls if (timeout is None or timeout > 0) and at < 59]
    return polls, blocks


def test_after_spin_the_loop_polls_without_sleeping_for_at_most_spin_ms():
    """Holds at 0 and 20 ms, never released, with spin_ms 10: the selector is polled
    (timeout 0) from 0 to 10 and from 20 to 30 ms, and blocks in between and after."""
    polls, blocks = _polls_and_blocks(_selector_timeouts(10.0, (0.0, 20.0)))
    assert len(polls) >= 50  # 20 ms of polling: thousands on any machine
    # outside the holds a poll comes only where a timer's callback made a task ready
    assert len([at for at in polls if not (at < 11 or 20 <= at < 31)]) <= 5
    assert any(10 <= at < 20 for at in blocks)  # the first hold lapsed: the loop slept
    assert any(at >= 30 for at in blocks)
    assert len(blocks) <= 10  # sleeping, the loop wakes only for its timers


def test_the_spin_ends_when_its_holds_are_released():
    """Two holds at 0 and 5 ms with spin_ms 50, both released at 15 ms: polling from 0 to
    15 ms only."""
    polls, blocks = _polls_and_blocks(_selector_timeouts(50.0, (0.0, 5.0), release_at_ms=15.0))
    assert len(polls) >= 50
    assert len([at for at in polls if at >= 16]) <= 3
    assert any(at >= 15 for at in blocks)


def test_spin_does_nothing_on_a_loop_run_without_spin_ms():
    polls, _ = _polls_and_blocks(_selector_timeouts(0.0, (0.0, 20.0), release_at_ms=30.0))
    assert len(polls) <= 6  # one after each of its timers, as any loop
    event_loop.spin()  # no running loop at all: nothing either
    event_loop.unspin()
