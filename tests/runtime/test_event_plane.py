"""Event plane: msgspec messages over ZMQ PUB/SUB with topic filtering and sequence numbers."""

from __future__ import annotations

import asyncio
import time

import pytest
from runtime_helpers import run

from shoal.protocol import BlockRemoved, BlockStored, KVEventBatch, LoadReport
from shoal.runtime import Event, EventPublisher, EventSubscriber, RuntimePlaneError


def batch(worker: str, seq: int) -> KVEventBatch:
    return KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(block_hashes=[seq], parent_block_hash=None, token_ids=[1, 2], block_size=2),
            BlockRemoved(block_hashes=[seq - 1]),
        ],
    )


async def first_event(pub: EventPublisher, sub: EventSubscriber, topic: str, make) -> Event:
    """Publish until the subscription has propagated (ZMQ's slow joiner); the last warm-up event."""
    for _ in range(200):
        pub.publish(topic, make())
        try:
            event = await asyncio.wait_for(sub.recv(), 0.05)
        except TimeoutError:
            continue
        while True:  # warm-up messages delivered late
            try:
                event = await asyncio.wait_for(sub.recv(), 0.1)
            except TimeoutError:
                return event
    raise AssertionError("subscription never received anything")


def test_topic_filtering_and_typed_messages() -> None:
    async def main() -> None:
        pub = EventPublisher()
        kv = EventSubscriber(KVEventBatch, topics=["kv."])
        load = EventSubscriber(LoadReport, topics=["load."])
        for sub in (kv, load):
            sub.connect(pub.address)
        report = LoadReport(
            worker_id="w1", num_running=3, num_waiting=1, active_blocks=10, total_blocks=64
        )
        warm = await first_event(pub, kv, "kv.w1", lambda: batch("w1", 0))
        await first_event(pub, load, "load.w1", lambda: report)
        start = warm.seq
        for i in range(1, 51):
            pub.publish("kv.w1", batch("w1", i))
            pub.publish("load.w1", report)
            pub.publish("other", report)
        received = [await asyncio.wait_for(kv.recv(), 5) for _ in range(50)]
        # every kv message, in order, with this topic's consecutive sequence numbers
        assert all(e.topic == "kv.w1" for e in received)
        assert [e.message.events[0].block_hashes[0] for e in received] == list(range(1, 51))
        assert [e.seq for e in received] == list(range(start + 1, start + 51))
        assert received[0].message.events[0] == BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2
        )
        loads = [await asyncio.wait_for(load.recv(), 5) for _ in range(50)]
        assert all(e.topic == "load.w1" and e.message == report for e in loads)
        await asyncio.sleep(0.1)  # nothing else (no "other", no kv) reaches the load subscriber
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(load.recv(), 0.1)
        for sub in (kv, load):
            sub.close()
        pub.close()

    run(main())


def test_one_subscriber_many_publishers_and_bounded_pending() -> None:
    async def main() -> None:
        pubs = [EventPublisher() for _ in range(3)]
        sub = EventSubscriber(KVEventBatch, topics=["kv."], max_pending=4)
        for pub in pubs:
            sub.connect(pub.address)
        for n, pub in enumerate(pubs):
            await first_event(pub, sub, f"kv.w{n}", lambda n=n: batch(f"w{n}", 0))
        for i in range(1, 301):
            for n, pub in enumerate(pubs):
                pub.publish(f"kv.w{n}", batch(f"w{n}", i))
        await asyncio.sleep(0.2)  # the subscriber holds at most 4; the rest waits in ZMQ
        seen: dict[str, list[int]] = {f"w{n}": [] for n in range(3)}
        for _ in range(900):
            event = await asyncio.wait_for(sub.recv(), 5)
            seen[event.topic.removeprefix("kv.")].append(event.message.events[0].block_hashes[0])
        assert all(seqs == list(range(1, 301)) for seqs in seen.values())
        sub.close()
        with pytest.raises(RuntimePlaneError):
            await sub.recv()
        assert [e async for e in sub] == []
        for pub in pubs:
            pub.close()

    run(main())


def test_ready_reads_what_has_arrived_without_the_loop_and_recv_goes_on_after() -> None:
    async def main() -> None:
        pub = EventPublisher()
        sub = EventSubscriber(KVEventBatch, topics=["kv."])
        sub.connect(pub.address)
        start = (await first_event(pub, sub, "kv.w1", lambda: batch("w1", 0))).seq
        assert sub.ready() == []
        for i in range(1, 4):
            pub.publish("kv.w1", batch("w1", i))
        time.sleep(0.2)  # the loop is busy: the messages wait on the socket, unread
        assert [e.seq - start for e in sub.ready()] == [1, 2, 3]
        assert sub.ready() == []
        pub.publish("kv.w1", batch("w1", 4))
        assert (await asyncio.wait_for(sub.recv(), 5)).seq - start == 4
        sub.close()
        pub.close()

    run(main())
