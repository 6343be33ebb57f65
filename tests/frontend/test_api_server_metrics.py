"""/metrics across --api-server-count processes: each process's series, labelled by index."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from shoal.frontend.api_server_metrics import ApiServerMetrics, merge
from shoal.frontend.metrics import FrontendMetrics


def frontend_metrics(requests: int, seconds: float) -> FrontendMetrics:
    metrics = FrontendMetrics()
    metrics.requests.labels("tiny", "/v1/completions", "200").inc(requests)
    metrics.requests.labels('a "b" {c} d', "other", "404").inc()  # quotes, braces, spaces
    metrics.request_duration.labels("tiny", "/v1/completions").observe(seconds)
    metrics.for_model("tiny").ttft.observe(seconds / 10)
    metrics.in_flight.set(requests % 2)
    return metrics


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, over every family of an exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_every_process_series_is_kept_under_its_index():
    texts = {i: frontend_metrics(3 + i, 0.2 * (i + 1)).render()[0] for i in range(2)}
    merged = merge(texts)
    got = samples(merged)
    for index, text in texts.items():
        for (name, labels), value in samples(text).items():
            assert (
                got[(name, tuple(sorted({**dict(labels), "api_server": str(index)}.items())))]
                == value
            )
    assert len(got) == sum(len(samples(text)) for text in texts.values())
    # one HELP and TYPE per family however many processes have it
    assert merged.count(b"# TYPE shoal_requests_total counter") == 1
    assert merged.count(b"# TYPE shoal_time_to_first_token_seconds histogram") == 1


def requests_by_process(text: bytes) -> dict[str, float]:
    return {
        dict(labels)["api_server"]: value
        for (name, labels), value in samples(text).items()
        if name == "shoal_requests_total" and dict(labels)["model"] == "tiny"
    }


def test_a_process_gathers_its_siblings_over_their_sockets(tmp_path, caplog):
    """Three processes' worth in one loop: two serve their registries, the third never
    started, so a scrape has the two and a warning for the third."""

    async def run() -> bytes:
        registries = [frontend_metrics(5, 0.1), frontend_metrics(7, 0.3)]
        sides = [ApiServerMetrics(str(tmp_path), i, 3) for i in range(2)]
        for side, metrics in zip(sides, registries, strict=True):
            await side.serve(metrics.registry)
        try:
            return await sides[0].gather(registries[0].render()[0])
        finally:
            for side in sides:
                await side.close()

    text = asyncio.run(asyncio.wait_for(run(), 10))
    assert requests_by_process(text) == {"0": 5.0, "1": 7.0}
    assert "no metrics from api-server-2" in caplog.text
