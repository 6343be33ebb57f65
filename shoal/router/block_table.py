"""A hash table from 64-bit block hashes to small dense block ids, held in numpy arrays.

Open addressing with linear probing (Fibonacci hashing picks the home slot), so finding,
adding or removing many keys at once costs a few vectorised passes over the keys instead
of a Python step (and a few cache misses) per key; gathers use np.take, which numpy runs at
about twice the speed of indexing with an array. Removed keys leave tombstones until the
next rehash; freed ids are handed out again, so ids stay below the peak number of keys.
"""

from __future__ import annotations

import numpy as np

EMPTY, GONE = -1, -2  # slot states in the id array (a live slot holds an id >= 0)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIN_SLOTS = 1 << 12
_WINDOW = np.arange(8)  # slots probed together (a cache line of keys); 8 bools read as a uint64
_ONE_PROBE_FIRST = 256  # keys in a call above which each key's home slot is probed alone first
_STRIDE = 32  # leading_ids: one key in this many is looked up in the slots


def _offsets(n: int) -> np.ndarray:
    """0, 1, ..., _STRIDE - 1, 0, 1, ... (n values)."""
    return np.arange(n) & (_STRIDE - 1)


def _grown(array: np.ndarray, size: int) -> np.ndarray:
    """`array` extended with zeros to `size` elements."""
    grown = np.zeros(size, array.dtype)
    grown[: len(array)] = array
    return grown


class BlockTable:
    """Block hash (uint64) -> block id (int), for many keys per call."""

    def __init__(self) -> None:
        self._reset_slots(_MIN_SLOTS)
        self.key_of = np.zeros(_MIN_SLOTS // 2, np.uint64)  # block id -> its block hash
        self._live_id = np.zeros(_MIN_SLOTS // 2, bool)  # whether the id names a key now
        self._free: list[int] = []  # ids freed, reused first
        self._next = 0  # ids below this have been handed out
        self.live = 0  # keys in the table

    @property
    def id_capacity(self) -> int:
        """Every id handed out is below this (arrays indexed by id need this many rows)."""
        return len(self.key_of)

    def ids(self, keys: np.ndarray) -> np.ndarray:
        """The id of each key, -1 where the key is absent."""
        pos = self._find(keys)
        out = np.take(self._ids, pos)
        out[pos < 0] = -1
        return out

    def leading_ids(self, keys: np.ndarray) -> np.ndarray:
        """The ids of a sequence's blocks (chained hashes, in order) up to the first one
        absent. Blocks stored together were given consecutive ids, so only every
        _STRIDE-th key is looked up in the slots: the ids between are guessed from the one
        before and checked against key_of and the live ids (reads in id order, not
        scattered ones), and only the keys guessed wrong are looked up."""
        n = len(keys)
        if n < 4 * _STRIDE:
            ids = self.ids(keys)
        else:
            anchors = self.ids(keys[::_STRIDE])
            absent = np.flatnonzero(anchors < 0)
            end = int(absent[0]) * _STRIDE if len(absent) else n  # no key from there is needed
            keys = keys[:end]
            ids = np.repeat(anchors[: -(-end // _STRIDE)], _STRIDE)[:end]
            ids += _offsets(end)
            wrong = ids >= self._next
            guess = np.minimum(ids, self._next - 1)
            wrong |= np.take(self.key_of, guess) != keys
            wrong |= ~np.take(self._live_id, guess)  # a freed id still names its last key
            wrong = np.flatnonzero(wrong)
            if len(wrong):
                ids[wrong] = self.ids(keys[wrong])
        missing = np.flatnonzero(ids < 0)
        return ids[: missing[0]] if len(missing) else ids

    def add(self, keys: np.ndarray) -> np.ndarray:
        """Add keys (distinct, none present yet); their new ids."""
        n = len(keys)
        if (self._used + n) * 5 > 2 * len(self._keys):
            self._rehash(self.live + n)
        ids = self._allocate(n)
        self.key_of[ids] = keys
        self._live_id[ids] = True
        self._place(keys, ids)
        self.live += n
        return ids

    def remove(self, ids: np.ndarray) -> None:
        """Remove the keys of these live ids (distinct), freeing the ids."""
        self._ids[self._find(self.key_of[ids])] = GONE
        self._live_id[ids] = False
        self._free.extend(ids.tolist())
        self.live -= len(ids)

    def _reset_slots(self, slots: int) -> None:
        self._keys = np.zeros(slots, np.uint64)
        self._ids = np.full(slots, EMPTY, np.int32)
        self._mask = slots - 1
        self._shift = np.uint64(65 - slots.bit_length())  # top log2(slots) bits
        self._used = 0  # live slots and tombstones

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _GOLDEN) >> self._shift).astype(np.intp)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key, -1 where absent. Probes go WINDOW slots a pass, so the passes
        do not follow the longest probe sequence one slot at a time; a long array first
        probes each key's home slot alone (where most keys are)."""
        pos = self._home(keys)
        found = np.full(len(keys), -1, np.intp)
        todo = np.arange(len(keys))
        while len(todo) > _ONE_PROBE_FIRST:
            ids = np.take(self._ids, pos)
            hit = (np.take(self._keys, pos) == keys) & (ids >= 0)
            found[todo[hit]] = pos[hit]
            go_on = ~hit & (ids != EMPTY)
            todo, keys, pos = todo[go_on], keys[go_on], (pos[go_on] + 1) & self._mask
        while len(todo):
            window = (pos[:, None] + _WINDOW) & self._mask
            ids = np.take(self._ids, window)
            match = (np.take(self._keys, window) == keys[:, None]) & (ids >= 0)
            row, col = np.nonzero(match)  # a key is never stored past an empty slot
            found[todo[row]] = window[row, col]
            # a row of 8 bools read as one uint64: nonzero if any is set
            go_on = (match.view(np.uint64)[:, 0] == 0) & ((ids == EMPTY).view(np.uint64)[:, 0] == 0)
            todo, keys, pos = todo[go_on], keys[go_on], pos[go_on] + len(_WINDOW)
        return found

    def _place(self, keys: np.ndarray, ids: np.ndarray) -> None:
        """Put absent keys in free slots (home first, then the first open one of a window
        on). Where several keys want one slot, each writes its id there and the one whose
        id stays has it; the others probe on."""
        pos = self._home(keys)
        if len(keys) > _ONE_PROBE_FIRST:
            pos = self._claim(pos, keys, ids, np.take(self._ids, pos) < 0)
            keys, ids = keys[pos >= 0], ids[pos >= 0]
            pos = pos[pos >= 0]
        while len(keys):
            window = (pos[:, None] + _WINDOW) & self._mask
            open_ = np.take(self._ids, window) < 0
            some = open_.view(np.uint64)[:, 0] != 0
            target = np.where(some, window[np.arange(len(keys)), open_.argmax(axis=1)], pos)
            pos = self._claim(target, keys, ids, some)
            more = pos >= 0
            pos = np.where(some, pos, pos + len(_WINDOW))[more]
            keys, ids = keys[more], ids[more]

    def _claim(
        self, target: np.ndarray, keys: np.ndarray, ids: np.ndarray, open_: np.ndarray
    ) -> np.ndarray:
        """Place each key whose target slot is open and who wins it; the target of those
        left to place (-1 for those placed)."""
        slots = target[open_]
        was_empty = self._ids[slots] == EMPTY
        self._ids[slots] = ids[open_]  # one id per slot stays
        mine = self._ids[slots] == ids[open_]
        self._used += int(np.count_nonzero(mine & was_empty))
        won = np.zeros(len(keys), bool)
        won[open_] = mine
        self._keys[target[won]] = keys[won]
        return np.where(won, -1, target)

    def _rehash(self, live: int) -> None:
        """Rebuild the slots for `live` keys at most a quarter full, dropping tombstones."""
        held = self._ids >= 0
        keys, ids = self._keys[held], self._ids[held]
        self._reset_slots(max(_MIN_SLOTS, 1 << (4 * live).bit_length()))
        self._place(keys, ids)

    def _allocate(self, n: int) -> np.ndarray:
        reused = min(n, len(self._free))
        ids = np.empty(n, np.int64)
        if reused:
            ids[:reused] = self._free[-reused:]
            del self._free[-reused:]
        ids[reused:] = np.arange(self._next, self._next + n - reused)
        self._next += n - reused
        if self._next > len(self.key_of):
            size = max(2 * len(self.key_of), self._next)
            self.key_of = _grown(self.key_of, size)
            self._live_id = _grown(self._live_id, size)
        return ids
