"""The KV-aware cost and choice: cache hits against load, ties, sampling, busy workers."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from shoal.protocol import LoadReport
from shoal.router.load import LoadTracker
from shoal.router.selector import KvRouterConfig, busy, cost, free_workers, select_worker

BLOCK = 16


def loaded(decode: dict[str, int] | None = None, prefill: dict[str, int] | None = None):
    """A tracker whose workers hold `decode` blocks and have `prefill` blocks to prefill."""
    load = LoadTracker(block_size=BLOCK)
    for worker, blocks in (decode or {}).items():
        load.add(f"decode-{worker}", worker, blocks=blocks, prefill_tokens=0)
    for worker, blocks in (prefill or {}).items():
        load.add(f"prefill-{worker}", worker, blocks=0, prefill_tokens=blocks * BLOCK)
    return load


def pick(load, overlaps, prompt_blocks=10, seed=0, **config) -> str:
    """The choice between a and b; the arithmetic below is at prefill scale 1, credit 1."""
    config = KvRouterConfig(**{"prefill_load_scale": 1.0, "overlap_credit": 1.0, **config})
    return select_worker(["a", "b"], prompt_blocks, overlaps, load, config, random.Random(seed))


def test_cost_formula():
    load = loaded(decode={"a": 7}, prefill={"a": 3})
    config = KvRouterConfig(overlap_credit=0.5, prefill_load_scale=2.0)
    # 2 * max(3 + 10 - 0.5 * 8, 0) + (7 + 10 - 8)
    assert cost("a", 10, 8, load, config) == 2 * 9 + 9
    # a credit larger than the work left clamps the prefill term at 0
    assert cost("a", 10, 10, load, KvRouterConfig(overlap_credit=3.0)) == 0 + 7


def test_equal_loads_pick_the_worker_holding_the_prefix():
    # a: max(10 - 8, 0) + (10 - 8) = 4; b: 10 + 10 = 20
    for seed in range(20):
        assert pick(loaded(), {"a": 8}, seed=seed) == "a"


def test_cached_worker_loaded_beyond_the_credit_loses():
    # 8 cached blocks save 8 blocks of prefill and 8 of new memory. a holds 20 more decode
    # blocks than b: a: 2 + (20 + 2) = 24; b: 10 + 10 = 20.
    assert pick(loaded(decode={"a": 20}), {"a": 8}) == "b"
    # 15 more blocks is less than the saving: a: 2 + 17 = 19 < 20.
    assert pick(loaded(decode={"a": 15}), {"a": 8}) == "a"


def test_overlap_credit_scales_what_a_cached_block_is_worth():
    load = loaded(decode={"a": 11})
    # credit 0.25: a: (10 - 2) + (11 + 2) = 21 > b: 20
    assert pick(load, {"a": 8}, overlap_credit=0.25) == "b"
    # credit 1: a: 2 + 13 = 15 < 20
    assert pick(load, {"a": 8}, overlap_credit=1.0) == "a"


def test_prefill_load_scale_trades_prefill_queue_against_decode_memory():
    load = loaded(decode={"b": 8}, prefill={"a": 10})
    # scale 1: a: (10 + 4) + 4 = 18; b: 4 + (8 + 4) = 16
    assert pick(load, {}, prompt_blocks=4, prefill_load_scale=1.0) == "b"
    # scale 0.1: a: 1.4 + 4 = 5.4; b: 0.4 + 12 = 12.4
    assert pick(load, {}, prompt_blocks=4, prefill_load_scale=0.1) == "a"


def test_ties_are_broken_at_random():
    chosen = {pick(loaded(), {}, seed=seed) for seed in range(40)}
    assert chosen == {"a", "b"}
    # with a zero credit the cache only saves memory: a: 10 + (8 + 2) = 20 = b: 10 + 10
    load = loaded(decode={"a": 8})
    chosen = {pick(load, {"a": 8}, seed=seed, overlap_credit=0.0) for seed in range(40)}
    assert chosen == {"a", "b"}


def test_temperature_samples_the_softmax_of_normalized_costs():
    workers = ["a", "b", "c"]
    load = loaded(decode={"a": 8, "b": 13, "c": 18})
    config = KvRouterConfig(temperature=0.2, prefill_load_scale=1.0, overlap_credit=1.0)
    costs = [2 + 8 + 2, 2 + 13 + 2, 2 + 18 + 2]  # prompt of 2 blocks, nothing cached
    assert [cost(w, 2, 0, load, config) for w in workers] == costs
    weights = [math.exp(-c / max(costs) / 0.2) for c in costs]
    expected = [w / sum(weights) for w in weights]
    n = 20_000
    rng = random.Random(1234)
    counts = Counter(select_worker(workers, 2, {}, load, config, rng) for _ in range(n))
    chi2 = sum((counts[w] - n * p) ** 2 / (n * p) for w, p in zip(workers, expected, strict=True))
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001


def test_temperature_with_all_costs_zero_is_uniform():
    workers = ["a", "b", "c"]
    config = KvRouterConfig(temperature=1.0)
    rng = random.Random(7)
    counts = Counter(select_worker(workers, 0, {}, loaded(), config, rng) for _ in range(3000))
    assert set(counts) == set(workers)
    assert all(800 < counts[w] < 1200 for w in workers)


def test_tiny_temperature_picks_the_cheapest_without_overflow():
    config = KvRouterConfig(temperature=1e-9)
    load = loaded(decode={"b": 1})
    for seed in range(10):
        assert select_worker(["a", "b"], 4, {}, load, config, random.Random(seed)) == "a"


def test_no_workers_is_an_error():
    with pytest.raises(ValueError, match="no workers"):
        select_worker([], 1, {}, loaded(), KvRouterConfig(), random.Random(0))


def test_busy_and_free_workers():
    load = loaded(decode={"a": 50, "b": 50, "c": 95})
    for worker, waiting in (("a", 0), ("b", 4), ("c", 0)):
        load.report(
            LoadReport(
                worker_id=worker,
                num_running=1,
                num_waiting=waiting,
                active_blocks=50,
                total_blocks=100,
            )
        )
    workers = ["a", "b", "c", "d"]  # d never reported: not busy
    assert free_workers(workers, load, KvRouterConfig()) == workers
    assert free_workers(workers, load, KvRouterConfig(busy_threshold=0.9)) == ["a", "b", "d"]
    assert free_workers(workers, load, KvRouterConfig(max_waiting=3)) == ["a", "c", "d"]
    assert free_workers(workers, load, KvRouterConfig(max_waiting=4)) == workers
    both = KvRouterConfig(busy_threshold=0.9, max_waiting=3)
    assert free_workers(workers, load, both) == ["a", "d"]
    assert busy("c", load, both) and not busy("a", load, both)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("overlap_credit", -1.0),
        ("overlap_credit", math.inf),
        ("prefill_load_scale", -0.5),
        ("prefill_load_scale", math.nan),
        ("temperature", -0.1),
        ("busy_threshold", 0.0),
        ("busy_threshold", 1.5),
        ("max_waiting", -1),
        ("approx_ttl", 0.0),
        ("approx_ttl", math.inf),
    ],
)
def test_config_rejects_out_of_range_values(field, value):
    with pytest.raises(ValueError, match=field):
        KvRouterConfig(**{field: value})


def test_config_accepts_edge_values():
    KvRouterConfig(
        overlap_credit=0.0,
        prefill_load_scale=0.0,
        temperature=0.0,
        busy_threshold=1.0,
        max_waiting=0,
        approx_ttl=0.1,
    )
