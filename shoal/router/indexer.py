"""Which workers hold which KV blocks, kept up to date from the workers' KV events.

Block hashes are chained (shoal.kv_hash), so one hash names its block and its whole prefix:
the index is a flat map from hash to the workers holding it, with no tree to walk.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set

from shoal.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_NONE: frozenset[str] = frozenset()


class KvIndexer:
    """Block hash -> workers holding it, and worker -> its hashes, applied from KV events."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}

    def apply(self, worker_id: str, event: KVEvent) -> None:
        """Apply one KV event published by `worker_id`."""
        match event:
            case BlockStored(block_hashes=hashes):
                self.store(worker_id, hashes)
            case BlockRemoved(block_hashes=hashes):
                self.remove(worker_id, hashes)
            case AllBlocksCleared():
                self.clear(worker_id)
            case _:
                raise TypeError(f"not a KV event: {event!r}")

    def apply_batch(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(worker_id, event)

    def store(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """Record that `worker_id` holds these blocks (storing a held block again is a no-op)."""
        held = self._blocks.setdefault(worker_id, set())
        for h in block_hashes:
            if h not in held:
                held.add(h)
                self._holders.setdefault(h, set()).add(worker_id)

    def remove(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """Forget these blocks on `worker_id`; blocks it does not hold are ignored."""
        held = self._blocks.setdefault(worker_id, set())
        for h in block_hashes:
            if h in held:
                held.remove(h)
                self._drop_holder(h, worker_id)

    def clear(self, worker_id: str) -> None:
        """Forget every block of `worker_id`, keeping the worker known (with no blocks)."""
        for h in self._blocks.get(worker_id, ()):
            self._drop_holder(h, worker_id)
        self._blocks[worker_id] = set()

    def load_dump(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """Replace all that is known of `worker_id` with exactly these blocks (a resync)."""
        new = set(block_hashes)
        old = self._blocks.get(worker_id, set())
        for h in old - new:
            self._drop_holder(h, worker_id)
        for h in new - old:
            self._holders.setdefault(h, set()).add(worker_id)
        self._blocks[worker_id] = new

    def remove_worker(self, worker_id: str) -> None:
        for h in self._blocks.pop(worker_id, ()):
            self._drop_holder(h, worker_id)

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of this chained-hash sequence it holds.

        Workers holding none of the leading blocks are left out. The candidate set only
        shrinks, block by block, and the walk stops when it is empty: O(blocks) set
        intersections, each bounded by the number of workers still matching.
        """
        if not block_hashes:
            return {}
        result: dict[str, int] = {}
        candidates = set(self._holders.get(block_hashes[0], ()))
        for depth in range(1, len(block_hashes)):
            if not candidates:
                return result
            survivors = candidates & self._holders.get(block_hashes[depth], _NONE)
            if len(survivors) < len(candidates):
                for worker_id in candidates - survivors:
                    result[worker_id] = depth
                candidates = survivors
        for worker_id in candidates:
            result[worker_id] = len(block_hashes)
        return result

    def blocks(self, worker_id: str) -> Set[int]:
        """The hashes `worker_id` holds (a live read-only view; empty if unknown)."""
        return self._blocks.get(worker_id, frozenset())

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def workers(self) -> set[str]:
        """Workers this index has heard of and not removed (some may hold no blocks)."""
        return set(self._blocks)

    def _drop_holder(self, block_hash: int, worker_id: str) -> None:
        holders = self._holders[block_hash]
        holders.discard(worker_id)
        if not holders:
            del self._holders[block_hash]
