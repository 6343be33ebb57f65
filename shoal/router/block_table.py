"""A hash table from 64-bit block hashes to small dense block ids, held in numpy arrays.

Open addressing with linear probing (Fibonacci hashing picks the home slot), so finding,
adding or removing many keys at once costs a few vectorised passes over the keys instead
of a Python step (and a few cache misses) per key; gathers use np.take, which numpy runs at
about twice the speed of indexing with an array. A removed key leaves a tombstone where a
probe may pass it (a slot followed by an empty one is emptied instead), until the next
rehash (a new key takes the first free slot it passes, tombstone or empty); freed ids
are handed out again, so ids stay below the peak number of keys.
"""

from __future__ import annotations

import numpy as np

EMPTY, GONE = -1, -2  # slot states in the id array (a live slot holds an id >= 0)
_CLAIMED = np.iinfo(np.int32).max  # a slot taken while add() places keys, before its id
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIN_SLOTS = 1 << 12
_WINDOW = np.arange(8)  # slots probed together (a cache line of keys)
_WIDE_WINDOW = np.arange(64)  # slots probed together by the keys still looking after one window
_ONE_PROBE_FIRST = 256  # keys in a call above which each key's home slot is probed alone first
_STRIDE = 32  # leading_ids: one key in this many is looked up in the slots
_FEW = 8  # keys left to probe or place below which a Python loop is cheaper than a numpy pass
_U64 = (1 << 64) - 1


def _offsets(n: int) -> np.ndarray:
    """0, 1, ..., _STRIDE - 1, 0, 1, ... (n values)."""
    return np.arange(n) & (_STRIDE - 1)


def _any_per_row(flags: np.ndarray) -> np.ndarray:
    """Whether each row of a bool matrix (a multiple of 8 wide) has a set flag: its rows
    read as uint64 words."""
    words = flags.view(np.uint64)
    return words[:, 0] != 0 if words.shape[1] == 1 else words.any(axis=1)


def _grown(array: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
    """`array` extended with `fill` to `size` elements."""
    grown = np.full(size, fill, array.dtype)
    grown[: len(array)] = array
    return grown


class BlockTable:
    """Block hash (uint64) -> block id (int), for many keys per call."""

    def __init__(self) -> None:
        self._reset_slots(_MIN_SLOTS)
        self.key_of = np.zeros(_MIN_SLOTS // 2, np.uint64)  # block id -> its block hash
        self._slot_of = np.full(_MIN_SLOTS // 2, -1, np.intp)  # block id -> its slot; -1: free
        self._free: list[int] = []  # ids freed, reused first
        self._next = 0  # ids below this have been handed out
        self.live = 0  # keys in the table

    @property
    def id_capacity(self) -> int:
        """Every id handed out is below this (arrays indexed by id need this many rows)."""
        return len(self.key_of)

    @property
    def tombstones(self) -> int:
        """Slots of removed keys that probes still pass (until the next rehash)."""
        return self._used - self.live

    def ids(self, keys: np.ndarray) -> np.ndarray:
        """The id of each key, -1 where the key is absent."""
        pos = self._find(keys)
        out = np.take(self._ids, pos)
        out[pos < 0] = -1
        return out

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
        """The id of one key, -1 if absent."""
        slot, _ = self._probe_one(key, ((key * int(_GOLDEN)) & _U64) >> int(self._shift), -1)
        return -1 if slot < 0 else int(self._ids[slot])

    def _probe_one(self, key: int, slot: int, free: int) -> tuple[int, int]:
        """_probe for one key, in Python, going on from `slot`; `free`: the first free slot it
        has passed (-1: none yet)."""
        ids, keys, mask = memoryview(self._ids), memoryview(self._keys), self._mask
        while (state := ids[slot]) != EMPTY:
            if state >= 0:
                if keys[slot] == key:
                    return slot, free
            elif free < 0:
                free = slot
            slot = (slot + 1) & mask
        return -1, slot if free < 0 else free

    def add(self, keys: np.ndarray) -> np.ndarray:
        """The id of each key, adding the keys the table lacks (keys may repeat). Keys added
        together get ids in the order they come, so a sequence's blocks stored together
        have consecutive ids (see leading_ids)."""
        if (self._used + len(keys)) * 5 > 2 * len(self._keys):
            self._rehash(self.live + len(keys))
        found, open_ = self._probe(keys, open_slots=True)
        ids = np.take(self._ids, found)
        absent = np.flatnonzero(found < 0)
        if len(absent):
            ids[absent] = self._insert(keys[absent], open_[absent])
        return ids

    def remove(self, ids: np.ndarray) -> None:
        """Remove the keys of these live ids (which may repeat), freeing the ids."""
        slots, rank = self._slot_of[ids], -1 - np.arange(len(ids))
        self._slot_of[ids] = rank  # one rank stays per id
        first = self._slot_of[ids] == rank
        ids, slots = ids[first], slots[first]
        self._ids[slots] = GONE
        self._vacate(slots)
        self._slot_of[ids] = -1
        self.key_of[ids] = 0  # leading_ids' guesses never take a freed id for its old key
        self._free.extend(ids.tolist())
        self.live -= len(ids)

    def _vacate(self, slots: np.ndarray) -> None:
        """Empty the tombstones among `slots` that end their cluster, and the tombstones
        before them in turn: no probe passes a slot followed by an empty one, so it needs
        no tombstone (later probes stop there, and fewer rehashes are due). The first pass
        is vectorised; the few tombstones found before emptied slots are walked in Python."""
        ends = slots[np.take(self._ids, (slots + 1) & self._mask) == EMPTY]
        self._ids[ends] = EMPTY
        self._used -= len(ends)
        before = (ends - 1) & self._mask
        ids, mask = memoryview(self._ids), self._mask
        for slot in before[np.take(self._ids, before) == GONE].tolist():
            while ids[slot] == GONE:
                ids[slot] = EMPTY
                self._used -= 1
                slot = (slot - 1) & mask

    def _reset_slots(self, slots: int) -> None:
        self._keys = np.zeros(slots, np.uint64)
        self._ids = np.full(slots, EMPTY, np.int32)
        self._mask = slots - 1
        self._shift = np.uint64(65 - slots.bit_length())  # top log2(slots) bits
        self._used = 0  # live slots and tombstones

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _GOLDEN) >> self._shift).astype(np.intp)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key, -1 where absent."""
        return self._probe(keys, open_slots=False)[0]

    def _probe(self, keys: np.ndarray, open_slots: bool) -> tuple[np.ndarray, np.ndarray]:
        """Slot of each key (-1 where absent) and, if open_slots, the first free slot (empty
        or a tombstone) each absent key passed. A long array first probes each key's home
        slot alone (where most keys are); then each pass reads a window of slots per key,
        wider after the first, so the few keys in long clusters cost few passes."""
        pos = self._home(keys)
        if len(keys) > _ONE_PROBE_FIRST:
            ids = np.take(self._ids, pos)
            hit = np.take(self._keys, pos) == keys
            hit &= ids >= 0
            found = np.where(hit, pos, -1)
            free = np.where(ids < 0, pos, -1) if open_slots else np.full(len(keys), -1, np.intp)
            todo = np.flatnonzero((ids != EMPTY) > hit)  # neither found nor at an empty slot
            keys = np.take(keys, todo)
            pos = (np.take(pos, todo) + 1) & self._mask
        else:
            found = np.full(len(keys), -1, np.intp)
            free = np.full(len(keys), -1, np.intp)
            todo = np.arange(len(keys))
        window_slots = _WINDOW
        while len(todo):
            if len(todo) <= _FEW:
                for i, key, slot in zip(todo.tolist(), keys.tolist(), pos.tolist(), strict=True):
                    found[i], free[i] = self._probe_one(key, slot & self._mask, int(free[i]))
                break
            window = (pos[:, None] + window_slots) & self._mask
            ids = np.take(self._ids, window)
            match = np.take(self._keys, window) == keys[:, None]
            match &= ids >= 0
            row, col = np.nonzero(match)  # a key is never stored past an empty slot
            found[todo[row]] = window[row, col]
            missed = ~_any_per_row(match)
            if open_slots:
                open_ = ids < 0
                first = missed & _any_per_row(open_) & (np.take(free, todo) < 0)
                free[todo[first]] = window[first, open_[first].argmax(axis=1)]
            go_on = np.flatnonzero(missed & ~_any_per_row(ids == EMPTY))
            todo, keys = np.take(todo, go_on), np.take(keys, go_on)
            pos = np.take(pos, go_on) + len(window_slots)
            window_slots = _WIDE_WINDOW
        return found, free

    def _insert(self, keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Add absent keys (which may repeat), each at the free slot it reached or past it;
        their new ids, handed out in the keys' order."""
        slots, fresh = self._claim(keys, slots)
        rank = np.arange(len(keys), dtype=np.int32)
        np.minimum.at(self._ids, slots, rank)  # claimed slots hold _CLAIMED: now their first key
        first = np.take(self._ids, slots) == rank
        ids = self._allocate(int(np.count_nonzero(first)))
        self._ids[slots[first]] = ids
        self.key_of[ids] = keys[first]
        self._slot_of[ids] = slots[first]
        self.live += len(ids)
        self._used += int(np.count_nonzero(fresh & first))
        return np.take(self._ids, slots)

    def _claim(self, keys: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A slot for each key, from its target on (free when chosen), marked _CLAIMED, and
        whether it was empty (not a tombstone). Where distinct keys want one slot, the key
        written last keeps it and the others go on to the next free slot; equal keys move
        together, so they share one."""
        slots = np.empty(len(keys), np.intp)
        fresh = np.empty(len(keys), bool)
        todo = np.arange(len(keys))
        while len(todo) > _FEW:
            wanted = keys[todo]
            self._keys[target] = wanted
            won = np.take(self._keys, target) == wanted
            mine = target[won]
            slots[todo[won]] = mine
            fresh[todo[won]] = np.take(self._ids, mine) == EMPTY
            self._ids[mine] = _CLAIMED
            todo, target = todo[~won], target[~won]
            if len(todo) > _FEW:
                target = self._free_from(target + 1)
        ids, mask = memoryview(self._ids), self._mask
        placed: dict[int, tuple[int, bool]] = {}  # the few left, one at a time: key -> slot
        for i, key, slot in zip(todo.tolist(), keys[todo].tolist(), target.tolist(), strict=True):
            if key not in placed:
                while ids[slot] >= 0:  # taken meanwhile (live or _CLAIMED)
                    slot = (slot + 1) & mask
                self._keys[slot] = key
                placed[key] = slot, ids[slot] == EMPTY
                ids[slot] = _CLAIMED
            slots[i], fresh[i] = placed[key]
        return slots, fresh

    def _free_from(self, pos: np.ndarray) -> np.ndarray:
        """The first free slot (empty or a tombstone) at or after each position."""
        out = np.empty(len(pos), np.intp)
        todo = np.arange(len(pos))
        window_slots = _WINDOW
        while len(todo):
            window = (pos[:, None] + window_slots) & self._mask
            open_ = np.take(self._ids, window) < 0
            some = _any_per_row(open_)
            out[todo[some]] = window[some, open_[some].argmax(axis=1)]
            todo, pos = todo[~some], pos[~some] + len(window_slots)
            window_slots = _WIDE_WINDOW
        return out

    def _rehash(self, live: int) -> None:
        """Rebuild the slots for `live` keys at most a quarter full, dropping tombstones.

        Taken in order of their new home slots, keys fill the table the way linear probing
        would place them one at a time: each at its home or just past the key before it,
        which a running maximum gives for all at once. The old slots run in home order and a
        new home is an old one with more bits, so the order is nearly sorted already."""
        held = np.flatnonzero(self._ids >= 0)
        keys, ids = np.take(self._keys, held), np.take(self._ids, held)
        self._reset_slots(max(_MIN_SLOTS, 1 << (4 * live).bit_length()))
        home = self._home(keys)
        order = np.argsort(home, kind="stable")
        keys, ids, home = np.take(keys, order), np.take(ids, order), np.take(home, order)
        rank = np.arange(len(keys))
        slots = rank + np.maximum.accumulate(home - rank)  # increasing: past the end come last
        n = int(np.searchsorted(slots, self._mask, side="right"))
        self._keys[slots[:n]] = keys[:n]
        self._ids[slots[:n]] = ids[:n]
        self._slot_of[ids[:n]] = slots[:n]
        if n < len(keys):  # ran past the last slot: they go on from the first
            wrapped = len(keys) - n
            slots, _ = self._claim(keys[n:], self._free_from(np.zeros(wrapped, np.intp)))
            self._ids[slots] = ids[n:]
            self._slot_of[ids[n:]] = slots
        self._used = len(keys)

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
            self._slot_of = _grown(self._slot_of, size, fill=-1)
        return ids
