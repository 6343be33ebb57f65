"""The local-disk tier: one file per block, written by a background thread, LRU order.

A file holds a header (magic, block hash, payload size, xxh3 checksum of the payload) and
the block's KV bytes. A block that cannot be read back whole and unchanged (file missing,
short, or its checksum off) is a miss: it leaves the tier and its prefix is recomputed.
The tier starts empty: every block file left in the folder by an earlier run is deleted.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash

from shoal.engine.kv_offload.host import BlockMeta
from shoal.engine.kv_offload.stats import TierStats

log = logging.getLogger(__name__)

SUFFIX = ".kvblock"
_HEADER = struct.Struct("<8sQQQ")  # magic, block hash, payload bytes, xxh3_64 of the payload
_MAGIC = b"SHOALKV1"


class DiskTier:
    """Block hash -> a file in `path`, least recently used first, at most `capacity` blocks."""

    def __init__(
        self,
        path: str | os.PathLike,
        capacity: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        stats: TierStats,
    ) -> None:
        """stats: the tier's counters; its writer thread adds the bytes and time it writes."""
        if capacity < 1:
            raise ValueError(f"the disk KV tier holds no block (capacity {capacity})")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.glob(f"*{SUFFIX}"):
            stale.unlink()
        self.capacity = capacity
        self.stats = stats
        self.block_shape = block_shape
        self.dtype = dtype
        self.block_bytes = dtype.itemsize * int(torch.Size(block_shape).numel())
        self.entries: OrderedDict[int, BlockMeta] = OrderedDict()
        # blocks whose file is being written: their KV stays here until it is on disk
        self.pending: dict[int, tuple[Future, torch.Tensor]] = {}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk")

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.entries

    def file(self, block_hash: int) -> Path:
        return self.path / f"{block_hash:016x}{SUFFIX}"

    def put(self, meta: BlockMeta, data: torch.Tensor) -> list[BlockMeta]:
        """Write a block (a host tensor this tier now owns) in the background; returns the
        blocks evicted for room, least recently used first."""
        evicted = []
        while len(self.entries) >= self.capacity:
            _, old = self.entries.popitem(last=False)
            self._forget(old.block_hash)
            evicted.append(old)
        h = meta.block_hash
        self.entries[h] = meta
        self.pending[h] = (self._writer.submit(self._write, h, data), data)
        return evicted

    def touch(self, block_hash: int) -> None:
        self.entries.move_to_end(block_hash)

    def read(self, block_hash: int) -> torch.Tensor | None:
        """The block's KV (now the most recently used), or None if it cannot be read whole
        and unchanged: then it leaves the tier."""
        pending = self.pending.get(block_hash)
        if pending is not None:
            self.touch(block_hash)
            return pending[1]
        try:
            data = self._read(block_hash)
        except (OSError, ValueError) as e:
            log.warning("KV block %016x unreadable on disk (%s): a miss", block_hash, e)
            self.remove(block_hash)
            return None
        self.touch(block_hash)
        return data

    def remove(self, block_hash: int) -> None:
        if self.entries.pop(block_hash, None) is not None:
            self._forget(block_hash)

    def reap(self) -> None:
        """Let go of the KV of blocks whose file is written."""
        for h in [h for h, (f, _) in self.pending.items() if f.done()]:
            future, _ = self.pending.pop(h)
            if future.exception() is not None:
                log.warning("KV block %016x not written: %s", h, future.exception())
                self.entries.pop(h, None)

    def clear(self) -> list[int]:
        """Forget every block, deleting its file; returns their hashes."""
        hashes = list(self.entries)
        for h in hashes:
            self.remove(h)
        return hashes

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def _forget(self, block_hash: int) -> None:
        """Delete the block's file once any write of it is done (in the writer's order)."""
        self.pending.pop(block_hash, None)
        self._writer.submit(self.file(block_hash).unlink, missing_ok=True)

    def _write(self, block_hash: int, data: torch.Tensor) -> None:
        t0 = time.perf_counter()
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        header = _HEADER.pack(_MAGIC, block_hash, len(payload), xxhash.xxh3_64_intdigest(payload))
        tmp = self.file(block_hash).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(header + payload)
        tmp.replace(self.file(block_hash))
        self.stats.bytes_written += len(payload)
        self.stats.write_seconds += time.perf_counter() - t0

    def _read(self, block_hash: int) -> torch.Tensor:
        raw = self.file(block_hash).read_bytes()
        if len(raw) < _HEADER.size:
            raise ValueError("file shorter than its header")
        magic, h, size, checksum = _HEADER.unpack_from(raw)
        payload = raw[_HEADER.size :]
        if magic != _MAGIC or h != block_hash or not size == len(payload) == self.block_bytes:
            raise ValueError("header does not match the block")
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            raise ValueError("checksum mismatch")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return data.view(self.dtype).reshape(self.block_shape)
