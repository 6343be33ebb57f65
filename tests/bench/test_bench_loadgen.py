"""Load shapes send exactly what they should, when they should."""

from __future__ import annotations

import numpy as np
import pytest
from bench_helpers import run_sessions

from shoal.bench.loadgen import LoadShape
from shoal.bench.metrics import summarize
from shoal.bench.workloads import LengthDist, single_turn


def sessions(builder, n: int, out: int = 3):
    return single_turn(builder, n, LengthDist.parse("16"), LengthDist.parse(str(out)))


def test_fixed_concurrency_holds_exactly_n_in_flight(stub, vocab, builder):
    result = run_sessions(
        stub.url,
        sessions(builder, 23),
        LoadShape("concurrency", concurrency=5),
        vocab,
        stub={"ttft_ms": 30, "itl_ms": 2, "hold_until": 5},
    )
    assert len(result.records) == 23 == stub.count
    assert sorted(r.index for r in result.records) == list(range(23))
    assert stub.max_in_flight == 5
    summary = summarize(result.records)
    assert summary["requests"] == {
        "total": 23,
        "ok": 23,
        "errors": 0,
        "error_kinds": {},
        "error_examples": {},
    }
    assert 4.0 < summary["mean_in_flight"] <= 5.0


def test_duration_stops_new_requests(stub, vocab, builder):
    result = run_sessions(
        stub.url,
        sessions(builder, 1000),
        LoadShape("concurrency", concurrency=2, duration_s=0.2),
        vocab,
        stub={"ttft_ms": 40},
    )
    # two workers, 40+ ms per request, none started after 0.2 s: at most ten requests
    assert 2 <= len(result.records) <= 10
    assert max(r.start_s for r in result.records) < 0.2


def test_constant_rate_starts_on_schedule(stub, vocab, builder):
    result = run_sessions(
        stub.url,
        sessions(builder, 20),
        LoadShape("rate", rate=100.0, arrival="constant"),
        vocab,
        stub={"ttft_ms": 5},
    )
    records = sorted(result.records, key=lambda r: r.index)
    assert len(records) == 20
    assert [r.scheduled_s for r in records] == pytest.approx([i * 0.01 for i in range(20)])
    lag = np.array([r.start_s - r.scheduled_s for r in records])
    assert lag.min() >= 0 and np.median(lag) < 0.005 and lag.max() < 0.05


def test_poisson_rate_has_exponential_gaps(stub, vocab, builder):
    result = run_sessions(
        stub.url, sessions(builder, 300, out=1), LoadShape("rate", rate=500.0, seed=3), vocab
    )
    scheduled = np.sort([r.scheduled_s for r in result.records])
    gaps = np.diff(scheduled)
    assert len(result.records) == 300
    assert gaps.mean() == pytest.approx(1 / 500, rel=0.2)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.2)  # constant gaps give 0


def test_rate_with_max_concurrency_caps_in_flight(stub, vocab, builder):
    result = run_sessions(
        stub.url,
        sessions(builder, 15),
        LoadShape("rate", rate=1000.0, concurrency=3, arrival="constant"),
        vocab,
        stub={"ttft_ms": 30, "hold_until": 3},
    )
    assert len(result.records) == 15 and all(r.ok for r in result.records)
    assert stub.max_in_flight == 3
    lag = summarize(result.records)["schedule_lag_ms"]
    assert lag["max"] > 100  # the last arrivals waited for a free slot


def test_thousand_concurrent_streams(stub, vocab, builder):
    n = 1024
    result = run_sessions(
        stub.url,
        sessions(builder, n, out=3),
        LoadShape("concurrency", concurrency=n),
        vocab,
        stub={"itl_ms": 20, "hold_until": n},
        max_connections=n,
    )
    assert len(result.records) == n
    assert all(r.ok for r in result.records), summarize(result.records)["requests"]
    assert stub.max_in_flight == n
    assert all(r.chunks == 3 and r.output_tokens == 3 for r in result.records)
