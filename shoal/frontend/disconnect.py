"""Stop work the moment the HTTP client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the work finished; the work was cancelled."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first: then cancel it and raise ClientGone.

    Call only once the request body has been read: this reads the ASGI receive channel.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # let it unwind (closing engine streams aborts them)
    if task.cancelled():
        raise ClientGone
    return task.result()
