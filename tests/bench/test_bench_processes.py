"""Splitting one load run over client processes: each process's sessions and shape."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from shoal.bench.loadgen import LoadShape, scheduled
from shoal.bench.processes import RunStopped, run_load_in_processes, shares, split
from shoal.bench.workloads import Session, Turn


def sessions(n: int) -> list[Session]:
    return [Session(id=i) for i in range(n)]


def test_shares_are_even_and_sum_to_the_total():
    assert shares(7, 3) == [3, 2, 2]
    assert shares(6, 3) == [2, 2, 2]
    assert shares(2, 4) == [1, 1, 0, 0]


def test_a_concurrency_is_divided_and_sessions_dealt_round_robin():
    parts = split(sessions(5), LoadShape("concurrency", concurrency=5, duration_s=3.0), 2)
    assert [[s.id for s in mine] for mine, _ in parts] == [[0, 2, 4], [1, 3]]
    assert [shape.concurrency for _, shape in parts] == [3, 2]
    assert all(shape.mode == "concurrency" and shape.duration_s == 3.0 for _, shape in parts)


def test_no_process_gets_nothing():
    parts = split(sessions(5), LoadShape("concurrency", concurrency=2), 4)
    assert [[s.id for s in mine] for mine, _ in parts] == [[0, 2, 4], [1, 3]]
    assert [shape.concurrency for _, shape in parts] == [1, 1]
    assert len(split(sessions(1), LoadShape("rate", rate=5.0), 4)) == 1
    assert split([], LoadShape("concurrency", concurrency=3), 2) == []


def test_a_rate_becomes_a_replay_of_the_same_arrivals():
    shape = LoadShape("rate", rate=10.0, concurrency=5, seed=3, duration_s=1.0)
    expected = {s.id: at for s, at in scheduled(sessions(20), shape)}
    parts = split(sessions(20), shape, 3)
    assert [part.concurrency for _, part in parts] == [2, 2, 1]
    assert all(part.mode == "replay" and part.duration_s == 1.0 for _, part in parts)
    got = {s.id: s.arrival_s for mine, _ in parts for s in mine}
    assert got == expected and len(got) < 20  # the duration cut the schedule short


def test_a_stopped_run_ends_its_processes(stub, tokenizer_json):
    stop = threading.Event()
    options = {
        "base_url": stub.url,
        "model": "stub-model",
        "extra_body": {"stub": {"itl_ms": 50}},
    }
    turns = [Turn(text="a b c", tokens=3, max_tokens=200)]
    work = [Session(id=i, turns=turns) for i in range(4)]
    shape = LoadShape("concurrency", concurrency=4)
    threading.Timer(3.0, stop.set).start()  # the processes are streaming by then
    start = time.monotonic()
    with pytest.raises(RunStopped):
        run_load_in_processes(work, shape, options, str(tokenizer_json), 2, stop=stop)
    assert time.monotonic() - start < 3.0 + 3.0  # not the 10 s the streams would take
    assert not multiprocessing.active_children()
