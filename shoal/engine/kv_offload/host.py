"""The host-memory tier: a preallocated buffer of block slots (pinned with CUDA), LRU order."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class BlockMeta:
    """What a lower tier keeps of a block besides its KV: enough to announce it again."""

    block_hash: int
    parent: int | None
    token_ids: list[int]
    lora_id: int | None


@dataclass
class HostEntry:
    meta: BlockMeta
    slot: int
    ready: bool = False  # its KV has landed in the slot (a save is done)
    pins: int = 0  # loads reading the slot now; a pinned entry is not evicted


class HostTier:
    """Block hash -> a slot of one host buffer [capacity, *block_shape], least recently
    used first. Slots of entries being written (not ready) or read (pinned) are never
    reused."""

    def __init__(
        self, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool
    ) -> None:
        if capacity < 1:
            raise ValueError(f"the host KV tier holds no block (capacity {capacity})")
        self.capacity = capacity
        self.buffer = torch.empty((capacity, *block_shape), dtype=dtype, pin_memory=pin)
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()
        self._free_slots = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.entries

    def get(self, block_hash: int) -> HostEntry | None:
        """The ready entry of this block, now the most recently used; None if absent."""
        entry = self.entries.get(block_hash)
        if entry is None or not entry.ready:
            return None
        self.entries.move_to_end(block_hash)
        return entry

    def touch(self, block_hash: int) -> None:
        self.entries.move_to_end(block_hash)

    def reserve(self, meta: BlockMeta) -> tuple[HostEntry | None, list[HostEntry]]:
        """A slot for a block about to be saved (not ready yet), and the entries evicted
        for it, least recently used first (their slots are free again: copy their KV out
        before the next save). No slot (every entry busy): None."""
        evicted: list[HostEntry] = []
        if not self._free_slots:
            victim = next((e for e in self.entries.values() if e.ready and not e.pins), None)
            if victim is None:
                return None, evicted
            del self.entries[victim.meta.block_hash]
            self._free_slots.append(victim.slot)
            evicted.append(victim)
        entry = HostEntry(meta, self._free_slots.pop())
        self.entries[meta.block_hash] = entry
        return entry, evicted

    def drop(self, block_hash: int) -> None:
        """Forget a block (a save that did not happen) and free its slot."""
        entry = self.entries.pop(block_hash)
        self._free_slots.append(entry.slot)

    def clear(self) -> list[int]:
        """Forget every block; returns their hashes."""
        hashes = list(self.entries)
        self.entries.clear()
        self._free_slots = list(range(self.capacity - 1, -1, -1))
        return hashes
