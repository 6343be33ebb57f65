"""Server-sent events: the chat and completions chunk streams and the response that sends them.

Chunks are plain dicts encoded by msgspec; nothing per token goes through pydantic.
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from contextlib import aclosing, suppress
from typing import Any

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from shoal.frontend.disconnect import ClientGone, mark_client_gone, until_disconnected
from shoal.frontend.engine_client import WorkerFailed
from shoal.frontend.errors import internal_error, worker_failed
from shoal.frontend.generation import RequestRun
from shoal.frontend.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    empty_completion_logprobs,
)
from shoal.frontend.tokenizer_pool import ModelTokenizer
from shoal.frontend.tool_parsers.base import Delta
from shoal.frontend.tool_parsers.output import OutputParsing

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def event(payload: dict) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def _failure(e: Exception) -> bytes:
    """The SSE error event for a failure after the response started."""
    if isinstance(e, WorkerFailed):
        return event(worker_failed(e.message).body())
    log.exception("stream failed", exc_info=e)
    return event(internal_error().body())


class _Chunks:
    """Encodes one stream's chunks: the fixed fields (encoded once), and `usage: null` when
    usage comes last. A choice's text alone, the common chunk, is encoded without a dict."""

    __slots__ = ("head", "include_usage", "kind", "run", "tail")

    def __init__(self, run: RequestRun, kind: str, include_usage: bool) -> None:
        self.run = run
        self.kind = kind
        self.include_usage = include_usage
        fixed = {"id": run.id, "object": kind, "created": run.created, "model": run.model}
        self.head = b"data: " + _encode({**fixed, "choices": []})[:-2]  # ends in "choices":[
        self.tail = b"]%s}\n\n" % (b',"usage":null' if include_usage else b"")

    def choices(self, choices: list[dict]) -> bytes:
        return b"".join((self.head, b",".join(map(_encode, choices)), self.tail))

    def completion_text(self, index: int, text: str) -> bytes:
        """The chunk of choice `index`'s text, with no logprobs and no finish."""
        body = b'{"index":%d,"text":%s,"logprobs":null,"finish_reason":null}'
        return b"".join((self.head, body % (index, _encode(text)), self.tail))

    def chat_content(self, index: int, text: str) -> bytes:
        """The chunk of choice `index`'s content delta, with no logprobs and no finish."""
        body = b'{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":null}'
        return b"".join((self.head, body % (index, _encode(text)), self.tail))

    def usage(self) -> bytes:
        return event(
            {
                "id": self.run.id,
                "object": self.kind,
                "created": self.run.created,
                "model": self.run.model,
                "choices": [],
                "usage": self.run.usage(),
            }
        )


async def chat_events(
    run: RequestRun,
    tok: ModelTokenizer,
    logprobs: bool,
    include_usage: bool,
    parsing: OutputParsing | None = None,
) -> AsyncGenerator[bytes, None]:
    """chat.completion.chunk events: a role delta per choice, content deltas (or, with
    parsers, reasoning, content and tool-call deltas), finish, usage."""
    chunks = _Chunks(run, "chat.completion.chunk", include_usage)
    parsers = [parsing.new() for _ in run.choices] if parsing is not None else None
    called = [False] * len(run.choices)
    try:
        for choice in run.choices:
            role = {"role": "assistant", "content": ""}
            yield chunks.choices(
                [{"index": choice.index, "delta": role, "logprobs": None, "finish_reason": None}]
            )
        async with aclosing(run.updates()) as updates:
            async for choice, text, out in updates:
                entries = (
                    chat_logprobs(tok, out.new_logprobs) if logprobs and out.new_logprobs else None
                )
                finish_reason = choice.finish_reason
                if parsers is None:
                    if text and entries is None and finish_reason is None:
                        yield chunks.chat_content(choice.index, text)
                        continue
                    delta = {"content": text} if text else {}
                else:
                    parser = parsers[choice.index]
                    parsed = parser.feed(text) if text else Delta()
                    if finish_reason is not None:
                        parsed.add(parser.finish())
                    delta = parsed.to_dict()
                    called[choice.index] = called[choice.index] or bool(parsed.calls)
                    if called[choice.index] and finish_reason == "stop":
                        finish_reason = "tool_calls"
                if not delta and entries is None and finish_reason is None:
                    continue  # text held back (a possible stop string, half a character)
                body = {
                    "index": choice.index,
                    "delta": delta,
                    "logprobs": None if entries is None else {"content": entries},
                    "finish_reason": finish_reason,
                }
                if choice.finish_reason is not None:
                    body["stop_reason"] = choice.stop_reason
                yield chunks.choices([body])
        if include_usage:
            yield chunks.usage()
    except Exception as e:
        yield _failure(e)
    yield DONE


async def completion_events(
    run: RequestRun,
    tok: ModelTokenizer,
    logprobs: int | None,
    echo: list[str] | None,
    include_usage: bool,
) -> AsyncGenerator[bytes, None]:
    """text_completion events; with echo, a choice's first event starts with its prompt."""
    chunks = _Chunks(run, "text_completion", include_usage)
    trackers = [CompletionLogprobs(tok) for _ in run.choices] if logprobs is not None else None
    started = [False] * len(run.choices)
    try:
        async with aclosing(run.updates()) as updates:
            async for choice, text, out in updates:
                i = choice.index
                lp = None
                if not started[i]:
                    started[i] = True
                    if echo is not None:
                        text = echo[i // run.n] + text
                        if trackers is not None:
                            lp = _prompt_logprobs(run, trackers[i], i // run.n)
                if trackers is not None and out.new_logprobs:
                    lp = trackers[i].add(
                        out.new_token_ids, out.new_logprobs, lp or empty_completion_logprobs()
                    )
                if lp is None and choice.finish_reason is None:
                    if text:
                        yield chunks.completion_text(i, text)
                    continue
                body = {"index": i, "text": text, "logprobs": lp, "finish_reason": None}
                if choice.finish_reason is not None:
                    body["finish_reason"] = choice.finish_reason
                    body["stop_reason"] = choice.stop_reason
                yield chunks.choices([body])
        if include_usage:
            yield chunks.usage()
    except Exception as e:
        yield _failure(e)
    yield DONE


def _prompt_logprobs(run: RequestRun, tracker: CompletionLogprobs, prompt: int) -> dict:
    """The echoed prompt's logprobs (the first token has none)."""
    token_ids = run.prompts[prompt]
    logprobs = run.prompt_logprobs[prompt] or [None] * len(token_ids)
    return tracker.add(token_ids, logprobs, empty_completion_logprobs())


FLUSH_BYTES = 1 << 16  # a burst of events longer than this is sent in parts


@types.coroutine
def _next_or_flush(
    events: AsyncGenerator[bytes, None], flush: Callable[[], Awaitable[None]]
) -> Generator[Any, Any, bytes]:
    """anext(events), except that when the generator has to wait, flush() runs first.

    Steps the generator by hand: what it has ready comes back without a flush, and the
    moment it would wait (on the engine) the events gathered so far go out, then the wait
    goes on as the generator asked. If the flush fails (the task cancelled, the socket
    gone), the generator unwinds as if cancelled and the failure goes on.
    """
    step = anext(events)
    try:
        wait = step.send(None)
    except StopIteration as done:
        return done.value
    try:
        yield from flush()
    except BaseException as e:
        cancel = e if isinstance(e, asyncio.CancelledError) else asyncio.CancelledError()
        with suppress(asyncio.CancelledError, StopIteration):
            yield from _resume(step, step.throw(cancel))
        raise e
    return (yield from _resume(step, wait))


def _resume(step: Any, wait: Any) -> Generator[Any, Any, bytes]:
    """Hand the waits of a generator's step to the running task until the step ends."""
    while True:
        try:
            sent = yield wait
        except BaseException as e:
            resume, arg = step.throw, e
        else:
            resume, arg = step.send, sent
        try:
            wait = resume(arg)
        except StopIteration as done:
            return done.value


class SSEResponse(StreamingResponse):
    """Streams events until they end or the client disconnects; either way it then closes
    the events and calls `on_close` (which closes the engine streams: an abort if running).

    `opening`, if given, is awaited before anything is sent: the status is decided by it,
    so an error it raises leaves the response unstarted (`started` stays False) for the
    app to answer with the error's own status, while the wait for a first token costs no
    extra trip through the app's layers once it ends. Events that are ready together
    (several tokens of an engine step, or a backlog) go out in one write; an event is
    never held back while the engine is awaited.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        on_close: Callable[[], Awaitable[None]],
        opening: Awaitable[None] | None = None,
    ) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_close = on_close
        self.opening = opening
        self.started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        burst: list[bytes] = []
        size = 0

        async def flush() -> None:
            nonlocal size
            if burst:
                body = b"".join(burst)
                burst.clear()
                size = 0
                await send({"type": "http.response.body", "body": body, "more_body": True})

        async def stream() -> None:
            nonlocal size
            if self.opening is not None:
                await self.opening
            self.started = True
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            while True:
                try:
                    chunk = await _next_or_flush(self.events, flush)
                except StopAsyncIteration:
                    break
                burst.append(chunk)
                size += len(chunk)
                if size >= FLUSH_BYTES:
                    await flush()
            await send({"type": "http.response.body", "body": b"".join(burst), "more_body": False})

        try:
            await until_disconnected(receive, stream())
        except (ClientGone, OSError):
            mark_client_gone(scope)
        finally:
            await self.events.aclose()
            await self.on_close()
