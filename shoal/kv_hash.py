"""THE block-hash function: engine and router both call it, so they agree on every block.

h_i = xxh3_64(h_{i-1} as 8 little-endian bytes + token ids as little-endian u32 + extra key),
with a fixed seed; the first block of a sequence has no parent bytes. Only full blocks
are hashed.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from sys import byteorder

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


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    buf = array("I", token_ids)
    if byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


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
