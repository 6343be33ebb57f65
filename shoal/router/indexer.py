"""Which workers hold which KV blocks, kept up to date from the workers' KV events.

The index keys every block on the router's own hash of its tokens (kv_hash.route_hashes),
whatever hash the engine that cached it uses: a BlockStored event's token_ids are re-hashed,
chained from the router hash of the event's parent block, and each worker keeps a map from
its engine's hashes to the router's, which BlockRemoved events are read through. So the
index follows shoal engines and any engine publishing vLLM-format events alike. A batch's
events are re-hashed in one vectorised call (a _Wave) wherever each event's parent is known
before the batch or is the last block of the event before it, as it is when an engine
stores a request's blocks step after step.

Router hashes are chained, so one hash names its block and its whole prefix: the index is a
flat table from hash to block id (shoal.router.block_table, numpy), and per block id a bit
mask of the workers holding it (one bit per worker, shared by every block: a block costs
one row of W/64 words however many workers hold it). A lookup finds the ids of all the
prompt's blocks in one vectorised pass, gathers their masks and ANDs them cumulatively:
where the running mask loses a worker's bit is that worker's overlap, so Python work is
done only where the holders change. A short prompt (SHORT_PROMPT_BLOCKS), where numpy's
cost per call would dominate, is looked up through a dict mirror of the table instead,
its masks ANDed as Python ints.

Events first update each worker's own dicts (engine hash -> router hash, router hash ->
engine blocks with that content) with whole-batch dict operations in C, and queue the
(worker, block) pairs that start or stop being held; the queue is applied to the table and
the masks in one vectorised pass before any lookup, or once it holds FLUSH_OPS pairs, so
numpy's cost per call is paid per thousand blocks rather than per event.

Blocks in GPU memory are indexed here; blocks in a worker's lower tiers (events with
`medium` CPU or DISK, shoal.engine.kv_offload) go to a second index of the same kind,
`lower`, with the same bit per worker, and tiered_overlaps says how far a prompt's prefix
reaches through GPU and lower tiers together. A stored block's parent is looked up in both
(a block offloaded to the host may be the child of one only the GPU holds, and the other
way round).
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence, Set
from functools import partial
from itertools import accumulate, filterfalse, groupby, repeat, takewhile
from operator import and_, is_not

import numpy as np

from shoal.kv_hash import ROUTE_ROOT, extra_key, route_extra, route_hash_runs
from shoal.protocol import (
    GPU_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEvent,
)
from shoal.router.block_table import BlockTable

log = logging.getLogger(__name__)

FLUSH_OPS = 1024  # queued (worker, block) changes applied without waiting for a lookup
SHORT_PROMPT_BLOCKS = 256  # prompts up to this many blocks are looked up without numpy
_not_none = partial(is_not, None)


class _Columns:
    """Each known worker's bit in the holder masks, shared by the GPU and lower-tier indexes."""

    def __init__(self) -> None:
        self.of: dict[str, int] = {}
        self.names: list[str | None] = []  # column -> worker
        self._free: list[int] = []

    @property
    def words(self) -> int:
        return max(1, (len(self.names) + 63) // 64)

    def get(self, worker_id: str) -> int:
        column = self.of.get(worker_id)
        if column is None:
            if self._free:
                column = self._free.pop()
                self.names[column] = worker_id
            else:
                column = len(self.names)
                self.names.append(worker_id)
            self.of[worker_id] = column
        return column

    def release(self, worker_id: str) -> None:
        column = self.of.pop(worker_id, None)
        if column is not None:
            self.names[column] = None
            self._free.append(column)


class _Held:
    """One worker's blocks: its column, engine hash -> router hash, router hash -> engine
    blocks with that content."""

    __slots__ = ("column", "count", "dups", "router_of")

    def __init__(self, column: int) -> None:
        self.column = column
        self.router_of: dict[EngineBlockHash, int] = {}
        self.count: dict[int, int] = {}
        self.dups = 0  # router hashes held by more than one engine block


def _bits_of(mask: int) -> Iterator[int]:
    """The positions of the set bits of a Python int."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _u64(hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(hashes, np.ndarray):
        return hashes.astype(np.uint64, copy=False)
    return np.frombuffer(array("Q", hashes), np.uint64)


def _masks(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each column's word and bit in a mask row."""
    return columns >> 6, np.left_shift(np.uint64(1), (columns & 63).astype(np.uint64))


def _leading(words: list[np.ndarray], columns: _Columns) -> dict[str, int]:
    """Per worker whose bit is set in the first row, how many leading rows all have it; the
    rows come as one array per mask word (each a long prompt's rows, small enough to stay
    in cache).

    The rows are ANDed cumulatively; at each row where the running mask changes, the bits
    it loses are unpacked in one call, so no Python step is taken per row or per change."""
    if not len(words[0]):
        return {}
    acc = [np.bitwise_and.accumulate(word) for word in words]
    changed = acc[0][1:] != acc[0][:-1]
    for word in acc[1:]:
        changed |= word[1:] != word[:-1]
    changes = np.flatnonzero(changed)
    lost = np.stack([np.append(a[changes] & ~a[changes + 1], a[-1]) for a in acc], axis=1)
    depth = np.append(changes + 1, len(acc[0]))
    bits = np.unpackbits(lost.astype("<u8", copy=False).view(np.uint8), axis=1, bitorder="little")
    where, column = np.nonzero(bits)
    names = columns.names
    return {names[c]: d for c, d in zip(column.tolist(), depth[where].tolist(), strict=True)}


class _Wave:
    """BlockStored events whose router hashes one vectorised call computes: runs of blocks,
    each chained from a parent known before the wave or continuing the run before it."""

    __slots__ = ("_extra", "block_size", "engine", "extras", "lengths", "parents", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.engine: list[EngineBlockHash] = []  # the engine's hashes of the blocks, in order
        self.parents: list[int] = []  # per run: the router hash it chains from
        self.lengths: list[int] = []  # per run: its blocks
        self.extras: list[int] = []  # per run: route_extra of its extra key
        self.block_size = 0
        self._extra = b""

    def __bool__(self) -> bool:
        return bool(self.lengths)

    def continues(self, event: BlockStored, extra: bytes) -> bool:
        """Whether the event chains from the last block of the wave's last run."""
        return (
            bool(self.engine)
            and event.parent_block_hash == self.engine[-1]
            and event.block_size == self.block_size
            and extra == self._extra
        )

    def extend(self, event: BlockStored) -> None:
        self.tokens += event.token_ids
        self.engine += event.block_hashes
        self.lengths[-1] += len(event.block_hashes)

    def start(self, event: BlockStored, parent: int, extra: bytes) -> None:
        self.block_size = event.block_size
        self._extra = extra
        self.tokens += event.token_ids
        self.engine += event.block_hashes
        self.parents.append(parent)
        self.lengths.append(len(event.block_hashes))
        self.extras.append(route_extra(extra))


class KvIndexer:
    """Router block hash -> workers holding it, and per worker its blocks, from KV events."""

    def __init__(self, lower_tiers: bool = True, _columns: _Columns | None = None) -> None:
        """lower_tiers: also index the blocks workers hold in host memory or on disk."""
        self._columns = _columns or _Columns()
        self._table = BlockTable()
        self._bits = np.zeros((self._table.id_capacity, 1), np.uint64)  # block id -> mask
        self._held: dict[str, _Held] = {}
        self._id_of: dict[int, int] = {}  # the table as a dict, for short lookups
        # (worker, block) changes not yet in the table and masks: router hash, column, held
        self._keys: list[int] = []
        self._cols: list[int] = []
        self._sets: list[bool] = []
        self.lower: KvIndexer | None = (
            KvIndexer(lower_tiers=False, _columns=self._columns) if lower_tiers else None
        )
        self._peer: KvIndexer | None = None  # the other tier's index, for parent lookups
        if self.lower is not None:
            self.lower._peer = self
            self._peer = self.lower

    def apply(self, worker_id: str, event: KVEvent) -> None:
        """Apply one KV event published by `worker_id`."""
        match event:
            case BlockStored():
                if event.medium in GPU_MEDIA:
                    self._apply_stored(worker_id, [event])
                elif self.lower is not None:
                    self.lower._apply_stored(worker_id, [event])
            case BlockRemoved(block_hashes=hashes, medium=medium):
                if medium in GPU_MEDIA:
                    self.remove(worker_id, hashes)
                elif self.lower is not None:
                    self.lower.remove(worker_id, hashes)
            case AllBlocksCleared():
                self.clear(worker_id)
            case _:
                raise TypeError(f"not a KV event: {event!r}")

    def apply_batch(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """Apply a batch in order; consecutive GPU BlockStored events are applied as one."""
        run: list[BlockStored] = []
        for event in events:
            if type(event) is BlockStored and event.medium in GPU_MEDIA:
                run.append(event)
                continue
            if run:
                self._apply_stored(worker_id, run)
                run = []
            self.apply(worker_id, event)
        if run:
            self._apply_stored(worker_id, run)

    def _apply_stored(self, worker_id: str, events: list[BlockStored]) -> None:
        """Re-hash the events' blocks (chained from their parents' router hashes) and store
        them, the whole batch in one vectorised hash where the parents allow; an event whose
        parent is unknown or whose sizes disagree is skipped."""
        self._held_of(worker_id)  # a worker is known from its first event on
        wave = _Wave()
        for event in events:
            size = event.block_size
            if size <= 0 or len(event.token_ids) != size * len(event.block_hashes):
                log.debug(
                    "worker %s: BlockStored with %d tokens for %d blocks of %d: skipped",
                    worker_id,
                    len(event.token_ids),
                    len(event.block_hashes),
                    size,
                )
                continue
            parent = event.parent_block_hash
            extra = extra_key(event.lora_id)
            if wave.continues(event, extra):
                wave.extend(event)
                continue
            router_parent = ROUTE_ROOT if parent is None else self._router_parent(worker_id, parent)
            if router_parent is None and wave:  # its parent may be in the wave: store that
                self._store_wave(worker_id, wave)
                wave = _Wave()
                router_parent = self._router_parent(worker_id, parent)
            if router_parent is None:
                log.debug("worker %s: stored blocks after an unknown parent: skipped", worker_id)
                continue
            if wave and size != wave.block_size:
                self._store_wave(worker_id, wave)
                wave = _Wave()
            wave.start(event, router_parent, extra)
        if wave:
            self._store_wave(worker_id, wave)

    def _router_parent(self, worker_id: str, parent: EngineBlockHash) -> int | None:
        """The router hash of a worker's engine block, from either tier's index."""
        held = self._held.get(worker_id)
        found = None if held is None else held.router_of.get(parent)
        if found is None and self._peer is not None:
            peer = self._peer._held.get(worker_id)
            found = None if peer is None else peer.router_of.get(parent)
        return found

    def _store_wave(self, worker_id: str, wave: _Wave) -> None:
        hashes = route_hash_runs(
            wave.tokens,
            wave.block_size,
            np.array(wave.parents, np.uint64),
            np.array(wave.lengths),
            np.array(wave.extras, np.uint64) if any(wave.extras) else None,
        )
        self.store(worker_id, hashes.tolist(), wave.engine)

    def store(
        self,
        worker_id: str,
        block_hashes: Sequence[int],
        engine_hashes: Sequence[EngineBlockHash] | None = None,
    ) -> None:
        """Record that `worker_id` holds these blocks (router hashes), which its engine calls
        `engine_hashes` (the same if None); storing a held engine block again is a no-op.

        The usual batch (engine blocks new to the index, each named once) costs a few dict
        operations in C over the whole batch; others go block by block."""
        keys = block_hashes if type(block_hashes) is list else list(block_hashes)
        engine = keys if engine_hashes is None else engine_hashes
        if len(engine) != len(keys):
            raise ValueError(f"{len(keys)} router hashes for {len(engine)} engine hashes")
        held = self._held_of(worker_id)
        router_of, count = held.router_of, held.count
        if not any(map(router_of.__contains__, engine)):
            before = len(router_of)
            router_of.update(zip(engine, keys, strict=True))
            if len(router_of) - before < len(keys):  # a name given twice: its last block wins
                keys = list(dict(zip(engine, keys, strict=True)).values())
            fresh = list(filterfalse(count.__contains__, keys))
            if len(fresh) < len(keys):  # contents held already, under other engine names
                for key in keys:
                    if key in count:
                        held.dups += count[key] == 1
                        count[key] += 1
            before = len(count)
            count.update(zip(fresh, repeat(1)))
            if len(count) - before < len(fresh):  # a new content under several names
                for key, n in Counter(fresh).items():
                    if n > 1:
                        count[key] = n
                        held.dups += 1
                fresh = list(dict.fromkeys(fresh))
            self._queue(held.column, fresh, True)
        else:
            for key, name in zip(keys, engine, strict=True):
                old = router_of.get(name)
                if old == key:
                    continue
                if old is not None:
                    self._drop(held, old)
                router_of[name] = key
                self._add(held, key)
        if len(self._keys) >= FLUSH_OPS:
            self.flush()

    def remove(self, worker_id: str, engine_hashes: Iterable[EngineBlockHash]) -> None:
        """Forget these blocks (by the engine's hashes); blocks not held are ignored."""
        held = self._held_of(worker_id)
        keys = list(filter(_not_none, map(held.router_of.pop, engine_hashes, repeat(None))))
        if not held.dups:  # each key held once: all go
            deque(map(held.count.__delitem__, keys), maxlen=0)
            self._queue(held.column, keys, False)
        else:
            for key in keys:
                self._drop(held, key)
        if len(self._keys) >= FLUSH_OPS:
            self.flush()

    def clear(self, worker_id: str) -> None:
        """Forget every block of `worker_id`, keeping the worker known (with no blocks)."""
        self._forget(worker_id)
        self._held_of(worker_id)
        if self.lower is not None:
            self.lower.clear(worker_id)

    def load_dump(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """Replace all that is known of `worker_id` with what these events store (a resync:
        KVStateDump.events, each block's parent before it)."""
        self.clear(worker_id)
        self.apply_batch(worker_id, events)

    def remove_worker(self, worker_id: str) -> None:
        self._forget(worker_id)
        self.flush()
        if self.lower is not None:
            self.lower._forget(worker_id)
            self.lower.flush()
        if self._peer is None or self.lower is not None:  # the index owning the columns
            self._columns.release(worker_id)

    def overlaps(self, block_hashes: Sequence[int] | np.ndarray) -> dict[str, int]:
        """Per worker, how many leading blocks of this chained-hash sequence it holds.

        Workers holding none of the leading blocks are left out. The blocks' ids are found
        in one pass; the masks of the leading blocks the index knows are ANDed cumulatively
        and each worker's overlap is where its bit drops out.
        """
        self.flush()
        if not len(block_hashes) or not self._table.live:
            return {}
        if len(block_hashes) <= SHORT_PROMPT_BLOCKS:
            if isinstance(block_hashes, np.ndarray):
                block_hashes = block_hashes.tolist()
            return self._short_overlaps(block_hashes)
        ids = self._table.leading_ids(_u64(block_hashes))
        return _leading([self._bits[ids, w] for w in range(self._bits.shape[1])], self._columns)

    def _short_overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """overlaps() for a short prompt, where numpy's cost per call would dominate: ids
        from the dict mirror, masks as Python ints, ANDed and grouped into runs in C."""
        ids = list(takewhile(_not_none, map(self._id_of.get, block_hashes)))
        if not ids:
            return {}
        rows = self._bits[ids].astype("<u8", copy=False)
        step = 8 * rows.shape[1]
        data = rows.tobytes()
        masks = [int.from_bytes(data[i : i + step], "little") for i in range(0, len(data), step)]
        names = self._columns.names
        result: dict[str, int] = {}
        depth, held = 0, masks[0]
        for mask, run in groupby(accumulate(masks, and_)):
            for worker in _bits_of(held & ~mask):
                result[names[worker]] = depth
            held = mask
            depth += len(list(run))
        for worker in _bits_of(held):
            result[names[worker]] = depth
        return result

    def tiered_overlaps(
        self, block_hashes: Sequence[int] | np.ndarray, gpu: dict[str, int]
    ) -> dict[str, int]:
        """Per worker whose lower tiers hold more of this prefix, how many leading blocks
        it holds in any tier (GPU or lower); `gpu` is overlaps(block_hashes). Workers whose
        lower tiers add nothing are left out. One vectorised pass over both indexes."""
        lower = self.lower
        if lower is None or not len(block_hashes):
            return {}
        self.flush()
        lower.flush()
        if not lower._table.live:
            return {}
        keys = _u64(block_hashes)
        words = self._columns.words
        rows = self._rows(keys, words) | lower._rows(keys, words)
        deep = _leading([rows[:, w] for w in range(words)], self._columns)
        return {w: d for w, d in deep.items() if d > gpu.get(w, 0)}

    def blocks(self, worker_id: str) -> Set[int]:
        """The router hashes `worker_id` holds (a live read-only view; empty if unknown)."""
        held = self._held.get(worker_id)
        return frozenset() if held is None else held.count.keys()

    def num_blocks(self, worker_id: str) -> int:
        held = self._held.get(worker_id)
        return 0 if held is None else len(held.count)

    def num_distinct_blocks(self) -> int:
        """Blocks held by at least one worker (each counted once)."""
        self.flush()
        return self._table.live

    def workers(self) -> set[str]:
        """Workers this index has heard of and not removed (some may hold no blocks)."""
        return set(self._held)

    # ---- internals

    def _held_of(self, worker_id: str) -> _Held:
        held = self._held.get(worker_id)
        if held is None:
            held = self._held[worker_id] = _Held(self._columns.get(worker_id))
        return held

    def _add(self, held: _Held, key: int) -> None:
        n = held.count.get(key, 0)
        held.count[key] = n + 1
        if not n:
            self._queue(held.column, (key,), True)
        held.dups += n == 1

    def _drop(self, held: _Held, key: int) -> None:
        n = held.count[key]
        if n == 1:
            del held.count[key]
            self._queue(held.column, (key,), False)
        else:
            held.count[key] = n - 1
            held.dups -= n == 2

    def _forget(self, worker_id: str) -> None:
        held = self._held.pop(worker_id, None)
        if held is not None:
            self._queue(held.column, list(held.count), False)

    def _queue(self, column: int, keys: Sequence[int], held: bool) -> None:
        self._keys += keys
        self._cols += repeat(column, len(keys))
        self._sets += repeat(held, len(keys))

    def flush(self) -> None:
        """Apply the queued (worker, block) changes to the table and the masks at once
        (lookups do it first)."""
        if not self._keys:
            return
        keys = np.frombuffer(array("Q", self._keys), np.uint64)
        cols = np.frombuffer(array("q", self._cols), np.int64)
        sets = np.frombuffer(array("b", self._sets), np.bool_)
        self._keys, self._cols, self._sets = [], [], []
        if not (sets.all() or not sets.any()):
            keys, cols, sets = _net(keys, cols, sets)
        self._fit()
        if sets.any():
            on = keys[sets] if not sets.all() else keys
            on_cols = cols[sets] if not sets.all() else cols
            ids = self._ids_for(on)
            words, bits = _masks(on_cols)
            np.bitwise_or.at(self._bits, (ids, words), bits)
        if not sets.all():
            off = ~sets
            ids = self._table.ids(keys[off])
            words, bits = _masks(cols[off])
            np.bitwise_and.at(self._bits, (ids, words), ~bits)
            ids = np.unique(ids)
            dead = ids[~self._bits[ids].any(axis=1)]
            if len(dead):
                deque(map(self._id_of.__delitem__, self._table.key_of[dead].tolist()), maxlen=0)
                self._table.remove(dead)

    def _fit(self) -> None:
        """Grow the mask matrix to every id the table hands out and every worker's column."""
        rows, words = self._table.id_capacity, self._columns.words
        old_rows, old_words = self._bits.shape
        if old_rows < rows or old_words < words:
            grown = np.zeros((max(rows, old_rows), max(words, old_words)), np.uint64)
            grown[:old_rows, :old_words] = self._bits
            self._bits = grown

    def _ids_for(self, keys: np.ndarray) -> np.ndarray:
        """The block ids of these keys (which may repeat), adding those the table lacks."""
        ids = self._table.ids(keys)
        missing = ids < 0
        if missing.any():
            new, first, inverse = np.unique(keys[missing], return_index=True, return_inverse=True)
            order = np.argsort(first)  # ids in the order the blocks came: see leading_ids
            added = np.empty(len(new), np.int64)
            added[order] = self._table.add(new[order])
            ids[missing] = added[inverse]
            self._id_of.update(zip(new.tolist(), added.tolist(), strict=True))
            self._fit()
        return ids

    def _rows(self, keys: np.ndarray, words: int) -> np.ndarray:
        """The masks of these keys' blocks (zero where not indexed), `words` wide."""
        ids = self._table.ids(keys)
        rows = np.zeros((len(keys), words), np.uint64)
        known = ids >= 0
        width = min(words, self._bits.shape[1])
        rows[known, :width] = self._bits[ids[known], :width]
        return rows


def _net(keys: np.ndarray, cols: np.ndarray, sets: np.ndarray) -> tuple[np.ndarray, ...]:
    """The net change of each (block, worker) pair in a queue of changes, in order.

    A pair's changes alternate (held, not held, held...): it ends changed only if its
    first and last changes agree (both held: it was not held before; both not: it was)."""
    order = np.lexsort((cols, keys))  # stable: a pair's changes stay in queue order
    keys, cols, sets = keys[order], cols[order], sets[order]
    same = (keys[1:] == keys[:-1]) & (cols[1:] == cols[:-1])
    first = np.ones(len(keys), bool)
    first[1:] = ~same
    last = np.ones(len(keys), bool)
    last[:-1] = ~same
    changed = sets[first] == sets[last]
    last_ix = np.flatnonzero(last)[changed]
    return keys[last_ix], cols[last_ix], sets[last_ix]
