"""Which workers hold which KV blocks, kept up to date from the workers' KV events.

The index keys every block on the router's own hash of its tokens (kv_hash.route_hashes),
whatever hash the engine that cached it uses. A shoal worker publishes the router hashes it
starts and stops holding (RouteHashesStored, RouteHashesRemoved: it runs the translation of
shoal.route_events itself), which are queued as they come; any other worker's events
(vLLM's format) go through an EventTranslator here, one per worker, which re-hashes each
BlockStored's token ids (with the compiled twin of the hash, shoal.router.hash_kernel) and
reads BlockRemoved events through its map of engine hashes.

Router hashes are chained, so one hash names its block and its whole prefix: the index is a
flat table from hash to block id (shoal.router.block_table), and per block id a bit
mask of the workers holding it (one bit per worker, shared by every block: a block costs
one row of W/64 words however many workers hold it). A lookup finds the ids of all the
prompt's blocks in one vectorised pass, gathers their masks and ANDs them cumulatively:
where the running mask loses a worker's bit is that worker's overlap, so Python work is
done only where the holders change. A short prompt (SHORT_PROMPT_BLOCKS), where numpy's
cost per call would dominate, is looked up in Python instead (BlockTable.leading_ids_short),
its masks ANDed as Python ints.

The (worker, block) pairs that start or stop being held are queued, a batch of keys at a
time, and applied in order to the table and the masks by one compiled loop
(table_kernels.apply_changes) before any lookup, or once FLUSH_OPS pairs wait (a lookup
pays for what is queued: the larger FLUSH_OPS, the fewer calls per block and the more a
lookup may wait).

Blocks in GPU memory are indexed here; blocks in a worker's lower tiers (events with
`medium` CPU or DISK, shoal.engine.kv_offload) go to a second index of the same kind,
`lower`, with the same bit per worker, and tiered_overlaps says how far a prompt's prefix
reaches through GPU and lower tiers together.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence, Set
from contextlib import AbstractContextManager, nullcontext
from itertools import accumulate, groupby
from operator import and_

import numpy as np

from shoal.protocol import (
    GPU_MEDIA,
    AllBlocksCleared,
    EngineBlockHash,
    KVEvent,
    RouteHashesRemoved,
    RouteHashesStored,
)
from shoal.route_events import Change, EventTranslator
from shoal.router import hash_kernel, table_kernels
from shoal.router.block_table import BlockTable, Prefilled

FLUSH_OPS = 2048  # queued (worker, block) changes applied without waiting for a lookup
# queued changes past which a flush waits for the table's growth in a thread to end (events
# far faster than a growth: the queue and the next growth stay bounded)
MAX_DEFERRED_OPS = 1 << 18
SHORT_PROMPT_BLOCKS = 96  # prompts up to this many blocks are looked up without numpy
DUMP_SLICE_OPS = 4096  # block changes a dump applies per hold of the caller's lock (load_dump)
DUMP_SCAN_ROWS = 1 << 17  # rows of the masks a dump reads per hold (KvIndexer.holdings)
_DIRECT = frozenset((RouteHashesStored, RouteHashesRemoved, AllBlocksCleared))  # no translation


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


def _le_bytes(hashes: np.ndarray) -> bytes:
    """u64 hashes as the little-endian bytes events carry them in (the queue's form)."""
    return hashes.astype("<u8", copy=False).tobytes()


def _leading(words: list[np.ndarray], columns: _Columns) -> dict[str, int]:
    """Per worker whose bit is set in the first row, how many leading rows all have it; the
    rows come as one array per mask word (each a long prompt's rows, small enough to stay
    in cache).

    The rows fall into runs of equal masks (a prefix's holders change at a few blocks), so
    only each run's first mask is ANDed cumulatively with the runs before; where the running
    mask loses bits, they are unpacked in one call. No Python step is taken per row or per
    change."""
    n = len(words[0])
    if not n:
        return {}
    changed = words[0][1:] != words[0][:-1]
    for word in words[1:]:
        changed |= word[1:] != word[:-1]
    starts = np.flatnonzero(changed) + 1  # the rows that begin a run, after the first
    acc = np.stack([np.bitwise_and.accumulate(word[np.append(0, starts)]) for word in words], 1)
    lost = acc.copy()  # per run: the bits its end loses (the last run: all it still has)
    lost[:-1] &= ~acc[1:]
    depth = np.append(starts, n)
    bits = np.unpackbits(lost.astype("<u8", copy=False).view(np.uint8), bitorder="little")
    where, column = np.divmod(np.flatnonzero(bits.view(np.bool_)), 64 * len(words))
    names = columns.names
    return {names[c]: d for c, d in zip(column.tolist(), depth[where].tolist(), strict=True)}


Tiers = tuple[np.ndarray, np.ndarray]  # router hashes (u64) in GPU memory, in the lower tiers
_NO_KEYS = np.zeros(0, np.uint64)
_UNSHARED = nullcontext()  # the lock of a caller that shares the index with no thread


def dump_stores(translated: list[KVEvent | list[Change]]) -> Tiers | None:
    """The router hashes a dump's events (as KvIndexer.translate gives them) store, per tier,
    each once; None if they do more than store (a dump only stores what the worker holds)."""
    tiers: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for item in translated:
        kind = type(item)
        if kind is RouteHashesStored:
            keys = np.frombuffer(item.route_hashes, "<u8").astype(np.uint64, copy=False)
            tiers[item.medium not in GPU_MEDIA].append(keys)
        elif kind is list:
            for held, keys, lower, _medium in item:
                if not held or keys is None:
                    return None
                tiers[lower].append(_u64(keys))
        else:
            return None
    gpu, lower = (np.unique(np.concatenate(keys)) if keys else _NO_KEYS for keys in tiers)
    return gpu, lower


def resync_changes(held: Tiers, stored: Tiers) -> list[tuple[bool, np.ndarray, bool]]:
    """The (lower tier, keys, now held) changes that take a worker from the blocks it `held`
    to those it `stored`, per tier, in slices of at most DUMP_SLICE_OPS keys; removals first."""
    changes = []
    for lower, (before, after) in enumerate(zip(held, stored, strict=True)):
        gone = np.setdiff1d(before, after, assume_unique=True)
        new = np.setdiff1d(after, before, assume_unique=True)
        for keys, now_held in ((gone, False), (new, True)):
            for start in range(0, len(keys), DUMP_SLICE_OPS):
                changes.append((bool(lower), keys[start : start + DUMP_SLICE_OPS], now_held))
    return changes


class KvIndexer:
    """Router block hash -> workers holding it, and per worker how many, from KV events."""

    def __init__(self, lower_tiers: bool = True, _columns: _Columns | None = None) -> None:
        """lower_tiers: also index the blocks workers hold in host memory or on disk."""
        self._owns_columns = _columns is None  # the GPU index; the lower one shares its bits
        self._columns = _columns or _Columns()
        self._table = BlockTable()
        self._bits = np.zeros((self._table.id_capacity, 1), np.uint64)  # block id -> mask
        self._spare_bits: Prefilled | None = None  # the masks for the table's next ids
        self._held: dict[str, int] = {}  # worker -> blocks it holds here
        self._translators: dict[str, EventTranslator] = {}  # workers publishing vLLM's format
        # (worker, block) changes not yet in the table and masks: (router hashes as u64
        # bytes, their count, column, held)
        self._queued: list[tuple[bytes, int, int, bool]] = []
        self._queued_ops = 0
        self._queued_stores = 0
        self.lower: KvIndexer | None = (
            KvIndexer(lower_tiers=False, _columns=self._columns) if lower_tiers else None
        )

    def apply(self, worker_id: str, event: KVEvent) -> None:
        """Apply one KV event published by `worker_id`."""
        self.apply_batch(worker_id, (event,))

    def apply_batch(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """Apply a batch in order: router hashes are queued as they come; runs of
        vLLM-format events go through the worker's translator."""
        self.apply_translated(worker_id, self.translate(worker_id, events))

    def translate(
        self, worker_id: str, events: Iterable[KVEvent], fresh: bool = False
    ) -> list[KVEvent | list[Change]]:
        """The batch as apply_translated takes it: runs of vLLM-format events as the Changes
        the worker's translator makes of them (their tokens re-hashed), the rest as they
        are. Only the worker's translator changes here (a thread applying one worker's
        events may run this outside the lock lookups take); fresh: it starts from nothing
        first (a dump)."""
        if fresh:
            self._clear_translator(worker_id)
        translated: list[KVEvent | list[Change]] = []
        foreign: list[KVEvent] = []
        for event in events:
            kind = type(event)
            if kind not in _DIRECT:
                foreign.append(event)
                continue
            if foreign:
                translated.append(self._translator(worker_id).translate(foreign))
                foreign = []
            if kind is AllBlocksCleared:
                self._clear_translator(worker_id)
            translated.append(event)
        if foreign:
            translated.append(self._translator(worker_id).translate(foreign))
        return translated

    def apply_translated(
        self, worker_id: str, translated: list[KVEvent | list[Change]], fresh: bool = False
    ) -> None:
        """Apply a batch of `translate`, in order; fresh: what the index knows of the worker
        is dropped first (a dump: translated with fresh too)."""
        if fresh:
            self._clear_bits(worker_id)
        self._known(worker_id)  # a worker is known from its first event on
        for item in translated:
            kind = type(item)
            if kind is list:
                self._apply_changes(worker_id, item)
            elif kind is AllBlocksCleared:
                self._clear_bits(worker_id)
            else:
                index = self if item.medium in GPU_MEDIA else self.lower
                if index is not None and item.route_hashes:
                    index._queue_bytes(worker_id, item.route_hashes, kind is RouteHashesStored)
        self._flush_if_full()

    def store(
        self,
        worker_id: str,
        block_hashes: Sequence[int],
        engine_hashes: Sequence[EngineBlockHash] | None = None,
    ) -> None:
        """Record that `worker_id` holds these blocks (router hashes), which its engine calls
        `engine_hashes` (the same if None); storing a held engine block again is a no-op."""
        keys = block_hashes if type(block_hashes) is list else list(block_hashes)
        self._known(worker_id)
        for held, changed in self._translator(worker_id).gpu.store(keys, engine_hashes):
            self._change(worker_id, changed, held)
        self._flush_if_full()

    def remove(self, worker_id: str, engine_hashes: Iterable[EngineBlockHash]) -> None:
        """Forget these blocks (by the engine's hashes); blocks not held are ignored."""
        self._known(worker_id)
        self._change(worker_id, self._translator(worker_id).gpu.remove(engine_hashes), False)
        self._flush_if_full()

    def clear(self, worker_id: str) -> None:
        """Forget every block of `worker_id`, keeping the worker known (with no blocks)."""
        self._clear_translator(worker_id)
        self._clear_bits(worker_id)

    def _clear_translator(self, worker_id: str) -> None:
        """Empty the worker's translator's maps, if it has one (vLLM-format events)."""
        translator = self._translators.get(worker_id)
        if translator is not None:
            translator.clear()

    def _clear_bits(self, worker_id: str) -> None:
        """Clear the worker's bit from every block, in both tiers, keeping it known."""
        self._forget(worker_id)
        self._known(worker_id)
        if self.lower is not None:
            self.lower._clear_bits(worker_id)

    def load_dump(
        self,
        worker_id: str,
        events: Iterable[KVEvent],
        lock: AbstractContextManager = _UNSHARED,
    ) -> None:
        """Replace all that is known of `worker_id` with what these events store (a resync:
        KVStateDump.events).

        Only the difference from what the index holds of the worker changes, DUMP_SLICE_OPS
        blocks at a time, each slice under `lock` (the event thread's: lookups run between
        slices, and the blocks the worker kept stay indexed throughout); the re-hash and the
        difference are computed without it. Events that do more than store are applied in
        one step instead."""
        translated = self.translate(worker_id, events, fresh=True)
        stored = dump_stores(translated)
        if stored is None:
            with lock:
                self.apply_translated(worker_id, translated, fresh=True)
            return
        if self.lower is None:
            stored = stored[0], _NO_KEYS
        self._await_growth()
        held = self.holdings(worker_id, lock)
        for lower, keys, now_held in resync_changes(held, stored):
            index = self.lower if lower else self
            index._table.await_growth()  # a growth is waited for here, not under the lock
            with lock:
                index._change(worker_id, keys, now_held)
                index.flush(wait=False)

    def _await_growth(self) -> None:
        for index in (self, self.lower):
            if index is not None:
                index._table.await_growth()

    def holdings(self, worker_id: str, lock: AbstractContextManager = _UNSHARED) -> Tiers:
        """The router hashes `worker_id` holds, in GPU memory and in the lower tiers, read
        DUMP_SCAN_ROWS rows of the masks per hold of `lock` (whoever calls this is the only
        one changing the worker's blocks meanwhile; a tier that never heard of the worker is
        not read); from here on the worker is known (a dump of nothing still names it)."""
        with lock:
            held = worker_id in self._held, self.lower is not None and worker_id in self.lower._held
            self._known(worker_id)
            column = self._columns.of[worker_id]
        lower = self.lower._column_keys(column, lock) if held[1] else _NO_KEYS
        return self._column_keys(column, lock) if held[0] else _NO_KEYS, lower

    def remove_worker(self, worker_id: str) -> None:
        self._forget(worker_id)
        self._translators.pop(worker_id, None)
        if self.lower is not None:
            self.lower._forget(worker_id)
        if self._owns_columns:
            self._columns.release(worker_id)

    def overlaps(self, block_hashes: Sequence[int] | np.ndarray) -> dict[str, int]:
        """Per worker, how many leading blocks of this chained-hash sequence it holds.

        Workers holding none of the leading blocks are left out. The blocks' ids are found
        in one pass; the masks of the leading blocks the index knows are ANDed cumulatively
        and each worker's overlap is where its bit drops out.
        """
        self.flush(wait=False)
        if not len(block_hashes) or not self._table.live:
            return {}
        if len(block_hashes) <= SHORT_PROMPT_BLOCKS:
            if isinstance(block_hashes, np.ndarray):
                block_hashes = block_hashes.tolist()
            return self._short_overlaps(block_hashes)
        ids = self._table.leading_ids(_u64(block_hashes))
        rows = np.take(self._bits, ids, axis=0)
        return _leading([rows[:, w] for w in range(rows.shape[1])], self._columns)

    def _short_overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """overlaps() for a short prompt, where numpy's cost per call would dominate: ids
        read from the table in Python, masks as Python ints, ANDed and grouped into runs in C."""
        ids = self._table.leading_ids_short(block_hashes)
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
        self.flush(wait=False)
        lower.flush(wait=False)
        if not lower._table.live:
            return {}
        keys = _u64(block_hashes)
        words = self._columns.words
        rows = self._rows(keys, words) | lower._rows(keys, words)
        deep = _leading([rows[:, w] for w in range(words)], self._columns)
        return {w: d for w, d in deep.items() if d > gpu.get(w, 0)}

    def blocks(self, worker_id: str) -> Set[int]:
        """The router hashes `worker_id` holds (read-only; a live view where its events are
        translated here, as the router's own predictions are; empty if unknown)."""
        translator = self._translators.get(worker_id)
        if translator is not None:
            return translator.gpu.count.keys()
        column = self._columns.of.get(worker_id)
        if column is None or worker_id not in self._held:
            return frozenset()
        return frozenset(self._column_keys(column).tolist())

    def num_blocks(self, worker_id: str) -> int:
        return self._held.get(worker_id, 0)

    def num_distinct_blocks(self) -> int:
        """Blocks held by at least one worker (each counted once)."""
        self.flush()
        return self._table.live

    def workers(self) -> set[str]:
        """Workers this index has heard of and not removed (some may hold no blocks)."""
        return set(self._held)

    # ---- internals

    def _known(self, worker_id: str) -> None:
        if worker_id not in self._held:
            self._held[worker_id] = 0
            self._columns.get(worker_id)

    def _translator(self, worker_id: str) -> EventTranslator:
        translator = self._translators.get(worker_id)
        if translator is None:
            translator = self._translators[worker_id] = EventTranslator(
                worker_id, hash_kernel.route_hash_runs
            )
        return translator

    def _apply_changes(self, worker_id: str, changes: list[Change]) -> None:
        for held, keys, lower, _medium in changes:
            if keys is None:  # the translator has cleared its maps
                self._clear_bits(worker_id)
            elif not lower:
                self._change(worker_id, keys, held)
            elif self.lower is not None:
                self.lower._change(worker_id, keys, held)

    def _change(self, worker_id: str, keys: np.ndarray | list[int], held: bool) -> None:
        """Queue that `worker_id` now holds (or no longer holds) these router hashes."""
        if len(keys):
            self._queue_bytes(worker_id, _le_bytes(_u64(keys)), held)

    def _queue_bytes(self, worker_id: str, keys: bytes, held: bool) -> None:
        """_change for router hashes as little-endian u64 bytes (as events carry them)."""
        count = len(keys) >> 3
        self._known(worker_id)
        self._held[worker_id] += count if held else -count
        self._queue(self._columns.of[worker_id], keys, count, held)

    def _queue(self, column: int, keys: bytes, count: int, held: bool) -> None:
        self._queued.append((keys, count, column, held))
        self._queued_ops += count
        if held:
            self._queued_stores += count

    def _flush_if_full(self) -> None:
        if self._queued_ops >= FLUSH_OPS:
            self.flush(wait=False)
        if self.lower is not None and self.lower._queued_ops >= FLUSH_OPS:
            self.lower.flush(wait=False)

    def _forget(self, worker_id: str) -> None:
        """Clear the worker's bit from every block and forget it here."""
        if self._held.pop(worker_id, None) is None:
            return
        column = self._columns.of[worker_id]
        keys = self._column_keys(column)
        if len(keys):
            self._queue(column, _le_bytes(keys), len(keys), False)
            self.flush()

    def _column_keys(self, column: int, lock: AbstractContextManager = _UNSHARED) -> np.ndarray:
        """The router hashes of the blocks whose mask has this column's bit (the queue
        applied), read DUMP_SCAN_ROWS rows of the masks per hold of `lock`."""
        word, bit = column >> 6, np.uint64(1 << (column & 63))
        parts = [_NO_KEYS]
        start, rows = 0, 1
        while start < rows:
            with lock:
                self.flush()
                bits = self._bits
                rows = len(bits) if word < bits.shape[1] else 0
                if start < rows:
                    masks = bits[start : start + DUMP_SCAN_ROWS, word]
                    parts.append(self._table.key_of[np.flatnonzero(masks & bit) + start])
            start += DUMP_SCAN_ROWS
        return np.concatenate(parts)

    def flush(self, wait: bool = True) -> None:
        """Apply the queued (worker, block) changes to the table and the masks, in order.

        Lookups and full queues flush with `wait` False: while the table grows its slots in
        a thread (BlockTable.reserve), the changes stay queued and lookups read the index as
        it was, a stale answer for the growth's tens of milliseconds rather than a loop held
        for them (up to MAX_DEFERRED_OPS queued changes)."""
        if not self._queued:
            return
        wait = wait or self._queued_ops >= MAX_DEFERRED_OPS
        if not self._table.reserve(self._queued_stores, wait):
            return
        queued, self._queued, self._queued_ops, self._queued_stores = self._queued, [], 0, 0
        chunks, lengths, columns, helds = zip(*queued, strict=True)
        keys = np.frombuffer(b"".join(chunks), "<u8")
        self._fit()
        strays = np.zeros(64 * self._bits.shape[1], np.int64)
        table_kernels.apply_changes(
            keys,
            np.repeat(np.array(columns, np.int64), lengths),
            np.repeat(np.array(helds, np.bool_), lengths),
            self._bits,
            strays,
            *self._table.arrays,
        )
        if strays.any():
            self._count_back(strays)

    def _count_back(self, strays: np.ndarray) -> None:
        """Undo the queue's count of the changes that changed nothing (strays per column:
        table_kernels.apply_changes), per worker."""
        names = self._columns.names
        for column in np.flatnonzero(strays).tolist():
            worker = names[column]
            if worker in self._held:
                self._held[worker] += int(strays[column])

    def _fit(self) -> None:
        """Grow the mask matrix to every id the table hands out and every worker's column
        (into the matrix filled in a thread for the table's next id capacity, when that
        is the size)."""
        rows, words = self._table.id_capacity, self._columns.words
        old_rows, old_words = self._bits.shape
        if old_rows < rows or old_words < words:
            shape = (max(rows, old_rows), max(words, old_words))
            spare, self._spare_bits = self._spare_bits, None
            if spare is not None and spare.array.shape == shape:
                grown = spare.take()
            else:
                grown = np.zeros(shape, np.uint64)
            grown[:old_rows, :old_words] = self._bits
            self._bits = grown
        upcoming = self._table.next_id_capacity
        if upcoming is not None and self._spare_bits is None:
            self._spare_bits = Prefilled((upcoming, self._bits.shape[1]), np.uint64, 0)

    def _rows(self, keys: np.ndarray, words: int) -> np.ndarray:
        """The masks of these keys' blocks (zero where not indexed), `words` wide."""
        ids = self._table.ids(keys)
        rows = np.zeros((len(keys), words), np.uint64)
        known = ids >= 0
        width = min(words, self._bits.shape[1])
        rows[known, :width] = self._bits[ids[known], :width]
        return rows
