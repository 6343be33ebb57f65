"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Each step: running requests first (decodes and unfinished prefill chunks), in order,
preempting the newest running request whenever the KV pool is short; then waiting
requests, oldest first, under the per-step token budget and max_num_seqs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_arrivals = 0

    def add(self, request: Request) -> None:
        request.arrival = self.num_arrivals
        self.num_arrivals += 1
        self.waiting.append(request)

    def requeue(self, request: Request) -> None:
        """Put a request back among the waiting in arrival order, ahead of those that
        reached the scheduler after it."""
        for i, other in enumerate(self.waiting):
            if other.arrival > request.arrival:
                self.waiting.insert(i, request)
                return
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        running, allocate_slots = self.running, self.kv.allocate_slots
        max_model_len = self.config.max_model_len
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if request.ends_with_placeholder(max_model_len):
                i += 1  # finishes when the step in flight completes: a step more is waste
                continue
            pending = request.num_tokens + request.num_placeholders - request.num_computed_tokens
            num_new = min(pending, budget)
            while not allocate_slots(request, num_new):
                victim = running.pop()
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.add(request, num_new)
                budget -= num_new
                i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        blocked: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.waits_for_leader(request):
                blocked.append(self.waiting.popleft())
                continue
            computed, num_cached = [], 0
            if request.num_computed_tokens == 0:
                computed, num_cached = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - request.num_computed_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request, num_new, computed):
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.add(request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(blocked))

    def waits_for_leader(self, request: Request) -> bool:
        """A parallel sample waits until its leader's prompt is in the prefix cache."""
        leader = request.leader
        if leader is None or leader.is_finished:
            return False
        return leader.num_computed_tokens < leader.num_prompt_tokens

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        out.preempted.append(request)
        self.num_preemptions += 1

    def finish(self, requests: list[Request]) -> None:
        """Remove finished or aborted requests and release their blocks."""
        if not requests:
            return
        for request in requests:
            if request.status == RequestStatus.FINISHED:
                continue
            if request.status != RequestStatus.RUNNING:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED
            self.kv.free(request)
        self.running = [r for r in self.running if r.status != RequestStatus.FINISHED]
