"""`shoal bench` end to end: every mode through the CLI, its files, compare and plot."""

from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_helpers import bench_cli

from shoal.bench.client import endpoint_url

ROOT = Path(__file__).resolve().parents[2]


def common(stub, tokenizer_json, **stub_cfg) -> list[str]:
    return [
        "--url",
        stub.url,
        "--tokenizer",
        str(tokenizer_json),
        "--extra-body",
        json.dumps({"stub": stub_cfg}),
        "--no-progress",
    ]


@pytest.mark.parametrize("base", ["http://h:8000", "http://h:8000/", "http://h:8000/v1"])
def test_endpoint_urls(base):
    assert endpoint_url(base, "completions") == "http://h:8000/v1/completions"
    assert endpoint_url(base, "chat") == "http://h:8000/v1/chat/completions"


def load(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def max_overlap(requests: list[dict]) -> int:
    """The most requests of a run that were in flight at the same moment."""
    events = sorted([(r["start_s"], 1) for r in requests] + [(r["end_s"], -1) for r in requests])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_run_writes_json_csv_and_plots(stub, tokenizer_json, tmp_path, capsys):
    out = tmp_path / "run"
    code = bench_cli(
        "run",
        *common(stub, tokenizer_json, ttft_ms=20, itl_ms=5),
        "--concurrency", "4",
        "--num-requests", "12",
        "--input-len", "uniform:20:40",
        "--output-len", "6",
        "--slo", "ttft=1000ms,itl=50ms",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "model stub-model" in printed and "TTFT (ms)" in printed and "goodput" in printed
    assert stub.count == 12
    assert {body["model"] for body in stub.received} == {"stub-model"}
    body = stub.received[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == 6
    doc = load(out)
    assert doc["config"]["token_counts_exact"] is True
    assert doc["config"]["input_len"] == "uniform:20:40"
    (run,) = doc["runs"]
    assert run["label"] == "concurrency=4"
    assert len(run["requests"]) == 12
    assert all(r["output_tokens"] == 6 and len(r["itl_s"]) == 5 for r in run["requests"])
    summary = run["summary"]
    assert summary["requests"]["ok"] == 12
    assert summary["goodput"]["good"] == 12
    assert summary["tokens"]["input_check"]["mismatches"] == 0
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12
    assert float(rows[0]["ttft_ms"]) == pytest.approx(run["requests"][0]["ttft_ms"])
    with (out / "summary.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["ttft_p50_ms"]) == pytest.approx(summary["latency_ms"]["ttft"]["p50"])
    for name in ("latency_cdf.png", "ttft_over_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_then_compare_and_plot(stub, tokenizer_json, tmp_path, capsys):
    slow, fast = tmp_path / "slow", tmp_path / "fast"
    for out, itl in ((slow, 20), (fast, 10)):
        stub.reset()
        code = bench_cli(
            "run",
            *common(stub, tokenizer_json, ttft_ms=10, itl_ms=itl),
            "--sweep", "1..4",
            "--num-requests", "6",
            "--input-len", "16",
            "--output-len", "4",
            "--no-plots",
            "--out", str(out),
        )  # fmt: skip
        assert code == 0
        assert [max_overlap(r["requests"]) for r in load(out)["runs"]] == [1, 2, 4]
    printed = capsys.readouterr().out
    assert "req/s" in printed and "TTFT p99" in printed
    runs = load(slow)["runs"]
    assert [r["label"] for r in runs] == ["concurrency=1", "concurrency=2", "concurrency=4"]
    assert [len(r["requests"]) for r in runs] == [6, 6, 8]  # max(num_requests, 2 x level)
    assert bench_cli("compare", str(slow / "results.json"), str(fast / "results.json")) == 0
    table = capsys.readouterr().out
    assert table.count("== concurrency=") == 3
    ratios = [float(m) for m in re.findall(r"^TPOT p50 \(ms\)\s+\S+\s+\S+\s+(\S+)$", table, re.M)]
    assert len(ratios) == 3 and all(0.35 < r < 0.65 for r in ratios)  # 10 ms against 20 ms
    assert bench_cli("plot", str(slow / "results.json"), "--out", str(tmp_path / "png")) == 0
    names = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert names == ["latency_cdf.png", "throughput_vs_latency.png", "ttft_over_time.png"]


def test_rate_shared_prefix_and_multi_turn_modes(stub, tokenizer_json, tmp_path):
    out = tmp_path / "rate"
    code = bench_cli(
        "run",
        *common(stub, tokenizer_json, ttft_ms=20),
        "--workload", "shared-prefix",
        "--num-prefixes", "2",
        "--prefix-len", "10",
        "--rate", "200",
        "--max-concurrency", "3",
        "--num-requests", "10",
        "--input-len", "24",
        "--output-len", "2",
        "--no-plots",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0 and stub.count == 10 and stub.max_in_flight <= 3
    assert load(out)["runs"][0]["label"] == "rate=200/s(poisson),max_concurrency=3"
    stub.reset()
    out = tmp_path / "chat"
    code = bench_cli(
        "run",
        *common(stub, tokenizer_json, ttft_ms=20, hold_until=3),
        "--workload", "multi-turn",
        "--endpoint", "chat",
        "--num-sessions", "3",
        "--turns", "2",
        "--input-len", "8",
        "--output-len", "3",
        "--no-plots",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0 and stub.count == 6 and stub.max_in_flight == 3
    assert set(stub.paths) == {"/v1/chat/completions"}
    run = load(out)["runs"][0]
    assert run["label"] == "concurrency=3"
    assert sorted(r["messages"] for r in run["requests"]) == [1, 1, 1, 3, 3, 3]
    assert run["summary"]["tokens"]["input_check"]["mismatches"] == 0


def test_multi_turn_sweep_with_warmup(stub, tokenizer_json, tmp_path):
    out = tmp_path / "mt"
    code = bench_cli(
        "run",
        *common(stub, tokenizer_json, ttft_ms=10),
        "--workload", "multi-turn",
        "--num-sessions", "2",
        "--turns", "2",
        "--input-len", "6",
        "--output-len", "2",
        "--sweep", "1,4",
        "--warmup", "3",
        "--no-plots",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0
    runs = load(out)["runs"]
    # sessions per level: max(--num-sessions, 2 x level), two turns each
    assert [len(r["requests"]) for r in runs] == [4, 16]
    assert stub.count == 3 + 4 + 16  # the warmup requests are sent but not reported
    assert [max_overlap(r["requests"]) for r in runs] == [1, 4]


def test_trace_replay_mode(stub, tokenizer_json, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 700, "output_length": 40, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 600, "output_length": 20, "hash_ids": [0, 2]},
        {"timestamp": 2000, "input_length": 100, "output_length": 10, "hash_ids": [3]},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "trace"
    code = bench_cli(
        "run",
        *common(stub, tokenizer_json),
        "--workload", "trace",
        "--trace", str(trace),
        "--input-scale", "0.0625",
        "--output-scale", "0.1",
        "--speedup", "20",
        "--no-plots",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0
    run = load(out)["runs"][0]
    assert run["label"] == "replay"
    requests = sorted(run["requests"], key=lambda r: r["session"])
    assert [r["input_tokens"] for r in requests] == [32 + 12, 32 + 6, 6]
    assert [r["max_tokens"] for r in requests] == [4, 2, 1]
    assert [r["scheduled_s"] for r in requests] == [0.0, 0.05, 0.1]


def test_unreachable_server_is_reported_not_raised(closed_port_url, tmp_path, capsys):
    out = tmp_path / "down"
    code = bench_cli(
        "run",
        "--url", closed_port_url,
        "--model", "m",
        "--num-requests", "5",
        "--concurrency", "2",
        "--no-progress",
        "--no-plots",
        "--out", str(out),
    )  # fmt: skip
    assert code == 1
    assert "connect: 5" in capsys.readouterr().out
    summary = load(out)["runs"][0]["summary"]
    assert summary["requests"]["error_kinds"] == {"connect": 5}
    code = bench_cli("run", "--url", closed_port_url, "--no-progress")
    assert code == 1
    assert "pass --model" in capsys.readouterr().err
    missing = str(tmp_path / "missing.jsonl")
    code = bench_cli("run", "--url", closed_port_url, "--model", "m", "--workload", "trace",
                     "--trace", missing)  # fmt: skip
    assert code == 2
    assert "missing.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--replay"],
        ["--workload", "trace"],
        ["--workload", "trace", "--trace", "t.jsonl", "--sweep", "1,2"],
        ["--prefix-len", "5"],
        ["--rate", "5", "--max-concurrency", "0"],
        ["--workload", "multi-turn", "--num-requests", "3"],
    ],
)
def test_bad_option_combinations(argv, capsys):
    assert bench_cli("run", "--model", "m", *argv) == 2
    assert "error" in capsys.readouterr().err


def test_bad_values_are_argparse_errors():
    for argv in (["--slo", "speed=3"], ["--sweep", "0,1"], ["--input-len", "uniform:9:1"]):
        with pytest.raises(SystemExit):
            bench_cli("run", *argv)


def test_help_is_complete(capsys):
    with pytest.raises(SystemExit):
        bench_cli("--help")
    help_text = capsys.readouterr().out
    for word in ("run", "compare", "plot", "examples:"):
        assert word in help_text
    with pytest.raises(SystemExit):
        bench_cli("run", "--help")
    run_help = capsys.readouterr().out
    for option in (
        "--url", "--endpoint", "--model", "--tokenizer", "--workload", "--input-len",
        "--output-len", "--prefix-ratio", "--num-sessions", "--trace", "--speedup",
        "--concurrency", "--rate", "--sweep", "--replay", "--max-concurrency", "--slo",
        "--out", "--ignore-eos", "--min-tokens", "metrics:",
    ):  # fmt: skip
        assert option in run_help


def test_shoal_command_has_bench():
    result = subprocess.run(
        [sys.executable, "-m", "shoal", "bench", "compare", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "results.json" in result.stdout


def test_client_processes_share_one_run(stub, tokenizer_json, tmp_path):
    out = tmp_path / "processes"
    code = bench_cli(
        "run",
        *common(stub, tokenizer_json, ttft_ms=20, itl_ms=5, hold_until=6),
        "--client-processes", "2",
        "--concurrency", "6",
        "--num-requests", "12",
        "--input-len", "16",
        "--output-len", "4",
        "--no-plots",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0 and stub.count == 12
    assert stub.max_in_flight == 6  # each process held its three streams, all at once
    run = load(out)["runs"][0]
    assert run["label"] == "concurrency=6"
    assert sorted(r["index"] for r in run["requests"]) == list(range(12))
    assert max_overlap(run["requests"]) == 6  # one clock: the records line up
    assert all(r["output_tokens"] == 4 and len(r["itl_s"]) == 3 for r in run["requests"])
    assert run["summary"]["requests"]["ok"] == 12
    assert run["summary"]["tokens"]["input_check"]["mismatches"] == 0


def test_client_processes_keep_a_rate_runs_arrivals(stub, tokenizer_json, tmp_path):
    out = tmp_path / "rate"
    code = bench_cli(
        "run",
        *common(stub, tokenizer_json, ttft_ms=5),
        "--client-processes", "3",
        "--rate", "50",
        "--arrival", "constant",
        "--max-concurrency", "6",
        "--num-requests", "6",
        "--input-len", "8",
        "--output-len", "2",
        "--no-plots",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0 and stub.count == 6 and stub.max_in_flight <= 6
    run = load(out)["runs"][0]
    assert run["label"] == "rate=50/s(constant),max_concurrency=6"
    requests = sorted(run["requests"], key=lambda r: r["scheduled_s"])
    assert [r["scheduled_s"] for r in requests] == pytest.approx([0.0, 0.02, 0.04, 0.06, 0.08, 0.1])
    assert all(r["start_s"] >= r["scheduled_s"] - 1e-3 for r in requests)


def test_client_processes_run_multi_turn_sessions_whole(stub, tokenizer_json, tmp_path):
    out = tmp_path / "mt-processes"
    code = bench_cli(
        "run",
        *common(stub, tokenizer_json, ttft_ms=10),
        "--client-processes", "2",
        "--workload", "multi-turn",
        "--endpoint", "chat",
        "--num-sessions", "2",
        "--turns", "2",
        "--input-len", "6",
        "--output-len", "2",
        "--sweep", "1,4",
        "--no-plots",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0
    runs = load(out)["runs"]
    assert [len(r["requests"]) for r in runs] == [4, 16]
    assert [max_overlap(r["requests"]) for r in runs] == [1, 4]
    for run in runs:  # each session's second turn carries its first turn and reply
        turns = sorted(run["requests"], key=lambda r: (r["session"], r["turn"]))
        assert [r["messages"] for r in turns] == [1, 3] * (len(turns) // 2)
        assert all(r["error_kind"] is None for r in turns)


@pytest.mark.parametrize("processes", ["1", "2"])
def test_ctrl_c_stops_a_run_with_a_message_not_a_traceback(stub, tokenizer_json, processes):
    argv = [sys.executable, "-m", "shoal", "bench", "run", "--model", "stub-model"]
    argv += common(stub, tokenizer_json, itl_ms=50)
    argv += ["--concurrency", "4", "--num-requests", "400", "--client-processes", processes]

    # a shell may start a background job with SIGINT ignored; the run must see Ctrl-C
    def restore() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    pipe = subprocess.PIPE
    run = subprocess.Popen(argv, cwd=ROOT, stdout=pipe, stderr=pipe, text=True, preexec_fn=restore)
    deadline = time.monotonic() + 30
    while stub.in_flight < 4:  # every client is streaming
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()
        time.sleep(0.05)
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=30)
    assert run.returncode == 130
    assert "shoal bench: interrupted" in stderr and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("processes", [1, 2])
def test_connect_first_opens_the_runs_connections_before_it(
    stub, tokenizer_json, tmp_path, processes
):
    for connect_first in (False, True):
        stub.reset()
        code = bench_cli(
            "run",
            *common(stub, tokenizer_json, ttft_ms=5),
            "--client-processes", str(processes),
            "--concurrency", "6",
            "--num-requests", "18",
            "--input-len", "8",
            "--output-len", "2",
            "--no-plots",
            "--out", str(tmp_path / str(connect_first)),
            *(["--connect-first"] if connect_first else []),
        )  # fmt: skip
        assert code == 0 and stub.count == 18
        opened, used = set(stub.ports["models"]), set(stub.ports["generate"])
        assert len(used) == 6  # six connections, each reused by the requests that follow
        if connect_first:  # every request went out on a connection opened before the run
            assert used <= opened
        else:
            assert not used & opened


def test_connect_first_needs_a_cap_on_requests_in_flight(stub, tokenizer_json, tmp_path, capsys):
    code = bench_cli(
        "run",
        *common(stub, tokenizer_json),
        "--rate", "10",
        "--connect-first",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 2
    assert "--connect-first" in capsys.readouterr().err


@pytest.mark.parametrize("processes", ["1", "2"])
def test_connections_that_cannot_be_opened_first_are_a_message(
    closed_port_url, tmp_path, capsys, processes
):
    code = bench_cli(
        "run",
        "--url", closed_port_url,
        "--model", "m",
        "--concurrency", "2",
        "--client-processes", processes,
        "--connect-first",
        "--no-progress",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "could not open connections" in err and "asked)" in err
