"""A guessed KV index for engines that publish no KV events.

The router records where it sent each request's blocks and assumes the worker keeps them
for `ttl` seconds after their last use; a block sent again refreshes its time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from shoal.router.indexer import KvIndexer


class ApproxIndexer:
    """KvIndexer fed by the router's own routing decisions, with entries that expire."""

    def __init__(self, ttl: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be positive (got {ttl!r})")
        self._ttl = ttl
        self._clock = clock
        self._index = KvIndexer()
        # (worker, hash) -> expiry time; the TTL is fixed and the clock monotonic, so
        # moving a refreshed entry to the end keeps the dict in expiry order.
        self._expiry: OrderedDict[tuple[str, int], float] = OrderedDict()

    def record(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """Note that `worker_id` was sent (and so now caches) these blocks."""
        now = self._clock()
        self._expire(now)
        expiry = now + self._ttl
        for h in block_hashes:
            key = (worker_id, h)
            self._expiry[key] = expiry
            self._expiry.move_to_end(key)
        self._index.store(worker_id, block_hashes)

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """As KvIndexer.overlaps, over the entries not yet expired."""
        self._expire(self._clock())
        return self._index.overlaps(block_hashes)

    def remove_worker(self, worker_id: str) -> None:
        for h in self._index.blocks(worker_id):
            del self._expiry[(worker_id, h)]
        self._index.remove_worker(worker_id)

    def num_blocks(self, worker_id: str) -> int:
        """Blocks recorded for `worker_id` and not yet expired."""
        self._expire(self._clock())
        return self._index.num_blocks(worker_id)

    def workers(self) -> set[str]:
        return self._index.workers()

    def _expire(self, now: float) -> None:
        """Drop entries whose time is up, oldest first: amortized O(1) per recorded block."""
        expiry = self._expiry
        while expiry:
            key, until = next(iter(expiry.items()))
            if until > now:
                return
            del expiry[key]
            self._index.remove(key[0], (key[1],))
