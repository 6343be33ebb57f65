"""The KV-aware cost and choice: cache hits against load, ties, sampling, busy workers."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from shoal.protocol import LoadReport
from shoal.router.load import LoadTracker
from shoal.router.selector import (
    KvRouterConfig,
    busy,
    cost,
    costs,
    free_workers,
    select_worker,
    softmax_weights,
    spread_picks,
)

BLOCK = 16


def loaded(
    decode: dict[str, int] | None = None,
    prefill: dict[str, int] | None = None,
    queued: dict[str, list[int]] | None = None,
):
    """A tracker whose workers hold `decode` blocks of requests past their first token, and
    have `prefill` blocks to prefill in one queued request, or `queued` requests of the
    listed prefill blocks each."""
    load = LoadTracker(block_size=BLOCK)
    for worker, blocks in (decode or {}).items():
        load.add(f"decode-{worker}", worker, blocks=blocks, prefill_tokens=0)
        load.first_token(f"decode-{worker}")
    for worker, blocks in (prefill or {}).items():
        load.add(f"prefill-{worker}", worker, blocks=0, prefill_tokens=blocks * BLOCK)
    for worker, sizes in (queued or {}).items():
        for i, blocks in enumerate(sizes):
            load.add(f"queued-{worker}-{i}", worker, blocks=0, prefill_tokens=blocks * BLOCK)
    return load


def pick(load, overlaps, prompt_blocks=10, seed=0, **config) -> str:
    """The choice between a and b; the arithmetic below is at prefill scale 1, credit 1 and
    queue weight 0 unless a test says otherwise."""
    base = {"prefill_load_scale": 1.0, "overlap_credit": 1.0, "queue_weight": 0.0}
    config = KvRouterConfig(**{**base, **config})
    return select_worker(["a", "b"], prompt_blocks, overlaps, load, config, random.Random(seed))[0]


def test_cost_formula():
    load = loaded(decode={"a": 7}, prefill={"a": 3})
    assert load.queued("a") == 1  # the prefill; the decoding request had its first token
    config = KvRouterConfig(overlap_credit=0.5, queue_weight=2.0, prefill_load_scale=2.0)
    # 2 * (3 + (0.5 + 2 * 1) * (10 - 8)) + (7 + 10 - 8)
    assert cost("a", 10, 8, load, config) == 2 * 8 + 9
    # everything cached: the queue and the memory held, whatever the price of a block
    assert cost("a", 10, 10, load, KvRouterConfig(overlap_credit=3.0)) == 4 * 3 + 7


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
    # credit 0.25: a: 0.25 * 2 + (11 + 2) = 13.5 > b: 0.25 * 10 + 10 = 12.5
    assert pick(load, {"a": 8}, overlap_credit=0.25) == "b"
    # credit 1: a: 2 + 13 = 15 < b: 10 + 10 = 20
    assert pick(load, {"a": 8}, overlap_credit=1.0) == "a"


def test_a_credit_above_one_follows_the_prefix_to_a_longer_queue():
    # a holds 8 of the 10 blocks but has 20 blocks queued to prefill; b has none.
    load = loaded(prefill={"a": 20})
    # credit 1, this request's own wait: a: (20 + 2) + 2 = 24 > b: 10 + 10 = 20
    assert pick(load, {"a": 8}, overlap_credit=1.0) == "b"
    # credit 4 also prices the work a miss adds for the requests behind it:
    # a: (20 + 4 * 2) + 2 = 30 < b: 4 * 10 + 10 = 50
    assert pick(load, {"a": 8}, overlap_credit=4.0) == "a"


def test_queue_weight_keeps_long_prompts_off_workers_where_many_requests_wait():
    # a: three short requests queued (12 blocks); b: one long one (40 blocks).
    load = loaded(queued={"a": [4, 4, 4], "b": [40]})
    assert (load.queued("a"), load.queued("b")) == (3, 1)
    # weight 0, the least work ahead: a long prompt goes to a (12 + 100 < 40 + 100)
    assert pick(load, {}, prompt_blocks=100) == "a"
    # weight 1: a: 12 + (1 + 3) * 100 + 100 = 512 > b: 40 + (1 + 1) * 100 + 100 = 340
    assert pick(load, {}, prompt_blocks=100, queue_weight=1.0) == "b"
    # a short prompt still goes where the least work is ahead: a: 12 + 4 * 2 + 2 = 22 <
    # b: 40 + 2 * 2 + 2 = 46
    assert pick(load, {}, prompt_blocks=2, queue_weight=1.0) == "a"
    # the count drops at each request's first token: with a's requests prefilled, only
    # the queue ahead and the memory are left (a: 0 + 100 + 100 < b: 40 + 200 + 100)
    for i in range(3):
        load.first_token(f"queued-a-{i}")
    assert pick(load, {}, prompt_blocks=100, queue_weight=1.0) == "a"


def test_prefill_load_scale_trades_prefill_queue_against_decode_memory():
    load = loaded(decode={"b": 8}, prefill={"a": 10})
    # scale 1: a: (10 + 4) + 4 = 18; b: 4 + (8 + 4) = 16
    assert pick(load, {}, prompt_blocks=4, prefill_load_scale=1.0) == "b"
    # scale 0.1: a: 1.4 + 4 = 5.4; b: 0.4 + 12 = 12.4
    assert pick(load, {}, prompt_blocks=4, prefill_load_scale=0.1) == "a"


def test_ties_are_broken_at_random():
    chosen = {pick(loaded(), {}, seed=seed) for seed in range(40)}
    assert chosen == {"a", "b"}
    # with a zero credit the cache only saves memory: a: 0 + (8 + 2) = 10 = b: 0 + 10
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
    counts = Counter(select_worker(workers, 2, {}, load, config, rng)[0] for _ in range(n))
    chi2 = sum((counts[w] - n * p) ** 2 / (n * p) for w, p in zip(workers, expected, strict=True))
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001


def test_temperature_with_all_costs_zero_is_uniform():
    workers = ["a", "b", "c"]
    config = KvRouterConfig(temperature=1.0)
    rng = random.Random(7)
    counts = Counter(select_worker(workers, 0, {}, loaded(), config, rng)[0] for _ in range(3000))
    assert set(counts) == set(workers)
    assert all(800 < counts[w] < 1200 for w in workers)


def test_tiny_temperature_picks_the_cheapest_without_overflow():
    config = KvRouterConfig(temperature=1e-9)
    load = loaded(decode={"b": 1})
    for seed in range(10):
        assert select_worker(["a", "b"], 4, {}, load, config, random.Random(seed))[0] == "a"


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
        ("queue_weight", -1.0),
        ("queue_weight", math.nan),
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
        queue_weight=0.0,
        prefill_load_scale=0.0,
        temperature=0.0,
        busy_threshold=1.0,
        max_waiting=0,
        approx_ttl=0.1,
    )


def test_temperature_means_the_same_at_any_cost_scale():
    def probabilities(load, prompt_blocks, overlaps):
        config = KvRouterConfig(temperature=0.3)
        costs = [cost(w, prompt_blocks, overlaps.get(w, 0), load, config) for w in "abc"]
        weights = softmax_weights(costs, config.temperature)
        return costs, [w / sum(weights) for w in weights]

    small_costs, small = probabilities(loaded(decode={"a": 3, "b": 5, "c": 9}), 4, {"a": 2})
    big_costs, big = probabilities(
        loaded(decode={"a": 3000, "b": 5000, "c": 9000}), 4000, {"a": 2000}
    )
    assert big_costs == [1000 * c for c in small_costs]
    assert big == pytest.approx(small, rel=1e-12)
    assert len(set(small)) == 3 and max(small) < 0.9  # a real spread, not a forced one
    # the weight of a worker f (of the highest cost) above the cheapest is exp(-f / T)
    f = (small_costs[2] - small_costs[0]) / max(small_costs)
    assert small[2] / small[0] == pytest.approx(math.exp(-f / 0.3))


def test_the_pick_comes_with_the_chance_its_rule_gave_it():
    rng = random.Random(0)
    workers = ["a", "b", "c", "d"]
    one = loaded(prefill={"a": 5})  # b, c and d tie for the cheapest
    assert select_worker(["a", "b"], 4, {}, one, KvRouterConfig(), rng) == ("b", 1.0)
    picks = Counter()
    for _ in range(400):
        worker, chance = select_worker(workers, 4, {}, one, KvRouterConfig(), rng)
        assert chance == pytest.approx(1 / 3)
        picks[worker] += 1
    assert set(picks) == {"b", "c", "d"} and min(picks.values()) > 100
    config = KvRouterConfig(temperature=0.5)
    priced = costs(workers, 4, {}, one, config)
    weights = dict(zip(workers, softmax_weights(priced, 0.5), strict=True))
    for _ in range(50):
        worker, chance = select_worker(workers, 4, {}, one, config, rng)
        assert chance == pytest.approx(weights[worker] / sum(weights.values()))


def test_spread_picks_place_each_copy_where_the_one_before_left_it_cheapest():
    """spread_picks against its definition: copies placed one at a time, each on the
    cheapest worker (ties to the earlier) with every copy before it counted in the load,
    among the workers caching as much as the first copy's."""
    rng = random.Random(4)
    config = KvRouterConfig()
    for _ in range(50):
        workers = [f"w{i}" for i in range(rng.randint(1, 9))]
        load = loaded(
            decode={w: rng.randrange(50) for w in workers},
            queued={w: [rng.randrange(1, 30) for _ in range(rng.randrange(3))] for w in workers},
        )
        prompt = rng.randint(1, 40)
        overlaps = {w: rng.randint(0, prompt) for w in workers if rng.random() < 0.5}
        n = rng.randint(1, 6)
        expected = []
        eligible = workers
        for k in range(n):
            priced = costs(eligible, prompt, overlaps, load, config)
            best = priced.index(min(priced))
            if not k:
                hit = overlaps.get(eligible[best], 0)
                eligible = [w for w in workers if overlaps.get(w, 0) >= hit]
                priced = costs(eligible, prompt, overlaps, load, config)
                best = priced.index(min(priced))
            expected.append(eligible[best])
            new = prompt - overlaps.get(eligible[best], 0)
            load.add(f"copy{k}", eligible[best], blocks=new, prefill_tokens=new * BLOCK)
        for k in range(n):
            load.finish(f"copy{k}")
        assert spread_picks(workers, prompt, overlaps, load, config, n) == expected
    # idle workers: one copy each, in order; a worker caching the whole prompt takes them all
    idle = LoadTracker(block_size=BLOCK)
    assert spread_picks(["a", "b", "c"], 8, {}, idle, config, 3) == ["a", "b", "c"]
    assert spread_picks(["a", "b", "c"], 8, {"b": 8}, idle, config, 3) == ["b", "b", "b"]
    # two workers caching half: the copies stay on them, never on the third
    assert spread_picks(["a", "b", "c"], 8, {"a": 4, "c": 4}, idle, config, 3) == ["a", "c", "a"]
