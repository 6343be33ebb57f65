"""Whole-block copies between the runner's KV caches and host memory.

On CUDA each batch of blocks is gathered (or scattered) on a side stream and copied to
(or from) host memory with asynchronous copies; a Job's event says when it is done, and
the engine polls it instead of waiting. On the CPU a copy is a memory copy in the
caller's thread: the Job is done when it is made.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from shoal.engine.transfer import to_device


class Job:
    """One batch of block copies in flight (or done)."""

    def __init__(self, started: float, end: torch.cuda.Event | None = None, begin=None) -> None:
        self._end, self._begin = end, begin
        self._seconds = None if end is not None else time.perf_counter() - started

    def done(self) -> bool:
        return self._end is None or self._end.query()

    def wait(self) -> None:
        if self._end is not None:
            self._end.synchronize()

    def order_before(self, stream: torch.cuda.Stream | None) -> None:
        """Have the work queued on `stream` from now on wait for these copies."""
        if self._end is not None and stream is not None:
            stream.wait_event(self._end)

    @property
    def seconds(self) -> float:
        """Time the copies took (on the device's clock with CUDA); call once done."""
        if self._seconds is None:
            self._seconds = self._begin.elapsed_time(self._end) / 1000.0
        return self._seconds


class BlockCopier:
    """Moves blocks between per-layer caches [2, blocks, block_size, heads, head_dim] and
    host blocks [layers, 2, block_size, heads, head_dim]."""

    def __init__(self, kv_caches: list[torch.Tensor], in_order: bool = False) -> None:
        """in_order: keep the copies in order with the device's work (a tensor-parallel
        follower, which cannot poll): a save waits for the steps queued before it and the
        steps queued after it wait for its blocks to be gathered; the steps queued after a
        load wait for it."""
        self.caches = kv_caches
        self.device = kv_caches[0].device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.in_order = in_order and self.stream is not None

    def order_before_steps(self, job: Job) -> None:
        """Have the steps launched from now on wait for this job's copies."""
        if self.stream is not None:
            job.order_before(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        """Wait for every copy started so far."""
        if self.stream is not None:
            self.stream.synchronize()

    def _events(self) -> tuple:
        if self.stream is None:
            return None, None
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(self.stream)
        return begin, torch.cuda.Event(enable_timing=True)

    def _finish(self, started: float, begin, end) -> Job:
        if end is not None:
            end.record(self.stream)
        return Job(started, end, begin)

    @torch.inference_mode()
    def save(self, block_ids: list[int], host: torch.Tensor, slots: list[int]) -> Job:
        """Copy these device blocks into these slots of the host buffer. The blocks must
        hold their final KV already (the step that wrote them is complete)."""
        started = time.perf_counter()
        main = torch.cuda.current_stream(self.device) if self.in_order else None
        if main is not None:
            self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            begin, end = self._events()
            index = to_device(block_ids, torch.int64, self.device)
            gathered = torch.stack([c.index_select(1, index) for c in self.caches])
            blocks = gathered.permute(2, 0, 1, 3, 4, 5)  # [n, layers, 2, size, heads, dim]
            if self.stream is None:
                host.index_copy_(0, torch.tensor(slots, dtype=torch.int64), blocks)
                return self._finish(started, begin, end)
            blocks = blocks.contiguous()
            if main is not None:  # later steps may reuse the blocks once they are gathered
                main.wait_stream(self.stream)
            for i, slot in enumerate(slots):
                host[slot].copy_(blocks[i], non_blocking=True)
            return self._finish(started, begin, end)

    @torch.inference_mode()
    def load(
        self, sources: list[torch.Tensor], block_ids: list[int], after_queued: bool = True
    ) -> Job:
        """Copy host blocks (one tensor each) into these device blocks. With CUDA the copy
        starts after the work queued so far when after_queued (a step in flight may still
        write a block that was just freed), else at once; run nothing on the blocks before
        the Job is done or ordered before the work that uses them."""
        started = time.perf_counter()
        if self.stream is not None and (after_queued or self.in_order):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            begin, end = self._events()
            index = to_device(block_ids, torch.int64, self.device)
            if self.stream is None:
                blocks = torch.stack(sources)
            else:
                blocks = torch.empty(
                    (len(sources), *sources[0].shape), dtype=sources[0].dtype, device=self.device
                )
                for i, src in enumerate(sources):
                    blocks[i].copy_(src, non_blocking=True)
            for layer, cache in enumerate(self.caches):
                cache.index_copy_(1, index, blocks[:, layer].transpose(0, 1))
            job = self._finish(started, begin, end)
        if self.in_order:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return job
