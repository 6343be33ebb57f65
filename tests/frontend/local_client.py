"""EngineClients for the frontend tests: a real in-process engine, and clients that fail."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from pathlib import Path

from shoal.engine.async_llm import AsyncLLM
from shoal.engine.config import EngineConfig
from shoal.frontend import NoWorkerAvailable, WorkerFailed
from shoal.protocol import EngineOutput, EngineRequest, ModelCard


class LocalEngineClient:
    """An EngineClient over an in-process AsyncLLM; records how each request's stream ended.
    An output the engine ends with an error is a ValueError, as the worker client makes it."""

    def __init__(self, model_dir: Path, served_name: str, **engine_options) -> None:
        self.llm = AsyncLLM(EngineConfig(model=str(model_dir), **engine_options))
        core = self.llm.engine
        self.card = ModelCard(
            model_name=served_name,
            tokenizer=str(model_dir),
            context_length=core.max_model_len,
            kv_block_size=core.config.block_size,
            num_kv_blocks=core.kv.num_blocks,
        )
        self.requests: dict[str, EngineRequest] = {}
        self.tokens: dict[str, int] = {}  # request id -> tokens streamed out
        self.closed_early: set[str] = set()  # closed before the engine finished them

    def models(self) -> dict[str, ModelCard]:
        return {self.card.model_name: self.card}

    def live_models(self) -> list[str]:
        return [self.card.model_name]

    async def generate(self, model: str, request: EngineRequest) -> AsyncGenerator[EngineOutput]:
        if model != self.card.model_name:
            raise NoWorkerAvailable(f"no worker serves {model!r}")
        rid = request.request_id
        self.requests[rid] = request
        self.tokens[rid] = 0
        finished = False
        try:
            async with contextlib.aclosing(self.llm.generate(request)) as stream:
                async for out in stream:
                    if out.error is not None:
                        raise ValueError(out.error)
                    self.tokens[rid] += len(out.new_token_ids)
                    yield out
            finished = True
        finally:
            if not finished:
                self.closed_early.add(rid)

    def engine_ids(self, api_id: str) -> set[str]:
        """The engine request ids the frontend made for API request `api_id`
        (`<api id>@<frontend>.<serial>`: unique by construction)."""
        return {rid for rid in self.requests if rid.split("@")[0] == api_id}

    def idle(self) -> bool:
        """No request left in the engine and every KV block free (read from another thread)."""
        core = self.llm.engine
        return (
            not core.has_unfinished_requests()
            and core.kv.num_free_blocks == core.kv.num_blocks
            and not self.llm._streams
        )

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.idle():
                return True
            time.sleep(0.01)
        return self.idle()

    def shutdown(self) -> None:
        self.llm.shutdown()


class NoWorkerClient:
    """Knows a model but has no worker for it right now."""

    def __init__(self, card: ModelCard) -> None:
        self.card = card

    def models(self) -> dict[str, ModelCard]:
        return {self.card.model_name: self.card}

    def live_models(self) -> list[str]:
        return []

    async def generate(self, model: str, request: EngineRequest) -> AsyncGenerator[EngineOutput]:
        raise NoWorkerAvailable(f"no worker serves {model!r} right now")
        yield  # an async generator, as the interface asks


class EmptyClient:
    """Serves no model at all (a frontend started before any worker)."""

    def models(self) -> dict[str, ModelCard]:
        return {}

    def live_models(self) -> list[str]:
        return []

    async def generate(self, model: str, request: EngineRequest) -> AsyncGenerator[EngineOutput]:
        raise NoWorkerAvailable(model)
        yield


class DyingWorkerClient:
    """Streams `outputs_before_death` real outputs, then fails as a crashed worker would."""

    def __init__(self, inner: LocalEngineClient, outputs_before_death: int) -> None:
        self.inner = inner
        self.outputs_before_death = outputs_before_death

    def models(self) -> dict[str, ModelCard]:
        return self.inner.models()

    def live_models(self) -> list[str]:
        return self.inner.live_models()

    async def generate(self, model: str, request: EngineRequest) -> AsyncGenerator[EngineOutput]:
        async with contextlib.aclosing(self.inner.generate(model, request)) as stream:
            sent = 0
            async for out in stream:
                if sent == self.outputs_before_death:
                    raise WorkerFailed("worker process exited with code -9")
                sent += 1
                yield out
