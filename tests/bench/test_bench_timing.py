"""The client measures TTFT and inter-token latency to within a few ms of the server's pacing."""

from __future__ import annotations

import numpy as np
import pytest
from bench_helpers import run_sessions

from shoal.bench.loadgen import LoadShape
from shoal.bench.metrics import summarize
from shoal.bench.workloads import LengthDist, single_turn

TTFT_MS = 80.0
ITL_MS = 15.0
OUT_TOKENS = 10


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_ttft_and_itl_match_server_pacing(stub, vocab, builder, endpoint):
    sessions = single_turn(builder, 12, LengthDist.parse("32"), LengthDist.parse(str(OUT_TOKENS)))
    result = run_sessions(
        stub.url,
        sessions,
        LoadShape("concurrency", concurrency=3),
        vocab,
        endpoint=endpoint,
        stub={"ttft_ms": TTFT_MS, "itl_ms": ITL_MS},
    )
    records = result.records
    assert len(records) == 12 and all(r.ok for r in records)
    assert all(r.chunks == OUT_TOKENS for r in records)
    # Against the nominal pacing. Medians and loose upper bounds: this machine may be busy
    # with other work, and the stub's own timers wake up late then (epoll also rounds
    # timeouts up to 1 ms); the exact comparison is against the stub's send times below.
    ttft = np.array([r.ttft_s * 1e3 for r in records])
    assert ttft.min() >= TTFT_MS  # the server cannot answer before its delay
    assert np.median(ttft) <= TTFT_MS + 10.0
    itl = np.array([x * 1e3 for r in records for x in r.itl_s])
    assert len(itl) == 12 * (OUT_TOKENS - 1)
    assert np.median(itl) == pytest.approx(ITL_MS, abs=1.0)
    assert itl.mean() == pytest.approx(ITL_MS, abs=2.0)
    tpot = np.array([r.tpot_s * 1e3 for r in records])
    assert np.median(tpot) == pytest.approx(ITL_MS, abs=1.0)
    # after the last token only the usage chunk and [DONE] follow
    tail = np.array([(r.e2e_s - r.ttft_s - sum(r.itl_s)) * 1e3 for r in records])
    assert tail.min() >= 0 and np.median(tail) < 2.0

    # Against what the stub actually did (same monotonic clock, same process): the client's
    # numbers differ from the server's only by the time the bytes take over loopback.
    session_of_prompt = {s.turns[0].text: s.id for s in sessions}
    truth = {}
    for body, times in zip(stub.received, stub.sent_at, strict=True):
        prompt = body["prompt"] if endpoint == "completions" else body["messages"][0]["content"]
        truth[session_of_prompt[prompt]] = np.diff(times) * 1e3
    ttft_gap, itl_gap = [], []
    for r in records:
        server = truth[r.session]
        if r.index >= 3:  # the first three also opened their connections
            ttft_gap.append(r.ttft_s * 1e3 - server[0])
        itl_gap.extend(np.abs(np.array(r.itl_s) * 1e3 - server[1:]))
    assert min(ttft_gap) > 0  # the request upload and the chunk delivery take some time
    assert np.median(ttft_gap) < 4.0, ttft_gap
    assert np.median(itl_gap) < 0.5

    summary = summarize(records)
    assert summary["latency_ms"]["ttft"]["mean"] == pytest.approx(ttft.mean())
    assert summary["latency_ms"]["itl"]["count"] == len(itl)


def test_chat_role_chunk_is_not_the_first_token(stub, vocab, builder):
    """The stub sends an empty assistant-role chunk at once; TTFT waits for real content."""
    sessions = single_turn(builder, 2, LengthDist.parse("8"), LengthDist.parse("2"))
    result = run_sessions(
        stub.url,
        sessions,
        LoadShape("concurrency", concurrency=1),
        vocab,
        endpoint="chat",
        stub={"ttft_ms": 60.0},
    )
    assert all(r.ttft_s * 1e3 >= 60.0 for r in result.records)
