"""SSE: events ready together go out as one body, none waits on the engine; chunk bytes."""

from __future__ import annotations

import asyncio
import json

import pytest

from shoal.frontend.disconnect import client_gone
from shoal.frontend.streaming import FLUSH_BYTES, SSEResponse, _Chunks

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


def bodies(sent: list[dict]) -> list[tuple[bytes, bool]]:
    assert sent[0]["type"] == "http.response.start"
    return [(m["body"], m["more_body"]) for m in sent[1:]]


async def never_disconnects() -> dict:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def serve(events, send, receive=never_disconnects) -> tuple[dict, list[str]]:
    """Run an SSEResponse over `events` to its end; its scope and what was closed."""
    closed: list[str] = []
    scope = dict(SCOPE)

    async def on_close() -> None:
        closed.append("run")

    async def main() -> None:
        await SSEResponse(events, on_close)(scope, receive, send)

    asyncio.run(asyncio.wait_for(main(), 10))
    return scope, closed


def test_ready_events_share_a_write_and_none_waits_for_the_engine():
    engine_step = asyncio.Event()
    sent: list[dict] = []

    async def events():
        for i in range(3):
            yield f"e{i};".encode()
        await engine_step.wait()  # only the write of e0-e2 lets the engine go on
        yield b"e3;"
        yield b"e4;"

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) == 2:
            engine_step.set()

    _, closed = serve(events(), send)
    assert bodies(sent) == [(b"e0;e1;e2;", True), (b"e3;e4;", False)]
    assert closed == ["run"]


def test_a_long_burst_goes_out_in_parts():
    part = b"x" * (FLUSH_BYTES // 2 + 1)
    sent: list[dict] = []

    async def events():
        for _ in range(3):
            yield part

    async def send(message: dict) -> None:
        sent.append(message)

    serve(events(), send)
    assert bodies(sent) == [(part + part, True), (part, False)]


@pytest.mark.parametrize("stuck_write", [False, True])
def test_a_client_that_leaves_closes_the_events_and_the_run(stuck_write):
    """The client leaves while the events wait on the engine, or while a write is stuck (the
    cancellation then reaches the events through the write)."""
    left = asyncio.Event()
    sent: list[dict] = []
    ended: list[str] = []

    async def events():
        try:
            yield b"first;"
            await asyncio.Event().wait()
            yield b"never;"
        finally:
            ended.append("events")

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            left.set()
            if stuck_write:
                await asyncio.Event().wait()

    async def receive() -> dict:
        await left.wait()
        return {"type": "http.disconnect"}

    scope, closed = serve(events(), send, receive)
    assert bodies(sent) == [(b"first;", True)]
    assert ended == ["events"] and closed == ["run"]
    assert client_gone(scope["state"])


@pytest.mark.parametrize("include_usage", [False, True])
def test_text_chunks_encode_as_the_general_chunk(include_usage):
    class Run:
        id, created, model = "cmpl-1", 1700000000, 'm"odel'

    for kind in ("text_completion", "chat.completion.chunk"):
        chunks = _Chunks(Run(), kind, include_usage)
        for index, text in [(0, "plain"), (3, 'q"uote\\ \n\t\x01 鱼 \U0001f41f'), (12, "")]:
            rest = {"logprobs": None, "finish_reason": None}
            if kind == "text_completion":
                fast = chunks.completion_text(index, text)
                general = chunks.choices([{"index": index, "text": text, **rest}])
            else:
                fast = chunks.chat_content(index, text)
                general = chunks.choices([{"index": index, "delta": {"content": text}, **rest}])
            assert fast == general
            payload = json.loads(fast.removeprefix(b"data: "))
            assert payload["id"] == "cmpl-1" and payload["model"] == 'm"odel'
            assert payload["object"] == kind and ("usage" in payload) == include_usage
            choice = payload["choices"][0]
            assert choice["index"] == index
            got = choice["text"] if kind == "text_completion" else choice["delta"]["content"]
            assert got == text


def test_a_failed_write_unwinds_the_events_as_cancelled():
    """A dead socket while the events wait: no error event is made of it; the run closes."""
    seen: list[str] = []
    sent: list[dict] = []

    async def events():
        try:
            yield b"first;"
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        except Exception:
            seen.append("error event")
            yield b"error;"

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            raise OSError("connection reset")
        sent.append(message)

    scope, closed = serve(events(), send)
    assert seen == ["cancelled"] and closed == ["run"]
    assert client_gone(scope["state"])
