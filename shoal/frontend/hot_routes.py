"""The generation routes served in front of FastAPI's middleware stack.

Every request and every streamed chunk of a FastAPI route passes through FastAPI's and
Starlette's layers (server errors, telemetry, exceptions, the router's matching, the route's
exception wrapper), four of which wrap `send`. `POST /v1/chat/completions` and
`POST /v1/completions` skip them, and FastAPI's own call before them (OpenAIApp.__call__):
they go through the app's own middleware (metrics, API key, body and concurrency limits) to
their endpoint, and an exception becomes the same answer the
app's exception handlers give (errors.error_response). Everything else, and these paths
with any other method, goes through the whole stack as before. A burst of generation
requests reaches its endpoints REQUESTS_PER_TURN a turn of the loop (shoal.runtime.turns),
so responses already back from the workers are streamed while the rest are prepared.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from shoal.frontend.errors import error_response
from shoal.runtime.turns import TurnGate

Endpoint = Callable[[Request], Awaitable[Response]]
# Generation requests that start in one turn of the loop: a burst of them is prepared this
# many at a time, with the loop reading its sockets in between (shoal.runtime.turns; 4 gave
# a 256-request burst its lowest median and last TTFT of 1, 2, 4, 8 and 16 on the dev VM).
REQUESTS_PER_TURN = 4


class HotRoutes:
    """Dispatch `POST path` for each path of `endpoints` straight to it (through the
    app's user middleware); anything else to `app`, the full stack.

    The user middleware is built a second time for this chain, so a middleware that keeps
    state in its instance (ConcurrencyLimitMiddleware's count) keeps it per chain: the
    generation requests it counts all come this way.
    """

    def __init__(self, app: ASGIApp, endpoints: dict[str, Endpoint], user_middleware: list) -> None:
        self.app = app
        self.endpoints = endpoints
        self.turns = TurnGate(REQUESTS_PER_TURN)
        chain: ASGIApp = self._serve
        for cls, args, kwargs in reversed(user_middleware):
            chain = cls(chain, *args, **kwargs)
        self.chain = chain

    def serves(self, scope: Scope) -> bool:
        """Whether the request is a POST to one of `endpoints` (it takes the chain)."""
        return (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in self.endpoints
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.serves(scope):
            await self.chain(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The endpoint's response; an exception before the response has started (an
        endpoint's, or a response's whose `started` is still False) answers as an error.
        A burst of requests starts REQUESTS_PER_TURN a turn of the loop."""
        await self.turns.enter()
        path = scope["path"]
        try:
            response = await self.endpoints[path](Request(scope, receive, send))
        except Exception as exc:
            await error_response(exc, path)(scope, receive, send)
            return
        try:
            await response(scope, receive, send)
        except Exception as exc:
            if getattr(response, "started", True):
                raise  # mid-answer: the server closes the connection, as for any route
            await error_response(exc, path)(scope, receive, send)


class OpenAIApp(FastAPI):
    """FastAPI, with `hot_routes` (path -> endpoint; mounted with add_route as well, for
    the other methods and the schema) served by HotRoutes."""

    hot_routes: dict[str, Endpoint]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hot_routes = {}

    def build_middleware_stack(self) -> ASGIApp:
        return HotRoutes(super().build_middleware_stack(), self.hot_routes, self.user_middleware)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A generation request goes straight to the stack (HotRoutes); anything else takes
        FastAPI's own call first. That call asks OpenTelemetry on every request whether
        FastAPI's native tracing is configured (FastAPI 0.165 on): 30-35 us of a cold
        request's TTFT on the dev VM. So these two routes get no FastAPI span; shoal's
        own metrics and access log cover them."""
        stack = self.middleware_stack
        if isinstance(stack, HotRoutes) and not self.root_path and stack.serves(scope):
            scope["app"] = self
            await stack.chain(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
