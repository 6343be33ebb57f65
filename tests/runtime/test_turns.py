"""TurnGate: a burst of callers goes on a few per turn of the loop, in the order they came."""

from __future__ import annotations

import asyncio

import pytest

from shoal.runtime.turns import TurnGate


class Turns:
    """Counts the turns of the running loop: a callback that schedules itself again runs
    once in every turn."""

    def __init__(self) -> None:
        self.now = 0
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.now += 1
        asyncio.get_running_loop().call_soon(self._tick)


def test_a_burst_goes_on_per_turn_in_arrival_order_with_turns_between():
    async def main() -> list[tuple[int, int]]:
        gate, turns, went = TurnGate(4), Turns(), []

        async def caller(i: int) -> None:
            await gate.enter()
            went.append((i, turns.now))

        await asyncio.gather(*(caller(i) for i in range(10)))
        return went

    went = asyncio.run(main())
    assert [i for i, _ in went] == list(range(10))
    groups = [[i for i, turn in went if turn == t] for t in sorted({t for _, t in went})]
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_an_open_gate_lets_a_caller_on_without_yielding_and_reopens_a_turn_later():
    async def main() -> None:
        gate = TurnGate(2)
        for _ in range(2):
            step = gate.enter()
            with pytest.raises(StopIteration):  # returned at once, no turn waited
                step.send(None)
        third = gate.enter()
        waited = third.send(None)  # the third in this turn waits for the next
        assert isinstance(waited, asyncio.Future) and not waited.done()
        await asyncio.sleep(0)
        assert waited.done()
        with pytest.raises(StopIteration):
            third.send(None)
        await asyncio.sleep(0)  # a quiet turn: the gate is open again
        step = gate.enter()
        with pytest.raises(StopIteration):
            step.send(None)

    asyncio.run(main())


def test_a_cancelled_waiter_gives_its_place_to_the_next():
    async def main() -> list[int]:
        gate, went = TurnGate(1), []

        async def caller(i: int) -> None:
            await gate.enter()
            went.append(i)

        tasks = [asyncio.ensure_future(caller(i)) for i in range(4)]
        await asyncio.sleep(0)  # 0 went on; 1, 2 and 3 wait
        tasks[1].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return went

    assert asyncio.run(main()) == [0, 2, 3]


def test_per_turn_must_be_positive():
    with pytest.raises(ValueError, match="per_turn"):
        TurnGate(0)
