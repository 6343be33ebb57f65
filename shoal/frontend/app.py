"""build_app: the OpenAI-compatible HTTP app over an EngineClient."""

from __future__ import annotations

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry
from starlette.responses import Response

from shoal.frontend.engine_client import EngineClient
from shoal.frontend.errors import install_error_handlers
from shoal.frontend.metrics import FrontendMetrics
from shoal.frontend.middleware import (
    ApiKeyMiddleware,
    ConcurrencyLimitMiddleware,
    MetricsMiddleware,
)
from shoal.frontend.protocol_openai import ChatCompletionRequest, CompletionRequest
from shoal.frontend.serving import OpenAIServing, json_response


def build_app(
    client: EngineClient,
    *,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The app: /v1/chat/completions, /v1/completions, /v1/models, /health, /live, /metrics.

    api_key: require `Authorization: Bearer <api_key>` on /v1. max_concurrency: answer 429
    to a generation request arriving while that many are in flight. registry: where the
    app's metrics go (shared with the router's); /metrics serves all of it.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1 (got {max_concurrency})")
    metrics = FrontendMetrics(registry)
    serving = OpenAIServing(client, metrics)
    app = FastAPI(title="shoal", summary="OpenAI-compatible LLM serving")
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(serving.models())

    @app.get("/health")
    async def health() -> Response:
        served = sorted(client.models())
        if not served:
            return json_response({"status": "unavailable", "models": []}, status=503)
        return json_response({"status": "ok", "models": served})

    @app.get("/live")
    async def live() -> Response:
        return json_response({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        text, content_type = metrics.render()
        return Response(text, media_type=content_type)

    # The last added is the outermost: metrics see every answer, auth comes before the limit.
    if max_concurrency is not None:
        app.add_middleware(ConcurrencyLimitMiddleware, limit=max_concurrency)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
