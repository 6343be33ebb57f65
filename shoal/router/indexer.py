"""Which workers hold which KV blocks, kept up to date from the workers' KV events.

The index keys every block on the router's own hash of its tokens (shoal.kv_hash), whatever
hash the engine that cached it uses: a BlockStored event's token_ids are re-hashed, chained
from the router hash of the event's parent block, and each worker keeps a map from its
engine's hashes to the router's, which BlockRemoved events are read through. So the index
follows shoal engines and any engine publishing vLLM-format events alike.

Router hashes are chained, so one hash names its block and its whole prefix: the index is a
flat map from hash to the set of workers holding it, with no tree to walk. Those sets are
interned: every block held by exactly the same workers shares one set object, so a block
costs one pointer however many workers hold it, and a lookup walking a prompt's blocks
moves on in O(1) while the holders stay the same object, intersecting sets only where they
change. Blocks in GPU memory are indexed here; blocks in a worker's lower tiers (events
with `medium` CPU or DISK, shoal.engine.kv_offload) go to a second index of the same kind,
`lower`, and tiered_overlaps says how far a prompt's prefix reaches through GPU and lower
tiers together. A stored block's parent is looked up in both (a block offloaded to the host
may be the child of one only the GPU holds, and the other way round).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence, Set
from itertools import groupby

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


class _Holders:
    """One interned set of workers, shared by every block those workers (only) hold."""

    __slots__ = ("members", "minus", "plus", "refs")

    def __init__(self, members: frozenset[str]) -> None:
        self.members = members
        self.refs = 0  # blocks pointing at this set; 0: dropped from the index's table
        # The sets one worker more or fewer lead to (cached; a target with refs 0 is stale).
        self.plus: dict[str, _Holders] = {}
        self.minus: dict[str, _Holders] = {}


_UNSHARED = _Holders(_NONE)  # no block points at it: a walk's "no shared set" marker


class _Held:
    """One worker's blocks: engine hash -> router hash, and router hash -> engine blocks."""

    __slots__ = ("count", "router_of")

    def __init__(self) -> None:
        self.router_of: dict[EngineBlockHash, int] = {}
        self.count: dict[int, int] = {}  # router hash -> engine blocks with that content


class KvIndexer:
    """Router block hash -> workers holding it, and per worker its blocks, from KV events."""

    def __init__(self, lower_tiers: bool = True) -> None:
        """lower_tiers: also index the blocks workers hold in host memory or on disk."""
        self._holders: dict[int, _Holders] = {}
        self._sets: dict[frozenset[str], _Holders] = {}
        self._held: dict[str, _Held] = {}
        self.lower: KvIndexer | None = KvIndexer(lower_tiers=False) if lower_tiers else None
        self._peer: KvIndexer | None = None  # the other tier's index, for parent lookups
        if self.lower is not None:
            self.lower._peer = self
            self._peer = self.lower

    def apply(self, worker_id: str, event: KVEvent) -> None:
        """Apply one KV event published by `worker_id`."""
        match event:
            case BlockStored():
                if event.medium in _INDEXED_MEDIA:
                    self._apply_stored(worker_id, event)
                elif self.lower is not None:
                    self.lower._apply_stored(worker_id, event)
            case BlockRemoved(block_hashes=hashes, medium=medium):
                if medium in _INDEXED_MEDIA:
                    self.remove(worker_id, hashes)
                elif self.lower is not None:
                    self.lower.remove(worker_id, hashes)
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
            if router_parent is None and self._peer is not None:
                peer = self._peer._held.get(worker_id)
                router_parent = None if peer is None else peer.router_of.get(parent)
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
                self._add_holder(h, worker_id)

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
        if self.lower is not None:
            self.lower.clear(worker_id)

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
        if self.lower is not None:
            self.lower.remove_worker(worker_id)

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of this chained-hash sequence it holds.

        Workers holding none of the leading blocks are left out. The blocks' holder sets
        are looked up and grouped into runs of one interned set in C (map, groupby), so
        Python work is done only where the holders change: there the workers still
        matching are intersected with the run's set. It stops when no worker matches.
        """
        holders = self._holders
        if not block_hashes or block_hashes[0] not in holders:
            return {}
        result: dict[str, int] = {}
        current = holders[block_hashes[0]]
        candidates = current.members
        depth = 0  # where the run starts
        for nxt, run in groupby(map(holders.get, block_hashes)):
            start, depth = depth, depth + len(list(run))
            if nxt is current:
                continue
            survivors = _NONE if nxt is None else candidates & nxt.members
            if len(survivors) < len(candidates):
                for worker_id in candidates - survivors:
                    result[worker_id] = start
                if not survivors:
                    return result
                candidates = survivors
            # survivors is a subset of nxt's members: equal sizes mean the same set
            if nxt is not None and len(survivors) == len(nxt.members):
                current = nxt
            else:
                current = self._sets.get(survivors, _UNSHARED)
        for worker_id in candidates:
            result[worker_id] = len(block_hashes)
        return result

    def tiered_overlaps(self, block_hashes: Sequence[int], gpu: dict[str, int]) -> dict[str, int]:
        """Per worker whose lower tiers hold more of this prefix, how many leading blocks
        it holds in any tier (GPU or lower); `gpu` is overlaps(block_hashes). Workers whose
        lower tiers add nothing are left out. O(workers with hits x blocks walked past
        the longer of their two single-tier overlaps)."""
        lower = self.lower
        if lower is None or not lower._holders:
            return {}
        deep = lower.overlaps(block_hashes)
        result: dict[str, int] = {}
        for worker_id in deep.keys() | gpu.keys():
            on_gpu = gpu.get(worker_id, 0)
            depth = max(on_gpu, deep.get(worker_id, 0))
            mine, below = self.blocks(worker_id), lower.blocks(worker_id)
            while depth < len(block_hashes) and (
                block_hashes[depth] in mine or block_hashes[depth] in below
            ):
                depth += 1
            if depth > on_gpu:
                result[worker_id] = depth
        return result

    def blocks(self, worker_id: str) -> Set[int]:
        """The router hashes `worker_id` holds (a live read-only view; empty if unknown)."""
        held = self._held.get(worker_id)
        return frozenset() if held is None else held.count.keys()

    def num_blocks(self, worker_id: str) -> int:
        held = self._held.get(worker_id)
        return 0 if held is None else len(held.count)

    def num_distinct_blocks(self) -> int:
        """Blocks held by at least one worker (each counted once)."""
        return len(self._holders)

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

    def _add_holder(self, block_hash: int, worker_id: str) -> None:
        old = self._holders.get(block_hash)
        if old is None:
            new = self._shared(frozenset((worker_id,)))
        else:
            new = old.plus.get(worker_id)
            if new is None or not new.refs:
                new = old.plus[worker_id] = self._shared(old.members | {worker_id})
        new.refs += 1
        self._holders[block_hash] = new
        if old is not None:
            self._unref(old)

    def _drop_holder(self, block_hash: int, worker_id: str) -> None:
        old = self._holders[block_hash]
        if len(old.members) == 1:
            del self._holders[block_hash]
        else:
            new = old.minus.get(worker_id)
            if new is None or not new.refs:
                new = old.minus[worker_id] = self._shared(old.members - {worker_id})
            new.refs += 1
            self._holders[block_hash] = new
        self._unref(old)

    def _shared(self, members: frozenset[str]) -> _Holders:
        """The one set object for `members` (callers add their reference)."""
        shared = self._sets.get(members)
        if shared is None:
            shared = self._sets[members] = _Holders(members)
        return shared

    def _unref(self, shared: _Holders) -> None:
        shared.refs -= 1
        if not shared.refs:
            del self._sets[shared.members]
            shared.plus.clear()
            shared.minus.clear()
