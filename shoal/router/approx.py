"""The approximate KV index, for engines that publish no KV events.

The router cannot see what a worker caches, so it predicts it from where it sent each
prompt: a model of each worker's prefix cache as the engine keeps it (shoal.engine's block
pool). A request's blocks become the most recently used on its worker; the engine frees a
request's blocks last block first, so the model orders them that way too (its last blocks
are evicted before its first ones). Once a worker's predicted blocks exceed its KV capacity
(ModelCard.num_kv_blocks, set_capacity), the least recently used are evicted, as the
engine's free queue evicts them. A request's last, partly filled block takes a slot of its
own (the engine allocates it, and frees it into the same queue) but holds nothing to
find: the model counts it as a placeholder. A block also expires `ttl` seconds after its last use,
which bounds the guess for a worker whose capacity is unknown or whose cache is shared
with traffic the router does not see.

What the model leaves out: blocks filled by generated tokens (they take cache space the
model does not count, so it overestimates a little what survives; the router does not
know how many tokens a request will generate), blocks still in use
(the engine cannot evict them), and the time a request actually ends (its blocks are
ordered when it is routed, not when it frees them).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence, Set

from shoal.router.indexer import KvIndexer


class ApproxIndexer:
    """KvIndexer fed by the router's own routing decisions: an LRU model of each cache."""

    def __init__(self, ttl: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be positive (got {ttl!r})")
        self._ttl = ttl
        self._clock = clock
        self._index = KvIndexer()
        # worker -> block hash -> expiry, least recently used first. The TTL is fixed and the
        # clock monotonic, so this order is both the eviction order and the expiry order.
        self._lru: dict[str, OrderedDict[int, float]] = {}
        self._capacity: dict[str, int] = {}
        # placeholders for slots holding no cached block: negative keys, never a block hash
        self._placeholders = itertools.count(-1, -1)

    def set_capacity(self, worker_id: str, num_blocks: int | None) -> None:
        """The worker's KV cache size in blocks (None or 0: unknown, TTL only)."""
        if num_blocks:
            self._capacity[worker_id] = num_blocks
            self._evict(worker_id)
        else:
            self._capacity.pop(worker_id, None)

    def record(
        self, worker_id: str, block_hashes: Sequence[int], num_blocks: int | None = None
    ) -> None:
        """Note that `worker_id` was sent (and so now caches) these blocks, chained in order.

        `num_blocks`: the KV blocks the request takes there (its prompt's, the partly filled
        last one included), if more than its full blocks.
        """
        now = self._clock()
        self._expire(now)
        lru = self._lru.setdefault(worker_id, OrderedDict())
        expiry = now + self._ttl
        for _ in range((num_blocks or 0) - len(block_hashes)):
            lru[next(self._placeholders)] = expiry  # freed first, so evicted first
        new = []
        for h in reversed(block_hashes):  # the first block ends most recently used
            if h in lru:
                lru.move_to_end(h)
            else:
                new.append(h)
            lru[h] = expiry
        self._index.store(worker_id, new)
        self._evict(worker_id)

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """As KvIndexer.overlaps, over the blocks predicted cached now."""
        self._expire(self._clock())
        return self._index.overlaps(block_hashes)

    def blocks(self, worker_id: str) -> Set[int]:
        """The blocks predicted cached on `worker_id` (a live read-only view)."""
        return self._index.blocks(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        self._lru.pop(worker_id, None)
        self._capacity.pop(worker_id, None)
        self._index.remove_worker(worker_id)

    def num_blocks(self, worker_id: str) -> int:
        """Blocks predicted cached on `worker_id` now."""
        self._expire(self._clock())
        return self._index.num_blocks(worker_id)

    def workers(self) -> set[str]:
        return self._index.workers()

    def _evict(self, worker_id: str) -> None:
        """Drop the worker's least recently used blocks beyond its capacity."""
        capacity = self._capacity.get(worker_id)
        lru = self._lru.get(worker_id)
        if capacity is None or lru is None or len(lru) <= capacity:
            return
        gone = [lru.popitem(last=False)[0] for _ in range(len(lru) - capacity)]
        self._index.remove(worker_id, [h for h in gone if h >= 0])

    def _expire(self, now: float) -> None:
        """Drop blocks whose time is up, oldest first: O(workers) plus O(1) per dropped block."""
        for worker_id, lru in self._lru.items():
            gone = []
            while lru:
                h, until = next(iter(lru.items()))
                if until > now:
                    break
                del lru[h]
                if h >= 0:
                    gone.append(h)
            if gone:
                self._index.remove(worker_id, gone)
