"""The generation routes served in front of FastAPI's stack answer as the full stack does."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from frontend_helpers import ServerThread, error_shape
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from shoal.frontend.errors import bad_request, install_error_handlers
from shoal.frontend.hot_routes import OpenAIApp
from shoal.frontend.streaming import SSEResponse

HOT = "/v1/completions"


class Seen:
    """A user middleware that records the paths it saw and the statuses sent through it."""

    def __init__(self, app: ASGIApp, log: list) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def noted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.log.append((scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, noted)


async def _events(parts: list[bytes], fail_after: int | None = None):
    for i, part in enumerate(parts):
        if i == fail_after:
            raise RuntimeError("broken mid-stream")
        yield part
        await asyncio.sleep(0)


def _app(log: list, behaviour: dict) -> OpenAIApp:
    """An app whose hot route does what behaviour["what"] says; /plain is a normal route."""
    app = OpenAIApp()
    install_error_handlers(app)
    closed: list[bool] = behaviour.setdefault("closed", [])

    async def close() -> None:
        closed.append(True)

    async def endpoint(request: Request) -> Response:
        what = behaviour["what"]
        behaviour["routed"] = "endpoint" in request.scope  # set by Starlette's router
        if what == "api_error":
            raise bad_request("no such thing", param="prompt")
        if what == "validation":
            raise RequestValidationError([{"type": "missing", "loc": ("body", "model")}])
        if what == "unexpected":
            raise KeyError("a bug")
        if what == "opening_fails":

            async def opening() -> None:
                await asyncio.sleep(0.01)
                raise bad_request("refused by the engine", param="prompt")

            return SSEResponse(_events([b"data: x\n\n"]), close, opening())
        if what == "fails_mid_stream":
            return SSEResponse(_events([b"data: a\n\n", b"data: b\n\n"], fail_after=1), close)
        return SSEResponse(_events([b"data: a\n\n", b"data: b\n\n"]), close, asyncio.sleep(0))

    async def plain(request: Request) -> Response:
        return Response(b"plain")

    app.hot_routes[HOT] = endpoint
    app.add_route(HOT, endpoint, ["POST"])
    app.add_route("/plain", plain, ["GET"])
    app.add_middleware(Seen, log=log)
    return app


@pytest.fixture(scope="module")
def served():
    log: list = []
    behaviour: dict = {}
    server = ServerThread(_app(log, behaviour)).start()
    with httpx.Client(base_url=server.url, timeout=10) as http:
        yield http, log, behaviour
    server.stop()


@pytest.mark.parametrize(
    "what, status, param",
    [
        ("api_error", 400, "prompt"),
        ("validation", 400, "model"),
        ("unexpected", 500, None),
        ("opening_fails", 400, "prompt"),
    ],
)
def test_errors_before_the_answer_starts_keep_their_status(served, what, status, param, caplog):
    http, log, behaviour = served
    behaviour["what"] = what
    log.clear()
    with caplog.at_level(logging.ERROR, logger="shoal.frontend.errors"):
        reply = http.post(HOT, json={})
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    assert error_shape(reply.json())["param"] == param
    assert log == [(HOT, status)]  # the user middleware saw the error's status
    assert ("unhandled error" in caplog.text) == (what == "unexpected")


def test_a_stream_goes_through_the_user_middleware_and_closes(served):
    http, log, behaviour = served
    behaviour["what"] = "ok"
    log.clear()
    behaviour["closed"].clear()
    reply = http.post(HOT, json={})
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.text == "data: a\n\ndata: b\n\n"
    assert log == [(HOT, 200)]
    assert behaviour["closed"] == [True]
    assert behaviour["routed"] is False  # FastAPI's stack and router were skipped


def test_a_failure_mid_stream_drops_the_connection_and_the_server_goes_on(served):
    http, _, behaviour = served
    behaviour["what"] = "fails_mid_stream"
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):  # cut short, or reset
        http.post(HOT, json={})
    behaviour["what"] = "ok"
    assert http.post(HOT, json={}).status_code == 200


def test_other_methods_and_paths_take_the_full_stack(served):
    http, log, _ = served
    log.clear()
    assert http.get(HOT).status_code == 405
    assert http.get("/plain").text == "plain"
    assert http.post("/missing").status_code == 404
    assert log == [(HOT, 405), ("/plain", 200), ("/missing", 404)]


def test_only_other_requests_take_fastapis_own_call(monkeypatch):
    """FastAPI's __call__ (which asks OpenTelemetry whether its native tracing is on, every
    request) runs for everything but a generation request; with a root path set, the
    generation routes take it too and still answer."""
    calls: list[str] = []
    fastapi_call = FastAPI.__call__

    async def counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        calls.append(scope.get("path", scope["type"]))
        await fastapi_call(self, scope, receive, send)

    monkeypatch.setattr(FastAPI, "__call__", counted)
    behaviour = {"what": "ok"}
    server = ServerThread(_app([], behaviour)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            http.get("/plain")  # the first request builds the stack
            calls.clear()
            assert http.post(HOT, json={}).text == "data: a\n\ndata: b\n\n"
            assert http.get("/plain").text == "plain"
            assert calls == ["/plain"]
    finally:
        server.stop()
    rooted = _app([], behaviour)
    rooted.root_path = "/api"
    server = ServerThread(rooted).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            calls.clear()
            assert http.post(HOT, json={}).text == "data: a\n\ndata: b\n\n"
            assert calls == [HOT]
    finally:
        server.stop()


def test_a_burst_streams_its_first_answers_before_its_last_request_is_prepared():
    """Twelve requests arrive in one turn of the loop, each endpoint waiting a turn for its
    engine (as a response comes back over a socket): the first answers' first chunks go out
    while later requests are still to be prepared, REQUESTS_PER_TURN of them a turn, rather
    than after all twelve."""
    events: list[tuple[str, int]] = []
    app = OpenAIApp()

    async def endpoint(request: Request) -> Response:
        i = int(request.headers["x-i"])
        events.append(("prepared", i))
        engine = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(engine.set_result, None)
        await engine

        async def close() -> None:
            pass

        return SSEResponse(_events([b"data: a\n\n"]), close, asyncio.sleep(0))

    app.hot_routes[HOT] = endpoint
    app.add_route(HOT, endpoint, ["POST"])

    async def request(stack: ASGIApp, i: int) -> None:
        scope = {
            "type": "http",
            "method": "POST",
            "path": HOT,
            "headers": [(b"x-i", str(i).encode())],
            "query_string": b"",
        }

        bodies = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict:
            if bodies:
                return bodies.pop()
            await asyncio.Event().wait()  # the client stays connected
            raise AssertionError("unreachable")

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                events.append(("first chunk", i))

        await stack(scope, receive, send)

    async def burst() -> None:
        stack = app.build_middleware_stack()
        await asyncio.gather(*(request(stack, i) for i in range(12)))

    asyncio.run(burst())
    assert sorted(i for kind, i in events if kind == "prepared") == list(range(12))
    assert events.index(("first chunk", 0)) < events.index(("prepared", 11))
