"""Prometheus metrics of one app, in a registry of its own (several apps may share a process).

The latency histograms observed on the token path (TTFT and ITL, once per output) are
LoopHistograms: observed only by the event loop's thread, so an observation is a bisect
and two additions without locks (0.96 us with prometheus_client's Histogram, a lock per
bucket and sum and a scan of the bounds, on the dev VM: several percent of a frontend's
CPU when it streams one token per event). They are exposed as histogram families of the
same names, buckets, `_count` and `_sum` through a collector; /metrics reads them on the
loop too.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class LoopHistogram:
    """Bucket counts and a sum, observed from one thread (the event loop) without locks."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount
        self.sum += amount


class LoopHistograms:
    """A histogram family with one label, of LoopHistogram children, as a registry's
    collector."""

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.label = label
        self.buckets = tuple(buckets)
        self.children: dict[str, LoopHistogram] = {}
        registry.register(self)

    def labels(self, value: str) -> LoopHistogram:
        child = self.children.get(value)
        if child is None:
            child = self.children[value] = LoopHistogram(self.buckets)
        return child

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=[self.label])

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        bounds = [*map(floatToGoString, self.buckets), "+Inf"]
        for value, child in list(self.children.items()):
            cumulative = accumulate(list(child.counts))
            family.add_metric([value], list(zip(bounds, cumulative, strict=True)), child.sum)
        yield family


@dataclass(frozen=True)
class ModelMetrics:
    """The per-model children, resolved once so the token path does no label lookups."""

    ttft: LoopHistogram
    itl: LoopHistogram
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
        self.ttft = LoopHistograms(
            "shoal_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token",
            "model",
            LATENCY_BUCKETS,
            r,
        )
        self.itl = LoopHistograms(
            "shoal_inter_token_latency_seconds",
            "Time between consecutive outputs of one sequence",
            "model",
            LATENCY_BUCKETS,
            r,
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
