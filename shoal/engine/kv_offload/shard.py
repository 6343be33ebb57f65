"""The lower KV tiers under tensor parallelism: rank 0 decides, every rank moves its shard.

Rank 0's OffloadManager keeps the one index of the tiers (hashes, LRU order, host slots,
KV events, counters). Each block's KV is split by KV heads like the GPU cache, so every
follower holds its shard of each block at the same host slot and, on disk, in a file of
its own folder under the same hash. Rank 0 sends the copies it makes as TierOps, in its
own order, on the follower's command pipe (so they keep their place between the steps);
a follower replays them on its ShardTiers. A disk read is the one question asked back:
before onboarding blocks from disk, every follower reads its shard of them, and only the
leading blocks every rank could read are used (the first unreadable one is a miss).
"""

from __future__ import annotations

import os
from typing import Protocol

import msgspec
import torch

from shoal.engine.kv_offload.copier import BlockCopier
from shoal.engine.kv_offload.disk import DiskTier
from shoal.engine.kv_offload.host import BlockMeta
from shoal.engine.kv_offload.stats import TierStats


class SaveOp(msgspec.Struct, tag="save", array_like=True):
    """GPU blocks to host slots."""

    block_ids: list[int]
    slots: list[int]


class LoadOp(msgspec.Struct, tag="load", array_like=True):
    """Host slots (or, where a slot is -1, the next of the disk blocks just read) to GPU
    blocks."""

    block_ids: list[int]
    slots: list[int]
    disk_hashes: list[int]


class SpillOp(msgspec.Struct, tag="spill", array_like=True):
    """A host slot's block, evicted, written to disk under its hash."""

    slot: int
    block_hash: int


class ForgetOp(msgspec.Struct, tag="forget", array_like=True):
    """Disk blocks to delete."""

    block_hashes: list[int]


class ClearOp(msgspec.Struct, tag="clear", array_like=True):
    """Every disk block to delete."""


TierOp = SaveOp | LoadOp | SpillOp | ForgetOp | ClearOp


def encode_ops(ops: list[TierOp]) -> bytes:
    return msgspec.msgpack.encode(ops)


def decode_ops(data: bytes) -> list[TierOp]:
    return msgspec.msgpack.decode(data, type=list[TierOp])


class TierMirror(Protocol):
    """What rank 0's tiers tell the other ranks (the tensor-parallel followers)."""

    def send_tier_ops(self, ops: list[TierOp]) -> None:
        """Have every follower replay these copies on its shard, in order."""

    def read_disk(self, block_hashes: list[int]) -> int:
        """Have every follower read its shard of these disk blocks; the fewest leading
        blocks any follower could read."""


def rank_disk_path(disk_path: str, rank: int) -> str:
    """The folder of a follower's disk shards (rank 0's are in disk_path itself)."""
    return os.path.join(disk_path, f"rank-{rank}")


class ShardTiers:
    """A follower's lower tiers: its shard of every block rank 0's tiers hold, at the same
    host slots and disk hashes, moved only when rank 0 says."""

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        host_capacity: int,
        disk_path: str | None,
        disk_capacity: int,
    ) -> None:
        caches = kv_caches
        shape = (len(caches), caches[0].shape[0], *caches[0].shape[2:])
        pin = caches[0].device.type == "cuda"
        self.buffer = torch.empty((host_capacity, *shape), dtype=caches[0].dtype, pin_memory=pin)
        self.copier = BlockCopier(caches, in_order=True)
        self.disk = None
        if disk_path is not None:
            self.disk = DiskTier(disk_path, disk_capacity, shape, caches[0].dtype, TierStats())
        self.staged: dict[int, torch.Tensor] = {}  # disk blocks read for the next load

    def apply(self, ops: list[TierOp]) -> None:
        for op in ops:
            if isinstance(op, SaveOp):
                self.copier.save(op.block_ids, self.buffer, op.slots)
            elif isinstance(op, LoadOp):
                disk = iter(op.disk_hashes)
                sources = [
                    self.buffer[slot] if slot >= 0 else self.staged[next(disk)] for slot in op.slots
                ]
                self.copier.load(sources, op.block_ids)
                self.staged = {}
            elif isinstance(op, SpillOp):
                self.copier.synchronize()  # the slot's save has landed
                meta = BlockMeta(op.block_hash, None, [], None)
                self.disk.put(meta, self.buffer[op.slot].clone())
            elif isinstance(op, ForgetOp):
                for h in op.block_hashes:
                    self.disk.remove(h)
            elif self.disk is not None:
                self.disk.clear()
        if self.disk is not None:
            self.disk.reap()

    def read_disk(self, block_hashes: list[int]) -> int:
        """Read this rank's shard of these disk blocks for the next load; how many leading
        ones could be read."""
        self.staged = {}
        self.disk.reap()
        for h in block_hashes:
            data = self.disk.read(h)
            if data is None:
                break
            self.staged[h] = data
        return len(self.staged)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
