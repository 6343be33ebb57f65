"""The frontend's lock-free latency histograms expose what prometheus_client's would."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from shoal.frontend.metrics import LATENCY_BUCKETS, FrontendMetrics


def _lines(registry: CollectorRegistry, family: str) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if family in line and "_created" not in line]


def test_ttft_and_itl_expose_the_buckets_count_and_sum_of_a_prometheus_histogram():
    """The same observations (bounds themselves, zero, past the last bound, random ones,
    two models) give the exposition lines a prometheus_client Histogram gives (its
    `_created` series aside)."""
    rng = random.Random(0)
    values = [*LATENCY_BUCKETS, 0.0, 1e3, *(rng.random() ** 3 * 30 for _ in range(500))]
    ours = FrontendMetrics(CollectorRegistry())
    reference = CollectorRegistry()
    for family, attribute in (
        ("shoal_time_to_first_token_seconds", "ttft"),
        ("shoal_inter_token_latency_seconds", "itl"),
    ):
        mine = getattr(ours, attribute)
        theirs = Histogram(
            family, mine.documentation, ["model"], buckets=LATENCY_BUCKETS, registry=reference
        )
        for i, value in enumerate(values):
            model = "a" if i % 3 else "b/c"
            getattr(ours.for_model(model), attribute).observe(value)
            theirs.labels(model).observe(value)
        assert _lines(ours.registry, family) == _lines(reference, family)
        assert ours.registry.get_sample_value(f"{family}_count", {"model": "b/c"}) == len(
            values[::3]
        )
