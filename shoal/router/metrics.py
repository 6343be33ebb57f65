"""Prometheus metrics of the KV router: hit rate, routing overhead, events, per-worker load."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

OVERHEAD_BUCKETS = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
)  # fmt: skip


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.routed = Counter(
            "shoal_router_requests", "Requests routed by the KV router", registry=r
        )
        self.prompt_blocks = Counter(
            "shoal_router_prompt_blocks",
            "Full prompt blocks of routed requests (the hit rate's denominator)",
            registry=r,
        )
        self.cached_blocks = Counter(
            "shoal_router_cached_blocks",
            "Of those, blocks the chosen worker already held (hit rate = cached / prompt)",
            registry=r,
        )
        self.hash_seconds = Histogram(
            "shoal_router_hash_seconds",
            "Time to hash one request's prompt blocks",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.select_seconds = Histogram(
            "shoal_router_select_seconds",
            "Time to find overlaps, score the workers and pick one",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.events_applied = Counter(
            "shoal_router_kv_events_applied", "KV events applied to the index", registry=r
        )
        self.resyncs = Counter(
            "shoal_router_kv_resyncs",
            "Full-state dumps fetched from workers, by reason (start: a new worker; gap: "
            "missed event batches)",
            ["reason"],
            registry=r,
        )
        self.busy_rejections = Counter(
            "shoal_router_busy_rejections",
            "Routing attempts that found every worker busy",
            registry=r,
        )

    def watch_workers(self, sample: Callable[[], Iterator[tuple[str, float, float, int]]]) -> None:
        """Export per-worker gauges read at scrape time from `sample`.

        `sample` yields (worker id, predicted active blocks, predicted prefill tokens, blocks
        in the router's index) for every worker the router knows.
        """
        self.registry.register(_WorkerCollector(sample))


class _WorkerCollector(Collector):
    def __init__(self, sample: Callable[[], Iterator[tuple[str, float, float, int]]]) -> None:
        self._sample = sample

    def collect(self):
        active = GaugeMetricFamily(
            "shoal_router_worker_active_blocks",
            "The router's estimate of a worker's KV blocks in use",
            labels=["worker"],
        )
        prefill = GaugeMetricFamily(
            "shoal_router_worker_prefill_tokens",
            "Prompt tokens the router has sent to a worker that are not yet prefilled",
            labels=["worker"],
        )
        indexed = GaugeMetricFamily(
            "shoal_router_worker_indexed_blocks",
            "Blocks the router's index says a worker caches",
            labels=["worker"],
        )
        for worker, blocks, tokens, cached in self._sample():
            active.add_metric([worker], blocks)
            prefill.add_metric([worker], tokens)
            indexed.add_metric([worker], cached)
        yield active
        yield prefill
        yield indexed
