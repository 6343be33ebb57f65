"""A dump reconciles the index with what a worker holds: only the difference changes, a
slice at a time under the caller's lock, so lookups run between slices and the blocks the
worker kept stay indexed throughout; a dump that does more than store is applied at once."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from shoal.protocol import AllBlocksCleared, RouteHashesStored
from shoal.router import indexer as indexer_module
from shoal.router.indexer import KvIndexer, dump_stores

SLICE = 64


class RecordingLock:
    """Stands in for the event thread's lock: counts its holds and, at each release, records
    what `probe` reads of the index (what a lookup between two holds would see)."""

    def __init__(self, probe) -> None:
        self.probe = probe
        self.holds = 0
        self.seen: list = []

    def __enter__(self) -> None:
        self.holds += 1

    def __exit__(self, *exc) -> None:
        self.seen.append(self.probe())


def stored(keys, medium: str = "GPU") -> RouteHashesStored:
    return RouteHashesStored(route_hashes=np.array(sorted(keys), "<u8").tobytes(), medium=medium)


def lower_blocks(index: KvIndexer, worker: str) -> set[int]:
    return set(index.lower.blocks(worker))


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(indexer_module, "DUMP_SLICE_OPS", SLICE)


@pytest.mark.parametrize("seed", range(4))
def test_a_dump_changes_only_the_difference_a_slice_per_hold(small_slices, seed):
    rng = random.Random(seed)
    keys = rng.sample(range(1, 1 << 40), 3000)
    before, after = set(keys[:1200]), set(keys[400:1600])  # 800 kept, 400 gone, 400 new
    lower_before, lower_after = set(keys[2000:2300]), set(keys[2100:2500])
    other = set(keys[1000:1100]) | set(keys[2900:])
    index = KvIndexer()
    index.apply_batch("a", [stored(before), stored(lower_before, "CPU")])
    index.apply_batch("b", [stored(other)])
    dump = [stored(sorted(after)[i : i + 100]) for i in range(0, len(after), 100)]
    dump.append(stored(lower_after, "CPU"))
    lock = RecordingLock(lambda: set(index.blocks("a")))
    index.load_dump("a", dump, lock)

    assert set(index.blocks("a")) == after
    assert index.num_blocks("a") == len(after)
    assert lower_blocks(index, "a") == lower_after
    assert set(index.blocks("b")) == other
    # the holdings (the worker made known, each tier's masks read: small tables, one hold
    # each), then the GPU's 400 removals and 400 stores and the lower tier's 100 and 200, in
    # slices of SLICE
    assert lock.holds == 3 + 7 + 7 + 2 + 4
    kept = before & after
    assert all(kept <= seen for seen in lock.seen)
    assert any(seen == kept for seen in lock.seen)  # removals went before the stores
    fresh = KvIndexer()
    fresh.load_dump("a", dump)
    assert set(fresh.blocks("a")) == after and lower_blocks(fresh, "a") == lower_after


def test_a_dump_of_what_the_index_holds_changes_nothing():
    index = KvIndexer()
    index.apply("a", stored(range(1, 500)))
    lock = RecordingLock(lambda: index.num_blocks("a"))
    index.load_dump("a", [stored(range(1, 500))], lock)
    assert lock.holds == 2  # the holdings read (the GPU's masks: no lower-tier block); no slice
    assert index.num_blocks("a") == 499


def test_a_dump_names_a_worker_even_when_empty():
    index = KvIndexer()
    index.apply("a", stored([5, 6]))
    index.load_dump("a", [])
    index.load_dump("c", [])
    assert index.workers() == {"a", "c"}
    assert index.num_blocks("a") == index.num_blocks("c") == 0
    assert index.overlaps([5, 6]) == {}


def test_a_dump_that_does_more_than_store_is_applied_in_one_hold(small_slices):
    index = KvIndexer()
    index.apply("a", stored(range(1, 1000)))
    dump = [stored(range(1, 300)), AllBlocksCleared(), stored(range(500, 700))]
    assert dump_stores(index.translate("a", dump)) is None
    lock = RecordingLock(lambda: index.num_blocks("a"))
    index.load_dump("a", dump, lock)
    assert lock.holds == 1
    assert set(index.blocks("a")) == set(range(500, 700))


def test_dump_stores_gathers_each_tier_once():
    gpu, lower = dump_stores([stored([3, 1]), stored([2, 3]), stored([9], "DISK")])
    assert gpu.tolist() == [1, 2, 3] and lower.tolist() == [9]


def test_the_masks_are_read_a_part_per_hold(monkeypatch):
    monkeypatch.setattr(indexer_module, "DUMP_SCAN_ROWS", 128)
    index = KvIndexer()
    index.apply_batch("a", [stored(range(1, 1000, 2)), stored(range(5000, 5100), "CPU")])
    index.apply("b", stored(range(2, 1000, 2)))
    lock = RecordingLock(lambda: None)
    gpu, lower = index.holdings("a", lock)
    assert sorted(gpu.tolist()) == list(range(1, 1000, 2))
    assert sorted(lower.tolist()) == list(range(5000, 5100))
    assert lock.holds >= 1 + 1000 // 128 + 1  # the GPU masks alone span 1,000 rows


def test_lookups_from_another_thread_during_a_dump_find_the_kept_blocks(small_slices):
    """The event thread's way: a dump reconciled under a real lock in one thread while
    another looks prompts up under it; every lookup finds the blocks the worker keeps."""
    rng = random.Random(7)
    keys = rng.sample(range(1, 1 << 40), 6000)
    kept, gone, new = keys[:2000], keys[2000:4000], keys[4000:]
    index = KvIndexer()
    index.apply("a", stored(kept + gone))
    lock = threading.Lock()
    dump = [stored(kept + new)]
    loader = threading.Thread(target=index.load_dump, args=("a", dump, lock))
    seen = []
    loader.start()
    while loader.is_alive() or not seen:
        with lock:
            seen.append(index.overlaps(kept[:50]))
    loader.join()
    assert all(found == {"a": 50} for found in seen)
    assert set(index.blocks("a")) == set(kept + new)
    assert index.overlaps(gone[:1]) == {}
