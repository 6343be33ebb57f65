"""LoadTracker: the prediction's arithmetic and its correction by load reports."""

from __future__ import annotations

import pytest

from shoal.protocol import LoadReport
from shoal.router.load import LoadTracker


def report(worker: str, active: int, total: int = 100, waiting: int = 0) -> LoadReport:
    return LoadReport(
        worker_id=worker,
        num_running=1,
        num_waiting=waiting,
        active_blocks=active,
        total_blocks=total,
    )


def test_add_first_token_finish_arithmetic():
    load = LoadTracker(block_size=16)
    load.add("r1", "a", blocks=4, prefill_tokens=40)
    load.add("r2", "a", blocks=2, prefill_tokens=16)
    assert load.prefill_blocks("a") == 3.5
    assert load.decode_blocks("a") == 6
    load.first_token("r1")
    load.first_token("r1")  # again: no-op
    assert load.prefill_blocks("a") == 1.0
    assert load.decode_blocks("a") == 6
    load.finish("r1")
    load.finish("r1")  # again: no-op
    load.finish("unknown")
    load.first_token("unknown")
    assert load.prefill_blocks("a") == 1.0
    assert load.decode_blocks("a") == 2
    load.finish("r2")  # finishing before the first token releases the prefill too
    assert load.prefill_blocks("a") == 0.0
    assert load.decode_blocks("a") == 0


def test_queued_counts_requests_until_their_first_token():
    load = LoadTracker(block_size=16)
    load.add("r1", "a", blocks=4, prefill_tokens=40)
    load.add("r2", "a", blocks=2, prefill_tokens=0)  # all cached: still waits for a step
    load.add("r3", "b", blocks=1, prefill_tokens=16)
    assert (load.queued("a"), load.queued("b")) == (2, 1)
    load.first_token("r1")
    load.first_token("r1")  # again: no-op
    assert load.queued("a") == 1
    load.finish("r1")  # after its first token: nothing more to release
    assert load.queued("a") == 1
    load.finish("r2")  # finishing before the first token releases it
    assert load.queued("a") == 0
    load.add("r3", "a", blocks=1, prefill_tokens=16)  # moved: counted where it went
    assert (load.queued("a"), load.queued("b")) == (1, 0)
    load.first_token("r3")
    load.finish("r3")
    assert (load.queued("a"), load.queued("b")) == (0, 0)


def test_unknown_workers_are_idle():
    load = LoadTracker(block_size=16)
    assert load.prefill_blocks("x") == 0.0
    assert load.queued("x") == 0
    assert load.decode_blocks("x") == 0
    assert load.waiting("x") == 0
    assert load.usage("x") is None


def test_adding_an_id_again_moves_the_request():
    load = LoadTracker(block_size=8)
    load.add("r", "a", blocks=3, prefill_tokens=24)
    load.add("r", "b", blocks=5, prefill_tokens=8)
    assert (load.decode_blocks("a"), load.prefill_blocks("a")) == (0, 0.0)
    assert (load.decode_blocks("b"), load.prefill_blocks("b")) == (5, 1.0)


def test_report_adds_the_foreign_blocks_until_the_next_report():
    load = LoadTracker(block_size=16)
    load.add("r1", "a", blocks=6, prefill_tokens=0)
    load.report(report("a", active=10))  # 4 blocks this router did not send
    assert load.decode_blocks("a") == 10
    load.add("r2", "a", blocks=2, prefill_tokens=0)
    assert load.decode_blocks("a") == 12  # prediction moves at once, foreign stays
    load.finish("r2")
    load.finish("r1")
    assert load.decode_blocks("a") == 4
    load.report(report("a", active=1))
    assert load.decode_blocks("a") == 1
    load.add("r3", "a", blocks=6, prefill_tokens=0)
    load.report(report("a", active=5))  # fewer than predicted (shared prefixes): no foreign
    assert load.decode_blocks("a") == 6


def test_report_of_a_worker_never_routed_to():
    load = LoadTracker(block_size=16)
    load.report(report("b", active=7, total=70, waiting=3))
    assert load.decode_blocks("b") == 7
    assert load.waiting("b") == 3
    assert load.usage("b") == pytest.approx(0.1)


def test_usage_and_waiting_follow_reports():
    load = LoadTracker(block_size=16)
    load.add("r", "a", blocks=20, prefill_tokens=0)
    assert load.usage("a") is None
    load.report(report("a", active=30, total=0))  # a size of 0 is unknown
    assert load.usage("a") is None
    load.report(report("a", active=30, total=200, waiting=2))
    assert load.usage("a") == pytest.approx(30 / 200)
    assert load.waiting("a") == 2
    load.report(report("a", active=10, total=200, waiting=0))
    assert load.usage("a") == pytest.approx(20 / 200)
    assert load.waiting("a") == 0


def test_remove_worker_detaches_its_requests():
    load = LoadTracker(block_size=16)
    load.add("old", "a", blocks=4, prefill_tokens=32)
    load.report(report("a", active=9, waiting=5))
    load.remove_worker("a")
    assert (load.decode_blocks("a"), load.prefill_blocks("a"), load.waiting("a")) == (0, 0.0, 0)
    assert load.usage("a") is None
    load.add("new", "a", blocks=1, prefill_tokens=16)  # the id comes back
    load.first_token("old")
    load.finish("old")  # the old request must not drain the new worker's sums
    assert (load.decode_blocks("a"), load.prefill_blocks("a"), load.queued("a")) == (1, 1.0, 1)


def test_block_size_can_change_and_must_be_positive():
    load = LoadTracker(block_size=16)
    load.add("r", "a", blocks=2, prefill_tokens=32)
    load.block_size = 8  # learnt from the first worker's model card
    assert load.block_size == 8
    assert load.prefill_blocks("a") == 4.0
    with pytest.raises(ValueError, match="block_size"):
        LoadTracker(block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        load.block_size = 0


def test_capacity_is_known_before_the_first_report():
    load = LoadTracker(block_size=16)
    assert load.usage("w") is None
    load.set_capacity("w", 200)
    load.add("r", "w", blocks=50, prefill_tokens=0)
    assert load.usage("w") == 0.25
    assert load.waiting("w") == 0


def test_watchers_hear_of_every_change_that_may_lower_a_load():
    load = LoadTracker(block_size=16)
    heard: list[int] = []
    load.watch(lambda: heard.append(len(heard)))
    load.add("r1", "a", blocks=4, prefill_tokens=40)
    load.first_token("r1")
    assert heard == []  # routing adds load; a first token frees no block
    load.finish("r1")
    load.finish("r1")  # nothing left to release
    assert len(heard) == 1
    load.report(report("a", active=3))
    assert len(heard) == 2
