"""A hash table from 64-bit block hashes to small dense block ids, held in numpy arrays.

Open addressing with linear probing (Fibonacci hashing picks the home slot); the loops that
add, find and remove keys are compiled (shoal.router.table_kernels), a call per batch of
keys. A removal shifts the keys after it back, so no tombstones pile up, and freed ids are
handed out again (oldest first), so ids stay below the peak number of keys.

A table past GROW_IN_THREAD_KEYS keys prepares and builds its larger slots in threads: the
new slots' first touch is the costly part of a growth (page faults: 7-9 us a 4 KiB page on
the VMs measured, 0.1-0.4 s for a table of 1-2M keys), so a thread fills them with empty
slots once the table is _PREPARE_LOAD full (they are held from then on, twice the table's
slots), and at _MAX_LOAD another rehashes the keys into them (reserve with `wait` False).
Filling and the rehash kernel let go of the GIL: the event loop goes on meanwhile, reading
the table as it was. The arrays indexed by id (key_of, slot_of, the ring of freed ids) are
filled the same way once _PREPARE_IDS of their capacity is handed out (and the index's
mask matrix for that capacity, shoal.router.indexer), so that their growth is a copy into
memory already touched: 2.3-2.6 ms at most a step where it was 11-19 ms, on an index
growing to 2M blocks (router_decision.py's growth, dev VM). One thread, started once, does
all the filling (Prefilled): a thread started while another takes page faults waits
milliseconds for the kernel's lock on the address space.
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from shoal.router import table_kernels as kernels
from shoal.router.table_kernels import (
    EMPTY,
    FIBONACCI,
    FREE_COUNT,
    ID,
    KEY,
    LIVE,
    MASK,
    NEXT,
    SHIFT,
    STATE_FIELDS,
    empty_slots,
    set_size,
)

_MIN_SLOTS = 1 << 12
_MAX_LOAD = 0.4  # keys per slot above which the slots are doubled (and more)
_PREPARE_LOAD = 0.3  # keys per slot from which the next slots are prepared in a thread
_PREPARE_IDS = 0.75  # share of the id capacity handed out from which the next is prepared
GROW_IN_THREAD_KEYS = 1 << 14  # from this many keys, slots are prepared and grown in threads
_ID_FILLS = (0, -1, 0)  # what key_of, slot_of and the ring of freed ids hold past their use
_STRIDE = 32  # leading_ids: one key in this many is looked up in the slots
_U64 = (1 << 64) - 1


def _offsets(n: int) -> np.ndarray:
    """0, 1, ..., _STRIDE - 1, 0, 1, ... (n values)."""
    return np.arange(n) & (_STRIDE - 1)


def _slots_for(live: int) -> int:
    """The slots a rehash for `live` keys makes: a quarter full at most."""
    return max(_MIN_SLOTS, 1 << (4 * live).bit_length())


class _Filler(threading.Thread):
    """The one thread that first-touches the arrays prepared for growths, one after another.
    A thread started while another takes page faults waits milliseconds for the kernel's
    lock on the address space, and so does whoever starts it: this one is started once."""

    def __init__(self) -> None:
        super().__init__(name="shoal-block-table-prefill", daemon=True)
        self.jobs: queue.SimpleQueue[Prefilled] = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            job.array.fill(job.fill)  # lets go of the GIL
            job.filled.set()


_filler: _Filler | None = None
_filler_started = threading.Lock()


def _the_filler() -> _Filler:
    global _filler
    with _filler_started:
        if _filler is None:
            _filler = _Filler()
        return _filler


class Prefilled:
    """An array of `shape` filled with `fill`: allocated here, from the calling thread's
    malloc arena (where freed arrays are reused most), and first touched by the filler
    thread (the page faults of fresh memory cost far more than copying into it)."""

    def __init__(self, shape: int | tuple[int, ...], dtype: type, fill: int) -> None:
        self.array = np.empty(shape, dtype)
        self.fill = fill
        self.filled = threading.Event()
        _the_filler().jobs.put(self)

    def take(self) -> np.ndarray:
        """The array, once filled."""
        self.filled.wait()
        return self.array


def _empty_slots(size: int) -> Prefilled:
    """`size` empty slots, filled in a thread (every slot's id EMPTY; keys are not read)."""
    return Prefilled((size, 2), np.int64, EMPTY)


class _Growth(threading.Thread):
    """Larger slots for a table's keys, built beside the event loop (into `spare`, when it
    has the size). The table must not change until it ends: the rehash reads its slots and
    writes its id -> slot map."""

    def __init__(
        self,
        old: np.ndarray,
        slot_of: np.ndarray,
        state: np.ndarray,
        live: int,
        spare: Prefilled | None,
    ) -> None:
        super().__init__(name="shoal-block-table-growth", daemon=True)
        self.old, self.slot_of = old, slot_of
        size = _slots_for(live)
        self.state = state.copy()
        set_size(self.state, size)
        self.empty = spare if spare is not None and len(spare.array) == size else None
        self.slots = self.empty.array if self.empty is not None else np.empty((size, 2), np.int64)
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            if self.empty is not None:
                self.empty.take()
            else:
                self.slots.fill(EMPTY)
            kernels.rehash(self.old, self.slots, self.slot_of, self.state)
        except BaseException as e:  # raised where the table takes the slots
            self.error = e


def _grown(array: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
    """`array` extended with `fill` to `size` elements."""
    grown = np.full(size, fill, array.dtype)
    grown[: len(array)] = array
    return grown


class BlockTable:
    """Block hash (uint64) -> block id (int), for many keys per call."""

    def __init__(self) -> None:
        self._state = np.zeros(STATE_FIELDS, np.int64)
        self._use_slots(empty_slots(_MIN_SLOTS))
        self.key_of = np.zeros(_MIN_SLOTS // 2, np.uint64)  # block id -> its block hash
        self._slot_of = np.full(_MIN_SLOTS // 2, -1, np.int64)  # block id -> its slot; -1: free
        self._free = np.zeros(_MIN_SLOTS // 2, np.int64)  # a ring of freed ids, oldest first
        self._growth: _Growth | None = None  # larger slots being built in a thread
        self._spare: Prefilled | None = None  # empty slots for the next growth
        self._spare_ids: tuple[Prefilled, Prefilled, Prefilled] | None = None  # key_of,
        # slot_of and free of the next id capacity, filled in threads (_PREPARE_IDS)

    @property
    def live(self) -> int:
        """Keys in the table."""
        return int(self._state[LIVE])

    @property
    def _next(self) -> int:
        """Ids below this have been handed out."""
        return int(self._state[NEXT])

    @property
    def id_capacity(self) -> int:
        """Every id handed out is below this (arrays indexed by id need this many rows)."""
        return len(self.key_of)

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """The table as table_kernels' functions take it."""
        return self._slots, self.key_of, self._slot_of, self._free, self._state

    def reserve(self, n: int, wait: bool = True) -> bool:
        """Make room for `n` more keys (the kernels never grow the arrays themselves); whether
        there is. With `wait` False, a table of GROW_IN_THREAD_KEYS keys or more that must
        grow its slots builds them in a thread and this returns False until it is done:
        until a reserve returns True, nothing may change the table (lookups may read it)."""
        if self._growth is not None:
            if self._growth.is_alive() and not wait:
                return False
            self._take_growth()
        if (self.live + n) > _MAX_LOAD * len(self._slots):
            if wait or self.live < GROW_IN_THREAD_KEYS:
                self._rehash(self.live + n)
            else:
                self._growth = _Growth(
                    self._slots, self._slot_of, self._state, self.live + n, self._spare
                )
                self._spare = None
                return False
        needed = self._next + max(0, n - int(self._state[FREE_COUNT]))
        if needed > len(self.key_of):
            self._grow_ids(max(2 * len(self.key_of), needed))
        if self._spare is None and self.live + n >= max(
            GROW_IN_THREAD_KEYS, _PREPARE_LOAD * len(self._slots)
        ):
            self._spare = _empty_slots(2 * len(self._slots))  # what the next growth makes
        if self._spare_ids is None and needed >= max(
            GROW_IN_THREAD_KEYS, _PREPARE_IDS * len(self.key_of)
        ):
            size = 2 * len(self.key_of)
            arrays = (self.key_of, self._slot_of, self._free)
            self._spare_ids = tuple(
                Prefilled(size, a.dtype, fill) for a, fill in zip(arrays, _ID_FILLS, strict=True)
            )
        return True

    @property
    def next_id_capacity(self) -> int | None:
        """The id capacity the next growth of the id arrays makes, once it is prepared."""
        return len(self._spare_ids[0].array) if self._spare_ids is not None else None

    def _grow_ids(self, size: int) -> None:
        """Room for `size` ids: key_of, slot_of and the ring of freed ids (oldest first from
        0) copied into arrays of that size, the prepared ones when they have it."""
        spare, self._spare_ids = self._spare_ids, None
        old = (self.key_of, self._slot_of, self._ring())
        if spare is not None and len(spare[0].array) == size:
            grown = tuple(prepared.take() for prepared in spare)
            for array, part in zip(grown, old, strict=True):
                array[: len(part)] = part
        else:
            parts = zip(old, _ID_FILLS, strict=True)
            grown = tuple(_grown(part, size, fill) for part, fill in parts)
        self.key_of, self._slot_of, self._free = grown
        self._state[kernels.FREE_HEAD] = 0

    def await_growth(self) -> None:
        """Wait for larger slots being built in a thread, if any, without taking them (the
        next reserve does): a caller holding no lock lets lookups go on meanwhile."""
        growth = self._growth
        if growth is not None:
            growth.join()

    @property
    def growing(self) -> bool:
        """Whether larger slots are being built in a thread (reserve(wait=False) said so)."""
        return self._growth is not None and self._growth.is_alive()

    def ids(self, keys: np.ndarray) -> np.ndarray:
        """The id of each key, -1 where the key is absent."""
        out = np.empty(len(keys), np.int64)
        kernels.lookup(keys, out, self._slots, self._state)
        return out

    def add(self, keys: np.ndarray) -> np.ndarray:
        """The id of each key, adding the keys the table lacks (keys may repeat). Keys added
        together get ids in the order they come, so a sequence's blocks stored together
        have consecutive ids where no freed ids are handed out (see leading_ids)."""
        self.reserve(len(keys))
        out = np.empty(len(keys), np.int64)
        kernels.add(keys, out, *self.arrays)
        return out

    def remove(self, ids: np.ndarray) -> None:
        """Remove the keys of these live ids (which may repeat), freeing the ids."""
        self.reserve(0)  # a growth in a thread first ends
        kernels.remove(ids, *self.arrays)

    def leading_ids(self, keys: np.ndarray) -> np.ndarray:
        """The ids of a sequence's blocks (chained hashes, in order) up to the first one
        absent. Blocks stored together were given consecutive ids, so the ids are guessed
        and checked against key_of (reads in id order, not scattered ones) rather than
        looked up in the slots: first every id from the first key's (a prefix stored in
        one go costs one lookup), then, from the first wrong guess on, from the ids of
        every _STRIDE-th key, looking up only the keys guessed wrong."""
        n = len(keys)
        if n < 4 * _STRIDE:
            return self._strided_ids(keys)
        first = self._id_of_key(int(keys[0]))
        if first < 0:
            return np.zeros(0, np.int64)
        ids = np.arange(first, first + n)
        wrong = self._wrong_guesses(ids, keys)
        if not len(wrong):
            return ids
        start = int(wrong[0])
        return np.concatenate((ids[:start], self._strided_ids(keys[start:])))

    def _strided_ids(self, keys: np.ndarray) -> np.ndarray:
        """leading_ids from every _STRIDE-th key's id (a short sequence: every key's)."""
        n = len(keys)
        if n < 4 * _STRIDE:
            return self._up_to_absent(self.ids(keys))
        anchors = self.ids(keys[::_STRIDE])
        absent = np.flatnonzero(anchors < 0)
        end = int(absent[0]) * _STRIDE if len(absent) else n  # no key from there is needed
        keys = keys[:end]
        ids = np.repeat(anchors[: -(-end // _STRIDE)], _STRIDE)[:end]
        ids += _offsets(end)
        wrong = self._wrong_guesses(ids, keys)
        if len(wrong):
            ids[wrong] = self.ids(keys[wrong])
        return self._up_to_absent(ids)

    def _wrong_guesses(self, ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Where a guessed id does not name its key. A freed id's key_of is 0, so only a key
        of 0 (a chance of 2**-64 a block) could take a freed id: its mask is empty, so the
        prefix would only end early there."""
        wrong = ids >= self._next
        wrong |= np.take(self.key_of, np.minimum(ids, self._next - 1)) != keys
        return np.flatnonzero(wrong)

    @staticmethod
    def _up_to_absent(ids: np.ndarray) -> np.ndarray:
        """ids up to the first absent one (-1)."""
        missing = np.flatnonzero(ids < 0)
        return ids[: missing[0]] if len(missing) else ids

    def leading_ids_short(self, keys: list[int]) -> list[int]:
        """leading_ids for a few keys, in Python (numpy's cost per call would dominate): each
        key is first tried at the id after the one before, then looked up in the slots."""
        key_of = memoryview(self.key_of)
        ids: list[int] = []
        guess, end = 0, self._next
        for key in keys:
            if not (guess < end and key_of[guess] == key):  # a freed id's key_of is 0
                guess = self._id_of_key(key)
                if guess < 0:
                    break
            ids.append(guess)
            guess += 1
        return ids

    def _id_of_key(self, key: int) -> int:
        """The id of one key, -1 if absent (in Python: a kernel call costs more for one)."""
        slots, mask = memoryview(self._slots.reshape(-1)), int(self._state[MASK])
        bits = key - (1 << 64) if key >> 63 else key  # as the slots hold it (int64)
        slot = ((key * FIBONACCI) & _U64) >> int(self._state[SHIFT])
        while (block := slots[2 * slot + ID]) != EMPTY:
            if slots[2 * slot + KEY] == bits:
                return block
            slot = (slot + 1) & mask
        return -1

    def _ring(self) -> np.ndarray:
        """The freed ids, oldest first."""
        head, count = int(self._state[kernels.FREE_HEAD]), int(self._state[FREE_COUNT])
        return self._free[(head + np.arange(count)) % len(self._free)]

    def _use_slots(self, slots: np.ndarray) -> None:
        self._slots = slots
        set_size(self._state, len(slots))

    def _rehash(self, live: int) -> None:
        """Rebuild the slots for `live` keys, at most a quarter full (into the spare slots,
        when they have the size)."""
        old, spare, self._spare = self._slots, self._spare, None
        size = _slots_for(live)
        if spare is not None and len(spare.array) == size:
            self._use_slots(spare.take())
        else:
            self._use_slots(empty_slots(size))
        kernels.rehash(old, self._slots, self._slot_of, self._state)

    def _take_growth(self) -> None:
        """Wait for the slots built in a thread and use them."""
        growth, self._growth = self._growth, None
        growth.join()
        if growth.error is not None:
            raise growth.error
        self._use_slots(growth.slots)
