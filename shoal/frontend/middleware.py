"""Pure-ASGI middleware: request metrics, Bearer API keys and the concurrency limit on /v1."""

from __future__ import annotations

import hmac
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.frontend.errors import too_many_requests, unauthorized
from shoal.frontend.metrics import FrontendMetrics

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
KNOWN_PATHS = GENERATION_PATHS | {"/v1/models"}


def _is_api(scope: Scope) -> bool:
    return scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/"))


def _is_generation(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["path"] in GENERATION_PATHS


class MetricsMiddleware:
    """Counts /v1 requests by model, endpoint and status; times them; tracks those in flight.

    Routes put the request's model in `scope["state"]["model"]` once they know it.
    """

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_api(scope):
            await self.app(scope, receive, send)
            return
        status = 500  # what an exception escaping the app becomes
        state = scope.setdefault("state", {})

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        endpoint = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
        generation = endpoint in GENERATION_PATHS
        if generation:
            self.metrics.in_flight.inc()
        start = time.perf_counter()
        try:
            await self.app(scope, receive, send_status)
        finally:
            if generation:
                self.metrics.in_flight.dec()
            model = state.get("model", "")
            self.metrics.requests.labels(model, endpoint, str(status)).inc()
            self.metrics.request_duration.labels(model, endpoint).observe(
                time.perf_counter() - start
            )


class ApiKeyMiddleware:
    """/v1 requires `Authorization: Bearer <key>`; anything else is a 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _is_api(scope) and not self._authorized(scope):
            await unauthorized().response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False


class ConcurrencyLimitMiddleware:
    """At most `limit` generation requests in flight; one more is answered 429 at once."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_generation(scope):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await too_many_requests(self.limit).response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
