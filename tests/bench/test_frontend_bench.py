"""benchmarks/frontend_bench.py: the engine-alone baseline runs the streams through the engine,
and it and the latency client wait on the event loop a server runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import frontend_bench


@pytest.fixture
def loop_runs(monkeypatch) -> list[float]:
    """The keep_warm_ms of each event_loop.run the bench makes (each still runs)."""
    runs: list[float] = []
    run = frontend_bench.event_loop.run

    def recorded(main, keep_warm_ms):
        runs.append(keep_warm_ms)
        return run(main, keep_warm_ms)

    monkeypatch.setattr(frontend_bench.event_loop, "run", recorded)
    return runs


def test_the_engine_alone_times_each_stream(llama_dir: Path) -> None:
    """`latency --engine real`'s baseline: sequential streams through AsyncLLM on the same
    model folder, first-output and between-output times in ms."""
    figures = frontend_bench._engine_alone(str(llama_dir), None, "the cat sat", 1, 3, 5, 0.0, 0.0)
    assert set(figures) == {"engine_ttft_p50_ms", "engine_itl_p50_ms"}
    assert 0 < figures["engine_itl_p50_ms"] < 10_000
    assert 0 < figures["engine_ttft_p50_ms"] < 10_000


def test_the_mocker_alone_takes_its_step_time(llama_dir: Path, loop_runs: list[float]) -> None:
    """`latency`'s mocker baseline: a MockEngine whose every step takes --step-ms, so each
    output comes a step after the one before, and the first a step after the request (the
    outputs' hand-over to the loop jitters by some microseconds either way). It runs on the
    event loop a worker runs, kept warm as the bench's processes are."""
    figures = frontend_bench._engine_alone(str(llama_dir), 20.0, "the cat sat", 1, 3, 5, 0.0, 1.0)
    assert loop_runs == [1.0]
    assert 19.5 <= figures["engine_itl_p50_ms"] < 40.0
    assert 19.5 <= figures["engine_ttft_p50_ms"] < 60.0


def test_the_latency_client_waits_on_the_servers_event_loop(loop_runs: list[float]) -> None:
    """latency's client runs on event_loop.run with the bench's keep-warm interval, as the
    engine alone's streams do; the busy clients of the other modes on asyncio's loop."""

    async def figures() -> dict:
        return {"ttft_p50_ms": 1.0}

    latency = argparse.Namespace(mode="latency", keep_warm_ms=1.0)
    assert frontend_bench.run_client(figures(), latency) == {"ttft_p50_ms": 1.0}
    assert loop_runs == [1.0]
    ceiling = argparse.Namespace(mode="ceiling", keep_warm_ms=1.0)
    assert frontend_bench.run_client(figures(), ceiling) == {"ttft_p50_ms": 1.0}
    assert loop_runs == [1.0]
