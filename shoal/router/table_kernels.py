"""The block table's loops and the KV index's flush, compiled with numba.

A table of 64-bit block hashes to dense block ids is one open-addressing array of keys and
one of ids (linear probing from a Fibonacci-hashed home slot, EMPTY where no key is), with
per id its key and its slot. A removal moves the keys after it back (backward shift), so
there are no tombstones and a probe stops at the first empty slot. Freed ids wait in a ring
and are handed out oldest first, so a prefix evicted and another stored after it reuse ids
in order (consecutive ids are what BlockTable.leading_ids guesses).

Every function takes the table as its arrays (the `TABLE` arguments, in that order; the
scalars in `state`) and never grows them: the caller makes room first (BlockTable.reserve).
`apply_changes` runs a queue of (block, worker, held) changes in order, table and holder
masks together: a change per loop turn, no sort to net them and no vectorised passes.
The functions are compiled on import (cached on disk by numba), for the argument types the
callers use.
"""

from __future__ import annotations

import numba as nb
import numpy as np

EMPTY = -1  # a free slot in the id array
# state: handed-out ids are below NEXT; LIVE keys; FREE_COUNT freed ids in the ring from
# FREE_HEAD; the slot mask; SHIFT picks the top log2(slots) bits of a key's Fibonacci hash
NEXT, LIVE, FREE_HEAD, FREE_COUNT, MASK, SHIFT = range(6)
STATE_FIELDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
TABLE = ("slot_keys", "slot_ids", "key_of", "slot_of", "free", "state")

_jit = nb.njit(cache=True, nogil=True, boundscheck=False)


@_jit
def home(key: np.uint64, shift: np.uint64) -> int:
    return np.int64((key * _GOLDEN) >> shift)


@_jit
def _find(slot_keys, slot_ids, state, key) -> int:
    """The slot holding `key`, or the empty slot where its probe stopped (as -2 - slot)."""
    mask = state[MASK]
    slot = home(key, np.uint64(state[SHIFT]))
    while slot_ids[slot] != EMPTY:
        if slot_keys[slot] == key:
            return slot
        slot = (slot + 1) & mask
    return -2 - slot


@_jit
def _allocate(key_of, free, state) -> int:
    """A block id: the oldest freed one, else a new one."""
    if state[FREE_COUNT]:
        head = state[FREE_HEAD]
        state[FREE_HEAD] = (head + 1) % len(free)
        state[FREE_COUNT] -= 1
        return free[head]
    new = state[NEXT]
    state[NEXT] = new + 1
    return new


@_jit
def _insert(slot_keys, slot_ids, key_of, slot_of, free, state, key) -> int:
    """The id of `key`, added if absent."""
    slot = _find(slot_keys, slot_ids, state, key)
    if slot >= 0:
        return slot_ids[slot]
    slot = -2 - slot
    new = _allocate(key_of, free, state)
    slot_keys[slot] = key
    slot_ids[slot] = new
    key_of[new] = key
    slot_of[new] = slot
    state[LIVE] += 1
    return new


@_jit
def _delete(slot_keys, slot_ids, key_of, slot_of, free, state, block) -> None:
    """Remove the key of live id `block`, free the id, and shift back the keys after it
    that its slot lets nearer their homes."""
    mask, shift = state[MASK], np.uint64(state[SHIFT])
    gap = slot_of[block]
    slot = (gap + 1) & mask
    while slot_ids[slot] != EMPTY:
        if ((slot - home(slot_keys[slot], shift)) & mask) >= ((slot - gap) & mask):
            moved = slot_ids[slot]
            slot_keys[gap] = slot_keys[slot]
            slot_ids[gap] = moved
            slot_of[moved] = gap
            gap = slot
        slot = (slot + 1) & mask
    slot_ids[gap] = EMPTY
    slot_of[block] = -1
    key_of[block] = 0  # leading_ids' guesses never take a freed id for its old key
    free[(state[FREE_HEAD] + state[FREE_COUNT]) % len(free)] = block
    state[FREE_COUNT] += 1
    state[LIVE] -= 1


@_jit
def lookup(keys, out, slot_keys, slot_ids, state) -> None:
    """out[i] = the id of keys[i], -1 where absent."""
    for i in range(len(keys)):
        slot = _find(slot_keys, slot_ids, state, keys[i])
        out[i] = slot_ids[slot] if slot >= 0 else -1


@_jit
def add(keys, out, slot_keys, slot_ids, key_of, slot_of, free, state) -> None:
    """out[i] = the id of keys[i], adding the keys the table lacks in their order."""
    for i in range(len(keys)):
        out[i] = _insert(slot_keys, slot_ids, key_of, slot_of, free, state, keys[i])


@_jit
def remove(ids, slot_keys, slot_ids, key_of, slot_of, free, state) -> None:
    """Remove the keys of these ids (repeats and freed ids are skipped)."""
    for i in range(len(ids)):
        if slot_of[ids[i]] >= 0:
            _delete(slot_keys, slot_ids, key_of, slot_of, free, state, ids[i])


@_jit
def rehash(old_keys, old_ids, slot_keys, slot_ids, slot_of, state) -> None:
    """Place every key of the old slots in the new (empty) ones `state` describes."""
    mask, shift = state[MASK], np.uint64(state[SHIFT])
    for old in range(len(old_ids)):
        block = old_ids[old]
        if block != EMPTY:
            key = old_keys[old]
            slot = home(key, shift)
            while slot_ids[slot] != EMPTY:
                slot = (slot + 1) & mask
            slot_keys[slot] = key
            slot_ids[slot] = block
            slot_of[block] = slot


@_jit
def apply_changes(
    keys, columns, held, bits, strays, slot_keys, slot_ids, key_of, slot_of, free, state
) -> None:
    """Apply (block keys[i], worker column columns[i], now held or not) in order: a store
    sets the column's bit in the block's mask (adding the block), a removal clears it (and
    removes the block once no worker holds it). strays[column] counts the changes that
    changed nothing: +1 per removal of a pair not held, -1 per store of a pair held."""
    for i in range(len(keys)):
        column = columns[i]
        word, bit = column >> 6, np.uint64(1) << np.uint64(column & 63)
        if held[i]:
            block = _insert(slot_keys, slot_ids, key_of, slot_of, free, state, keys[i])
            if bits[block, word] & bit:
                strays[column] -= 1
            else:
                bits[block, word] |= bit
            continue
        slot = _find(slot_keys, slot_ids, state, keys[i])
        if slot < 0 or not bits[slot_ids[slot], word] & bit:
            strays[column] += 1
            continue
        block = slot_ids[slot]
        bits[block, word] &= ~bit
        unheld = True
        for w in range(bits.shape[1]):
            if bits[block, w]:
                unheld = False
                break
        if unheld:
            _delete(slot_keys, slot_ids, key_of, slot_of, free, state, block)


def _compile() -> None:
    """Run every function once on a tiny table, for each argument type callers pass (keys
    read from bytes are read-only), so none compiles on a first request."""
    slots, ids = 8, 4
    state = np.array([0, 0, 0, 0, slots - 1, 61], np.int64)
    table = (
        np.zeros(slots, np.uint64),
        np.full(slots, EMPTY, np.int32),
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
        lookup(keys, out, table[0], table[1], state)
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
    new_keys, new_ids = np.zeros(slots, np.uint64), np.full(slots, EMPTY, np.int32)
    rehash(table[0], table[1], new_keys, new_ids, np.full(ids, -1, np.int64), state)


_compile()
