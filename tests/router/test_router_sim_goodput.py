"""router_sim: the goodput search for the highest load meeting the SLO, one real search, and
the KV events that feed the simulated router's index; router_bench's live search."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import router_bench
import router_sim


def search(capacity: float, start: float, cap: float | None = None, tolerance: float = 0.05):
    tried: list[float] = []

    def sustains(load: float) -> bool:
        tried.append(load)
        return load <= capacity

    return router_sim.highest_sustained(sustains, start, tolerance, cap), tried


@pytest.mark.parametrize(("capacity", "start"), [(37.0, 16.0), (3.3, 16.0), (1.0, 1.0), (0.2, 1)])
def test_search_ends_within_the_tolerance_below_the_capacity(capacity, start):
    found, tried = search(capacity, start)
    assert capacity / 1.05 <= found <= capacity
    assert len(tried) == len(set(tried)) <= 12  # no load is simulated twice


def test_search_stops_at_the_cap_and_at_the_floor():
    assert search(100.0, 1.0, cap=4.0) == (4.0, [1.0, 2.0, 4.0])
    found, tried = search(0.0, 1.0)
    assert found == 0.0 and min(tried) >= 1e-3


def test_a_real_search_finds_where_the_slo_breaks(tmp_path):
    """Simulated kv routing of a small shared-prefix load on 2 workers: the load found meets
    the SLO, and one at most 20% above it (the tolerance) was simulated and missed it."""
    model = router_sim.tiny_model_dir(tmp_path)
    args = router_sim.build_parser().parse_args(
        ["--workload", "shared-prefix", "--slo-ttft-p99-ms", "200", "--goodput-tolerance", "0.2"]
    )
    prefixes = [router_sim._tokens(f"p{g}", 256, 300) for g in range(4)]
    requests = [[(prefixes[i % 4] + router_sim._tokens(f"r{i}", 32, 300), 4)] for i in range(80)]

    def make(speed: float, seed: int) -> router_sim.Workload:
        arrivals = [i / (20 * speed) for i in range(len(requests))]
        return router_sim.Workload("small", requests, arrivals)

    def runs_at(mode: str, speed: float) -> list[dict]:
        config = router_sim.KvRouterConfig()
        return [router_sim.simulate(mode, make(speed, 0), model, 2, 512, config)]

    row = router_sim.goodput_row("kv", make, runs_at, 1.0, args)
    best = row["goodput_speed"]
    assert best > 0 and row["ttft_p99_ms"] <= 200
    assert row["goodput_requests_per_s"] == pytest.approx(20 * best)
    missed = [speed for speed, p99 in row["tried"] if p99 > 200]
    assert missed and best < min(missed) <= best * 1.2


def prefix_groups() -> tuple[router_sim.Workload, list[int]]:
    """64 requests, 20 a second, each one of 12 prefixes of 512 tokens drawn at random
    plus 32 tokens of its own; and which prefix each drew."""
    prefixes = [router_sim._tokens(f"p{g}", 512, 300) for g in range(12)]
    rng = random.Random(0)
    drawn = [rng.randrange(12) for _ in range(64)]
    requests = [
        [(prefixes[g] + router_sim._tokens(f"r{i}", 32, 300), 4)] for i, g in enumerate(drawn)
    ]
    return router_sim.Workload("groups", requests, [i / 20 for i in range(len(requests))]), drawn


def test_the_simulated_kv_router_follows_the_engines_cache(tmp_path):
    """12 shared prefixes drawn at random over 4 workers: kv's router hears the engines' KV
    events, so its index holds their blocks and it sends each request where its prefix is
    cached; round-robin (as an index left empty would) prefills each prefix on every worker."""
    model = router_sim.tiny_model_dir(tmp_path)
    workload, _ = prefix_groups()
    config = router_sim.KvRouterConfig()
    kv = router_sim.simulate("kv", workload, model, 4, 512, config)
    rr = router_sim.simulate("round-robin", workload, model, 4, 512, config)
    assert kv["kv_hit_rate"] > 0.7 and rr["kv_hit_rate"] < 0.45
    assert kv["ttft_p50_ms"] < rr["ttft_p50_ms"] / 2


def test_with_a_shared_cache_every_worker_finds_every_prefix(tmp_path):
    """--shared-cache: 12 prefixes drawn at random over 4 workers, round-robin. Each
    prefix is prefilled once in all (its first request), then found by every worker: the
    hit rate is the workload's reuse (a request's 512-token prefix of its 544 tokens, its
    32 own tokens never, the prefix's first request's nothing), reached from any routing:
    kv routing without it reaches at most as much, round-robin far less."""
    model = router_sim.tiny_model_dir(tmp_path)
    workload, drawn = prefix_groups()
    config = router_sim.KvRouterConfig()
    reuse = (len(drawn) - len(set(drawn))) * 512 / (len(drawn) * 544)
    shared = router_sim.simulate("round-robin", workload, model, 4, 512, config, shared_cache=True)
    alone = router_sim.simulate("round-robin", workload, model, 4, 512, config)
    kv = router_sim.simulate("kv", workload, model, 4, 512, config)
    assert shared["kv_hit_rate"] == pytest.approx(reuse, abs=0.01)
    assert alone["kv_hit_rate"] < 0.45 < kv["kv_hit_rate"] <= shared["kv_hit_rate"]


def test_the_live_search_reads_p99_in_model_time_and_fails_a_load_with_errors():
    """router_bench --goodput on a stand-in for live runs in quarter-speed slow motion:
    wall p99 is 4x the model's, which grows as 1 s x load^2 (the SLO holds to load 1.41),
    and from load 1.3 on some requests fail; the search stops below 1.3."""
    args = router_bench.build_parser().parse_args(
        ["--goodput", "--slo-ttft-p99-ms", "2000", "--goodput-tolerance", "0.1"]
    )

    def run_at(mode: str, load: float) -> list[dict]:
        return [
            {
                "load_scale": load,
                "ttft_p99_ms": 4 * 1000 * load**2,
                "errors": int(load >= 1.3),
                "requests_per_s": 10 * load,
                "kv_hit_rate": 0.2,
            }
        ]

    search = router_bench.goodput_search("kv", run_at, 0.25, args)
    best = search["goodput_load_scale"]
    assert 1.3 / 1.1 <= best < 1.3
    assert search["goodput_requests_per_s"] == pytest.approx(10 * best)
    assert [load for load, _, _ in search["tried"]][:2] == [1.0, 2.0]
    assert all(p99 == pytest.approx(1000 * load**2, abs=1) for load, p99, _ in search["tried"])
    assert all(r["goodput_probe"] for r in search["runs"])


@pytest.mark.parametrize(("load", "count"), [(1.0, 1500), (4.0, 6000), (0.5, 750)])
def test_a_shared_prefix_probe_spans_the_same_time_at_every_load(load, count):
    """Live and simulated, a higher load sends more requests over the same 30 s, rather than
    the same requests over a shorter run (a short overload can meet the SLO)."""
    argv = router_bench.WORKLOADS["shared-prefix"].args(load)
    assert argv[argv.index("--num-requests") + 1] == str(count)
    assert float(argv[argv.index("--rate") + 1]) == 50 * load
    workload = router_sim.shared_prefix(vocab=300, load=load)
    assert len(workload.sessions) == count
    assert workload.arrivals[-1] == pytest.approx(router_bench.SHARED_PREFIX.span_s, rel=0.1)


@pytest.mark.parametrize(("load", "in_flight"), [(1.0, 32), (1.41, 45), (4.0, 128), (0.01, 1)])
def test_a_multi_turn_probe_runs_as_many_turns_a_session_slot_at_every_load(load, in_flight):
    """Live and simulated, whole sessions in flight (shoal bench takes an integer) and four
    times as many sessions in all: a higher load is not one burst of the same 128."""
    argv = router_bench.WORKLOADS["multi-turn"].args(load)
    assert argv[argv.index("--concurrency") + 1] == str(in_flight)
    assert argv[argv.index("--num-sessions") + 1] == str(4 * in_flight)
    workload = router_sim.multi_turn(vocab=300, load=load)
    assert workload.concurrency == in_flight and len(workload.sessions) == 4 * in_flight
    assert {len(turns) for turns in workload.sessions} == {router_bench.MULTI_TURN.turns}


def test_a_worker_host_tier_keeps_what_its_gpu_cache_evicts(tmp_path):
    """--kv-offload-cpu-gb: 12 prefixes of 512 tokens on one worker whose GPU cache holds
    about two of them. Without a host tier a prefix seen before is mostly evicted by its
    next request; with one (1 GiB: hundreds of the mocker's 2 MiB blocks) it is onboarded."""
    model = router_sim.tiny_model_dir(tmp_path)
    workload, _ = prefix_groups()
    config = router_sim.KvRouterConfig()
    gpu_only = router_sim.simulate("round-robin", workload, model, 1, 80, config)
    tiered = router_sim.simulate("round-robin", workload, model, 1, 80, config, offload_cpu_gb=1.0)
    assert gpu_only["kv_hit_rate"] < 0.3 < 0.7 < tiered["kv_hit_rate"]
