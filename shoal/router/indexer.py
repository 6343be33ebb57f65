"""Which workers hold which KV blocks, kept up to date from the workers' KV events.

The index keys every block on the router's own hash of its tokens (shoal.kv_hash), whatever
hash the engine that cached it uses: a BlockStored event's token_ids are re-hashed, chained
from the router hash of the event's parent block, and each worker keeps a map from its
engine's hashes to the router's, which BlockRemoved events are read through. So the index
follows shoal engines and any engine publishing vLLM-format events alike.

Router hashes are chained, so one hash names its block and its whole prefix: the index is a
flat map from hash to the workers holding it, with no tree to walk. Only blocks in GPU
memory are indexed; events about other tiers (`medium` CPU, disk) are ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence, Set

from shoal.kv_hash import extra_key, hash_blocks
from shoal.protocol import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEvent,
)

log = logging.getLogger(__name__)

_NONE: frozenset[str] = frozenset()
_INDEXED_MEDIA = (None, MEDIUM_GPU)


class _Held:
    """One worker's blocks: engine hash -> router hash, and router hash -> engine blocks."""

    __slots__ = ("count", "router_of")

    def __init__(self) -> None:
        self.router_of: dict[EngineBlockHash, int] = {}
        self.count: dict[int, int] = {}  # router hash -> engine blocks with that content


class KvIndexer:
    """Router block hash -> workers holding it, and per worker its blocks, from KV events."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._held: dict[str, _Held] = {}

    def apply(self, worker_id: str, event: KVEvent) -> None:
        """Apply one KV event published by `worker_id`."""
        match event:
            case BlockStored():
                if event.medium in _INDEXED_MEDIA:
                    self._apply_stored(worker_id, event)
            case BlockRemoved(block_hashes=hashes, medium=medium):
                if medium in _INDEXED_MEDIA:
                    self.remove(worker_id, hashes)
            case AllBlocksCleared():
                self.clear(worker_id)
            case _:
                raise TypeError(f"not a KV event: {event!r}")

    def apply_batch(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(worker_id, event)

    def _apply_stored(self, worker_id: str, event: BlockStored) -> None:
        held = self._held.setdefault(worker_id, _Held())
        parent = event.parent_block_hash
        if parent is None:
            router_parent = None
        else:
            router_parent = held.router_of.get(parent)
            if router_parent is None:
                log.debug("worker %s: stored blocks after an unknown parent: skipped", worker_id)
                return
        size = event.block_size
        if size <= 0 or len(event.token_ids) != size * len(event.block_hashes):
            log.debug(
                "worker %s: BlockStored with %d tokens for %d blocks of %d: skipped",
                worker_id,
                len(event.token_ids),
                len(event.block_hashes),
                size,
            )
            return
        extra = extra_key(event.lora_id)
        hashes = hash_blocks(event.token_ids, size, extra, parent=router_parent)
        self.store(worker_id, hashes, event.block_hashes)

    def store(
        self,
        worker_id: str,
        block_hashes: Sequence[int],
        engine_hashes: Sequence[EngineBlockHash] | None = None,
    ) -> None:
        """Record that `worker_id` holds these blocks (router hashes), which its engine calls
        `engine_hashes` (the same if None); storing a held engine block again is a no-op."""
        held = self._held.setdefault(worker_id, _Held())
        router_of, count = held.router_of, held.count
        for h, e in zip(
            block_hashes, block_hashes if engine_hashes is None else engine_hashes, strict=True
        ):
            old = router_of.get(e)
            if old == h:
                continue
            if old is not None:
                self._release(worker_id, held, old)
            router_of[e] = h
            n = count.get(h, 0)
            count[h] = n + 1
            if not n:
                self._holders.setdefault(h, set()).add(worker_id)

    def remove(self, worker_id: str, engine_hashes: Iterable[EngineBlockHash]) -> None:
        """Forget these blocks (by the engine's hashes); blocks not held are ignored."""
        held = self._held.setdefault(worker_id, _Held())
        router_of = held.router_of
        for e in engine_hashes:
            h = router_of.pop(e, None)
            if h is not None:
                self._release(worker_id, held, h)

    def clear(self, worker_id: str) -> None:
        """Forget every block of `worker_id`, keeping the worker known (with no blocks)."""
        self.remove_worker(worker_id)
        self._held[worker_id] = _Held()

    def load_dump(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """Replace all that is known of `worker_id` with exactly these blocks (a resync).

        The hashes are kv_hash hashes, the engine's and the router's both (KVStateDump).
        """
        self.clear(worker_id)
        self.store(worker_id, list(dict.fromkeys(block_hashes)))

    def remove_worker(self, worker_id: str) -> None:
        held = self._held.pop(worker_id, None)
        if held is not None:
            for h in held.count:
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
        """The router hashes `worker_id` holds (a live read-only view; empty if unknown)."""
        held = self._held.get(worker_id)
        return frozenset() if held is None else held.count.keys()

    def num_blocks(self, worker_id: str) -> int:
        held = self._held.get(worker_id)
        return 0 if held is None else len(held.count)

    def workers(self) -> set[str]:
        """Workers this index has heard of and not removed (some may hold no blocks)."""
        return set(self._held)

    def _release(self, worker_id: str, held: _Held, block_hash: int) -> None:
        n = held.count[block_hash] - 1
        if n:
            held.count[block_hash] = n
        else:
            del held.count[block_hash]
            self._drop_holder(block_hash, worker_id)

    def _drop_holder(self, block_hash: int, worker_id: str) -> None:
        holders = self._holders[block_hash]
        holders.discard(worker_id)
        if not holders:
            del self._holders[block_hash]
