"""The goodput search both router benchmarks share: the highest load that meets an SLO."""

from __future__ import annotations

import math
from collections.abc import Callable


def highest_sustained(
    sustains: Callable[[float], bool],
    start: float,
    tolerance: float,
    cap: float | None = None,
    floor: float = 1e-3,
) -> float:
    """The highest load that `sustains`, within a factor 1 + `tolerance` (0 if not even
    `floor`): from `start`, doubling (up to `cap`) or halving until one load is sustained
    and the next is not, then bisecting between them in log scale. Assumes that a load above
    one that is missed is missed too."""
    known: dict[float, bool] = {}

    def ok(load: float) -> bool:
        if load not in known:
            known[load] = sustains(load)
        return known[load]

    load = start if cap is None else min(start, cap)
    if ok(load):
        low, high = load, None
        while high is None:
            if cap is not None and low >= cap:
                return low
            load = low * 2 if cap is None else min(low * 2, cap)
            low, high = (load, None) if ok(load) else (low, load)
    else:
        low, high = None, load
        while low is None:
            load = high / 2
            if load < floor:
                return 0.0
            low, high = (load, high) if ok(load) else (None, load)
    while high / low > 1 + tolerance:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if ok(middle) else (low, middle)
    return low
