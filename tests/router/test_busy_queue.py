"""BusyQueue: requests waiting for a non-busy worker, first come first served, woken by load."""

from __future__ import annotations

import asyncio

import pytest

from shoal.router.busy import AllWorkersBusy, BusyQueue


class Slots:
    """A pool of `free` places: attempt() takes one or raises AllWorkersBusy; counts tries."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.tries = 0
        self.served: list[str] = []

    def attempt(self, name: str):
        def take() -> str:
            self.tries += 1
            if self.free <= 0:
                raise AllWorkersBusy(f"{name}: all busy")
            self.free -= 1
            self.served.append(name)
            return name

        return take


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_free_room_routes_at_once_without_queueing():
    async def main():
        queue, slots = BusyQueue(), Slots(free=2)
        assert await queue.route(slots.attempt("a"), 1.0) == "a"
        assert await queue.route(slots.attempt("b"), 1.0) == "b"
        assert len(queue) == 0 and slots.tries == 2

    run(main())


def test_waiters_are_served_in_arrival_order_and_one_wake_serves_all_that_fit():
    async def main():
        queue, slots = BusyQueue(), Slots(free=0)
        tasks = []
        for name in "abcde":
            tasks.append(asyncio.create_task(queue.route(slots.attempt(name), 5.0)))
            await settle()
        assert len(queue) == 5
        assert slots.tries == 1  # only the first tried: the others went behind it
        slots.free = 3
        queue.wake()  # one wake-up: the head routes and hands the turn on while room lasts
        await settle()
        assert slots.served == ["a", "b", "c"] and len(queue) == 2
        slots.free = 2
        queue.wake()
        assert await asyncio.gather(*tasks) == list("abcde")
        assert slots.served == list("abcde")

    run(main())


def test_a_wake_with_no_room_costs_one_try_of_the_head():
    async def main():
        queue, slots = BusyQueue(), Slots(free=0)
        tasks = [asyncio.create_task(queue.route(slots.attempt(n), 5.0)) for n in "xyz"]
        await settle()
        tries = slots.tries
        queue.wake()
        await settle()
        assert slots.tries == tries + 1 and len(queue) == 3
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert len(queue) == 0

    run(main())


def test_timeout_raises_the_last_refusal_and_hands_the_turn_on():
    async def main():
        queue, slots = BusyQueue(), Slots(free=0)
        head = asyncio.create_task(queue.route(slots.attempt("head"), 0.05))
        await settle()
        second = asyncio.create_task(queue.route(slots.attempt("second"), 5.0))
        await settle()
        with pytest.raises(AllWorkersBusy, match="head: all busy"):
            await head
        slots.free = 1
        queue.wake()
        assert await second == "second"

    run(main())


def test_other_errors_end_the_wait_and_propagate():
    async def main():
        queue, slots = BusyQueue(), Slots(free=0)
        waiting = asyncio.create_task(queue.route(slots.attempt("w"), 5.0))
        await settle()

        def gone():
            raise LookupError("no worker serves it now")

        failing = asyncio.create_task(queue.route(gone, 5.0))
        await settle()
        waiting.cancel()  # the head leaves: the next in line is woken and tries
        with pytest.raises(LookupError):
            await failing
        assert len(queue) == 0

    run(main())
