"""Prometheus metrics of one worker's engine, refreshed after every engine step."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from shoal.engine.llm_engine import LLMEngine


class WorkerMetrics:
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = {"model": model}

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, list(labels), registry=self.registry).labels(**labels)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, list(labels), registry=self.registry).labels(**labels)

        self.running = gauge("shoal_worker_requests_running", "sequences in the running batch")
        self.waiting = gauge("shoal_worker_requests_waiting", "sequences waiting to be scheduled")
        self.kv_usage = gauge("shoal_worker_kv_cache_usage", "fraction of KV blocks in use")
        self.kv_blocks = gauge("shoal_worker_kv_cache_blocks", "KV blocks in the pool")
        self.prefix_queries = counter(
            "shoal_worker_prefix_cache_queries", "prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = counter(
            "shoal_worker_prefix_cache_hits", "prompt tokens found in the prefix cache"
        )
        self.preemptions = counter("shoal_worker_preemptions", "requests preempted")
        self._seen = (0, 0, 0)

    def update(self, engine: LLMEngine) -> None:
        """Copy the engine's state (runs in the engine thread after each step)."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.kv_usage.set(engine.kv.usage)
        self.kv_blocks.set(engine.kv.num_blocks)
        stats = engine.kv.stats
        now = (stats.queries, stats.hits, engine.scheduler.num_preemptions)
        self.prefix_queries.inc(now[0] - self._seen[0])
        self.prefix_hits.inc(now[1] - self._seen[1])
        self.preemptions.inc(now[2] - self._seen[2])
        self._seen = now

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Expose /metrics over HTTP from a background thread."""
        start_http_server(port, addr=host, registry=self.registry)
