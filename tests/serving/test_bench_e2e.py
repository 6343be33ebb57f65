"""`shoal bench` against a real `shoal serve`: every load shape and workload, consistent numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_helpers import start_serve, stop_serve

from shoal.cli import main as shoal_main

TRACE = Path(__file__).parents[1] / "data" / "mooncake_head.jsonl"  # first 12 Mooncake rows


@pytest.fixture(scope="module")
def url(llama_dir, tmp_path_factory):
    proc, base, _ = start_serve(llama_dir, tmp_path_factory.mktemp("discovery"), workers=2)
    yield base
    stop_serve(proc)


def bench(url: str, model_dir: Path, out: Path, *args: str) -> list[dict]:
    argv = ["bench", "run", "--url", url, "--tokenizer", str(model_dir), "--out", str(out)]
    assert shoal_main([*argv, "--no-progress", "--no-plots", *args]) == 0
    return json.loads((out / "results.json").read_text())["runs"]


def check_run(run: dict, num_requests: int, exact_output: int | None) -> None:
    summary = run["summary"]
    assert summary["requests"] == {**summary["requests"], "total": num_requests, "ok": num_requests}
    assert summary["requests"]["errors"] == 0
    tokens = summary["tokens"]
    assert tokens["input_check"]["mismatches"] == 0  # the server saw the intended prompts
    for name in ("ttft", "e2e"):
        s = summary["latency_ms"][name]
        assert 0 < s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    for record in run["requests"]:
        assert record["output_tokens"] == record["output_tokens_server"]
        assert 0 <= record["cached_tokens_server"] <= record["input_tokens_server"]
        if exact_output is not None:
            assert record["output_tokens"] == exact_output


@pytest.mark.parametrize(
    ("shape", "workload"),
    [
        (["--concurrency", "8"], ["--input-len", "64", "--output-len", "12"]),
        (["--rate", "40"], ["--input-len", "uniform:20:80", "--output-len", "12"]),
        (
            ["--concurrency", "4"],
            [
                "--workload",
                "shared-prefix",
                "--input-len",
                "96",
                "--prefix-len",
                "64",
                "--output-len",
                "12",
            ],
        ),
    ],
)
def test_shapes_and_synthetic_workloads(url, llama_dir, tmp_path, shape, workload):
    (run,) = bench(url, llama_dir, tmp_path, "--num-requests", "24", *shape, *workload)
    check_run(run, 24, exact_output=12)
    cache = run["summary"]["prefix_cache"]
    assert cache["requests"] == 24
    assert cache["cached_tokens"] == sum(r["cached_tokens_server"] for r in run["requests"])
    if "shared-prefix" in workload:  # 8 prefixes of 64 tokens over 24 requests: reuse
        assert cache["hit_rate"] > 0.1


def test_sweep(url, llama_dir, tmp_path):
    runs = bench(
        url,
        llama_dir,
        tmp_path,
        "--sweep",
        "1,4",
        "--num-requests",
        "8",
        "--input-len",
        "32",
        "--output-len",
        "8",
    )
    assert len(runs) == 2
    for run in runs:
        check_run(run, 8, exact_output=8)


def test_multi_turn_sessions(url, llama_dir, tmp_path):
    (run,) = bench(
        url,
        llama_dir,
        tmp_path,
        "--workload",
        "multi-turn",
        "--concurrency",
        "3",
        "--num-sessions",
        "3",
        "--turns",
        "3",
        "--input-len",
        "24",
        "--output-len",
        "6",
    )
    sessions = {}
    for record in run["requests"]:
        sessions.setdefault(record["session"], []).append(record)
    assert len(sessions) == 3
    for turns in sessions.values():
        lengths = [r["input_tokens"] for r in sorted(turns, key=lambda r: r["turn"])]
        assert lengths == sorted(lengths) and len(set(lengths)) == 3  # each turn grows


def test_mooncake_trace_replay_scaled_down(url, llama_dir, tmp_path):
    (run,) = bench(
        url,
        llama_dir,
        tmp_path,
        "--workload",
        "trace",
        "--trace",
        str(TRACE),
        "--input-scale",
        "0.008",
        "--output-scale",
        "0.01",
        "--speedup",
        "10",
    )
    check_run(run, 12, exact_output=None)
