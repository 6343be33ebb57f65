"""Prometheus metrics of KV transfers on a worker: pulls, bytes, time, pinned blocks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DisaggMetrics:
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        names = ["model"]
        reg = self.registry
        self.transfers = Counter(
            "shoal_kv_transfers",
            "KV transfers this decode worker made, by backend and outcome (ok, failed)",
            [*names, "backend", "outcome"],
            registry=reg,
        )
        self.transfer_bytes = Counter(
            "shoal_kv_transfer_bytes", "KV bytes pulled from prefill workers", names, registry=reg
        )
        self.transfer_blocks = Counter(
            "shoal_kv_transfer_blocks", "KV blocks pulled from prefill workers", names, registry=reg
        )
        self.cached_blocks = Counter(
            "shoal_kv_transfer_cached_blocks",
            "blocks of transferred prompts this worker already cached (not pulled)",
            names,
            registry=reg,
        )
        self.transfer_seconds = Histogram(
            "shoal_kv_transfer_seconds",
            "time to pull one request's KV blocks",
            names,
            buckets=TRANSFER_BUCKETS,
            registry=reg,
        )
        self.local_fallbacks = Counter(
            "shoal_kv_transfer_local_prefills",
            "requests sent with transferred KV that prefilled here instead",
            names,
            registry=reg,
        )
        self.pinned_blocks = Gauge(
            "shoal_kv_pinned_blocks",
            "blocks a prefill worker holds for decode workers to pull",
            names,
            registry=reg,
        )
        self.released = Counter(
            "shoal_kv_pinned_releases",
            "pinned prefills released, by reason (pulled, released by the frontend, timeout)",
            [*names, "reason"],
            registry=reg,
        )
        self.model = model

    def transfer(
        self, backend: str, ok: bool, blocks: int, cached: int, nbytes: int, seconds: float
    ) -> None:
        """Count one pull."""
        m = self.model
        self.transfers.labels(m, backend, "ok" if ok else "failed").inc()
        if ok:
            self.transfer_blocks.labels(m).inc(blocks)
            self.cached_blocks.labels(m).inc(cached)
            self.transfer_bytes.labels(m).inc(nbytes)
            self.transfer_seconds.labels(m).observe(seconds)
