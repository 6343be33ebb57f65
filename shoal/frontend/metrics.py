"""Prometheus metrics of one app, in a registry of its own (several apps may share a process)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass(frozen=True)
class ModelMetrics:
    """The per-model children, resolved once so the token path does no label lookups."""

    ttft: Histogram
    itl: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "shoal_requests",
            "HTTP requests to /v1, by model, endpoint and status code",
            ["model", "endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "shoal_requests_in_flight", "Generation requests being served now", registry=r
        )
        self.request_duration = Histogram(
            "shoal_request_duration_seconds",
            "Time from a request's arrival to the end of its response",
            ["model", "endpoint"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "shoal_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "shoal_inter_token_latency_seconds",
            "Time between consecutive outputs of one sequence",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "shoal_prompt_tokens",
            "Prompt tokens of requests the engines accepted",
            ["model"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "shoal_generation_tokens", "Generated tokens", ["model"], registry=r
        )
        self._models: dict[str, ModelMetrics] = {}

    def for_model(self, model: str) -> ModelMetrics:
        found = self._models.get(model)
        if found is None:
            found = ModelMetrics(
                self.ttft.labels(model),
                self.itl.labels(model),
                self.prompt_tokens.labels(model),
                self.generation_tokens.labels(model),
            )
            self._models[model] = found
        return found

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
