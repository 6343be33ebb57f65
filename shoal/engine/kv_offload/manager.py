"""OffloadManager: the lower KV tiers (host memory, then local disk) under the GPU pool.

Save on store: each block entered into the prefix cache is queued, with a reference on its
GPU block so the pool cannot hand it out before it is copied, and once per engine step
(after the step's outputs are made) the queue goes to the host tier in one batch of
copies. A block whose content a lower tier already holds is not copied again. The host
tier evicts least recently used blocks for room; with a disk tier they are written there
(in a background thread), else dropped. Each tier keeps its own LRU order and capacity.

Onboarding at admission is shoal.engine.kv_offload.onboard. Every change of a tier is a
KV event in the pool's event list, with `medium` CPU or DISK. Under tensor parallelism
this manager is rank 0's and its `mirror` has the other ranks copy their shards
(shoal.engine.kv_offload.shard).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shoal.engine.block_pool import KVBlock
from shoal.engine.kv_offload.copier import BlockCopier, Job
from shoal.engine.kv_offload.disk import DiskTier
from shoal.engine.kv_offload.host import BlockMeta, HostEntry, HostTier
from shoal.engine.kv_offload.shard import (
    ClearOp,
    ForgetOp,
    LoadOp,
    SaveOp,
    SpillOp,
    TierMirror,
    TierOp,
)
from shoal.engine.kv_offload.stats import MEDIUM_CPU, MEDIUM_DISK, TierStats
from shoal.protocol import BlockRemoved, BlockStored

if TYPE_CHECKING:
    from shoal.engine.kv_cache_manager import KVCacheManager
    from shoal.engine.request import Request


@dataclass
class OffloadConfig:
    cpu_bytes: int  # host tier size
    disk_path: str | None = None  # disk tier folder (its block files are deleted at start)
    disk_bytes: int = 0


@dataclass(eq=False)
class Onboarding:
    """A request whose lower-tier blocks are being copied in (kv_offload.onboard)."""

    request: Request
    job: Job
    num_tokens: int  # its tokens computed once the copy is done
    entries: list[HostEntry] = field(default_factory=list)  # host slots the copy reads
    settled: bool = False  # no step in flight can touch its blocks: the copy started at once
    cancelled: bool = False
    released: bool = False  # queued again before the copy is done (the steps wait for it)


class OffloadManager:
    def __init__(
        self,
        config: OffloadConfig,
        kv: KVCacheManager,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin_memory: bool,
    ) -> None:
        """block_shape: one block's KV in the host tier, [layers, 2, block_size, heads, dim]."""
        self.kv = kv
        self.pool = kv.pool
        self.block_bytes = dtype.itemsize * int(torch.Size(block_shape).numel())
        self.stats = {MEDIUM_CPU: TierStats(), MEDIUM_DISK: TierStats()}
        self.host = HostTier(config.cpu_bytes // self.block_bytes, block_shape, dtype, pin_memory)
        self.disk = None
        if config.disk_path is not None:
            self.disk = DiskTier(
                config.disk_path,
                config.disk_bytes // self.block_bytes,
                block_shape,
                dtype,
                self.stats[MEDIUM_DISK],
            )
        self.copier: BlockCopier | None = None
        self.queue: list[tuple[KVBlock, BlockMeta]] = []  # stored, not yet being saved
        self.saves: deque[tuple[Job, list[KVBlock], list[HostEntry]]] = deque()
        self.loads: list[Onboarding] = []  # requests waiting for their blocks to arrive
        self.mirror: TierMirror | None = None  # the other tensor-parallel ranks, if any
        self._ops: list[TierOp] = []  # copies the other ranks are yet to be told of

    def bind(self, kv_caches: list[torch.Tensor]) -> None:
        """Copy blocks to and from these per-layer caches (the model runner's)."""
        self.copier = BlockCopier(kv_caches)

    @property
    def queue_depth(self) -> int:
        """Blocks waiting to be saved or being saved."""
        return len(self.queue) + sum(len(blocks) for _, blocks, _ in self.saves)

    @property
    def busy(self) -> bool:
        """Copies queued or in flight (the engine steps until they are done)."""
        return bool(self.queue or self.saves or self.loads)

    # ---- saving

    def stored(
        self,
        blocks: list[KVBlock],
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        lora_id: int | None,
    ) -> None:
        """Queue the blocks just entered into the prefix cache (cache_full_blocks' arguments)
        for the host tier; those holding content cached elsewhere were not entered."""
        size = self.pool.block_size
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            if block.block_hash != h or block.ref_cnt == 0:
                continue
            if h in self.host:
                self.host.touch(h)
                continue
            if self.disk is not None and h in self.disk:
                self.disk.touch(h)
                continue
            meta = BlockMeta(
                h, hashes[i - 1] if i else parent, token_ids[i * size : (i + 1) * size], lora_id
            )
            self.pool.touch([block])
            self.queue.append((block, meta))

    def flush(self) -> None:
        """Start copying the queued blocks to the host tier (one batch), and finish the saves
        that are done (also when nothing is queued: a save still in flight after the last
        queued flush holds its GPU blocks until a poll reaps it)."""
        if not self.queue:
            self.poll()
            return
        queue, self.queue = self.queue, []
        blocks: list[KVBlock] = []
        entries: list[HostEntry] = []
        for block, meta in queue:
            entry, evicted = self.host.reserve(meta)
            self._evicted_from_host(evicted)
            if entry is None:
                self.pool.free([block])  # every host slot busy: this block is not kept
                continue
            blocks.append(block)
            entries.append(entry)
        if blocks:
            slots = [e.slot for e in entries]
            block_ids = [b.block_id for b in blocks]
            self._mirror(SaveOp(block_ids, slots))
            job = self.copier.save(block_ids, self.host.buffer, slots)
            self.saves.append((job, blocks, entries))
        self._send_ops()
        self.poll()

    def poll(self) -> None:
        """Finish the saves that are done; let go of the KV of blocks written to disk."""
        stats = self.stats[MEDIUM_CPU]
        while self.saves and self.saves[0][0].done():
            job, blocks, entries = self.saves.popleft()
            for entry in entries:
                entry.ready = True
            self.pool.free(blocks)
            stats.stored += len(entries)
            stats.bytes_written += len(entries) * self.block_bytes
            stats.write_seconds += job.seconds
            self._announce([e.meta for e in entries], MEDIUM_CPU)
        if self.disk is not None:
            self.disk.reap()

    def _evicted_from_host(self, evicted: list[HostEntry]) -> None:
        """Move blocks the host tier evicted down to disk (or lose them without one)."""
        if not evicted:
            return
        self.stats[MEDIUM_CPU].evicted += len(evicted)
        self._removed([e.meta.block_hash for e in evicted], MEDIUM_CPU)
        if self.disk is None:
            return
        for entry in evicted:
            lost = self.disk.put(entry.meta, self.host.buffer[entry.slot].clone())
            if lost:
                self.stats[MEDIUM_DISK].evicted += len(lost)
                self._removed([m.block_hash for m in lost], MEDIUM_DISK)
                self._queue(ForgetOp([m.block_hash for m in lost]))
            self._queue(SpillOp(entry.slot, entry.meta.block_hash))
            self.stats[MEDIUM_DISK].stored += 1
            self._announce([entry.meta], MEDIUM_DISK)

    # ---- lookups for onboarding

    def find(self, block_hashes: list[int]) -> list[str]:
        """The tier (CPU or DISK) of each leading block of these hashes a lower tier holds."""
        media = []
        for h in block_hashes:
            entry = self.host.entries.get(h)
            if entry is not None and entry.ready:
                media.append(MEDIUM_CPU)
            elif self.disk is not None and h in self.disk:
                media.append(MEDIUM_DISK)
            else:
                break
        return media

    def read(
        self, block_hashes: list[int], media: list[str]
    ) -> tuple[list[torch.Tensor], list[HostEntry]]:
        """Each block's KV on the host, stopping at the first that cannot be read (by any
        rank); the host entries among them are pinned (unpin once copied)."""
        found: list[torch.Tensor | None] = []  # a disk block's KV; None: in the host tier
        for h, medium in zip(block_hashes, media, strict=True):
            if medium == MEDIUM_CPU:
                found.append(None)
                continue
            t0 = time.perf_counter()
            data = self.disk.read(h)
            if data is None:
                self._disk_miss(h)
                break
            self.stats[MEDIUM_DISK].read_seconds += time.perf_counter() - t0
            found.append(data)
        found = found[: self._readable_everywhere(block_hashes[: len(found)], found)]
        sources: list[torch.Tensor] = []
        entries: list[HostEntry] = []
        for h, data in zip(block_hashes, found, strict=False):
            stats = self.stats[MEDIUM_CPU if data is None else MEDIUM_DISK]
            if data is None:
                entry = self.host.get(h)
                entry.pins += 1
                entries.append(entry)
                data = self.host.buffer[entry.slot]
            sources.append(data)
            stats.hits += 1
            stats.bytes_read += self.block_bytes
        return sources, entries

    def _readable_everywhere(self, block_hashes: list[int], found: list) -> int:
        """How many leading blocks of those rank 0 found every rank can read: the other
        ranks read their shards of the disk blocks among them."""
        on_disk = [h for h, data in zip(block_hashes, found, strict=True) if data is not None]
        if self.mirror is None or not on_disk:
            return len(found)
        self._send_ops()
        readable = self.mirror.read_disk(on_disk)
        if readable == len(on_disk):
            return len(found)
        bad = on_disk[readable]
        self.disk.remove(bad)
        self._disk_miss(bad)
        return block_hashes.index(bad)

    def _disk_miss(self, block_hash: int) -> None:
        """A disk block that could not be read (it has left the tier)."""
        self.stats[MEDIUM_DISK].misses += 1
        self._removed([block_hash], MEDIUM_DISK)
        self._queue(ForgetOp([block_hash]))

    def load(
        self,
        block_hashes: list[int],
        sources: list[torch.Tensor],
        entries: list[HostEntry],
        block_ids: list[int],
        after_queued: bool = True,
    ) -> Job:
        """Copy blocks that read() returned (sources, entries) into these GPU blocks (after
        the work queued on the device, unless no step in flight can touch them)."""
        if self.mirror is not None:
            slots = {e.meta.block_hash: e.slot for e in entries}
            disk = [h for h in block_hashes if h not in slots]
            self._mirror(LoadOp(block_ids, [slots.get(h, -1) for h in block_hashes], disk))
        return self.copier.load(sources, block_ids, after_queued)

    def cancel(self, request: Request) -> bool:
        """Abort a request whose blocks are being onboarded (its blocks are freed once the
        copy is done); False if it is not onboarding (or is queued again already)."""
        for load in self.loads:
            if load.request is request and not load.released:
                load.cancelled = True
                return True
        return False

    def clear(self) -> bool:
        """Forget every block of the lower tiers (with the prefix cache); False while
        copies are in flight."""
        if self.busy:
            return False
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()
            self._mirror(ClearOp())
        return True

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # ---- the other tensor-parallel ranks

    def _queue(self, op: TierOp) -> None:
        """A copy for the other ranks to make (sent with the next one that is sent now)."""
        if self.mirror is not None:
            self._ops.append(op)

    def _mirror(self, op: TierOp) -> None:
        """Have the other ranks make this copy after those queued, now."""
        self._queue(op)
        self._send_ops()

    def _send_ops(self) -> None:
        if self._ops:
            self.mirror.send_tier_ops(self._ops)
            self._ops = []

    # ---- KV events

    def _announce(self, metas: list[BlockMeta], medium: str) -> None:
        """BlockStored events for these blocks, one per chained run."""
        if not self.pool.record_events:
            return
        run: list[BlockMeta] = []
        for meta in metas:
            if run and meta.parent != run[-1].block_hash:
                self._stored_event(run, medium)
                run = []
            run.append(meta)
        if run:
            self._stored_event(run, medium)

    def _stored_event(self, run: list[BlockMeta], medium: str) -> None:
        self.pool.record(
            BlockStored(
                block_hashes=[m.block_hash for m in run],
                parent_block_hash=run[0].parent,
                token_ids=[t for m in run for t in m.token_ids],
                block_size=self.pool.block_size,
                lora_id=run[0].lora_id,
                medium=medium,
            )
        )

    def _removed(self, block_hashes: list[int], medium: str) -> None:
        self.pool.record(BlockRemoved(block_hashes=block_hashes, medium=medium))
