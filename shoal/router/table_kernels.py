"""The block table's loops and the KV index's flush, compiled with numba.

A table of 64-bit block hashes to dense block ids is one open-addressing array of slots,
each a key (its bits as int64) and the key's id side by side, so a probe reads one cache
line per slot (linear probing from a Fibonacci-hashed home slot, EMPTY ids where no key
is), with per id its key and its slot. A removal moves the keys after it back (backward
shift), so there are no tombstones and a probe stops at the first empty slot. Freed ids
wait in a ring and are handed out oldest first, so a prefix evicted and another stored
after it reuse ids in order (consecutive ids are what BlockTable.leading_ids guesses).

Every function takes the table as its arrays (slots, key_of, slot_of, free, state, in
that order; the scalars in `state`) and never grows them: the caller makes room first
(BlockTable.reserve).
`apply_changes` runs a queue of (block, worker, held) changes in order, table and holder
masks together: a change per loop turn, no sort to net them and no vectorised passes.

A probe's slot is a cache miss in a table of millions of keys, and a loop that probes one
key after another waits for each miss in turn. So the loops over keys first read the home
slots of the next READ_AHEAD keys (the sum they return stands for those reads, so that
they are kept), and the misses overlap: 42 against 166 ns a new key at 1.5M keys (dev VM).
The functions are compiled on import (cached on disk by numba where it can write), for the
argument types the callers use.
"""

from __future__ import annotations

import numpy as np

from shoal.router.jit import cached_njit

EMPTY = -1  # a free slot in the id array
# state: handed-out ids are below NEXT; LIVE keys; FREE_COUNT freed ids in the ring from
# FREE_HEAD; the slot mask; SHIFT picks the top log2(slots) bits of a key's Fibonacci hash
NEXT, LIVE, FREE_HEAD, FREE_COUNT, MASK, SHIFT = range(6)
STATE_FIELDS = 6
FIBONACCI = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio, odd: a key's home multiplier
_GOLDEN = np.uint64(FIBONACCI)
KEY, ID = 0, 1  # a slot's two columns

READ_AHEAD = 64  # keys whose home slots are read before they are probed in turn


@cached_njit
def home(key: np.uint64, shift: np.uint64) -> int:
    return np.int64((key * _GOLDEN) >> shift)


@cached_njit
def _read_ahead(slots, state, keys, start, end) -> int:
    """Read the home slots of keys[start:end] (their ids' sum: the reads must be used)."""
    shift, total = np.uint64(state[SHIFT]), 0
    for i in range(start, end):
        total += slots[home(keys[i], shift), ID]
    return total


@cached_njit
def _find(slots, state, key) -> int:
    """The slot holding `key` (uint64), or the empty slot where its probe stopped (as
    -2 - slot)."""
    mask, bits = state[MASK], np.int64(key)
    slot = home(key, np.uint64(state[SHIFT]))
    while slots[slot, ID] != EMPTY:
        if slots[slot, KEY] == bits:
            return slot
        slot = (slot + 1) & mask
    return -2 - slot


@cached_njit
def _allocate(free, state) -> int:
    """A block id: the oldest freed one, else a new one."""
    if state[FREE_COUNT]:
        head = state[FREE_HEAD]
        state[FREE_HEAD] = (head + 1) % len(free)
        state[FREE_COUNT] -= 1
        return free[head]
    new = state[NEXT]
    state[NEXT] = new + 1
    return new


@cached_njit
def _insert(slots, key_of, slot_of, free, state, key) -> int:
    """The id of `key`, added if absent."""
    slot = _find(slots, state, key)
    if slot >= 0:
        return slots[slot, ID]
    slot = -2 - slot
    new = _allocate(free, state)
    slots[slot, KEY] = np.int64(key)
    slots[slot, ID] = new
    key_of[new] = key
    slot_of[new] = slot
    state[LIVE] += 1
    return new


@cached_njit
def _delete(slots, key_of, slot_of, free, state, block) -> None:
    """Remove the key of live id `block`, free the id, and shift back the keys after it
    that its slot lets nearer their homes."""
    mask, shift = state[MASK], np.uint64(state[SHIFT])
    gap = slot_of[block]
    slot = (gap + 1) & mask
    while slots[slot, ID] != EMPTY:
        if ((slot - home(np.uint64(slots[slot, KEY]), shift)) & mask) >= ((slot - gap) & mask):
            moved = slots[slot, ID]
            slots[gap, KEY] = slots[slot, KEY]
            slots[gap, ID] = moved
            slot_of[moved] = gap
            gap = slot
        slot = (slot + 1) & mask
    slots[gap, ID] = EMPTY
    slot_of[block] = -1
    key_of[block] = 0  # leading_ids' guesses never take a freed id for its old key
    free[(state[FREE_HEAD] + state[FREE_COUNT]) % len(free)] = block
    state[FREE_COUNT] += 1
    state[LIVE] -= 1


@cached_njit
def lookup(keys, out, slots, state) -> int:
    """out[i] = the id of keys[i], -1 where absent."""
    read = 0
    for i in range(len(keys)):
        if i % READ_AHEAD == 0:
            read += _read_ahead(slots, state, keys, i, min(len(keys), i + READ_AHEAD))
        slot = _find(slots, state, keys[i])
        out[i] = slots[slot, ID] if slot >= 0 else -1
    return read


@cached_njit
def add(keys, out, slots, key_of, slot_of, free, state) -> int:
    """out[i] = the id of keys[i], adding the keys the table lacks in their order."""
    read = 0
    for i in range(len(keys)):
        if i % READ_AHEAD == 0:
            read += _read_ahead(slots, state, keys, i, min(len(keys), i + READ_AHEAD))
        out[i] = _insert(slots, key_of, slot_of, free, state, keys[i])
    return read


@cached_njit
def remove(ids, slots, key_of, slot_of, free, state) -> None:
    """Remove the keys of these ids (repeats and freed ids are skipped)."""
    for i in range(len(ids)):
        if slot_of[ids[i]] >= 0:
            _delete(slots, key_of, slot_of, free, state, ids[i])


@cached_njit
def rehash(old, slots, slot_of, state) -> None:
    """Place every key of the `old` slots in the new (empty) ones `state` describes."""
    mask, shift = state[MASK], np.uint64(state[SHIFT])
    for i in range(len(old)):
        block = old[i, ID]
        if block != EMPTY:
            slot = home(np.uint64(old[i, KEY]), shift)
            while slots[slot, ID] != EMPTY:
                slot = (slot + 1) & mask
            slots[slot, KEY] = old[i, KEY]
            slots[slot, ID] = block
            slot_of[block] = slot


@cached_njit
def apply_changes(keys, columns, held, bits, strays, slots, key_of, slot_of, free, state) -> int:
    """Apply (block keys[i], worker column columns[i], now held or not) in order: a store
    sets the column's bit in the block's mask (adding the block), a removal clears it (and
    removes the block once no worker holds it). strays[column] counts the changes that
    changed nothing: +1 per removal of a pair not held, -1 per store of a pair held."""
    read = 0
    for i in range(len(keys)):
        if i % READ_AHEAD == 0:
            read += _read_ahead(slots, state, keys, i, min(len(keys), i + READ_AHEAD))
        column = columns[i]
        word, bit = column >> 6, np.uint64(1) << np.uint64(column & 63)
        if held[i]:
            block = _insert(slots, key_of, slot_of, free, state, keys[i])
            if bits[block, word] & bit:
                strays[column] -= 1
            else:
                bits[block, word] |= bit
            continue
        slot = _find(slots, state, keys[i])
        if slot < 0 or not bits[slots[slot, ID], word] & bit:
            strays[column] += 1
            continue
        block = slots[slot, ID]
        bits[block, word] &= ~bit
        unheld = True
        for w in range(bits.shape[1]):
            if bits[block, w]:
                unheld = False
                break
        if unheld:
            _delete(slots, key_of, slot_of, free, state, block)
    return read


def set_size(state: np.ndarray, slots: int) -> None:
    """Make `state` describe `slots` slots (a power of two): its mask and home shift."""
    state[MASK] = slots - 1
    state[SHIFT] = 65 - slots.bit_length()  # the top log2(slots) bits


def empty_slots(n: int) -> np.ndarray:
    """`n` empty slots."""
    slots = np.zeros((n, 2), np.int64)
    slots[:, ID] = EMPTY
    return slots


def _compile() -> None:
    """Run every function once on a tiny table, for each argument type callers pass (keys
    read from bytes are read-only), so none compiles on a first request."""
    ids = 4
    state = np.zeros(STATE_FIELDS, np.int64)
    set_size(state, 8)
    table = (
        empty_slots(8),
        np.zeros(ids, np.uint64),
        np.full(ids, -1, np.int64),
        np.zeros(ids, np.int64),
        state,
    )
    writable = np.array([3], np.uint64)
    readonly = np.frombuffer(writable.tobytes(), np.uint64)
    out = np.empty(1, np.int64)
    for keys in (writable, readonly):
        add(keys, out, *table)
        lookup(keys, out, table[0], state)
        remove(out, *table)
        for bits in (np.zeros((ids, 1), np.uint64), np.zeros((ids, 2), np.uint64)):
            apply_changes(
                keys,
                np.zeros(1, np.int64),
                np.ones(1, np.bool_),
                bits,
                np.zeros(64, np.int64),
                *table,
            )
    rehash(table[0], empty_slots(8), np.full(ids, -1, np.int64), state)


_compile()
