"""Failures are counted by kind and never stop the run."""

from __future__ import annotations

from bench_helpers import run_sessions

from shoal.bench.loadgen import LoadShape
from shoal.bench.metrics import summarize
from shoal.bench.workloads import LengthDist, multi_turn, single_turn


def sessions(builder, n: int, out: int = 3):
    return single_turn(builder, n, LengthDist.parse("12"), LengthDist.parse(str(out)))


def test_http_500_counted_exactly(stub, vocab, builder):
    result = run_sessions(
        stub.url,
        sessions(builder, 30),
        LoadShape("concurrency", concurrency=4),
        vocab,
        stub={"fail_every": 3},
    )
    assert len(result.records) == 30
    failed = [r for r in result.records if not r.ok]
    assert len(failed) == 10
    assert all(r.error_kind == "http" and r.status == 500 for r in failed)
    assert "injected failure" in failed[0].error
    assert all(r.ttft_s is None and r.chunks == 0 for r in failed)
    summary = summarize(result.records)
    assert summary["requests"]["ok"] == 20
    assert summary["requests"]["error_kinds"] == {"http": 10}
    assert summary["latency_ms"]["ttft"]["count"] == 20


def test_connection_refused_counted(closed_port_url, vocab, builder):
    for shape in (LoadShape("concurrency", concurrency=3), LoadShape("rate", rate=500.0)):
        result = run_sessions(closed_port_url, sessions(builder, 9), shape, vocab)
        assert len(result.records) == 9
        assert {r.error_kind for r in result.records} == {"connect"}
        summary = summarize(result.records)
        assert summary["requests"]["ok"] == 0
        assert summary["throughput"]["requests_per_s"] == 0
        assert summary["latency_ms"]["ttft"] is None


def test_timeout_counted(stub, vocab, builder):
    result = run_sessions(
        stub.url,
        sessions(builder, 4),
        LoadShape("concurrency", concurrency=4),
        vocab,
        stub={"ttft_ms": 600},
        timeout_s=0.15,
    )
    assert [r.error_kind for r in result.records] == ["timeout"] * 4
    assert all(0.14 < r.e2e_s < 1.0 for r in result.records)


def test_error_inside_the_stream(stub, vocab, builder):
    result = run_sessions(
        stub.url,
        sessions(builder, 3, out=6),
        LoadShape("concurrency", concurrency=3),
        vocab,
        stub={"error_after": 2},
    )
    for r in result.records:
        assert r.error_kind == "server-error" and "engine failed" in r.error
        assert r.chunks == 2


def test_truncated_stream_is_incomplete(stub, vocab, builder):
    result = run_sessions(
        stub.url,
        sessions(builder, 2, out=6),
        LoadShape("concurrency", concurrency=2),
        vocab,
        stub={"truncate_after": 3},
    )
    assert [r.error_kind for r in result.records] == ["incomplete", "incomplete"]


def test_failed_turn_skips_the_rest_of_its_session(stub, vocab, builder):
    work = multi_turn(
        builder, 2, LengthDist.parse("3"), LengthDist.parse("6"), LengthDist.parse("2")
    )
    result = run_sessions(
        stub.url,
        work,
        LoadShape("concurrency", concurrency=1),
        vocab,
        stub={"fail_every": 2},
    )
    kinds = [
        (r.session, r.turn, r.error_kind) for r in sorted(result.records, key=lambda r: r.index)
    ]
    assert kinds == [
        (0, 0, None),
        (0, 1, "http"),
        (0, 2, "skipped"),
        (1, 0, None),
        (1, 1, "http"),
        (1, 2, "skipped"),
    ]
    assert stub.count == 4
    summary = summarize(result.records)
    assert summary["requests"]["error_kinds"] == {"http": 2, "skipped": 2}
    assert summary["schedule_lag_ms"]["count"] == 4
