"""The OpenAI routes' work: resolve the model, preprocess, run the engines, answer."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import msgspec
from fastapi import Request
from starlette.responses import Response

from shoal.frontend import preprocess
from shoal.frontend.disconnect import CLIENT_CLOSED_REQUEST, ClientGone, until_disconnected
from shoal.frontend.engine_client import EngineClient, NoWorkerAvailable, QueueFull, WorkerFailed
from shoal.frontend.errors import (
    bad_request,
    model_not_found,
    no_worker,
    queue_full,
    worker_failed,
)
from shoal.frontend.generation import RequestRun
from shoal.frontend.metrics import FrontendMetrics
from shoal.frontend.protocol_openai import ChatCompletionRequest, CompletionRequest
from shoal.frontend.responses import chat_response, completion_response
from shoal.frontend.streaming import SSEResponse, chat_events, completion_events
from shoal.frontend.tokenizer_pool import ModelTokenizer, TokenizerPool
from shoal.frontend.tool_parsers.output import ParserConfig, output_parsing
from shoal.protocol import ModelCard

T = TypeVar("T")

MAX_PROMPTS_PER_REQUEST = 1024  # prompts in one completions request, by default


def json_response(payload: dict, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")


@contextmanager
def engine_errors(model: str) -> Iterator[None]:
    """The EngineClient's errors as API errors (503, 502, 400)."""
    try:
        yield
    except QueueFull:
        raise queue_full(model) from None
    except NoWorkerAvailable:
        raise no_worker(model) from None
    except WorkerFailed as e:
        raise worker_failed(e.message) from None
    except ValueError as e:
        raise bad_request(str(e)) from None


async def _opened(model: str, run: RequestRun) -> None:
    """Open the run (its first output is in), with the engine client's errors as API errors."""
    with engine_errors(model):
        await run.open()


class OpenAIServing:
    def __init__(
        self,
        client: EngineClient,
        metrics: FrontendMetrics,
        max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST,
        parsers: ParserConfig | None = None,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.max_prompts = max_prompts_per_request
        self.parsers = parsers or ParserConfig()
        self.tokenizers = TokenizerPool()
        self.started = int(time.time())
        self.latest: tuple[float, str, str] | None = None  # the last request: arrival, kind, model

    async def _model(self, name: str, request: Request) -> tuple[ModelCard, ModelTokenizer]:
        """The model's card and tokenizer: 404 for a model no worker has served, 503 while
        this frontend has seen no worker at all (it is starting; the model may be coming)."""
        known = self.client.models()
        card = known.get(name)
        if card is None:
            raise model_not_found(name) if known else no_worker(name)
        request.state.model = name
        return card, await self.tokenizers.get(card.tokenizer)

    async def _guarded(self, request: Request, model: str, work: Awaitable[T]) -> T:
        """Await engine work, mapping its errors, cancelled if the client disconnects."""
        with engine_errors(model):
            return await until_disconnected(request.receive, work)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        card, tok = await self._model(body.model, request)
        self.latest = (arrival, "chat", body.model)
        preprocess.check_chat(body, tok)
        mode, function = preprocess.tool_choice(body, self.parsers)
        constraint = preprocess.chat_constraint(body, mode, function)
        prompt = await preprocess.chat_prompt(tok, body, card.context_length)
        parsing = output_parsing(self.parsers, mode, function, prompt.text or "")
        max_tokens = preprocess.max_tokens_for(
            body.max_completion_tokens or body.max_tokens,
            len(prompt.token_ids),
            card.context_length,
            param="messages",
        )
        num_top = body.top_logprobs or 0
        params = preprocess.sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=num_top if body.logprobs else None,
            constraint=constraint,
            keep_special_tokens=parsing is not None and parsing.keeps_special_tokens,
        )
        run = RequestRun(
            self.client,
            body.model,
            f"chatcmpl-{uuid.uuid4().hex}",
            [prompt.token_ids],
            params,
            tok,
            self.metrics.for_model(body.model),
            arrival,
        )
        return await self._answer(
            request,
            body,
            run,
            lambda usage: chat_events(run, tok, body.logprobs, usage, parsing),
            lambda: chat_response(run, tok, body.logprobs, parsing),
        )

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        card, tok = await self._model(body.model, request)
        self.latest = (arrival, "completions", body.model)
        preprocess.check_completion(body, tok, self.max_prompts)
        prompts = await preprocess.completion_prompts(tok, body, card.context_length)
        longest = max(len(p.token_ids) for p in prompts)
        max_tokens = preprocess.max_tokens_for(
            body.max_tokens, longest, card.context_length, param="prompt"
        )
        params = preprocess.sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if body.echo else None,
            constraint=preprocess.structured_outputs(body),
        )
        echo = preprocess.echo_texts(tok, body, prompts) if body.echo else None
        run = RequestRun(
            self.client,
            body.model,
            f"cmpl-{uuid.uuid4().hex}",
            [p.token_ids for p in prompts],
            params,
            tok,
            self.metrics.for_model(body.model),
            arrival,
        )
        return await self._answer(
            request,
            body,
            run,
            lambda usage: completion_events(run, tok, body.logprobs, echo, usage),
            lambda: completion_response(run, tok, body.logprobs, echo),
        )

    async def _answer(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        run: RequestRun,
        events: Callable[[bool], AsyncGenerator[bytes, None]],
        whole: Callable[[], Awaitable[dict]],
    ) -> Response:
        """Stream events(include_usage) as SSE, or send the awaited whole response as JSON."""
        request.state.run = run  # the access log reads its id and usage
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return SSEResponse(
                events(include_usage), on_close=run.close, opening=_opened(body.model, run)
            )
        try:
            payload = await self._guarded(request, body.model, whole())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return json_response(payload)

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self.started,
                    "owned_by": "shoal",
                    "max_model_len": card.context_length,
                }
                for name, card in self.client.models().items()
            ],
        }
