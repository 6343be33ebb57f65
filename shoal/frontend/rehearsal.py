"""Rehearsals: while the frontend is idle, a canned streamed request runs through the serving
path on an engine that answers at once, so the code of a request's first token stays in the
CPU's caches.

At low load a request finds that code cold: between two requests the frontend runs other
code (the streams' tokens, the loop, other processes on its cores), and the parse, the
prompt's rendering and tokenization, the run's set-up and the first SSE event then take
5-15 times their warm time (docs/serving.md, "Rehearsals"). A rehearsal replays the latest
request's kind (chat or completions) for its model, streamed, through the same functions a
request calls: `parse_body`, `OpenAIServing`'s route body, `RequestRun`, the SSE events and
their response. What it leaves out does I/O or keeps state: HTTP parsing (uvicorn), the
app's middleware, the router and the request plane. Nothing it does shows outside it: its
metrics go to a registry of its own, and its engine sends nothing.

A rehearsal costs about 0.2 ms of CPU (the dev VM, warm). It runs once per `interval_s` at
most, only when no request has arrived for that long and the process uses less than half a
core (event_loop.CpuLoad): a busy frontend keeps its code warm by serving.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Scope

from shoal.frontend.engine_client import EngineClient
from shoal.frontend.errors import APIError
from shoal.frontend.metrics import FrontendMetrics
from shoal.frontend.serving import OpenAIServing
from shoal.protocol import EngineOutput, EngineRequest, ModelCard
from shoal.runtime.codec import ENCODER, decoder
from shoal.runtime.event_loop import CpuLoad

log = logging.getLogger(__name__)

REHEARSAL_INTERVAL_MS = 5.0  # the default: at most one rehearsal this often
PROMPT = "Say hello to the world in a few short words, then stop."
REPLY_TOKENS = 2  # outputs the engine gives a rehearsal: a first token, then the last

Route = Callable[[OpenAIServing, Request], Awaitable[Response]]


class InstantEngine:
    """An EngineClient over another one's models whose requests finish at once: each gets
    REPLY_TOKENS outputs of one token (its prompt's last), the last with a `length` finish.
    The request and its outputs go through the request plane's encoding and decoding (the
    bytes are made and dropped), and before each output the loop runs what is ready, so a
    rehearsal holds the loop for a fraction of its time at a stretch, as a request does."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def models(self) -> dict[str, ModelCard]:
        return self.client.models()

    def live_models(self) -> list[str]:
        return self.client.live_models()

    async def generate(self, model: str, request: EngineRequest) -> AsyncGenerator[EngineOutput]:
        ENCODER.encode(request)
        decode = decoder(EngineOutput).decode
        token = int(request.prompt_token_ids[-1])
        for i in range(REPLY_TOKENS):
            await asyncio.sleep(0)
            last = i == REPLY_TOKENS - 1
            out = EngineOutput(
                request_id=request.request_id,
                new_token_ids=[token],
                finish_reason="length" if last else None,
                num_prompt_tokens=len(request.prompt_token_ids),
            )
            yield decode(ENCODER.encode(out))


@functools.lru_cache(maxsize=64)
def canned_body(kind: str, model: str) -> bytes:
    """A streamed request of `kind` ("chat" or "completions") for `model`, encoded once."""
    body: dict = {"model": model, "max_tokens": REPLY_TOKENS, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return msgspec.json.encode(body)


async def _discard(message: Message) -> None:
    """An ASGI send that sends nothing."""


class Rehearsal:
    """Rehearses the latest request's kind for its model through `routes` (kind -> the
    route's work, as the app calls it) on an InstantEngine copy of `serving`."""

    def __init__(self, serving: OpenAIServing, routes: dict[str, Route], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"the rehearsal interval must be positive (got {interval_s})")
        self.served = serving
        self.serving = OpenAIServing(
            InstantEngine(serving.client),
            FrontendMetrics(),
            serving.max_prompts,
            serving.parsers,
        )
        self.serving.tokenizers = serving.tokenizers
        self.routes = routes
        self.interval_s = interval_s
        self.load = CpuLoad()
        self.count = 0  # rehearsals run
        self.refused: set[tuple[str, str]] = set()  # (kind, model) that failed: not tried again

    async def run(self) -> None:
        """Rehearse whenever the frontend is idle, until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            latest = self.served.latest
            if latest is None or self.load.busy():
                continue
            arrival, kind, model = latest
            if time.perf_counter() - arrival >= self.interval_s:
                await self.rehearse(kind, model)

    async def rehearse(self, kind: str, model: str) -> bool:
        """Run one rehearsal of `kind` for `model`; False if it failed (then that pair is
        not rehearsed again: a model without a chat template answers chat with a 400)."""
        if (kind, model) in self.refused or kind not in self.routes:
            return False
        body = canned_body(kind, model)
        scope: Scope = {
            "type": "http",
            "method": "POST",
            "path": f"/rehearsal/{kind}",
            "headers": [(b"content-type", b"application/json")],
            "state": {},
        }
        delivered = False
        never: asyncio.Future = asyncio.get_running_loop().create_future()

        async def receive() -> Message:
            nonlocal delivered
            if delivered:
                return await never  # the client stays: the response's watcher waits here
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            response = await self.routes[kind](self.serving, Request(scope, receive))
            await response(scope, receive, _discard)
        except Exception as e:
            self.refused.add((kind, model))
            level = logging.DEBUG if isinstance(e, APIError) else logging.WARNING
            log.log(level, "no more %s rehearsals for %s: %r", kind, model, e)
            return False
        self.count += 1
        return True
