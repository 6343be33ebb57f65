"""The frontend's view of the engines behind it: the EngineClient interface and its errors.

The frontend never imports an engine. `shoal serve` hands it an EngineClient backed by the
router and the request plane; the tests hand it one wrapping an in-process engine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from shoal.protocol import EngineOutput, EngineRequest, ModelCard


class NoWorkerAvailable(Exception):
    """No worker serves a model the client knows right now (HTTP 503 with Retry-After)."""


class QueueFull(NoWorkerAvailable):
    """Every worker of the model stayed at its limit for the client's wait (HTTP 429)."""


class WorkerFailed(Exception):
    """The worker serving a request died or failed mid-request (HTTP 502, or an SSE error)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class EngineClient(Protocol):
    def models(self) -> dict[str, ModelCard]:
        """Known model name -> its card (tokenizer path, context length); cheap to call.

        A model is known once a worker has served it, and stays known while it has none
        (its requests then get NoWorkerAvailable); a model not in it answers 404.
        """
        ...

    def live_models(self) -> list[str]:
        """The models some worker serves right now (what /health reports)."""
        ...

    def generate(self, model: str, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream the request's outputs (an async generator function).

        Iterating raises NoWorkerAvailable if no worker serves `model` now (QueueFull if
        every one is at its limit), WorkerFailed if the request's worker fails and it cannot
        move to another, ValueError if the worker rejects the request. Closing the generator
        early (aclose) aborts the request in the engine.
        """
        ...
