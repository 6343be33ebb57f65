"""Rehearsals run a canned request through the serving path on an engine that answers at
once; nothing of them reaches the engines, the app's metrics or its latest request."""

from __future__ import annotations

import asyncio
import time

import pytest
from frontend_helpers import MODEL
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from shoal.frontend import build_app
from shoal.frontend.app import GENERATION_ROUTES
from shoal.frontend.metrics import FrontendMetrics
from shoal.frontend.rehearsal import REPLY_TOKENS, InstantEngine, Rehearsal, canned_body
from shoal.frontend.serving import OpenAIServing


class CountingClient:
    """An EngineClient passing everything to `inner`, counting its generate calls."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    def models(self):
        return self.inner.models()

    def live_models(self):
        return self.inner.live_models()

    def generate(self, model, request):
        self.calls += 1
        return self.inner.generate(model, request)


def _sample(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name, {"model": MODEL}) or 0.0


def _serving(engine_client) -> tuple[OpenAIServing, CountingClient]:
    client = CountingClient(engine_client)
    return OpenAIServing(client, FrontendMetrics()), client


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_rehearsal_runs_the_whole_stream_on_the_instant_engine(engine_client, kind):
    serving, client = _serving(engine_client)
    rehearsal = Rehearsal(serving, GENERATION_ROUTES, 0.005)
    assert asyncio.run(rehearsal.rehearse(kind, MODEL))
    assert rehearsal.count == 1
    assert client.calls == 0  # the real engine never saw it
    assert serving.latest is None
    registry = rehearsal.serving.metrics.registry  # its own metrics: one run, to the end
    assert _sample(registry, "shoal_time_to_first_token_seconds_count") == 1
    assert _sample(registry, "shoal_inter_token_latency_seconds_count") == REPLY_TOKENS - 1
    assert _sample(registry, "shoal_generation_tokens_total") == REPLY_TOKENS
    assert _sample(serving.metrics.registry, "shoal_generation_tokens_total") == 0


def test_a_failing_rehearsal_is_not_tried_again(engine_client):
    serving, _ = _serving(engine_client)
    rehearsal = Rehearsal(serving, GENERATION_ROUTES, 0.005)
    assert not asyncio.run(rehearsal.rehearse("completions", "no-such-model"))
    assert rehearsal.refused == {("completions", "no-such-model")}
    assert not asyncio.run(rehearsal.rehearse("completions", "no-such-model"))
    assert not asyncio.run(rehearsal.rehearse("embeddings", MODEL))  # no such route
    assert rehearsal.count == 0


def test_the_instant_engine_finishes_each_request_in_reply_tokens(engine_client, tokenizer):
    body = canned_body("completions", MODEL)
    assert b'"stream":true' in body and MODEL.encode() in body
    engine = InstantEngine(engine_client)
    assert engine.models() == engine_client.models()

    async def outputs():
        from shoal.protocol import EngineRequest, SamplingParams

        request = EngineRequest(
            request_id="r", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=2)
        )
        return [out async for out in engine.generate(MODEL, request)]

    outs = asyncio.run(outputs())
    assert [o.new_token_ids for o in outs] == [[7]] * REPLY_TOKENS
    assert [o.finish_reason for o in outs] == [None] * (REPLY_TOKENS - 1) + ["length"]


def test_rehearsals_run_only_while_no_request_arrives(engine_client):
    serving, _ = _serving(engine_client)
    rehearsal = Rehearsal(serving, GENERATION_ROUTES, 0.002)

    async def watch(arriving: bool, busy: bool) -> int:
        rehearsal.count = 0
        rehearsal.load.busy = lambda: busy
        task = asyncio.create_task(rehearsal.run())
        deadline = time.perf_counter() + 0.15
        while time.perf_counter() < deadline:
            if arriving:
                serving.latest = (time.perf_counter(), "completions", MODEL)
            await asyncio.sleep(0.0005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return rehearsal.count

    assert asyncio.run(watch(arriving=False, busy=False)) == 0  # no request yet: nothing to play
    serving.latest = (time.perf_counter() - 1.0, "completions", MODEL)
    assert asyncio.run(watch(arriving=False, busy=False)) >= 5
    assert asyncio.run(watch(arriving=True, busy=False)) == 0
    serving.latest = (time.perf_counter() - 1.0, "completions", MODEL)
    assert asyncio.run(watch(arriving=False, busy=True)) == 0


def test_the_app_rehearses_the_latest_request_while_it_serves(engine_client):
    client = CountingClient(engine_client)
    registry = CollectorRegistry()
    app = build_app(client, registry=registry, rehearsal_interval_ms=2)
    rehearsal = app.state.rehearsal
    with TestClient(app) as http:
        time.sleep(0.05)
        assert rehearsal.count == 0  # no request has come yet
        reply = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        )
        assert reply.status_code == 200
        deadline = time.monotonic() + 5
        while rehearsal.count < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rehearsal.count >= 3
        assert client.calls == 1
        assert _sample(registry, "shoal_time_to_first_token_seconds_count") == 1
        served = {"model": MODEL, "endpoint": "/v1/chat/completions", "status": "200"}
        assert registry.get_sample_value("shoal_requests_total", served) == 1
    assert app.state.rehearsal is rehearsal
    assert build_app(client).state.rehearsal is None  # off unless asked for
    with pytest.raises(ValueError, match="positive"):
        Rehearsal(OpenAIServing(client, FrontendMetrics()), GENERATION_ROUTES, 0)
