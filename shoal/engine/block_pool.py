"""The KV block pool: blocks, their ref counts, the LRU free queue and the prefix-cache map."""

from __future__ import annotations

import time

from shoal.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVBlock:
    __slots__ = ("block_hash", "block_id", "freed_at", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.freed_at = -1  # BlockPool.launches when its last reference went
        self.block_hash: int | None = None  # set while the block is in the prefix cache
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed first (the eviction order).

    Allocation pops the head; freeing appends at the tail; a prefix-cache hit on a free
    block takes it out of the middle in O(1).
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev
        last.next, block.prev, block.next, self.tail.prev = block, last, self.tail, block
        self.size += 1

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next
        if block is self.tail:
            raise IndexError("no free KV blocks")
        self.remove(block)
        return block

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        block = self.head.next
        while block is not self.tail:
            yield block
            block = block.next


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool, block_size: int, record_events: bool = False
    ) -> None:
        """record_events: keep the KV events (BlockStored, BlockRemoved, AllBlocksCleared) for
        take_events; off, none are kept (nobody would take them: an offline engine)."""
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # block hash -> block holding that content
        self.enable_caching = enable_caching
        self.block_size = block_size
        self.record_events = record_events
        self.events: list[KVEvent] = []
        self.event_time = time.time()
        # steps launched so far: a block freed since the last launch may still be read or
        # written by that step on the device
        self.launches = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free queue, evicting cached content."""
        if count > len(self.free_queue):
            raise ValueError(f"asked for {count} KV blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        if self.cached.get(h) is block:
            del self.cached[h]
            if self.record_events:
                self.events.append(BlockRemoved(block_hashes=[h]))
        block.block_hash = None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block; unreferenced ones join the tail of the free queue.

        Callers pass a request's blocks tail first, so a request's last blocks (the least
        likely to be shared) are evicted before its first ones.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.freed_at = self.launches
                self.free_queue.append(block)

    def settled(self, blocks: list[KVBlock]) -> bool:
        """Whether no step in flight can touch these blocks (each was freed before the
        latest launch, so that step was scheduled without them)."""
        return all(b.freed_at < self.launches for b in blocks)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: list[KVBlock],
        hashes: list[int],
        parent_hash: int | None,
        token_ids: list[int],
        lora_id: int | None,
    ) -> None:
        """Register newly filled blocks in the prefix cache, recording BlockStored events (if
        record_events).

        token_ids holds the tokens of `blocks`, block after block. A block whose content is
        already cached elsewhere stays out of the map; each run of newly stored blocks gives
        one event, chained to the block before it.
        """
        run: list[int] = []
        run_start = 0
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            if h not in self.cached:
                block.block_hash = h
                self.cached[h] = block
                if not run:
                    run_start = i
                run.append(h)
                continue
            if run:
                if self.record_events:
                    self._stored(run, run_start, parent_hash, hashes, token_ids, lora_id)
                run = []
        if run and self.record_events:
            self._stored(run, run_start, parent_hash, hashes, token_ids, lora_id)

    def _stored(self, run, start, parent_hash, hashes, token_ids, lora_id) -> None:
        """The BlockStored event of a run of newly cached blocks (events are recorded)."""
        size = self.block_size
        self.events.append(
            BlockStored(
                block_hashes=run,
                parent_block_hash=hashes[start - 1] if start else parent_hash,
                token_ids=token_ids[start * size : (start + len(run)) * size],
                block_size=size,
                lora_id=lora_id,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no block is in use."""
        if len(self.free_queue) != len(self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.record(AllBlocksCleared())
        return True

    def record(self, event: KVEvent) -> None:
        """Keep a KV event for take_events (dropped unless record_events)."""
        if self.record_events:
            self.events.append(event)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
