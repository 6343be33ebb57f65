"""disagg_sim: the frontend's busy rule sends a burst's overflow to the decode worker's own
prefill, every request still gets all its tokens, and the goodput search ends within its
tolerance below the rate where the SLO breaks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import disagg_sim

from shoal.engine.config import EngineConfig
from shoal.mocker.engine import MockEngine
from shoal.mocker.transfer import TransferModel

OUTPUT = 8


def burst(model: Path, max_waiting: int | None) -> tuple[disagg_sim.Simulation, list]:
    """Eight 4k-token prompts at once on one prefill and one decode worker."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    requests = [(disagg_sim._tokens(f"b{i}", 4096, vocab), OUTPUT) for i in range(8)]
    workload = disagg_sim.Workload("burst", requests, [i * 1e-6 for i in range(8)])
    engines = [MockEngine(EngineConfig(model=str(model), seed=i), speedup=1e12) for i in (0, 1)]
    sim = disagg_sim.Simulation(workload, engines, 1, TransferModel(), 1000, max_waiting)
    return sim, sim.run()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return disagg_sim.tiny_model_dir(tmp_path_factory.mktemp("disagg-sim"))


def test_busy_prefill_pool_sends_the_overflow_to_the_decode_worker(model):
    sim, results = burst(model, None)
    assert (sim.remote, sim.busy) == (8, 0)
    sim, results = burst(model, 1)
    # the first arrival is being prefilled, the next two wait (not more than 1 waiting
    # when each came): the rest find the pool busy
    assert sim.remote >= 2 and sim.busy >= 1 and sim.remote + sim.busy == 8
    assert len(results) == 8
    assert all(len(times) == OUTPUT for times in sim.tokens.values())
    assert all(ttft > 0 for ttft, _ in results)


@pytest.mark.parametrize("capacity", [0.7, 5.0, 37.0])
def test_goodput_search_ends_within_the_tolerance(capacity):
    def run(rate: float) -> dict:
        return {"rate": rate, "attainment": 1.0 if rate <= capacity else 0.5}

    found = disagg_sim.goodput(run, 2.0, 0.9, 0.03)
    assert capacity / 1.03 <= found["goodput"] <= capacity
    assert all(r["rate"] <= capacity for r in found["tried"] if r["attainment"] >= 0.9)
