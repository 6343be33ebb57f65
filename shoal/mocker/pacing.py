"""Sleeping a mocked step to its deadline: Linux ends a sleep up to the thread's timer slack
(50 us by default) after it is due, and a VM's wake-up adds more, so a 10 ms step lasted
10.06-10.15 ms. A pacing thread asks for 1 ns of slack, which halves the overshoot on the
dev machine (0.113 -> 0.063 ms p50); what is left is the host's wake-up."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time

log = logging.getLogger(__name__)

_PR_SET_TIMERSLACK = 29  # linux/prctl.h
_tight = threading.local()


def tighten_timer_slack() -> None:
    """Ask the kernel to end this thread's sleeps as close to their deadline as it can (a
    no-op off Linux, or where prctl is unavailable)."""
    if getattr(_tight, "done", False):
        return
    _tight.done = True
    if not sys.platform.startswith("linux"):
        return
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0) != 0:
            log.debug("prctl(PR_SET_TIMERSLACK) refused (errno %d)", ctypes.get_errno())
    except (AttributeError, OSError):
        log.debug("no prctl here: mocked steps keep the default timer slack")


def sleep_until(deadline: float) -> None:
    """Sleep until time.perf_counter() reaches `deadline` (at once if it has)."""
    tighten_timer_slack()
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)
