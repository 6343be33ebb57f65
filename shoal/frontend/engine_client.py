"""The frontend's view of the engines behind it: the EngineClient interface and its errors.

The frontend never imports an engine. `shoal serve` hands it an EngineClient backed by the
router and the request plane; the tests hand it one wrapping an in-process engine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from shoal.protocol import EngineOutput, EngineRequest, ModelCard


class NoWorkerAvailable(Exception):
    """No worker serves the model right now (HTTP 503)."""


class WorkerFailed(Exception):
    """The worker serving a request died or failed mid-request (HTTP 502, or an SSE error)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class EngineClient(Protocol):
    def models(self) -> dict[str, ModelCard]:
        """Served model name -> its card (tokenizer path, context length); cheap to call."""
        ...

    def generate(self, model: str, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream the request's outputs (an async generator function).

        Iterating raises NoWorkerAvailable if no worker serves `model` now, WorkerFailed if
        the worker dies mid-request, ValueError if the worker rejects the request. Closing
        the generator early (aclose) aborts the request in the engine.
        """
        ...
