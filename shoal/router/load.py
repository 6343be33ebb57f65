"""The router's running prediction of each worker's load, corrected by the workers' reports.

Between two reports the router knows what it sent where: it adds each request's blocks and
uncached prompt tokens when it routes it, and counts it as queued; at its first token (the
prefill is over) it drops the prompt tokens and the count, and the blocks when it
finishes. With replica sync (shoal.router.replica_sync) it also counts the requests other
router replicas send, as they announce them. Reports arrive only now and then, but they
also count what the prediction cannot see (unsynced routers' requests, blocks held by
generated tokens); see LoadTracker.report for how the two are combined.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from shoal.protocol import LoadReport


@dataclass(slots=True)
class WorkerLoad:
    blocks: int = 0  # predicted active KV blocks of the requests counted here
    prefill_tokens: int = 0  # uncached prompt tokens of those requests not yet prefilled
    queued: int = 0  # those requests without their first token yet
    foreign: int = 0  # reported active blocks the prediction did not account for
    waiting: int = 0  # requests queued on the worker, as last reported
    total_blocks: int | None = None  # the worker's KV cache size, once reported

    @property
    def decode_blocks(self) -> int:
        """Active KV blocks: predicted for the requests counted here plus foreign."""
        return self.blocks + self.foreign


@dataclass(slots=True)
class _Request:
    load: WorkerLoad
    blocks: int
    prefill_tokens: int
    count: int = 1  # requests it stands for
    queued: bool = True  # no first token yet


_UNKNOWN = WorkerLoad()  # what a worker never routed to nor heard from looks like; never mutated


class LoadTracker:
    """Per-worker running sums of routed requests' load, plus the workers' last reports.

    Every method is O(1): the sums change by one request's share at a time.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._workers: dict[str, WorkerLoad] = {}
        self._requests: dict[Hashable, _Request] = {}
        self._watchers: list[Callable[[], None]] = []

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback` after each change that may lower a worker's load (a request
        finished, a report): what requests waiting for a non-busy worker need."""
        self._watchers.append(callback)

    def _released(self) -> None:
        for callback in self._watchers:
            callback()

    @property
    def block_size(self) -> int:
        """Tokens per KV block: converts prefill tokens to blocks (settable, e.g. on discovery)."""
        return self._block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"block_size must be at least 1 (got {value!r})")
        self._block_size = value

    def add(
        self,
        request_id: Hashable,
        worker_id: str,
        blocks: int,
        prefill_tokens: int,
        count: int = 1,
    ) -> None:
        """Count a request just routed to `worker_id`; adding an id again moves it there.

        Ids are any hashable key: other router replicas' requests (shoal.router.replica_sync)
        are keyed (replica id, request id). `count`: how many requests the entry stands for
        (its blocks and tokens are their sum), as a guess at peers' decisions does.
        """
        self.finish(request_id)
        load = self._workers.setdefault(worker_id, WorkerLoad())
        load.blocks += blocks
        load.prefill_tokens += prefill_tokens
        load.queued += count
        self._requests[request_id] = _Request(load, blocks, prefill_tokens, count)

    def __contains__(self, request_id: Hashable) -> bool:
        """Whether the request is counted (routed and not finished)."""
        return request_id in self._requests

    def first_token(self, request_id: Hashable) -> None:
        """The request's prefill is done: release its prompt tokens (again: no-op)."""
        request = self._requests.get(request_id)
        if request is not None and request.queued:
            request.load.prefill_tokens -= request.prefill_tokens
            request.load.queued -= request.count
            request.prefill_tokens = 0
            request.queued = False

    def finish(self, request_id: Hashable) -> None:
        """The request is over: release all it held (again, or an unknown id: no-op)."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            request.load.blocks -= request.blocks
            request.load.prefill_tokens -= request.prefill_tokens
            request.load.queued -= request.count if request.queued else 0
            self._released()

    def set_capacity(self, worker_id: str, total_blocks: int) -> None:
        """The worker's KV cache size, known before its first report (its model card)."""
        load = self._workers.setdefault(worker_id, WorkerLoad())
        load.total_blocks = total_blocks if total_blocks > 0 else None

    def report(self, report: LoadReport) -> None:
        """Correct the prediction with a worker's own count.

        The predicted active blocks count only the requests counted here (this router's and,
        with replica sync, its peers'). The part of the
        reported active blocks that the prediction does not explain, foreign =
        max(0, report.active_blocks - predicted blocks now), is kept and added to the
        prediction until the next report replaces it; the prediction itself is left alone,
        so requests routed or finished after the report still move the total at once.
        The waiting count and the cache size are taken as reported (a total of 0 means
        unknown).
        """
        load = self._workers.setdefault(report.worker_id, WorkerLoad())
        load.foreign = max(0, report.active_blocks - load.blocks)
        load.waiting = report.num_waiting
        self.set_capacity(report.worker_id, report.total_blocks)
        self._released()

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker; its requests still in flight release into the forgotten state."""
        self._workers.pop(worker_id, None)

    def prefill_blocks(self, worker_id: str) -> float:
        """Prompt work queued on the worker by the requests counted here, in blocks."""
        return self._workers.get(worker_id, _UNKNOWN).prefill_tokens / self._block_size

    def queued(self, worker_id: str) -> int:
        """Requests counted here sent to the worker that have not had their first token."""
        return self._workers.get(worker_id, _UNKNOWN).queued

    def decode_blocks(self, worker_id: str) -> int:
        """Active KV blocks on the worker: predicted for the requests counted here plus foreign."""
        return self._workers.get(worker_id, _UNKNOWN).decode_blocks

    def loads(self, worker_ids: Iterable[str]) -> list[WorkerLoad]:
        """Each worker's running sums (read only; a worker never heard of reads as all 0):
        what pricing many workers at once reads instead of one method call per term."""
        get = self._workers.get
        return [get(w, _UNKNOWN) for w in worker_ids]

    def waiting(self, worker_id: str) -> int:
        return self._workers.get(worker_id, _UNKNOWN).waiting

    def usage(self, worker_id: str) -> float | None:
        """Fraction of the worker's KV blocks active, or None before it reports its size."""
        load = self._workers.get(worker_id, _UNKNOWN)
        if load.total_blocks is None:
            return None
        return (load.blocks + load.foreign) / load.total_blocks
