"""Stop work the moment the HTTP client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive, Scope

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
_GONE = "client_gone"  # the key in the request's state (scope["state"])


class ClientGone(Exception):
    """The client disconnected before the work finished; the work was cancelled."""


def mark_client_gone(scope: Scope) -> None:
    """Note in the request's state that its client left (metrics count it as 499)."""
    scope.setdefault("state", {})[_GONE] = True


def client_gone(state: dict) -> bool:
    """Whether the request whose state this is lost its client before the answer ended."""
    return state.get(_GONE, False)


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
