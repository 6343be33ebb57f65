"""Aggregates: percentiles, throughput, goodput under SLOs, token-count checks."""

from __future__ import annotations

import numpy as np
import pytest
from bench_helpers import run_sessions

from shoal.bench.client import RequestRecord
from shoal.bench.loadgen import LoadShape
from shoal.bench.metrics import (
    meets_slo,
    parse_slo,
    saturated_output_rate,
    stats,
    summarize,
    ttft_phases,
)
from shoal.bench.workloads import LengthDist, single_turn


def test_stats_match_numpy():
    values = np.random.default_rng(0).exponential(10.0, 1001)
    s = stats(values)
    assert s["count"] == 1001
    assert s["mean"] == pytest.approx(values.mean())
    assert s["p90"] == pytest.approx(np.percentile(values, 90))
    assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"] == values.max()
    assert stats([]) is None


def test_parse_slo():
    assert parse_slo("ttft=2000ms,itl=50ms") == {"ttft": 2000.0, "itl": 50.0}
    assert parse_slo("e2e=1.5s, tpot=250us,ttft:30") == {"e2e": 1500.0, "tpot": 0.25, "ttft": 30.0}
    for bad in ("latency=3ms", "ttft=fast", "ttft=3h"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def record(ttft_ms, itl_ms, error=None) -> RequestRecord:
    r = RequestRecord(0, 0, 0, 0.0, 10, 1, len(itl_ms) + 1)
    r.ttft_s = ttft_ms / 1e3
    r.itl_s = [x / 1e3 for x in itl_ms]
    r.end_s = r.ttft_s + sum(r.itl_s)
    r.output_tokens_server = len(itl_ms) + 1
    if error:
        r.fail(error, "x")
    return r


def test_meets_slo_checks_every_key():
    slo = parse_slo("ttft=100ms,itl=20ms")
    assert meets_slo(record(90, [10, 30]), slo)  # mean ITL 20 ms
    assert not meets_slo(record(90, [10, 40]), slo)
    assert not meets_slo(record(110, [10]), slo)
    assert not meets_slo(record(10, [10], error="http"), slo)
    assert meets_slo(record(10, []), slo)  # one token: no gaps to judge
    assert not meets_slo(record(10, [10, 10]), parse_slo("e2e=15ms"))


def test_summary_of_a_real_run(stub, vocab, builder):
    sessions = single_turn(
        builder, 40, LengthDist.parse("uniform:8:64"), LengthDist.parse("uniform:2:12"), seed=4
    )
    result = run_sessions(
        stub.url,
        sessions,
        LoadShape("concurrency", concurrency=8),
        vocab,
        stub={"ttft_ms": 20, "itl_ms": 4, "fail_every": 5, "skew_every": 7},
    )
    good = summarize(result.records, parse_slo("ttft=1000ms"), exact_output=True)
    strict = summarize(result.records, parse_slo("ttft=10ms"), exact_output=True)
    ok = [r for r in result.records if r.ok]
    assert good["requests"]["ok"] == len(ok) == 32
    for key in ("ttft", "itl", "tpot", "e2e"):
        s = good["latency_ms"][key]
        assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
        assert s["min"] <= s["mean"] <= s["max"]
    assert good["latency_ms"]["e2e"]["max"] > good["latency_ms"]["e2e"]["min"] + 20
    duration = good["duration_s"]
    out_tokens = sum(r.output_tokens for r in ok)
    assert out_tokens == sum(r.max_tokens for r in ok)
    assert good["throughput"]["output_tokens_per_s"] == pytest.approx(out_tokens / duration)
    assert good["throughput"]["requests_per_s"] == pytest.approx(32 / duration)
    in_tokens = sum(r.input_tokens_server for r in ok)
    assert good["throughput"]["total_tokens_per_s"] == pytest.approx(
        (in_tokens + out_tokens) / duration
    )
    assert good["goodput"]["good"] == 32 and good["goodput"]["fraction"] == pytest.approx(0.8)
    assert strict["goodput"]["good"] == 0
    # the server adds one token (BOS) to every prompt, and one more to every 7th request
    check = good["tokens"]["input_check"]
    assert check["overhead_by_messages"] == {"1": 1}
    assert check["checked"] == 32
    expected_skews = sum(1 for n in range(1, 41) if n % 7 == 0 and n % 5 != 0)
    assert check["mismatches"] == expected_skews == 4
    assert good["tokens"]["output_check"]["mismatches"] == 0


def test_output_token_mismatches_and_missing_usage(stub, vocab, builder):
    sessions = single_turn(builder, 12, LengthDist.parse("8"), LengthDist.parse("5"))
    shape = LoadShape("concurrency", concurrency=1)
    result = run_sessions(stub.url, sessions, shape, vocab, stub={"short_every": 4})
    summary = summarize(result.records, exact_output=True)
    assert summary["tokens"]["output_check"]["mismatches"] == 3
    assert (
        summarize(result.records, exact_output=False)["tokens"]["output_check"]["mismatches"] == 0
    )
    stub.reset()
    result = run_sessions(stub.url, sessions, shape, vocab, stub={"no_usage": True})
    summary = summarize(result.records, exact_output=True)
    assert summary["tokens"]["output_check"]["without_usage"] == 12
    assert summary["tokens"]["input_check"]["checked"] == 0
    assert all(r.output_tokens == r.chunks == 5 for r in result.records)


def test_saturated_output_rate_counts_tokens_inside_the_full_load_window():
    # every request started (first token at 0 and 4) before the first ended (at 10): no window
    assert saturated_output_rate([0.0, 4.0], [10.0, 14.0], [11, 11]) is None
    assert saturated_output_rate([], [], []) is None
    # A: first token 0, end 4; B: 2 -> 12, 11 tokens; C: 6 -> 16. The window is [4, 6]
    # (A's end to C's first token): none of A's tokens, 2 of B's 10 after its first (2 of
    # its 10 s), and C's first token.
    rate = saturated_output_rate([0.0, 2.0, 6.0], [4.0, 12.0, 16.0], [5, 11, 11])
    assert rate == pytest.approx((2.0 + 1.0) / 2.0)


def test_saturated_output_rate_ignores_ramp_and_drain():
    # 4 slots serve back-to-back requests of 10 tokens at 1 tok/s (the first at the start,
    # the last 9 s later, the next request 1 s after that): 4 tok/s in all. Slot 0's last
    # request is 100 tokens long and runs alone for a minute: the drain.
    firsts, ends, tokens = [], [], []
    for slot in range(4):
        for k in range(5):
            t = 10.0 * k + 0.25 * slot
            long = slot == 0 and k == 4
            firsts.append(t)
            ends.append(t + (99.0 if long else 9.0))
            tokens.append(100 if long else 10)
    rate = saturated_output_rate(firsts, ends, tokens)
    assert rate == pytest.approx(4.0, rel=0.05)
    assert sum(tokens) / (max(ends) - min(firsts)) < 0.6 * rate  # the whole-run rate


def test_ttft_phases_split_the_opening_burst_from_full_load():
    # two requests sent at 0 (TTFT 5 and 7), the first ends at 10; two sent after it
    starts, ttfts, ends = [0.0, 0.0, 10.0, 12.0], [5.0, 7.0, 1.0, 2.0], [10.0, 14.0, 20.0, 22.0]
    assert ttft_phases(starts, ttfts, ends) == ([5.0, 7.0], [1.0, 2.0])
    assert ttft_phases([], [], []) == ([], [])
