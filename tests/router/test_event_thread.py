"""KV events applied by the router's event thread: numbering, dumps, gaps, removal, signing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from shoal.kv_hash import route_hashes
from shoal.protocol import (
    KV_EVENTS_TOPIC,
    BlockStored,
    KVEventBatch,
    KVStateDump,
    RouteHashesRemoved,
    RouteHashesStored,
)
from shoal.router.event_thread import KvEventThread
from shoal.router.indexer import KvIndexer
from shoal.router.metrics import RouterMetrics
from shoal.runtime.auth import make_signer
from shoal.runtime.codec import ENCODER

SECRET = "plane-secret"


class Publisher:
    """Shoal's KV event framing (topic, seq, payload, MAC) on an XPUB socket, which also
    says when a subscription has arrived."""

    def __init__(self, secret: str | None = SECRET) -> None:
        self.sock = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.signer = make_signer(secret)

    def wait_for_subscriber(self, timeout: float = 10.0) -> None:
        assert self.sock.poll(int(timeout * 1e3)), "no subscription arrived"
        assert self.sock.recv() == b"\x01" + KV_EVENTS_TOPIC.encode()

    def send(self, seq: int, *events, signed: bool = True) -> None:
        frames = [
            KV_EVENTS_TOPIC.encode(),
            seq.to_bytes(8, "big"),
            ENCODER.encode(KVEventBatch(ts=time.time(), events=list(events))),
        ]
        if signed and self.signer is not None:
            frames.append(self.signer.mac(frames))
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close()


def keys(*values: int) -> np.ndarray:
    return np.array(values, np.uint64)


def stored(*values: int) -> RouteHashesStored:
    return RouteHashesStored(keys(*values).astype("<u8").tobytes())


def removed(*values: int) -> RouteHashesRemoved:
    return RouteHashesRemoved(keys(*values).astype("<u8").tobytes())


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Harness:
    """A KvEventThread over a fresh index; the resyncs it asks for, in order."""

    def __init__(self) -> None:
        self.indexer = KvIndexer()
        self.lock = threading.Lock()
        self.metrics = RouterMetrics()
        self.asked: list[tuple[str, str]] = []
        self.appliers: set[str] = set()
        apply_translated = self.indexer.apply_translated

        def traced(worker, translated, fresh=False):
            self.appliers.add(threading.current_thread().name)
            apply_translated(worker, translated, fresh)

        self.indexer.apply_translated = traced
        self.thread = KvEventThread(
            self.indexer,
            self.lock,
            self.metrics,
            lambda worker, reason: self.asked.append((worker, reason)),
            secret=SECRET,
        )

    def overlaps(self, *values: int) -> dict[str, int]:
        with self.lock:
            return self.indexer.overlaps(keys(*values))

    def close(self) -> None:
        self.thread.stop()
        self.thread.join()


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


@pytest.fixture
def publisher():
    p = Publisher()
    yield p
    p.close()


def test_batches_wait_for_the_dump_then_those_after_it_apply_in_the_thread(harness, publisher):
    harness.thread.follow("w", publisher.address)
    publisher.wait_for_subscriber()
    publisher.send(1, stored(1, 2))  # covered by the dump below
    publisher.send(2, stored(3))
    publisher.send(3, removed(3), stored(4))
    time.sleep(0.1)
    assert harness.overlaps(1, 2, 3) == {}  # held until the dump
    harness.thread.resynced(
        "w", KVStateDump(worker_id="w", seq=1, block_size=16, events=[stored(1, 2)])
    )
    wait_until(lambda: harness.overlaps(1, 2, 4) == {"w": 3})
    assert harness.overlaps(1, 2, 3) == {"w": 2}
    publisher.send(4, stored(3))
    wait_until(lambda: harness.overlaps(1, 2, 3) == {"w": 3})
    assert harness.metrics.events_applied._value.get() == 4  # batch 1 was the dump's
    assert harness.appliers == {"kv-events"}
    assert harness.asked == []


def test_a_gap_asks_for_a_resync_and_holds_the_batches_until_it_comes(harness, publisher):
    harness.thread.follow("w", publisher.address)
    publisher.wait_for_subscriber()
    harness.thread.resynced("w", KVStateDump(worker_id="w", seq=0, block_size=16, events=[]))
    publisher.send(1, stored(1))
    wait_until(lambda: harness.overlaps(1) == {"w": 1})
    publisher.send(3, stored(2))  # batch 2 was lost
    publisher.send(4, stored(3))
    wait_until(lambda: harness.asked == [("w", "gap")])
    assert harness.overlaps(1, 2, 3) == {"w": 1}
    dump = KVStateDump(worker_id="w", seq=3, block_size=16, events=[stored(1, 2)])
    harness.thread.resynced("w", dump)
    wait_until(lambda: harness.overlaps(1, 2, 3) == {"w": 3})
    assert harness.asked == [("w", "gap")]  # asked once, however many batches came meanwhile


def test_unsigned_and_undecodable_batches_are_dropped(harness, publisher):
    harness.thread.follow("w", publisher.address)
    publisher.wait_for_subscriber()
    harness.thread.resynced("w", KVStateDump(worker_id="w", seq=0, block_size=16, events=[]))
    publisher.send(1, stored(1), signed=False)
    frames = [KV_EVENTS_TOPIC.encode(), (1).to_bytes(8, "big"), b"\xc1"]
    publisher.sock.send_multipart([*frames, publisher.signer.mac(frames)])
    publisher.send(1, stored(2))
    wait_until(lambda: harness.overlaps(2) == {"w": 1})
    assert harness.overlaps(1) == {}
    assert harness.thread._check.num_dropped == 2
    assert harness.asked == []


def test_forgetting_a_worker_drops_it_and_its_subscription(harness, publisher):
    other = Publisher()
    try:
        for worker, pub in (("a", publisher), ("b", other)):
            harness.thread.follow(worker, pub.address)
            pub.wait_for_subscriber()
            harness.thread.resynced(
                worker, KVStateDump(worker_id=worker, seq=0, block_size=16, events=[])
            )
            pub.send(1, stored(1, 2))
        wait_until(lambda: harness.overlaps(1, 2) == {"a": 2, "b": 2})
        harness.thread.forget("a")
        wait_until(lambda: harness.overlaps(1, 2) == {"b": 2})
        publisher.send(2, stored(1, 2))  # no longer followed
        other.send(2, removed(2))
        wait_until(lambda: harness.overlaps(1, 2) == {"b": 1})
        assert "a" not in harness.indexer.workers()
    finally:
        other.close()


def test_a_batch_the_index_fails_on_brings_a_dump(harness, publisher):
    harness.thread.follow("w", publisher.address)
    publisher.wait_for_subscriber()
    harness.thread.resynced("w", KVStateDump(worker_id="w", seq=0, block_size=16, events=[]))
    traced = harness.indexer.apply_translated
    failures = []

    def failing_once(worker, translated, fresh=False):
        if not failures:
            failures.append(worker)
            raise RuntimeError("the index broke")
        traced(worker, translated, fresh)

    harness.indexer.apply_translated = failing_once
    publisher.send(1, stored(1))
    wait_until(lambda: harness.asked == [("w", "error")])
    publisher.send(2, stored(2))  # held until the dump
    time.sleep(0.1)
    assert harness.overlaps(1, 2) == {}
    harness.thread.resynced(
        "w", KVStateDump(worker_id="w", seq=1, block_size=16, events=[stored(1)])
    )
    wait_until(lambda: harness.overlaps(1, 2) == {"w": 2})


def test_vllm_format_events_are_rehashed_outside_the_lock(harness, publisher):
    """A lookup waits for no re-hashing of tokens: the thread translates a batch before it
    takes the lock, then applies it under the lock."""
    translate = harness.indexer.translate
    locked_while_translating = []

    def traced(worker, events, fresh=False):
        locked_while_translating.append(harness.lock.locked())
        return translate(worker, events, fresh)

    harness.indexer.translate = traced
    tokens = list(range(100, 132))
    harness.thread.follow("w", publisher.address)
    publisher.wait_for_subscriber()
    harness.thread.resynced("w", KVStateDump(worker_id="w", seq=0, block_size=16, events=[]))
    publisher.send(1, BlockStored([7, 8], None, tokens, 16, None, "GPU"))
    hashes = route_hashes(tokens, 16)
    wait_until(lambda: harness.overlaps(*hashes.tolist()) == {"w": 2})
    assert locked_while_translating == [False, False]  # the dump, then the batch
    assert harness.appliers == {"kv-events"}


def test_a_dump_the_index_fails_on_asks_for_another(harness, publisher):
    harness.thread.follow("w", publisher.address)
    publisher.wait_for_subscriber()
    translate = harness.indexer.translate

    def failing_dumps(worker, events, fresh=False):
        if fresh and not harness.asked:
            raise RuntimeError("the dump is broken")
        return translate(worker, events, fresh)

    harness.indexer.translate = failing_dumps
    harness.thread.resynced("w", KVStateDump(worker_id="w", seq=0, block_size=16, events=[]))
    wait_until(lambda: harness.asked == [("w", "error")])
    publisher.send(1, stored(1))  # held until a dump applies
    time.sleep(0.1)
    assert harness.overlaps(1) == {}
    harness.thread.resynced("w", KVStateDump(worker_id="w", seq=0, block_size=16, events=[]))
    wait_until(lambda: harness.overlaps(1) == {"w": 1})
