"""ApproxIndexer with a fake clock: expiry, refresh, worker removal, and a random model check."""

from __future__ import annotations

import random

import pytest

from shoal.kv_hash import hash_blocks
from shoal.router.approx import ApproxIndexer

H = hash_blocks(range(40), 4)  # ten chained blocks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_entries_expire_after_the_ttl(clock):
    index = ApproxIndexer(ttl=10.0, clock=clock)
    index.record("a", H[:4])
    assert index.overlaps(H) == {"a": 4}
    clock.now += 9.5
    assert index.overlaps(H) == {"a": 4}
    clock.now += 0.5  # exactly the TTL: expired
    assert index.overlaps(H) == {}
    assert index.num_blocks("a") == 0


def test_recording_again_refreshes_only_the_blocks_sent(clock):
    index = ApproxIndexer(ttl=10.0, clock=clock)
    index.record("a", H[:4])
    clock.now += 6
    index.record("a", H[:2])  # a shorter prompt with the same prefix
    clock.now += 6  # the first record's blocks are 12 s old, the refreshed ones 6 s
    assert index.overlaps(H) == {"a": 2}
    assert index.num_blocks("a") == 2
    clock.now += 4
    assert index.overlaps(H) == {}


def test_workers_expire_independently(clock):
    index = ApproxIndexer(ttl=10.0, clock=clock)
    index.record("a", H[:3])
    clock.now += 5
    index.record("b", H[:5])
    assert index.overlaps(H) == {"a": 3, "b": 5}
    clock.now += 5
    assert index.overlaps(H) == {"b": 5}
    assert index.workers() == {"a", "b"}


def test_remove_worker(clock):
    index = ApproxIndexer(ttl=10.0, clock=clock)
    index.record("a", H[:3])
    index.record("b", H[:2])
    index.remove_worker("a")
    index.remove_worker("nobody")
    assert index.overlaps(H) == {"b": 2}
    assert index.workers() == {"b"}
    clock.now += 20  # a's removed entries must not trip the expiry sweep
    assert index.overlaps(H) == {}
    index.record("a", H[:1])
    assert index.overlaps(H) == {"a": 1}


def test_ttl_must_be_positive():
    with pytest.raises(ValueError, match="ttl"):
        ApproxIndexer(ttl=0)


@pytest.mark.parametrize("seed", range(4))
def test_random_records_match_a_model(seed, clock):
    rng = random.Random(seed)
    ttl = 10.0
    sequences = [
        hash_blocks([rng.randrange(4) for _ in range(4 * rng.randint(1, 6))], 4) for _ in range(30)
    ]
    workers = ["a", "b", "c", "d"]
    index = ApproxIndexer(ttl=ttl, clock=clock)
    expiry: dict[tuple[str, int], float] = {}
    for _ in range(800):
        clock.now += rng.expovariate(2.0)
        worker = rng.choice(workers)
        if rng.random() < 0.01:
            index.remove_worker(worker)
            expiry = {key: t for key, t in expiry.items() if key[0] != worker}
            continue
        seq = rng.choice(sequences)
        index.record(worker, seq)
        expiry.update({(worker, h): clock.now + ttl for h in seq})
        query = rng.choice(sequences)
        expected = {}
        for w in workers:
            n = 0
            while n < len(query) and expiry.get((w, query[n]), 0) > clock.now:
                n += 1
            if n:
                expected[w] = n
        assert index.overlaps(query) == expected
