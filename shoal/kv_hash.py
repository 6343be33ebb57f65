"""The block hashes: the engine's prefix-cache identity, and the router's index key.

The engine's: h_i = xxh3_64(h_{i-1} as 8 little-endian bytes + token ids as little-endian
u32 + extra key), with a fixed seed; the first block of a sequence has no parent bytes. It
names blocks in the prefix cache, in KV events, in transfers and in the offload tiers.

The router's (route_hashes): the same chain over full blocks, computed in numpy for all of
a prompt's blocks at once; the router keys its index on it, re-hashing the tokens of every
stored block, and maps engine hashes to it for removals. Only full blocks are hashed.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Sequence
from sys import byteorder

import numpy as np
import xxhash

HASH_SEED = 0x5E0A1

_U64 = struct.Struct("<Q").pack  # a parent hash as 8 little-endian bytes


def extra_key(lora_id: int | None = None, mm_hashes: Sequence[str] = ()) -> bytes:
    """The extra bytes mixed into every block hash (LoRA adapter and multimodal content)."""
    if lora_id is None and not mm_hashes:
        return b""
    parts = [b"lora", struct.pack("<q", lora_id or 0)]
    parts.extend(h.encode() for h in mm_hashes)
    return b"|".join(parts)


def _u32(token_ids: Sequence[int]) -> array:
    """Token ids as little-endian u32 values."""
    buf = array("I", token_ids)
    if byteorder != "little":
        buf.byteswap()
    return buf


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return _u32(token_ids).tobytes()


def _chain(parent: int | None, block_bytes: bytes, extra: bytes) -> int:
    prefix = b"" if parent is None else _U64(parent)
    return xxhash.xxh3_64_intdigest(prefix + block_bytes + extra, HASH_SEED)


def hash_block(parent: int | None, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Hash of one full block given its parent's hash (None for the first block)."""
    return _chain(parent, _token_bytes(token_ids), extra)


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    parent: int | None = None,
    start: int = 0,
) -> list[int]:
    """Chained hashes of every full block of token_ids[start:], continuing from parent.

    All the tokens become bytes in one call; each block then costs one slice, one
    concatenation and one xxh3 call (the chain makes them sequential), with every name
    the loop uses bound locally: ~20% faster than a _chain call per block.
    """
    num_blocks = (len(token_ids) - start) // block_size
    if num_blocks <= 0:
        return []
    data = _token_bytes(token_ids[start : start + num_blocks * block_size])
    step = 4 * block_size  # bytes per block: u32 token ids
    xxh3, seed, u64 = xxhash.xxh3_64_intdigest, HASH_SEED, _U64
    hashes: list[int] = []
    append = hashes.append
    begin = 0
    if parent is None:
        parent = xxh3(data[:step] + extra, seed)
        append(parent)
        begin = step
    if extra:
        for b in range(begin, len(data), step):
            parent = xxh3(u64(parent) + data[b : b + step] + extra, seed)
            append(parent)
    else:
        for b in range(begin, len(data), step):
            parent = xxh3(u64(parent) + data[b : b + step], seed)
            append(parent)
    return hashes


# ---- The router's index key: the same chained structure, vectorised, for routing only.
#
# The router re-hashes every BlockStored's tokens and every prompt it routes, so its key is
# computed in numpy over all blocks at once instead of one xxh3 call per block. A block's
# content hash is a keyed multiply-xorshift sum over its tokens (two tokens a 64-bit word)
# passed through a finaliser; the chain is a polynomial over the content hashes,
# r_i = r_{i-1} * P + c_i (mod 2^64), which a prefix sum computes for every block at once.
# It is weaker than xxh3 against crafted collisions, which is why the engine's prefix cache
# never uses it: a collision here can only send a request to a worker that lacks its
# prefix.

_M64 = (1 << 64) - 1
ROUTE_ROOT = 0x243F6A8885A308D3  # r_{-1} of a sequence's first block
ROUTE_MULTIPLIER = 0x9E3779B97F4A7C15  # the chain's P (odd, so invertible mod 2^64)
_P = ROUTE_MULTIPLIER
_P_INV = pow(_P, -1, 1 << 64)
_S27, _S30, _S31, _S32 = (np.uint64(s) for s in (27, 30, 31, 32))
FINALISER_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's
_F1, _F2 = (np.uint64(m) for m in FINALISER_MULTIPLIERS)


def _splitmix64(seed: int, n: int) -> np.ndarray:
    """n odd 64-bit keys from splitmix64, so every process derives the same ones."""
    keys = []
    for _ in range(n):
        seed = (seed + 0x9E3779B97F4A7C15) & _M64
        z = seed
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        keys.append((z ^ (z >> 31)) | 1)
    return np.array(keys, np.uint64)


class _Powers:
    """P^i and P^-i mod 2^64 for i below a bound that grows on demand."""

    def __init__(self) -> None:
        self.up = np.ones(1, np.uint64)
        self.down = np.ones(1, np.uint64)

    def ensure(self, n: int) -> None:
        if n > len(self.up):
            size = max(n, 2 * len(self.up), 1024)
            self.up = np.cumprod(np.full(size, _P, np.uint64)) * np.uint64(_P_INV)
            self.down = np.cumprod(np.full(size, _P_INV, np.uint64)) * np.uint64(_P)


_powers = _Powers()


def _finalise(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place: every input bit reaches every output bit."""
    x ^= x >> _S30
    x *= _F1
    x ^= x >> _S27
    x *= _F2
    x ^= x >> _S31
    return x


def route_extra(extra: bytes) -> int:
    """The extra key as the 64-bit value mixed into each block's content hash."""
    return xxhash.xxh3_64_intdigest(extra, HASH_SEED) if extra else 0


_CHUNK_BLOCKS = 4096  # blocks hashed per pass: its arrays stay in cache and on reused pages


def _uint32(token_ids: Sequence[int] | np.ndarray, count: int) -> np.ndarray:
    """The first `count` token ids as a little-endian uint32 array (a packed array of u32,
    as an EngineRequest holds its prompt, is read in place)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids[:count].astype("<u4", copy=False)
    if type(token_ids) is array and token_ids.typecode == "I":
        return np.frombuffer(token_ids, np.uint32, count).astype("<u4", copy=False)
    return np.frombuffer(_u32(token_ids), "<u4")[:count]


def _content(token_ids: Sequence[int] | np.ndarray, n: int, block_size: int) -> np.ndarray:
    """Each of the first n full blocks' keyed multiply-xorshift sum, a chunk of blocks at a
    time: a long prompt's temporaries in one piece leave the cache and land on fresh pages.

    Every operation runs on flat arrays, where numpy's loops are long: the words times the
    keys tiled to a chunk's length, and a block's words summed by adding neighbours, which
    halves the width each time (8 words: 3 adds of strided halves), the columns of an odd
    width left added one by one. 131k tokens on the dev machine: 0.11 against 0.15 ms."""
    width = _route_width(block_size)
    keys = _tiled_keys(block_size)
    words = route_words(token_ids, n, block_size)
    content = np.empty(n, np.uint64)
    mixed = np.empty(min(n, _CHUNK_BLOCKS) * width, np.uint64)
    shifted = np.empty_like(mixed)
    for first in range(0, n, _CHUNK_BLOCKS):
        last = min(n, first + _CHUNK_BLOCKS)
        size = (last - first) * width
        m, t = mixed[:size], shifted[:size]
        np.multiply(words[first * width : last * width], keys[:size], out=m)
        np.right_shift(m, _S32, out=t)
        np.bitwise_xor(m, t, out=m)
        _sum_rows(m, width, content[first:last], t)
    return content


def _route_width(block_size: int) -> int:
    """Words per block: token pairs for an even block size, else single tokens."""
    return block_size // 2 if block_size % 2 == 0 else block_size


def route_words(token_ids: Sequence[int] | np.ndarray, n: int, block_size: int) -> np.ndarray:
    """The words of the first n full blocks that the content hash keys: pairs of tokens as
    little-endian u64 for an even block size, else the u32 tokens (block_size words)."""
    tokens = _uint32(token_ids, n * block_size)
    return tokens.view("<u8") if block_size % 2 == 0 else tokens


@functools.cache
def route_word_keys(block_size: int) -> np.ndarray:
    """The odd 64-bit key of each word of a block (route_words); one read-only array per
    block size."""
    keys = _splitmix64(HASH_SEED, _route_width(block_size))
    keys.flags.writeable = False
    return keys


@functools.cache
def _tiled_keys(block_size: int) -> np.ndarray:
    """The keys of a block's words (route_word_keys), repeated for a chunk of blocks."""
    return np.tile(route_word_keys(block_size), _CHUNK_BLOCKS)


def _sum_rows(flat: np.ndarray, width: int, out: np.ndarray, spare: np.ndarray) -> None:
    """out[r] = the sum of flat[r * width : (r + 1) * width] (mod 2^64); flat and spare, a
    buffer at least half its length, are overwritten."""
    while width % 2 == 0:
        half = spare[: len(flat) // 2]
        np.add(flat[0::2], flat[1::2], out=half)  # neighbours never straddle two rows
        flat, spare, width = half, flat, width // 2
    rows = flat.reshape(-1, width)
    out[:] = rows[:, 0]
    for column in range(1, width):
        out += rows[:, column]


def route_hash_runs(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parents: np.ndarray,
    lengths: np.ndarray,
    extras: np.ndarray | None = None,
) -> np.ndarray:
    """Router hashes of consecutive runs of full blocks laid end to end in `token_ids`: run k
    has lengths[k] blocks chained from parents[k] (a router hash, or ROUTE_ROOT), its content
    mixed with extras[k] (route_extra; none if None). One uint64 per block."""
    n = int(lengths.sum())
    if n == 0:
        return np.zeros(0, np.uint64)
    content = _content(token_ids, n, block_size)
    if extras is not None:
        content ^= np.repeat(extras, lengths)
    _finalise(content)
    _powers.ensure(n + 1)
    up, down = _powers.up, _powers.down
    sums = np.cumsum(content * down[:n], dtype=np.uint64)  # C_i = sum_{m<=i} c_m P^-m
    if len(lengths) == 1:
        return up[1 : n + 1] * np.uint64(parents[0]) + up[:n] * sums
    starts = np.cumsum(lengths) - lengths
    before = np.zeros(len(lengths), np.uint64)  # C_{s-1} of each run
    before[starts > 0] = sums[starts[starts > 0] - 1]
    local = np.arange(1, n + 1) - np.repeat(starts, lengths)  # i - s + 1
    return up[local] * np.repeat(parents, lengths) + up[:n] * (sums - np.repeat(before, lengths))


def route_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra: bytes = b"",
    parent: int | None = None,
) -> np.ndarray:
    """Router hashes (uint64) of every full block of token_ids, chained from `parent` (the
    router hash of the block before them; None: they start the sequence)."""
    n = len(token_ids) // block_size
    return route_hash_runs(
        token_ids,
        block_size,
        np.array([ROUTE_ROOT if parent is None else parent], np.uint64),
        np.array([n]),
        np.array([route_extra(extra)], np.uint64) if extra else None,
    )
