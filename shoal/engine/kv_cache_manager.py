"""KV cache manager: each request's block table, prefix-cache lookups and allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shoal.engine.block_pool import BlockPool, KVBlock
from shoal.engine.block_table import BlockTable
from shoal.engine.request import Request
from shoal.protocol import KVEvent


class LowerTiers(Protocol):
    """What the cache tells the tiers below it (kv_offload.OffloadManager), which copy the
    blocks it caches out of the device and bring them back."""

    @property
    def busy(self) -> bool:
        """Copies queued or in flight."""
        ...

    def stored(
        self,
        blocks: list[KVBlock],
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        lora_id: int | None,
    ) -> None:
        """Full blocks just entered the prefix cache (the arguments of cache_full_blocks)."""
        ...

    def clear(self) -> bool:
        """Forget every block of the lower tiers; False while copies are in flight."""
        ...


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        record_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, block_size, record_events)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.block_table = BlockTable()  # the same block ids, one numpy row per request
        self.rows: dict[str, int] = {}  # request id -> its row of block_table
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request in the cache
        self.pinned: dict[str, list[KVBlock]] = {}  # blocks kept for a remote decode, by request
        self.stats = PrefixCacheStats()
        self.offload: LowerTiers | None = None  # fed by cache_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Leading blocks of the request already in the prefix cache, and their token count.

        At least one token is always left to compute, so the step produces logits.
        """
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        hits = self.prefix_hits(request)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def prefix_hits(self, request: Request) -> list[KVBlock]:
        """The request's leading blocks in the prefix cache, up to its last token (which
        is left to compute); no counting."""
        hashes = request.update_block_hashes(self.block_size)
        return self._leading_cached(hashes[: (request.num_tokens - 1) // self.block_size])

    def _leading_cached(self, block_hashes: list[int]) -> list[KVBlock]:
        """The cached blocks of these hashes, up to the first that is not cached."""
        hits = []
        for h in block_hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        """Give the request blocks for num_new_tokens more tokens; False if the pool is short."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        if not computed:
            if request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
                return True  # the tokens fit in the blocks it holds (most decode steps)
            computed = []
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        needed = self.blocks_needed(total) - len(blocks) - len(computed)
        reclaimable = sum(1 for b in computed if b.ref_cnt == 0)
        if needed > self.pool.num_free - reclaimable:
            return False
        new = computed
        if computed:
            self.pool.touch(computed)
            self.num_cached_blocks[rid] = len(blocks) + len(computed)
        if needed > 0:
            new = new + self.pool.allocate(needed)
        blocks.extend(new)
        self.req_blocks[rid] = blocks  # entered only once it holds blocks: a miss leaves none
        row = self.rows.get(rid)
        if row is None:
            row = self.rows[rid] = self.block_table.add_row()
        self.block_table.append(row, [b.block_id for b in new])
        return True

    def cache_blocks(self, request: Request) -> None:
        """Enter the request's blocks that are now full of computed tokens into the cache."""
        if not self.enable_caching:
            return
        rid = request.request_id
        done = self.num_cached_blocks.get(rid, 0)
        # a token still being sampled has its slot computed but no value to hash yet
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full <= done:
            return
        hashes = request.update_block_hashes(self.block_size)
        size = self.block_size
        args = (
            self.req_blocks[rid][done:full],
            hashes[done:full],
            hashes[done - 1] if done else None,
            request.all_token_ids[done * size : full * size],
            request.lora_id,
        )
        self.pool.cache_full_blocks(*args)
        if self.offload is not None:
            self.offload.stored(*args)
        self.num_cached_blocks[rid] = full

    def free(self, request: Request) -> None:
        """Release the request's blocks (they stay in the prefix cache until evicted)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
        row = self.rows.pop(request.request_id, None)
        if row is not None:
            self.block_table.free_row(row)

    def pin(self, request: Request, num_tokens: int) -> list[KVBlock]:
        """Hold the blocks of the request's first num_tokens tokens past its end (for a
        decode worker to pull); they count as in use until unpin."""
        blocks = self.req_blocks[request.request_id][: self.blocks_needed(num_tokens)]
        self.pool.touch(blocks)
        self.pinned[request.request_id] = blocks
        return blocks

    def unpin(self, request_id: str) -> int:
        """Release a request's pinned blocks (they stay cached until evicted); how many."""
        blocks = self.pinned.pop(request_id, [])
        self.pool.free(reversed(blocks))
        return len(blocks)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(b) for b in self.pinned.values())

    def num_cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        """How many leading blocks of these hashes the prefix cache holds now."""
        if not self.enable_caching:
            return 0
        return len(self._leading_cached(block_hashes))

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks[request.request_id]]

    def table_rows(self, requests: list[Request]) -> np.ndarray:
        """The block_table row of each request (each must hold blocks)."""
        rows = self.rows
        return np.fromiter((rows[r.request_id] for r in requests), np.intp, len(requests))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, the lower tiers' too; False while blocks are in use
        or copies to or from the lower tiers are in flight."""
        if self.offload is not None and self.offload.busy:
            return False
        if not self.pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.clear()
        return True

    def keep_events(self) -> None:
        """Record the KV events from now on, for take_events."""
        self.pool.record_events = True

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def cached_block_hashes(self) -> list[int]:
        """Hashes of every block in the prefix cache (what the KV events have announced)."""
        return list(self.pool.cached)

    @property
    def num_active_blocks(self) -> int:
        """Blocks referenced by requests."""
        return self.num_blocks - self.pool.num_free
