"""until_disconnected: the work runs in the caller's task; a disconnect cancels it."""

from __future__ import annotations

import asyncio

import pytest

from shoal.frontend.disconnect import ClientGone, until_disconnected


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_the_work_runs_in_the_calling_task_and_returns():
    async def main():
        caller = asyncio.current_task()

        async def work():
            return asyncio.current_task() is caller

        async def receive():
            await asyncio.Event().wait()

        return await until_disconnected(receive, work())

    assert run(main()) is True


def test_a_disconnect_cancels_the_work_and_is_client_gone():
    ended: list[str] = []

    async def main():
        left = asyncio.Event()

        async def work():
            try:
                left.set()
                await asyncio.Event().wait()
            finally:
                ended.append("work")

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        with pytest.raises(ClientGone):
            await until_disconnected(receive, work())
        task = asyncio.current_task()
        assert task.cancelling() == 0  # the caller goes on as if never cancelled
        await asyncio.sleep(0)
        return "went on"

    assert run(main()) == "went on"
    assert ended == ["work"]


def test_a_cancellation_from_outside_stays_a_cancellation():
    async def main():
        started = asyncio.Event()

        async def work():
            started.set()
            await asyncio.Event().wait()

        async def receive():
            await asyncio.Event().wait()

        task = asyncio.create_task(until_disconnected(receive, work()))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
