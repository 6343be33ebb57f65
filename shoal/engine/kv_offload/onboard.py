"""Onboarding: a waiting request's prefix continues from the GPU prefix cache into the
lower tiers; the blocks found there are copied into freshly allocated GPU blocks before it
is scheduled, and it prefills only the rest.

Each step, before scheduling, the requests next in line (as many as could join the batch,
in order, while their prompts fit in the pool) are looked up. One with lower-tier hits
takes its GPU hits and new blocks for the tier hits, leaves the waiting queue while the
copy runs (the request waits, the batch does not), and returns to its place in the queue
(arrival order) with those tokens computed and entered into the prefix cache. With CUDA
the copy runs on a side stream and is polled; on the CPU it is a memory copy (a disk read
first for blocks on disk) in the engine thread, done at once, so the request is back in
the queue in the same step.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

from shoal.engine.kv_offload.manager import OffloadManager, Onboarding
from shoal.engine.kv_offload.stats import MEDIUM_CPU

if TYPE_CHECKING:
    from shoal.engine.block_pool import KVBlock
    from shoal.engine.request import Request
    from shoal.engine.scheduler import Scheduler


def admit(manager: OffloadManager, scheduler: Scheduler, max_num_seqs: int) -> None:
    """Finish the onboardings that are done, then start those of the requests next in line.

    First come, first served: the waiting requests are walked in order, each reserving the
    blocks its whole prompt still needs, and the walk stops at the first that does not fit
    in what is left, so nobody behind it takes the room it waits for.
    """
    if manager.loads and not scheduler.num_unfinished:
        manager.loads[0].job.wait()  # nothing else to run: no point spinning
    finish(manager, scheduler)
    copying = sum(1 for load in manager.loads if not load.released)
    room = max_num_seqs - len(scheduler.running) - copying
    if room <= 0 or not scheduler.waiting:
        return
    kv = manager.kv
    free = kv.pool.num_free
    started: list[Onboarding] = []
    for request in islice(scheduler.waiting, room):
        if scheduler.waits_for_leader(request):
            continue  # it shares its leader's prompt blocks
        hits = _gpu_hits(manager, request)
        held = len(kv.req_blocks.get(request.request_id, ()))
        reclaimable = sum(1 for b in hits if b.ref_cnt == 0)
        need = kv.blocks_needed(request.num_tokens) - held - len(hits) + reclaimable
        if need > free:
            break
        free -= need
        if _eligible(manager, request):
            load = _start(manager, request, hits)
            if load is not None:
                started.append(load)
    for load in started:
        scheduler.waiting.remove(load.request)
        if load.settled:
            _release(manager, scheduler, load)
        manager.loads.append(load)
    finish(manager, scheduler)


def finish(manager: OffloadManager, scheduler: Scheduler) -> None:
    """Requeue, in arrival order, the requests whose blocks have arrived."""
    ready = [load.job.done() for load in manager.loads]
    if not any(ready):
        return
    done = [load for load, r in zip(manager.loads, ready, strict=True) if r]
    manager.loads = [load for load, r in zip(manager.loads, ready, strict=True) if not r]
    stats = manager.stats[MEDIUM_CPU]
    for load in done:
        for entry in load.entries:
            entry.pins -= 1
        stats.read_seconds += load.job.seconds
        if load.cancelled:
            manager.kv.free(load.request)
        elif not load.released:
            _release(manager, scheduler, load)


def _release(manager: OffloadManager, scheduler: Scheduler, load: Onboarding) -> None:
    """Requeue, in arrival order, a request with its onboarded tokens computed and cached.
    Before its copy is done, the steps launched from now on wait for the copy."""
    request = load.request
    request.num_computed_tokens = load.num_tokens
    if request.num_cached_tokens < 0:
        request.num_cached_tokens = load.num_tokens
    manager.kv.cache_blocks(request)
    manager.copier.order_before_steps(load.job)
    load.released = True
    scheduler.requeue(request)


def _gpu_hits(manager: OffloadManager, request: Request) -> list[KVBlock]:
    """The leading blocks of a request yet to start that the GPU prefix cache holds."""
    kv = manager.kv
    if request.num_computed_tokens or not kv.enable_caching or request.wants_prompt_logprobs:
        return []
    return kv.prefix_hits(request)


def _eligible(manager: OffloadManager, request: Request) -> bool:
    """A request that would look up the prefix cache when admitted and holds no blocks."""
    leader = request.leader
    return (
        request.num_computed_tokens == 0
        and request.request_id not in manager.kv.req_blocks
        and not request.wants_prompt_logprobs
        and (leader is None or leader.is_finished)
    )


def _start(manager: OffloadManager, request: Request, hits: list[KVBlock]) -> Onboarding | None:
    """Take the request's GPU hits and blocks for its lower-tier hits, and start the copy
    (at once if no step in flight can touch those blocks: the request can then run in the
    next step, which waits for the copy); None when the tiers hold nothing more of its
    prefix."""
    kv = manager.kv
    size = kv.block_size
    hashes = request.block_hashes
    limit = (request.num_tokens - 1) // size
    gpu = len(hits)
    media = manager.find(hashes[gpu:limit])
    if not media:
        return None
    sources, entries = manager.read(hashes[gpu : gpu + len(media)], media)
    if not sources:
        return None
    kv.stats.queries += request.num_tokens
    kv.stats.hits += gpu * size
    if hits:
        kv.allocate_slots(request, 0, hits)
    request.num_computed_tokens = gpu * size
    kv.allocate_slots(request, len(sources) * size)
    blocks = kv.req_blocks[request.request_id][gpu : gpu + len(sources)]
    settled = kv.pool.settled(blocks)
    block_ids = [b.block_id for b in blocks]
    job = manager.load(hashes[gpu : gpu + len(sources)], sources, entries, block_ids, not settled)
    return Onboarding(request, job, (gpu + len(sources)) * size, entries, settled)
