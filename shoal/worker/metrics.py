"""Prometheus metrics of one worker's engine, its health endpoint, and its periodic stats line."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

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
        self.tiers = TierMetrics(model, self.registry)
        self._server: ThreadingHTTPServer | None = None

    def update(self, engine: LLMEngine) -> None:
        """Copy the engine's state (in the engine thread: after each step, and periodically,
        so that gauges are fresh after aborts on an idle engine too)."""
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
        if engine.kv.offload is not None:
            self.tiers.update(engine.kv.offload)

    def serve(
        self, port: int, host: str = "127.0.0.1", healthy: Callable[[], bool] = lambda: True
    ) -> int:
        """Serve /metrics and /health (200, or 503 once `healthy()` is false) from a thread.

        Returns the port (useful with port 0).
        """
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/health":
                    ok = healthy()
                    self._reply(200 if ok else 503, b"ok\n" if ok else b"engine dead\n")
                elif path in ("/metrics", "/"):
                    self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                else:
                    self._reply(404, b"not found\n")

            def _reply(self, status: int, body: bytes, kind: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                """Scrapes are not worth a log line each."""

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, name="worker-metrics", daemon=True
        ).start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class TierMetrics:
    """The lower KV tiers' counters (shoal.engine.kv_offload), labelled by tier (CPU, DISK)."""

    _COUNTERS = (  # TierStats field -> metric, help, direction label (None: none)
        ("hits", "shoal_worker_kv_offload_hits", "KV blocks onboarded from the tier", None),
        ("misses", "shoal_worker_kv_offload_misses", "tier blocks unreadable (recomputed)", None),
        ("stored", "shoal_worker_kv_offload_stored", "KV blocks written to the tier", None),
        ("evicted", "shoal_worker_kv_offload_evicted", "KV blocks evicted from the tier", None),
        ("bytes_read", "shoal_worker_kv_offload_bytes", "bytes moved", "read"),
        ("bytes_written", "shoal_worker_kv_offload_bytes", "bytes moved", "write"),
        ("read_seconds", "shoal_worker_kv_offload_seconds", "seconds moving bytes", "read"),
        ("write_seconds", "shoal_worker_kv_offload_seconds", "seconds moving bytes", "write"),
    )

    def __init__(self, model: str, registry: CollectorRegistry) -> None:
        made: dict[str, Counter] = {}
        self._counters = []
        for field, name, text, direction in self._COUNTERS:
            labels = ["model", "tier"] + (["direction"] if direction else [])
            if name not in made:
                made[name] = Counter(name, text, labels, registry=registry)
            self._counters.append((field, made[name], direction))
        self._model = model
        self.blocks = Gauge(
            "shoal_worker_kv_offload_blocks",
            "KV blocks held by the tier",
            ["model", "tier"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "shoal_worker_kv_offload_queue_depth",
            "KV blocks waiting to be copied to the host tier or being copied",
            ["model"],
            registry=registry,
        ).labels(model=model)
        self._seen: dict[tuple[str, str], float] = {}

    def update(self, offload) -> None:
        """Add what the tiers' counters gained since the last call; set the gauges."""
        for tier, stats in offload.stats.items():
            for field, counter, direction in self._counters:
                now = getattr(stats, field)
                gained = now - self._seen.get((tier, field), 0)
                self._seen[tier, field] = now
                if gained > 0:
                    labels = {"model": self._model, "tier": tier}
                    if direction:
                        labels["direction"] = direction
                    counter.labels(**labels).inc(gained)
        self.blocks.labels(model=self._model, tier="CPU").set(len(offload.host))
        if offload.disk is not None:
            self.blocks.labels(model=self._model, tier="DISK").set(len(offload.disk))
        self.queue_depth.set(offload.queue_depth)


class StatsLogger:
    """The worker's periodic engine stats line, as vLLM logs it.

    Count tokens with `count_prompt` / `count_generated` (event loop); `line(engine)` runs in
    the engine thread and describes the interval since its last call.
    """

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._last = (time.monotonic(), 0, 0, 0, 0)
        self._idle_logged = False

    def count_prompt(self, n: int) -> None:
        self.prompt_tokens += n

    def count_generated(self, n: int) -> None:
        self.generated_tokens += n

    def line(self, engine: LLMEngine) -> str | None:
        """The stats line for the interval, or None when idle and already said so."""
        now = time.monotonic()
        stats = engine.kv.stats
        then, prompt, generated, queries, hits = self._last
        self._last = (now, self.prompt_tokens, self.generated_tokens, stats.queries, stats.hits)
        running, waiting = engine.num_running, engine.num_waiting
        idle = not (running or waiting or self.prompt_tokens - prompt)
        idle = idle and self.generated_tokens == generated
        if idle and self._idle_logged:
            return None
        self._idle_logged = idle
        elapsed = max(now - then, 1e-9)
        looked_up = stats.queries - queries
        hit_rate = 100.0 * (stats.hits - hits) / looked_up if looked_up else 0.0
        return (
            f"Avg prompt throughput: {(self.prompt_tokens - prompt) / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {(self.generated_tokens - generated) / elapsed:.1f} "
            f"tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
            f"GPU KV cache usage: {100.0 * engine.kv.usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )
