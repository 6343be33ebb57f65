"""The reference meaning of an index lookup, for the tests' plain-dict index models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set


def leading_overlaps(hashes: Sequence[int], held: Mapping[str, Set[int]]) -> dict[str, int]:
    """Per worker, how many leading hashes its set holds; workers holding none left out."""
    result = {}
    for worker, blocks in held.items():
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        if n:
            result[worker] = n
    return result
