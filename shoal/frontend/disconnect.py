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

    `work` runs in the calling task (no task of its own to start or to switch to); a watcher
    task cancels the caller when the disconnect comes. Call only once the request body has
    been read: this reads the ASGI receive channel.
    """
    task = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(receive)
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        result = await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            raise ClientGone from None
        raise
    finally:
        watcher.cancel()
    if gone:  # the work caught the cancellation
        task.uncancel()
        raise ClientGone
    return result
