"""numba's njit as the router's compiled loops use it."""

from __future__ import annotations

from collections.abc import Callable

import numba as nb


def cached_njit(function: Callable) -> Callable:
    """numba.njit, cached on disk where numba finds a writable place for its cache (next to
    the module, or the user's cache folder); where it finds none (a read-only install with
    no writable home), compiled in each process instead. No bounds checks; the GIL is let
    go while it runs."""
    try:
        return nb.njit(cache=True, nogil=True, boundscheck=False)(function)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return nb.njit(nogil=True, boundscheck=False)(function)
