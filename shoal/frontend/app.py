"""build_app: the OpenAI-compatible HTTP app over an EngineClient."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from starlette.responses import Response

from shoal.frontend.api_server_metrics import ApiServerMetrics
from shoal.frontend.engine_client import EngineClient
from shoal.frontend.errors import install_error_handlers
from shoal.frontend.hot_routes import OpenAIApp
from shoal.frontend.metrics import FrontendMetrics
from shoal.frontend.middleware import (
    GENERATION_PATHS,
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    ConcurrencyLimitMiddleware,
    MetricsMiddleware,
)
from shoal.frontend.protocol_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
)
from shoal.frontend.rehearsal import Rehearsal, Route
from shoal.frontend.request_body import parse_body
from shoal.frontend.serving import MAX_PROMPTS_PER_REQUEST, OpenAIServing, json_response
from shoal.frontend.tokenizer_pool import TokenizerPool
from shoal.frontend.tool_parsers.output import ParserConfig

# 16 MiB holds the longest context served today as text or token ids: a 1M-token prompt
# is about 4 MB of text, or at most 8 MB as JSON token ids ("151642,"), with room for
# JSON escapes; anything larger is refused before it is parsed.
MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


def _error_responses(statuses: dict[int, str]) -> dict:
    """OpenAPI `responses` for these statuses (status -> when), all in the error schema.

    "default" covers the rest (500) and keeps FastAPI from documenting a 422 the server
    never sends.
    """
    documented: dict = {
        status: {"model": ErrorResponse, "description": why} for status, why in statuses.items()
    }
    documented["default"] = {"model": ErrorResponse, "description": "Any other error"}
    return documented


GENERATION_ERRORS = _error_responses(
    {
        400: "Invalid request: malformed JSON, a bad field (`param` names it), a prompt "
        "that does not fit the context, too many prompts",
        401: "Missing or wrong API key (when the server has one)",
        404: "Unknown model",
        413: "Request body over the size limit",
        429: "Too many requests in flight",
        502: "The worker failed mid-request",
        503: "No worker serves the model right now",
    }
)


# The generation routes' signatures as OpenAPI shows them; the routes that serve them take
# the Request and parse the body themselves (request_body.py). Their docstrings are the
# operations' descriptions.


async def _chat_schema(body: ChatCompletionRequest) -> Response:
    """OpenAI's chat completions: a whole response, or server-sent events with `stream`."""
    raise NotImplementedError


async def _completions_schema(body: CompletionRequest) -> Response:
    """OpenAI's (legacy) completions: a whole response, or server-sent events with `stream`."""
    raise NotImplementedError


def _document_generation_routes(app: FastAPI) -> None:
    """/openapi.json describes the generation routes, which are plain Starlette routes
    (see request_body.py), from FastAPI routes declared for the schema and never mounted."""
    documented = [
        APIRoute(path, endpoint, methods=["POST"], name=name, responses=GENERATION_ERRORS)
        for path, endpoint, name in (
            ("/v1/chat/completions", _chat_schema, "chat_completions"),
            ("/v1/completions", _completions_schema, "completions"),
        )
    ]

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=[*documented, *app.routes],
            )
        return app.openapi_schema

    app.openapi = openapi


async def _chat(serving: OpenAIServing, request: Request) -> Response:
    return await serving.chat(await parse_body(request, ChatCompletionRequest), request)


async def _completions(serving: OpenAIServing, request: Request) -> Response:
    return await serving.completions(await parse_body(request, CompletionRequest), request)


GENERATION_ROUTES = {"chat": _chat, "completions": _completions}  # a request's kind -> its work


def _endpoint(serving: OpenAIServing, work: Route) -> Callable[[Request], Awaitable[Response]]:
    """The route's endpoint: `work` on the app's serving."""

    async def endpoint(request: Request) -> Response:
        return await work(serving, request)

    return endpoint


def _rehearsing(rehearsal: Rehearsal | None):
    """The app's lifespan: rehearsal.run() in a task while the app serves (if any)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None if rehearsal is None else asyncio.create_task(rehearsal.run())
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    return lifespan


def build_app(
    client: EngineClient,
    *,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    registry: CollectorRegistry | None = None,
    max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES,
    max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST,
    access_log: bool = False,
    tokenizers: TokenizerPool | None = None,
    parsers: ParserConfig | None = None,
    rehearsal_interval_ms: float = 0.0,
    api_server_metrics: ApiServerMetrics | None = None,
) -> FastAPI:
    """The app: /v1/chat/completions, /v1/completions, /v1/models, /health, /live, /metrics.

    api_key: require `Authorization: Bearer <api_key>` on /v1. max_concurrency: answer 429
    to a generation request arriving while that many are in flight. registry: where the
    app's metrics go (shared with the router's); /metrics serves all of it.
    max_request_body_bytes: a larger body is answered 413 unread. max_prompts_per_request:
    a completions request with more prompts is a 400. access_log: one `shoal.access` log
    line per /v1 request. tokenizers: where the models' tokenizers come from (default:
    each card's folder on this host). parsers: the tool-call and reasoning parsers.
    rehearsal_interval_ms: while idle, rehearse the latest request's path this often
    (rehearsal.py; 0: never).
    api_server_metrics: this is one of --api-server-count processes, and /metrics answers
    with every process's series (api_server_metrics.py).
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1 (got {max_concurrency})")
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be positive (got {max_request_body_bytes})")
    if max_prompts_per_request < 1:
        raise ValueError(
            f"max_prompts_per_request must be at least 1 (got {max_prompts_per_request})"
        )
    metrics = FrontendMetrics(registry)
    serving = OpenAIServing(client, metrics, max_prompts_per_request, parsers)
    if tokenizers is not None:
        serving.tokenizers = tokenizers
    rehearsal = None
    if rehearsal_interval_ms:
        rehearsal = Rehearsal(serving, GENERATION_ROUTES, rehearsal_interval_ms / 1e3)
    app = OpenAIApp(
        title="shoal", summary="OpenAI-compatible LLM serving", lifespan=_rehearsing(rehearsal)
    )
    app.state.metrics = metrics
    app.state.rehearsal = rehearsal
    install_error_handlers(app)

    for path, kind in GENERATION_PATHS.items():
        endpoint = _endpoint(serving, GENERATION_ROUTES[kind])
        app.hot_routes[path] = endpoint
        app.add_route(path, endpoint, ["POST"], include_in_schema=False)
    _document_generation_routes(app)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(serving.models())

    @app.get("/health", responses={503: {"description": "No model is served"}})
    async def health() -> Response:
        served = client.live_models()
        if not served:
            return json_response({"status": "unavailable", "models": []}, status=503)
        return json_response({"status": "ok", "models": served})

    @app.get("/live")
    async def live() -> Response:
        return json_response({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        text, content_type = metrics.render()
        if api_server_metrics is not None:
            text = await api_server_metrics.gather(text)
        return Response(text, media_type=content_type)

    # The last added is the outermost: metrics see every answer, auth comes before the limits.
    if max_concurrency is not None:
        app.add_middleware(ConcurrencyLimitMiddleware, limit=max_concurrency)
    app.add_middleware(BodySizeLimitMiddleware, limit=max_request_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics, log_access=access_log)
    return app
