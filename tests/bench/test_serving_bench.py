"""benchmarks/serving_bench.py's engine half: its closed loop re-sends the offline pass's
prompts, so it must start from an empty prefix cache; its figures are computed as `shoal
bench` computes serve's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.protocol import EngineRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serving_bench

BENCHMARKS = Path(serving_bench.__file__).parent


def test_the_closed_loop_finds_no_prompt_of_the_offline_pass_cached(tmp_path):
    model = serving_bench.make_model_dir("tiny", tmp_path / "model")
    cmd = [sys.executable, str(BENCHMARKS / "serving_bench.py"), "--half", "engine"]
    cmd += ["--model-dir", str(model), "--shape", "tiny", "--num-requests", "8"]
    cmd += ["--concurrency", "4", "--min-len", "40", "--max-len", "80"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    engine = json.loads(out.stdout.strip().splitlines()[-1])
    assert engine["closed_loop_cached_prompt_tokens"] == 0
    assert engine["output_tok_s"] > 0 and engine["closed_loop_output_tok_s"] > 0
    assert engine["closed_loop_tpot_p50_ms"] > 0
    assert engine["closed_loop_ttft_p99_ms"] >= engine["closed_loop_ttft_p50_ms"]


def test_token_times_give_ttft_and_tpot_as_shoal_bench_does():
    requests = [
        EngineRequest(
            request_id=str(i), prompt_token_ids=[5, 6], sampling=SamplingParams(max_tokens=n)
        )
        for i, n in enumerate([3, 5, 1])
    ]
    times = serving_bench.TokenTimes()
    times.submit = {"c0": 0.0, "c1": 0.0, "c2": 0.0}
    for t, last in ((0.1, False), (0.2, False), (0.3, True)):
        times.saw("c0", t, last)
    for k in range(5):
        times.saw("c1", 0.2 + 0.05 * k, k == 4)
    times.saw("c2", 0.4, True)
    assert times.ttft_p50_ms() == pytest.approx(200.0)
    assert times.ttft_p99_ms() == pytest.approx(396.0)  # numpy's linear percentile
    # (end - first) / (tokens - 1): 100 ms for c0, 50 ms for c1; c2 has one token
    assert times.tpot_p50_ms(requests) == pytest.approx(75.0)
    assert times.itl_p50_ms() == pytest.approx(50.0)
    # all three were submitted before the first end (0.3 s): the opening burst
    assert times.phase_ttft_p50s_ms() == (pytest.approx(200.0), None)
    times.submit["c3"] = 0.35
    times.saw("c3", 0.45, True)
    assert times.phase_ttft_p50s_ms() == (pytest.approx(200.0), pytest.approx(100.0))


def test_the_table_gives_what_serve_adds_to_each_phase():
    engine = {"output_tok_s": 100.0, "saturated_output_tok_s": 110.0}
    engine |= {"closed_loop_output_tok_s": 98.0, "closed_loop_saturated_output_tok_s": 108.0}
    engine |= {"closed_loop_ttft_p50_ms": 50.0, "closed_loop_itl_p50_ms": 7.5}
    engine |= {"closed_loop_ttft_opening_p50_ms": 232.0, "closed_loop_ttft_full_load_p50_ms": 29.0}
    serve = {"output_tok_s": 97.0, "saturated_output_tok_s": 107.0, "errors": 0}
    serve |= {"ttft_p50_ms": 60.0, "ttft_p99_ms": 400.0, "itl_p50_ms": 8.0, "tpot_p50_ms": 8.0}
    serve |= {"ttft_opening_p50_ms": 415.0, "ttft_full_load_p50_ms": 31.0}
    workload = {"shape": "tiny", "num_requests": 4, "concurrency": 2}
    record = {"workload": workload, "device": "cpu", "commit": "x", "engine": engine}
    record["serve"] = serve
    table = serving_bench._table(record)
    assert "(232 ms opening burst, 29.0 ms at full load)" in table
    assert "TTFT p50 +10.00 ms (opening burst +183.00, full load +2.00)" in table
