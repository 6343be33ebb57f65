"""Pure-ASGI middleware: request metrics and access log, the body size limit, Bearer API keys
and the concurrency limit on /v1."""

from __future__ import annotations

import hmac
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.frontend.disconnect import CLIENT_CLOSED_REQUEST, client_gone
from shoal.frontend.errors import BodyTooLarge, request_too_large, too_many_requests, unauthorized
from shoal.frontend.metrics import FrontendMetrics

access_log = logging.getLogger("shoal.access")

# the generation routes' paths -> the kind of request each serves
GENERATION_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
KNOWN_PATHS = frozenset(GENERATION_PATHS) | {"/v1/models"}


def _is_api(scope: Scope) -> bool:
    return scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/"))


def _is_generation(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["path"] in GENERATION_PATHS


def _log_access(scope: Scope, state: dict, status: int, seconds: float) -> None:
    """One line for a finished /v1 request: who, what, status, time, tokens, request id."""
    run = state.get("run")
    usage = run.usage() if run is not None else {}
    client = scope.get("client")
    access_log.info(
        '%s "%s %s" %d %.3fs model=%s prompt_tokens=%d completion_tokens=%d request_id=%s',
        client[0] if client else "-",
        scope["method"],
        scope["path"],
        status,
        seconds,
        state.get("model") or "-",
        usage.get("prompt_tokens", 0),
        usage.get("completion_tokens", 0),
        run.id if run is not None else "-",
    )


class MetricsMiddleware:
    """Counts /v1 requests by model, endpoint and status; times them; tracks those in flight;
    with `log_access`, logs one line per request to the `shoal.access` logger.

    Routes put the request's model in `scope["state"]["model"]` once they know it, and its
    RequestRun in `scope["state"]["run"]`; a client that left mid-answer counts as 499.
    """

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics, log_access: bool = False) -> None:
        self.app = app
        self.metrics = metrics
        self.log_access = log_access

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
            if client_gone(state):
                status = CLIENT_CLOSED_REQUEST
            model = state.get("model", "")
            seconds = time.perf_counter() - start
            self.metrics.requests.labels(model, endpoint, str(status)).inc()
            self.metrics.request_duration.labels(model, endpoint).observe(seconds)
            if self.log_access:
                _log_access(scope, state, status, seconds)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class BodySizeLimitMiddleware:
    """A request body over `limit` bytes is answered 413 before anything parses it: at once
    when Content-Length says so, else when the bytes read pass the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await request_too_large(self.limit).response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited_receive, send)


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
